"""`splitspec bench-prefix --smoke` end to end through the real services with the bundled models:
every workload and method runs with the cache on and off, the report has its fields, the cache-on
runs report cached tokens (and no more than an unbounded cache could give), the cache-off runs
none, the targets' own counters agree with Usage, and greedy outputs do not depend on the cache.
A benchmark, not a test of speed: no timing thresholds here."""
from __future__ import annotations

import pytest
from service_helpers import bench_smoke

from splitspec_tools.bench.client import Sample
from splitspec_tools.bench.prefix import WORKLOADS, Result, main, set_ideal
from splitspec_tools.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir


def _result(key, prompt, tokens, start, wall):
    return Result(key, prompt, Sample(tokens=tokens, wall_s=wall, ttft_s=0.0, start_s=start))


def test_ideal_counts_blocks_sent_before_up_to_the_last_prompt_token():
    a = _result("a", list(range(40)), [100, 101, 102, 103], start=0.0, wall=1.0)
    b = _result("b", list(range(32)) + [7] * 8, [1], start=0.5, wall=1.0)        # a's prompt was sent: 2 blocks
    c = _result("c", list(range(40)) + [100, 101, 102], [1], start=2.0, wall=1.0)  # a had finished: its output too
    d = _result("d", list(range(16)), [1], start=3.0, wall=1.0)       # one block, the last token's: never a hit
    set_ideal([d, c, b, a], 16)
    assert [r.ideal_cached for r in (a, b, c, d)] == [0, 32, 32, 0]
    # a's sequence (prompt + output less its last token) has 43 tokens: 2 full blocks, so a later
    # prompt that goes on like it gets 2 blocks, not more
    e = _result("e", list(range(40)) + [100, 101, 102] + list(range(5)) + [9] * 20, [1], start=2.5, wall=1.0)
    set_ideal([a, e], 16)
    assert e.ideal_cached == 32


@pytest.mark.skipif(model_dir(None, DEFAULT_TARGET) is None or model_dir(None, DEFAULT_DRAFT) is None,
                    reason="the bundled models are missing")
def test_smoke_end_to_end(tmp_path):
    r, md = bench_smoke(main, tmp_path / "out", "splitspec bench-prefix")
    assert r["run"]["sizes"]["groups"] == 2 and r["run"]["sizes"]["system_tokens"] == 128
    cells = {(c["workload"], c["method"], c["variant"]): c for c in r["cells"]}
    assert set(cells) == {(w, m, v) for w in WORKLOADS for m in ("none", "dflash") for v in ("on", "off")}
    for (w, m, v), c in cells.items():
        for f in ("ttft_ms_p50", "ttft_ms_p90", "tokens_per_s", "hit_rate", "ideal_hit_rate", "target_hit_rate",
                  "tau", "tau_hit", "tau_miss", "requests_hit", "requests_miss"):
            assert f in c, f
        assert c["ttft_ms_p50"] > 0 and c["tokens_per_s"] > 0
        assert c["target_hit_rate"] == pytest.approx(c["hit_rate"], abs=1e-9)
        assert c["hit_rate"] <= c["ideal_hit_rate"] + 1e-9
        if v == "off" or w == "unique":
            assert c["hit_rate"] == 0 and c["requests_hit"] == 0
        else:
            assert c["hit_rate"] > 0 and c["requests_hit"] > 0
        if m == "dflash":
            assert c["tau"] >= 1
        else:
            assert c["tau"] is None
        if v == "on":       # greedy: the cache must not change a token
            assert c["outputs_equal_to_off"][0] == c["outputs_equal_to_off"][1] > 0
    probe = cells[("probe", "none", "on")]
    assert probe["probe_ttft_ratio"] > 0 and probe["probe_ttft_cached_ms_p50"] > 0
    ratios = {(x["workload"], x["method"]) for x in r["ratios"]}
    assert ratios == {(w, m) for w in WORKLOADS for m in ("none", "dflash")}
    assert all(x["tokens_per_s_on_over_off"] > 0 for x in r["ratios"])
    assert "## Cache on ÷ off" in md and "## TTFT probe" in md
