"""Prometheus metrics (issue 18): every service exports them on --metrics-port; the gateway's
counters move by exactly the tokens and steps of a request; every listed metric is present and
moves during a run; labels stay bounded."""
from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_helpers import (
    collect,
    gateway_stub,
    running,
    running_gateway,
    tiny_target_dir,
)

from draft_service.dflash import new_draft, save_draft
from gateway.generation import Stats
from gateway.metrics import GatewayMetrics
from splitspec_tools.client import build_request
from splitspec_tools.ops.launch import free_port
from splitspec.metrics import new_registry
from splitspec.models.loader import load_model


def parse(text: str) -> dict:
    """{(sample name, sorted label items): value}"""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return parse(resp.read().decode())


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(after: dict, before: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def names(samples: dict) -> set[str]:
    return {name for name, _ in samples}


# --- the gateway's recorder alone ------------------------------------------------------------

def test_request_counters_move_by_the_requests_stats():
    registry = new_registry()
    m = GatewayMetrics(registry)
    # The fields of gateway.generation.Stats the recorder reads (a stand-in: how Stats derives
    # its per-method and per-k counts is the speculative loop's business).
    stats = SimpleNamespace(method="dflash", verify_steps=5, committed=14, accepted_per_position=[4, 3, 2, 0],
                            draft_tokens=20, draft_ms=10.0, verify_ms=30.0, model_ms=25.0, queue_ms=5.0,
                            hidden_state_bytes=4096, draft_fallbacks=1, target_failovers=2,
                            steps_by_method={"dflash": 4, "none": 1}, steps_by_k={4: 4, 0: 1},
                            # (method, nodes, accepted depth, depth): three chains and one tree
                            steps=[("dflash", 4, 3, 4), ("dflash", 4, 3, 4), ("dflash", 4, 2, 3),
                                   ("dflash", 4, 1, 4), ("none", 0, 0, 0)],
                            started=time.perf_counter())
    t0 = stats.started
    marks = [(t0 + 0.1, 1), (t0 + 0.3, 4), (t0 + 0.4, 0), (t0 + 0.5, 10)]
    m.request_ended(stats, prompt_tokens=7, completion_tokens=15, chunk_marks=marks, finish_reason="length")
    s = parse(__import__("prometheus_client").generate_latest(registry).decode())
    assert value(s, "splitspec:prompt_tokens_total") == 7
    assert value(s, "splitspec:generation_tokens_total") == 15
    assert value(s, "splitspec:request_success_total", finished_reason="length") == 1
    assert value(s, "splitspec:spec_decode_num_drafts_total") == 4            # steps with k > 0
    assert value(s, "splitspec:spec_decode_num_draft_tokens_total") == 20
    assert value(s, "splitspec:spec_decode_num_accepted_tokens_total") == 9
    assert [value(s, "splitspec:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
            for p in range(4)] == [4, 3, 2, 0]
    assert value(s, "splitspec:spec_decode_verify_steps_total", method="dflash") == 4
    assert value(s, "splitspec:spec_decode_verify_steps_total", method="none") == 1
    assert value(s, "splitspec:spec_decode_steps_by_draft_len_total", k="4") == 4
    assert value(s, "splitspec:spec_decode_steps_by_draft_len_total", k="0") == 1
    assert value(s, "splitspec:spec_decode_num_committed_tokens_total") == 14
    assert value(s, "splitspec:spec_decode_draft_nodes_count") == 4 and value(s, "splitspec:spec_decode_draft_nodes_sum") == 16
    assert value(s, "splitspec:spec_decode_accepted_depth_sum") == 9
    assert value(s, "splitspec:spec_decode_tree_steps_total") == 1
    assert value(s, "splitspec:spec_decode_draft_fallbacks_total") == 1
    assert value(s, "splitspec:target_failovers_total") == 2
    assert value(s, "splitspec:hidden_state_bytes_total") == 4096
    # TTFT is the first chunk with tokens; ITL: 4 tokens after 0.2 s, 10 tokens after 0.2 s.
    assert value(s, "splitspec:time_to_first_token_seconds_count") == 1
    assert value(s, "splitspec:time_to_first_token_seconds_sum") == pytest.approx(0.1)
    assert value(s, "splitspec:inter_token_latency_seconds_count") == 14
    assert value(s, "splitspec:inter_token_latency_seconds_sum") == pytest.approx(0.4)
    assert value(s, "splitspec:spec_decode_request_accept_length_sum") == pytest.approx(14 / 5)
    # Per-step means: wire = draft + verify - model - queue = 10 ms over 5 steps.
    for part, ms in (("draft", 10), ("verify", 30), ("wire", 10), ("queue", 5)):
        assert value(s, "splitspec:spec_decode_step_time_seconds_sum", part=part) == pytest.approx(ms / 5 / 1e3)
    m.request_ended(Stats(), prompt_tokens=3, completion_tokens=0, chunk_marks=[], code="CANCELLED")
    s = parse(__import__("prometheus_client").generate_latest(registry).decode())
    assert value(s, "splitspec:request_failure_total", code="CANCELLED") == 1
    assert value(s, "splitspec:prompt_tokens_total") == 10


# --- through the real services ---------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    target_dir = tiny_target_dir(1024)
    model = load_model(target_dir)
    draft_dir = tmp_path_factory.mktemp("draft") / "tiny-dflash"
    save_draft(new_draft(model.cfg, num_layers=1, block_size=8, mask_token_id=2, seed=3), draft_dir)
    logs = tmp_path_factory.mktemp("logs")
    ports = {name: free_port() for name in ("target", "draft", "gateway")}
    with running("target", ["--model-path", str(target_dir), "--max-running-requests", "1",
                            "--metrics-port", str(ports["target"])], logs) as target, \
            running("draft", ["--method", "dflash", "--model-path", str(draft_dir), "--target-model-path",
                              str(target_dir), "--metrics-port", str(ports["draft"])], logs) as draft, \
            running_gateway(target, logs, "--draft", draft.address, "--speculative-algorithm", "DFLASH",
                            "--metrics-port", str(ports["gateway"]),
                            "--draft-timeout-ms", "60000") as gw:   # no fallback on a loaded machine
        ch, stub = gateway_stub(gw.address)
        yield stub, ports
        ch.close()


def test_metrics_off_by_default():
    from gateway.server import build_parser as gw
    from target_service.server import build_parser as tg
    assert gw().parse_args(["--target", "a:1"]).metrics_port == 0
    assert tg().parse_args(["--model-path", "m"]).metrics_port == 0


def test_gateway_counters_move_by_exactly_one_requests_tokens_and_steps(stack):
    stub, ports = stack
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 9]
    before = scrape(ports["gateway"])
    ids, _, complete = collect(stub.Generate(build_request(prompt, max_new_tokens=40, ignore_eos=True,
                                                           method="dflash"), timeout=120))
    after = scrape(ports["gateway"])
    st = complete.stats
    # verify_steps counts target-only Decode steps too: drafted tokens are what show speculation ran.
    assert st.method == "dflash" and st.draft_fallbacks == 0 and st.draft_tokens > 0
    assert delta(after, before, "splitspec:generation_tokens_total") == len(ids) == 40
    assert delta(after, before, "splitspec:prompt_tokens_total") == len(prompt)
    assert delta(after, before, "splitspec:request_success_total", finished_reason="length") == 1
    assert delta(after, before, "splitspec:spec_decode_num_draft_tokens_total") == st.draft_tokens
    assert delta(after, before, "splitspec:spec_decode_num_accepted_tokens_total") == sum(st.accepted_per_position)
    for pos, n in enumerate(st.accepted_per_position):
        assert delta(after, before, "splitspec:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == n
    steps = sum(delta(after, before, "splitspec:spec_decode_verify_steps_total", method=m)
                for m in ("dflash", "ngram", "none"))
    assert steps == st.verify_steps
    per_step = list(st.steps)                        # (method, k, accepted) per step
    assert len(per_step) == st.verify_steps
    drafted = sum(1 for x in per_step if x.k > 0)
    assert delta(after, before, "splitspec:spec_decode_num_drafts_total") == drafted > 0
    for k in {x.k for x in per_step}:
        assert delta(after, before, "splitspec:spec_decode_steps_by_draft_len_total", k=str(k)) == \
            sum(1 for x in per_step if x.k == k)
    assert delta(after, before, "splitspec:spec_decode_num_committed_tokens_total") == 40 - 1   # b0 is the prefill's
    assert delta(after, before, "splitspec:e2e_request_latency_seconds_count") == 1
    assert delta(after, before, "splitspec:time_to_first_token_seconds_count") == 1
    assert delta(after, before, "splitspec:inter_token_latency_seconds_count") == 40 - 1
    for part in ("draft", "verify", "wire", "queue"):
        assert delta(after, before, "splitspec:spec_decode_step_time_seconds_count", part=part) == 1
    assert delta(after, before, "splitspec:hidden_state_bytes_total") == st.hidden_state_bytes > 0
    # Mean tau derives from the counters: every step commits its accepted drafts + one bonus.
    accepted = delta(after, before, "splitspec:spec_decode_num_accepted_tokens_total")
    assert accepted + steps == 40 - 1
    assert (accepted + steps) / steps == pytest.approx(st.accept_length)


def test_the_targets_lookahead_counters_move_by_its_ngram_steps(stack):
    """auto, greedy, on a prompt that repeats: the target's prompt lookup inside its Decode runs
    (the gateway records those forwards as n-gram steps) moves the target's lookahead counters
    by exactly those steps' drafted and accepted tokens."""
    stub, ports = stack
    before = scrape(ports["target"])
    steps = []
    for i in range(3):
        req = build_request([5 + i, 6, 7, 8] * 4, max_new_tokens=48, ignore_eos=True, method="auto")
        steps += [s for s in collect(stub.Generate(req, timeout=120))[2].stats.steps if s.method == "ngram"]
    after = scrape(ports["target"])
    assert steps                                # drafts priced on the prior (0.7) are tried at first
    assert delta(after, before, "splitspec:lookahead_drafts_total") == len(steps)
    assert delta(after, before, "splitspec:lookahead_draft_tokens_total") == sum(s.k for s in steps)
    assert delta(after, before, "splitspec:lookahead_accepted_tokens_total") == sum(s.accepted for s in steps)
    print(f"{len(steps)} lookahead steps, {sum(s.k for s in steps)} tokens drafted")


GATEWAY_METRICS = [
    "splitspec:num_requests_running", "splitspec:num_requests_waiting", "splitspec:prompt_tokens_total",
    "splitspec:generation_tokens_total", "splitspec:time_to_first_token_seconds_count",
    "splitspec:inter_token_latency_seconds_count", "splitspec:e2e_request_latency_seconds_count",
    "splitspec:spec_decode_num_drafts_total", "splitspec:spec_decode_num_draft_tokens_total",
    "splitspec:spec_decode_num_accepted_tokens_total", "splitspec:spec_decode_num_accepted_tokens_per_pos_total",
    "splitspec:spec_decode_verify_steps_total", "splitspec:spec_decode_step_time_seconds_count",
    "splitspec:spec_decode_request_accept_length_count", "splitspec:request_success_total",
]
ENGINE_METRICS = ["splitspec:num_requests_running", "splitspec:kv_blocks_used", "splitspec:kv_blocks_free",
                  "splitspec:kv_cache_usage_perc", "splitspec:forward_passes_total", "splitspec:batch_size_count",
                  "splitspec:forward_time_seconds_count"]


def test_every_metric_is_present_and_moves_under_load(stack):
    """Three concurrent long requests on a target that runs one at a time: the gauges show
    them running and waiting while they run; every counter and histogram moved afterwards."""
    stub, ports = stack
    before = {name: scrape(port) for name, port in ports.items()}
    seen = {"gw_running": 0, "waiting": 0, "gw_waiting": 0, "kv_used": 0, "draft_running": 0}

    def one(i):
        req = build_request([9 + i, 10, 11, 12] * 3, max_new_tokens=48, ignore_eos=True,
                            method=("dflash", "none", "dflash")[i])
        return collect(stub.Generate(req, timeout=300))

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(one, i) for i in range(3)]
        while not all(f.done() for f in futures):
            gw, tg, dr = scrape(ports["gateway"]), scrape(ports["target"]), scrape(ports["draft"])
            seen["gw_running"] = max(seen["gw_running"], value(gw, "splitspec:num_requests_running"))
            seen["gw_waiting"] = max(seen["gw_waiting"], value(gw, "splitspec:num_requests_waiting"))
            seen["waiting"] = max(seen["waiting"], value(tg, "splitspec:num_requests_waiting"))
            seen["kv_used"] = max(seen["kv_used"], value(tg, "splitspec:kv_blocks_used"))
            seen["draft_running"] = max(seen["draft_running"], value(dr, "splitspec:num_requests_running"))
            time.sleep(0.03)
        for f in futures:
            f.result()
    after = {name: scrape(port) for name, port in ports.items()}
    assert seen["gw_running"] >= 2 and seen["waiting"] >= 1 and seen["gw_waiting"] >= 1, seen
    assert seen["kv_used"] > 0 and seen["draft_running"] >= 1, seen
    for name in GATEWAY_METRICS:
        assert name in names(after["gateway"]), name
    for name in ("splitspec:prompt_tokens_total", "splitspec:generation_tokens_total",
                 "splitspec:spec_decode_num_drafts_total", "splitspec:spec_decode_num_draft_tokens_total",
                 "splitspec:e2e_request_latency_seconds_count", "splitspec:inter_token_latency_seconds_count"):
        assert delta(after["gateway"], before["gateway"], name) > 0, name
    assert delta(after["gateway"], before["gateway"], "splitspec:spec_decode_verify_steps_total", method="none") > 0
    for svc in ("target", "draft"):
        for name in ENGINE_METRICS:
            assert name in names(after[svc]), (svc, name)
        assert delta(after[svc], before[svc], "splitspec:forward_passes_total") == \
            delta(after[svc], before[svc], "splitspec:batch_size_count") > 0
    for kind in ("prefill", "decode", "verify"):
        assert any(value(after["target"], "splitspec:forward_time_seconds_count", kind=k) >
                   value(before["target"], "splitspec:forward_time_seconds_count", kind=k)
                   for k in (kind, "mixed")), kind
    assert delta(after["draft"], before["draft"], "splitspec:forward_time_seconds_count", kind="propose") > 0
    # Bounded labels: no request or session ids anywhere.
    for samples in after.values():
        for _, labels in samples:
            assert {k for k, _ in labels} <= {"finished_reason", "code", "position", "method", "k", "part", "kind",
                                               "le", "quantile"}, labels
