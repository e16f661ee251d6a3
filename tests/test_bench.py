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
from splitspec_tools.bench.configs import Sample
from splitspec_tools.bench.report import FORMATS, split_gaps, token_gaps
from splitspec_tools.bench.run import main
from splitspec.models.loader import load_model

MAX_NEW = 12
CONFIGS = ["target", "dflash-grpc", "dflash-inproc", "ngram-grpc", "hf-pld"]


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


def test_token_gaps_are_per_token_and_split_by_overlap():
    # chunks of 1, 1, 3 and 1 tokens arriving at 0.1, 0.2, 0.5 and 1.0 s after a request sent at t=10
    s = Sample(tokens=[1] * 6, wall_s=1.0, ttft_s=0.1, step_sizes=[1, 3, 1], step_times=[0.1, 0.2, 0.5, 1.0],
               start_s=10.0)
    assert [g for _, _, g in token_gaps(s)] == pytest.approx([0.1, 0.1, 0.5])
    during, outside = split_gaps([s], 10.25, 10.3)      # only the 3-token chunk's gap overlaps
    assert during == pytest.approx([100.0]) and outside == pytest.approx([100.0, 500.0])


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    target = tiny_target_dir(1024)
    draft = out / "draft"
    save_draft(new_draft(load_model(target).cfg, num_layers=1, block_size=8, mask_token_id=2, seed=3), draft)
    argv = ["--target-model-path", str(target), "--draft-model-path", str(draft), "--num-prompts", "2",
            "--max-new-tokens", str(MAX_NEW), "--max-prompt-tokens", "48", "--configs", ",".join(CONFIGS),
            "--temperatures", "0,1", "--draft-sampling", "sample", "--warmup", "1", "--step-time-prompts", "1",
            "--concurrency", "1,2", "--sweep-requests", "2", "--sweep-configs", "target,dflash-grpc",
            "--mixed-run", "--mixed-streams", "3", "--mixed-prompt-tokens", "100", "--out", str(out)]
    assert main(argv) == 0
    return out, json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def test_outputs_are_produced(bench_run):
    out, results, md = bench_run
    for name in ("acceptance.png", "tokens_per_s.png", "concurrency.png"):
        assert (out / name).stat().st_size > 1000
    meta = results["meta"]
    assert meta["command"].startswith("splitspec bench ") and meta["git_revision"]
    assert meta["machine"]["cores"] >= 1 and meta["machine"]["torch"]
    assert meta["git_revision"] in md and meta["machine"]["torch"] in md and "--num-prompts 2" in md
    names = {(e["name"], e["temperature"]) for e in results["configs"]}
    assert {(c, 0.0) for c in CONFIGS} <= names
    assert ("dflash-grpc:sampled-drafts", 1.0) in names and ("dflash-inproc:sampled-drafts", 1.0) in names
    assert {(c["name"], c["streams"]) for c in results["concurrency"]} == {
        (n, s) for n in ("target", "dflash-grpc") for s in (1, 2)}
    assert set(results["step_times"]["ms"]) == {str(w) for w in range(1, 9)}


def test_figures_are_consistent(bench_run):
    _, results, _ = bench_run
    base = {e["temperature"]: e for e in results["configs"] if e["config"] == "target"}
    for e in results["configs"]:
        for key in ("name", "tokens_per_s", "speedup", "accept_length", "per_position_acceptance"):
            assert key in e
        assert e["requests"] == 2 and e["tokens"] == 2 * MAX_NEW       # eos ignored: same work everywhere
        assert e["tokens_per_s"] == pytest.approx(e["tokens"] / e["wall_s"])
        b = base[e["temperature"]]
        assert e["speedup"] == pytest.approx(e["tokens_per_s"] / b["tokens_per_s"])
        assert e["speedup_median"] == pytest.approx(e["tokens_per_s_median"] / b["tokens_per_s_median"])
        assert e["accept_length"] >= 1.0
        assert e["accept_length"] <= (8 if e["config"] != "target" else 1)
        assert all(0.0 <= x <= 1.0 for x in e["per_position_acceptance"])
        assert e["per_position_acceptance"] == sorted(e["per_position_acceptance"], reverse=True)
        if e["config"] in ("dflash-grpc", "dflash-inproc", "ngram-grpc"):
            assert e["ideal_speedup"] > 0 and e["efficiency"] == pytest.approx(e["speedup"] / e["ideal_speedup"])
            split = e["per_step_ms"]
            assert split["draft"] + split["verify"] + split["other"] == pytest.approx(split["total"])
        if e["config"] == "dflash-grpc":
            assert e["hidden_state_bytes_per_step"] > 0
        if e["temperature"] == 0:      # lossless: every greedy output equals the baseline's
            assert e["greedy_matches"] == e["requests"], e["greedy_mismatches"]
        assert e["method_mismatches"] == 0 and e["draft_fallbacks"] == 0
    one_stream = {c["config"]: c for c in results["concurrency"] if c["streams"] == 1}
    for c in results["concurrency"]:
        assert c["requests"] == max(c["streams"], 2) and c["tokens"] == c["requests"] * MAX_NEW
        for q in ("latency_ms", "ttft_ms", "itl_ms"):
            assert 0 < c[f"{q}_p50"] <= c[f"{q}_p99"], q
        assert c["speedup_vs_1_stream"] == pytest.approx(c["tokens_per_s"] / one_stream[c["config"]]["tokens_per_s"])
        # The bench started the services, so it reads both services' counters: every point ran
        # target forwards, the speculative one draft forwards too; a forward runs one step per session at most.
        assert 1 <= c["target_batch_mean"] <= c["streams"]
        if c["config"] == "dflash-grpc":
            assert 1 <= c["draft_batch_mean"] <= c["streams"]
        assert c["draft_batch_mean"] is None or c["draft_batch_mean"] >= 1
        assert c["greedy_matches"] == c["requests"]      # the sweep runs at the first temperature, 0


def _md_rows(md: str) -> list[tuple[str, str, dict[str, str]]]:
    """(section title, first cell, {column: cell}) for every Markdown table row."""
    rows, section, header = [], "", None
    for line in md.splitlines():
        if line.startswith("## "):
            section, header = line[3:], None
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if header is None:
                header = cells
            elif not set(line) <= set("|-"):
                rows.append((section, cells[0], dict(zip(header, cells))))
        else:
            header = None
    return rows


def test_json_matches_markdown(bench_run):
    _, results, md = bench_run
    rows = _md_rows(md)
    columns = {"tok/s": "tokens_per_s", "tok/s median": "tokens_per_s_median", "speedup": "speedup",
               "τ mean": "accept_length", "TTFT p50 ms": "ttft_ms_p50", "ITL p50 ms": "itl_ms_p50",
               "hidden B/step": "hidden_state_bytes_per_step", "ideal": "ideal_speedup", "efficiency": "efficiency"}
    for e in results["configs"]:
        section = next(s for s, _, _ in rows if s.startswith(f"temperature {e['temperature']:g}"))
        row = next(r for s, first, r in rows if s == section and first == f"({e['letter']}) {e['name']}")
        for col, key in columns.items():
            want = "–" if e[key] is None else FORMATS[key].format(e[key])
            assert row[col] == want, (e["name"], col)
        if e["per_position_acceptance"]:
            acc = next(r for s, first, r in rows if s == section and first == e["name"])
            got = [acc[str(k + 1)] for k in range(len(e["per_position_acceptance"]))]
            assert got == [f"{x:.3f}" for x in e["per_position_acceptance"]]
    columns = {"tok/s (aggregate)": "tokens_per_s", "× 1 stream": "speedup_vs_1_stream",
               "latency p99 ms": "latency_ms_p99", "TTFT p99 ms": "ttft_ms_p99", "ITL p50 ms": "itl_ms_p50",
               "ITL p99 ms": "itl_ms_p99", "target batch": "target_batch_mean", "draft batch": "draft_batch_mean"}
    for c in results["concurrency"]:
        row = next(r for s, first, r in rows
                   if s.startswith("Concurrency") and first == str(c["streams"]) and r["configuration"] == c["name"])
        for col, key in columns.items():
            assert row[col] == ("–" if c[key] is None else FORMATS[key].format(c[key])), col
        assert re.fullmatch(r"\d+", row["latency p99 ms"])
        assert row["= baseline"] == f"{c['greedy_matches']}/{c['requests']}"


def test_mixed_run(bench_run):
    """One 100-token prefill among 3 decoding streams: the fields exist, the decoders' token gaps
    fell on both sides of the prefill, and the Markdown shows the same numbers."""
    _, results, md = bench_run
    m = results["mixed"]
    assert m is not None, results["skipped"]
    assert m["config"] == "target" and m["streams"] == 3 and m["max_new_tokens"] == MAX_NEW
    assert m["long_prompt_tokens"] == m["long_prompt_tokens_asked"] == 100 and m["long_max_new_tokens"] == 16
    assert 0 < m["long_ttft_ms"] <= m["long_wall_ms"]
    assert m["decoder_requests"] >= 3
    assert m["itl_samples_during"] > 0 and m["itl_samples_outside"] > 0
    for side in ("during", "outside"):
        assert 0 < m[f"itl_ms_p50_{side}"] <= m[f"itl_ms_p99_{side}"]
    assert m["itl_p99_during_over_p50_outside"] == pytest.approx(m["itl_ms_p99_during"] / m["itl_ms_p50_outside"])
    assert 1 <= m["target_batch_mean"] <= 4
    assert m["draft_batch_mean"] is None or m["draft_batch_mean"] >= 1
    row = next(r for s, _, r in _md_rows(md) if s.startswith("Mixed load"))
    assert row["long TTFT ms"] == FORMATS["long_ttft_ms"].format(m["long_ttft_ms"])
    assert row["p99 during ÷ p50 outside"] == FORMATS["itl_p99_during_over_p50_outside"].format(
        m["itl_p99_during_over_p50_outside"])
    assert row["gaps during/outside"] == f"{m['itl_samples_during']}/{m['itl_samples_outside']}"
    assert "--mixed-run" in md.split("## Mixed load", 1)[1]


def test_a_sweep_point_reports_medians_of_its_repeats_and_paired_ratios():
    from splitspec_tools.bench.run import median_point
    runs = [{"tokens_per_s": 100.0, "x": 1}, {"tokens_per_s": 140.0, "x": 2}]
    target = [{"tokens_per_s": 100.0}, {"tokens_per_s": 70.0}]
    p = median_point(runs, target)
    assert p["tokens_per_s"] == 120.0 and p["x"] == 1          # the lower-middle run's other fields
    assert p["speedup_vs_target_runs"] == [1.0, 2.0] and p["speedup_vs_target"] == 1.5


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
