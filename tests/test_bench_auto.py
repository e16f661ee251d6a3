"""`splitspec bench-auto`: its arithmetic on hand-made numbers, and `--smoke` end to end through
the real services with the bundled models, started both ways (`splitspec up` and by hand): every
cell pairs auto with none on the same requests, greedy auto equals none, and the price table
gives each drafter a break-even τ from the same run. A benchmark, not a test of speed: no timing
thresholds here."""
from __future__ import annotations

import json
import types

import pytest

from splitspec_tools.bench.auto import Cell, drafter_tau, fit, grid, main, markdown, min_requests, requests_for, step_prices
from splitspec_tools.bench.client import Sample
from splitspec_tools.bench.harness import step_mix
from splitspec_tools.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir


def sample(n_tokens, wall_s, ttft_s, steps=(), by_method=None, **kw):
    """A request as the client records it: n tokens, its times, and the gateway's per-step stats."""
    return Sample([1] * n_tokens, 0.0, wall_s, ttft_s, steps_by_method=by_method or {},
                  stats=types.SimpleNamespace(steps=[types.SimpleNamespace(method=m, accepted=a) for m, a in steps]), **kw)


def test_grid_and_request_counts():
    args = types.SimpleNamespace(temperatures="0,1", streams="1,8", max_new_tokens="64,512", prompt_kinds="short,long")
    cells = grid(args)
    assert len(cells) == 16 and len(set(cells)) == 16
    assert cells[0] == Cell(0.0, 1, 64, "short") and "T=1 / top_p 0.95" in cells[-1].label
    assert min_requests("64:8,512:2") == {64: 8, 512: 2}


def test_a_short_cell_is_sized_up_in_whole_waves():
    # 16 requests at 16 streams took 2 s: 8 s wants 64, four waves.
    assert requests_for(16, 16, 2.0, 8.0) == 64
    # 16 at one stream took 5 s: 25.6 requests, rounded up to whole waves of one.
    assert requests_for(16, 1, 5.0, 8.0) == 26
    # 8 at 8 streams took 1.5 s: 42.7 wanted, 48 (six waves).
    assert requests_for(8, 8, 1.5, 8.0) == 48
    # Long enough already, sizing off, or a run so short it would ask for more than 8x: capped.
    assert requests_for(16, 16, 9.0, 8.0) == 16
    assert requests_for(16, 16, 2.0, 0.0) == 16
    assert requests_for(4, 1, 0.01, 8.0) == 32


def test_a_long_prompt_keeps_its_tail_and_leaves_room_for_the_generation():
    prompt = list(range(2000))
    kept = fit(prompt, 512, 2048, width=8)
    assert kept == prompt[-(2048 - 512 - 9):] and len(kept) + 512 + 8 < 2048
    assert fit(prompt[:100], 512, 2048) == prompt[:100]


def test_step_mix_and_drafter_tau():
    rs = [sample(9, 1.0, 0.1, [("dflash", 3), ("dflash", 1), ("none", 0)], {"dflash": 2, "none": 1}),
          sample(5, 1.0, 0.1, [("ngram", 2)], {"ngram": 1, "none": 3})]
    assert step_mix(rs) == pytest.approx({"dflash": 2 / 7, "ngram": 1 / 7, "none": 4 / 7})
    assert drafter_tau(rs, "dflash") == pytest.approx(3.0)       # (3 + 1) / 2 accepted, + the bonus
    assert drafter_tau(rs, "ngram") == pytest.approx(3.0) and drafter_tau(rs, "none") == pytest.approx(1.0)


def test_step_prices_by_hand():
    # Two requests of 9 tokens in 4 verify steps each; 0.1 s to the first token, 0.5 s in all:
    # (0.5 - 0.1) / 4 = 100 ms a step; Propose 40 + 40 ms over 8 steps = 10 ms; τ = 16 / 8 = 2.
    rs = [sample(9, 0.5, 0.1, verify_steps=4, committed=8, draft_ms=40, verify_ms=320, wire_ms=8, queue_ms=4) for _ in range(2)]
    p = step_prices(rs)
    assert p["step_ms"] == pytest.approx(100.0) and p["propose_ms"] == pytest.approx(10.0)
    assert p["verify_ms"] == pytest.approx(80.0) and p["wire_ms"] == pytest.approx(2.0)
    assert p["tau"] == pytest.approx(2.0) and p["steps"] == 8
    # Target-only: a step is a token.
    none = step_prices([sample(11, 0.3, 0.1)])
    assert none["step_ms"] == pytest.approx(20.0) and none["tau"] == pytest.approx(1.0)


def test_the_report_marks_the_cells_below_the_bar():
    cell = {"temperature": 1.0, "streams": 8, "max_new_tokens": 64, "prompts": "short", "prompt_tokens_mean": 180,
            "none_tok_s": 100.0, "auto_tok_s": 90.0, "ratio": 0.9, "ratios": [0.9, 0.9], "auto_steps": {"none": 1.0},
            "auto_dflash_tau": None, "auto_ngram_tau": None, "greedy_mismatches": None, "requests": 8, "repeats": 2}
    prices = [{"streams": 1, "config": "none", "step_ms": 5.0, "propose_ms": 0, "verify_ms": 0, "wire_ms": 0.1,
               "queue_ms": 0, "tau": 1.0, "tok_s_vs_none": 1.0},
              {"streams": 1, "config": "dflash", "step_ms": 15.0, "propose_ms": 6, "verify_ms": 9, "wire_ms": 2,
               "queue_ms": 0, "tau": 2.5, "break_even_tau": 3.0, "tok_s_vs_none": 0.83}]
    res = {"meta": {"command": "splitspec bench-auto", "git_revision": "x",
                    "machine": {"cpu": "cpu", "cores": 2, "torch": "2", "torch_threads": 2, "python": "3"},
                    "started": "now"}, "took_s": 1.0, "prompts": {"short": "1", "long": "1"},
           "runs": [{"services": "hand", "description": "d", "cells": [cell], "prices": prices}]}
    md = markdown(res)
    assert "**0.90**" in md and "0/1 cells ≥ 0.95" in md
    assert "| 1 | dflash | 15.00 | 6.00 | 9.00 | 2.00 | 0.00 | 2.50 | 3.00 | 0.83 |" in md


@pytest.mark.skipif(model_dir(None, DEFAULT_TARGET) is None or model_dir(None, DEFAULT_DRAFT) is None,
                    reason="the bundled models are missing")
def test_smoke_end_to_end_both_launches(tmp_path):
    out = tmp_path / "out"
    assert main(["--smoke", "--launch", "up,hand", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert [r["services"] for r in res["runs"]] == ["up", "hand"]
    for run in res["runs"]:
        assert {(c["temperature"], c["prompts"]) for c in run["cells"]} == \
            {(0.0, "short"), (0.0, "long"), (1.0, "short"), (1.0, "long")}
        for c in run["cells"]:
            assert c["ratio"] > 0 and len(c["ratios"]) == c["repeats"] == 1
            assert abs(sum(c["auto_steps"].values()) - 1.0) < 1e-6
            if c["temperature"] == 0:
                assert c["greedy_mismatches"] == 0          # greedy auto is target-only's output
        assert c["prompt_tokens_mean"] > 100                # the long cell's prompts are long
    prices = res["runs"][0]["prices"]
    steps = {r["config"]: r for r in prices}
    assert set(steps) == {"none", "ngram", "dflash", "dflash tree 16", "dflash tree 32"}
    for name, r in steps.items():
        assert r["step_ms"] > 0 and r["tau"] >= 1.0
        if name != "none":
            assert r["break_even_tau"] == pytest.approx(r["step_ms"] / steps["none"]["step_ms"])
            assert r["propose_ms"] >= 0 and r["verify_ms"] > 0
    assert steps["dflash"]["tau"] > 1.0                     # the bundled draft is accepted
    assert "break-even τ" in (out / "results.md").read_text()
    assert "prices" not in res["runs"][1]                   # the price table runs on the first launch only
