"""The gateway's Prometheus metrics: requests, tokens, latency and speculation, recorded once
per request when it ends, from its `Stats` (gateway/generation.py) and the arrival times of its
chunks; nothing is recorded inside the speculative loop.

Mean accept length τ is derivable: 1 + rate(spec_decode_num_accepted_tokens_total) /
rate(spec_decode_num_drafts_total). Labels: finish reason, gRPC code, method, draft length k,
draft position, time-split part: all bounded."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from splitspec.metrics import PREFIX

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                 0.4, 0.5, 0.75, 1.0, 2.5)
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
MAX_POSITIONS = 64      # draft positions get their own label up to here (verify width <= 65)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.running = Gauge(PREFIX + "num_requests_running", "Requests the gateway is serving now.", registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting",
                             "Requests admitted by the gateway that have no first token yet (waiting for "
                             "the target's admission and prefill).", registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated (streamed).", registry=r)
        self.success = Counter(PREFIX + "request_success", "Requests finished, by finish reason.",
                               ["finished_reason"], registry=r)
        self.failure = Counter(PREFIX + "request_failure", "Requests ended by an error or a cancel, by gRPC code.",
                               ["code"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between tokens (a chunk of n tokens after a gap g counts n times g/n).",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to end.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.drafts = Counter(PREFIX + "spec_decode_num_drafts", "Verify steps that verified a draft.", registry=r)
        self.draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.accepted = Counter(PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.accepted_per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (0: first drafted).",
                                        ["position"], registry=r)
        self.steps = Counter(PREFIX + "spec_decode_verify_steps",
                             "Target steps (Verify, or Decode target-only), by the drafter used (dflash, ngram, "
                             "none).", ["method"], registry=r)
        self.steps_by_k = Counter(PREFIX + "spec_decode_steps_by_draft_len",
                                  "Target steps by the number k of drafted tokens verified.", ["k"], registry=r)
        self.tree_nodes = Histogram(PREFIX + "spec_decode_draft_nodes",
                                    "Drafted nodes per verified draft (a chain's length, or a tree's size).",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64), registry=r)
        self.accepted_depth = Histogram(PREFIX + "spec_decode_accepted_depth",
                                        "Drafted tokens accepted per verified draft (the accepted path's depth).",
                                        buckets=(0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16), registry=r)
        self.tree_steps = Counter(PREFIX + "spec_decode_tree_steps",
                                  "Verified drafts that branched (token trees: more nodes than levels).", registry=r)
        self.committed = Counter(PREFIX + "spec_decode_num_committed_tokens",
                                 "Tokens committed by target steps (accepted drafts + bonus; not the prefill's "
                                 "first token).", registry=r)
        self.accept_length = Histogram(PREFIX + "spec_decode_request_accept_length",
                                       "Accept length tau of a request: committed tokens per verify step.",
                                       buckets=(1, 1.25, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 10, 12, 16), registry=r)
        self.step_time = Histogram(PREFIX + "spec_decode_step_time_seconds",
                                   "Per-step time of a request by part (draft, verify, wire, queue): the "
                                   "request's mean per step.", ["part"], buckets=STEP_BUCKETS, registry=r)
        self.fallbacks = Counter(PREFIX + "spec_decode_draft_fallbacks",
                                 "Requests that lost their draft and went on target-only.", registry=r)
        self.failovers = Counter(PREFIX + "target_failovers", "Moves of a request to another target replica.",
                                 registry=r)
        self.hidden_bytes = Counter(PREFIX + "hidden_state_bytes", "Target hidden-state bytes on the wire.",
                                    registry=r)

    def request_ended(self, stats, *, prompt_tokens: int, completion_tokens: int, chunk_marks: list,
                      finish_reason: str | None = None, code: str | None = None) -> None:
        """Record one request: `finish_reason` when it completed, else the gRPC `code` it ended
        with. `chunk_marks` holds (perf_counter time, tokens) per chunk streamed."""
        now = time.perf_counter()
        if finish_reason is not None:
            self.success.labels(finished_reason=finish_reason).inc()
        else:
            self.failure.labels(code=code or "UNKNOWN").inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.e2e.observe(now - stats.started)
        marks = [(t, n) for t, n in chunk_marks if n]
        if marks:
            self.ttft.observe(marks[0][0] - stats.started)
        for (t0, _), (t1, n) in zip(marks, marks[1:]):
            for _ in range(n):
                self.itl.observe((t1 - t0) / n)
        self._speculation(stats)

    def _speculation(self, stats) -> None:
        for method, n in stats.steps_by_method.items():
            self.steps.labels(method=method).inc(n)
        by_k = stats.steps_by_k
        for k, n in by_k.items():
            self.steps_by_k.labels(k=str(k)).inc(n)
        self.drafts.inc(sum(n for k, n in by_k.items() if k > 0))
        for _, k, accepted_depth, depth in stats.steps:
            if k:
                self.tree_nodes.observe(k)
                self.accepted_depth.observe(accepted_depth)
                if k > depth:
                    self.tree_steps.inc()
        self.draft_tokens.inc(stats.draft_tokens)
        accepted = stats.accepted_per_position
        self.accepted.inc(sum(accepted))
        for pos, n in enumerate(accepted):      # zeros too: a position drafted but never accepted shows as 0
            self.accepted_per_pos.labels(position=str(min(pos, MAX_POSITIONS))).inc(n)
        self.committed.inc(stats.committed)
        if stats.draft_tokens and stats.verify_steps:
            self.accept_length.observe(stats.committed / stats.verify_steps)
        if stats.verify_steps:
            steps = stats.verify_steps
            wire_ms = max(0.0, stats.draft_ms + stats.verify_ms - stats.model_ms - stats.queue_ms)
            for part, ms in (("draft", stats.draft_ms), ("verify", stats.verify_ms), ("wire", wire_ms),
                             ("queue", stats.queue_ms)):
                self.step_time.labels(part=part).observe(ms / steps / 1e3)
        if stats.draft_fallbacks:
            self.fallbacks.inc(stats.draft_fallbacks)
        if stats.target_failovers:
            self.failovers.inc(stats.target_failovers)
        self.hidden_bytes.inc(stats.hidden_state_bytes)
