"""Reliability of one request: the token source that survives the loss of its draft or of its
target replica, and the health trackers that keep new requests away from dead backends.

The gateway owns the token history of every request, which makes both recoveries lossless:

* **Draft failure** (a Propose/Open error, a step over `--draft-timeout-ms`, an unreachable
  draft): the draft session is dropped and the request continues with target `Decode` on the
  SAME target session. After Open or a Verify, the target's state is "last committed token not
  yet in the KV cache", exactly what Decode expects, so no token is lost or repeated. The draft
  is marked unhealthy (unless it only refused this one request) and a background loop probes
  it with grpc.health.v1 (and GetInfo + the pair check) with exponential backoff; while it is
  unhealthy new requests decode target-only. Each fallback is counted in
  `SpeculativeStats.draft_fallbacks` and logged as `draft_fallback`.
* **Target failure** (UNAVAILABLE, UNKNOWN or CANCELLED by the replica: it died or is
  draining): the request opens a session on another replica with prompt + the tokens committed
  so far as its prompt (re-prefill), re-opens the draft with the new hidden states (for a windowed
  draft, DraftInfo.context_window > 0, only the last context_window rows of them), and goes on.
  The Open samples the next token, so greedy output is identical to an uninterrupted run;
  sampled output stays a correct sample but not the same one (the replica's sampler is seeded
  afresh). Counted in `target_failovers`, logged as `target_failover`. After
  `--target-failover-attempts` failovers, or when no replica is left, the request ends with
  UNAVAILABLE; the tokens already streamed stay with the client.
* **A failed step** (INTERNAL from a target: its scheduler failed this session's step, a fault in
  the forward or in the session's own work, and freed the session; target_service/scheduler.py
  `_fail`): resumed exactly as above, prompt + history on another replica when there is one,
  else on the same one, which serves on. The replica is not marked unhealthy for it. It counts
  against `--target-failover-attempts` like any failover, so a fault that repeats on every try
  ends the request instead of looping.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitspec.ngram import NgramIndex

from .backends import BackendError, DraftSession, TargetClient, TargetSession
from .generation import Stats
from .plan import Plan
from .policy import AutoPolicy, FixedPolicy, sampling_bucket
from .request import Request
from .spec_loop import DraftLost, RemoteDraft, SpeculativeLoop

# Codes from a target that mean "this replica (or our connection to it) is gone": fail over.
REPLICA_LOST = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED})
# A target's INTERNAL: one step of this session failed there and the replica serves on: resume.
STEP_FAILED = grpc.StatusCode.INTERNAL
# Codes from a draft that say the draft service itself is in trouble (not just this request).
DRAFT_DOWN = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
                        grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL})


class Health:
    """Whether one backend address is usable. `mark_failed` flips it to unhealthy and starts a
    probe loop (grpc.health.v1 Check, then the optional `verify` coroutine) with exponential
    backoff from `min_backoff_s` to `max_backoff_s`; the first good probe makes it healthy."""

    def __init__(self, name: str, address: str, channel: grpc.aio.Channel, log, *,
                 min_backoff_s: float = 0.1, max_backoff_s: float = 5.0,
                 verify: Callable[[], Awaitable[bool]] | None = None):
        self.name, self.address, self.channel, self.log = name, address, channel, log
        self.min_backoff_s, self.max_backoff_s = min_backoff_s, max_backoff_s
        self.verify = verify
        self.healthy = True
        self.failures = 0
        self._task: asyncio.Task | None = None

    def mark_failed(self, reason: str) -> None:
        self.failures += 1
        if self.healthy:
            self.log.warning("backend_unhealthy", backend=self.name, address=self.address, reason=reason)
        self.healthy = False
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._reconnect())

    async def probe(self) -> bool:
        try:
            resp = await health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2.0)
        except grpc.aio.AioRpcError:
            return False
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            return False
        return await self.verify() if self.verify is not None else True

    async def _reconnect(self) -> None:
        delay, tries = self.min_backoff_s, 0
        while True:
            await asyncio.sleep(delay)
            tries += 1
            try:
                ok = await self.probe()
            except Exception as exc:  # noqa: BLE001 - a probe must never kill the loop
                self.log.warning("health_probe_error", backend=self.name, error=str(exc))
                ok = False
            if ok:
                self.healthy = True
                self.log.info("backend_healthy", backend=self.name, address=self.address, probes=tries)
                return
            delay = min(delay * 2, self.max_backoff_s)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


def refuses_client_params(exc: BackendError) -> bool:
    """A draft's INVALID_ARGUMENT about `open.speculative` (the client's own parameters, passed
    through): the client's error. Anything else (a prompt past the draft's context, say) only
    costs speed: the request goes on without the draft."""
    return exc.code == grpc.StatusCode.INVALID_ARGUMENT and exc.message.startswith("open.speculative")


class ResilientSource:
    """The token source of one request (see the module doc). Use `steps()` as the source for
    `stream_response`; afterwards `await close()` (polite) or `cancel()` (client gone)."""

    def __init__(self, backends, req: Request, stats: Stats, plan: Plan, log, *,
                 timeout_s: Callable[[], float | None] = lambda: None):
        self.b = backends
        self.cfg = backends.cfg
        self.req, self.stats, self.plan, self.log = req, stats, plan, log
        self.timeout_s = timeout_s
        self.history: list[int] = []             # tokens committed (and yielded) so far
        self.target: TargetSession | None = None
        self.draft: DraftSession | None = None
        self.client: TargetClient | None = None
        # One policy for the whole request: what it learned survives a target failover.
        bucket = sampling_bucket(req.sampling.temperature,
                                 plan.speculative.draft_sampling if plan.speculative is not None else "")
        self.policy = (AutoPolicy(backends.measurements, max_k=plan.max_k, bucket=bucket) if plan.method == "auto"
                       else FixedPolicy(plan.method))
    # -- lifecycle -------------------------------------------------------------------------
    async def close(self) -> None:
        if self.plan.method == "auto":
            self.log.debug("auto_policy", steps=dict(self.stats.steps_by_method), **self.b.measurements.snapshot())
        for s in (self.target, self.draft):
            if s is not None:
                await s.close()

    def cancel(self) -> None:
        for s in (self.target, self.draft):
            if s is not None:
                s.cancel()

    # -- the source ------------------------------------------------------------------------
    async def steps(self) -> AsyncIterator[list[int]]:
        failovers = 0
        tried: set[int] = set()
        # The prompt's prefix, not the history: a failover re-prefills prompt + history, but the
        # replicas' caches are keyed by how prompts start, which the history does not change.
        key = self.b.routing_key(self.req.prompt_ids, getattr(self.req, "cache_salt", "") or "")
        self.client = self.b.pick_target(key=key)
        while True:
            tried.add(id(self.client))
            self.target = self.client.session(self.timeout_s())
            try:
                with self.b.serving(self.client):       # counted until this attempt ends, however
                    async with contextlib.aclosing(self._attempt()) as attempt:
                        async for toks in attempt:
                            self.history.extend(toks)
                            yield toks
                return
            except BackendError as exc:
                if exc.backend != "target":
                    raise
                opening = self.target.opened is False
                lost = exc.code in REPLICA_LOST
                failed = exc.code == STEP_FAILED
                full = exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and opening
                if not (lost or full or failed):
                    raise
                self.target.cancel()
                self._drop_draft()
                if lost:
                    self.b.target_health(self.client).mark_failed(f"{exc.code.name}: {exc.message}")
                nxt = self.b.pick_target(exclude=tried, key=key)
                if full:
                    if nxt is None:
                        raise           # every replica is full: RESOURCE_EXHAUSTED as is
                    self.log.info("target_full_try_next", address=self.client.address, next=nxt.address)
                    self.client = nxt
                    continue
                failovers += 1
                if nxt is None and (failed or self.b.single_name()):
                    # a dns:/// name: a new stream goes to another replica; after a failed step
                    # the replica itself is still serving
                    nxt = self.client
                if nxt is None or failovers > self.cfg.target_failover_attempts:
                    self.log.warning("target_failover_failed", address=self.client.address, code=exc.code.name,
                                     tokens_streamed=len(self.history), failovers=failovers - 1)
                    raise BackendError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"no target replica could continue the request (failovers {failovers - 1}, "
                        f"--target-failover-attempts {self.cfg.target_failover_attempts}, replicas "
                        f"{', '.join(c.address for c in self.b.targets)}); {len(self.history)} tokens were "
                        f"streamed before it failed; last error from {self.client.address}: "
                        f"{exc.code.name}: {exc.message}") from None
                self.stats.target_failovers += 1
                self.log.warning("target_failover", failed=self.client.address, next=nxt.address,
                                 code=exc.code.name, message=exc.message, tokens_so_far=len(self.history))
                await asyncio.sleep(min(1.0, 0.05 * 2 ** (failovers - 1)))
                self.client = nxt

    # -- one target session ----------------------------------------------------------------
    def _want_draft(self) -> bool:
        if self.b.draft is None:
            return False
        if not self.b.draft_health.healthy:
            self._fallback("the draft is unhealthy (reconnecting)", count=True)
            return False
        return True

    def _fallback(self, reason: str, *, count: bool = True) -> None:
        if count:
            self.stats.draft_fallbacks += 1
        self.log.warning("draft_fallback", reason=reason, tokens_so_far=len(self.history),
                         fallbacks=self.stats.draft_fallbacks)

    def _drop_draft(self) -> None:
        if self.draft is not None:
            self.draft.cancel()
            self.draft = None

    def _draft_failed(self, exc: BaseException) -> None:
        if isinstance(exc, BackendError):
            reason = f"{exc.code.name}: {exc.message}"
            down = exc.code in DRAFT_DOWN
        else:
            reason = f"no answer within --draft-timeout-ms {self.cfg.draft_timeout_ms}"
            down = True
        self._drop_draft()
        if down:
            self.b.draft_health.mark_failed(reason)
        self._fallback(reason)

    async def _draft_call(self, coro, timeout_s: float, *, client_errors: bool = False):
        """Await a draft call; a failure drops the draft (DraftLost). With `client_errors` (the
        Open, which carries the client's parameters), a refusal of those parameters is the
        client's error and ends the request with it instead."""
        try:
            async with asyncio.timeout(timeout_s):     # unlike wait_for, never swallows a cancel
                return await coro
        except BackendError as exc:
            if exc.backend != "draft":
                raise
            if client_errors and refuses_client_params(exc):
                self._drop_draft()
                raise BackendError(exc.code, f"the draft refused this request: {exc.message}", "draft") from None
            self._draft_failed(exc)
        except asyncio.TimeoutError as exc:
            self._draft_failed(exc)
        raise DraftLost()

    async def _open_draft(self, opened, prefix: list[int]) -> RemoteDraft | None:
        """The draft session of this attempt, or None (the fallback is logged and counted)."""
        plan, req = self.plan, self.req
        self.draft = self.b.draft.session(self.timeout_s())
        # A windowed draft was sent only the prompt's last rows (TargetOpen.hidden_last): say where they start.
        start = len(prefix) - opened.hidden.shape[0] if plan.layer_ids and opened.hidden.shape else 0
        try:
            answer = await self._draft_call(self.draft.open(
                req.request_id, prefix, opened.hidden if plan.layer_ids else None, plan.speculative,
                req.sampling, plan.tokenizer_hash, prompt_hidden_start=start,
                generated_tokens=len(prefix) - len(req.prompt_ids)),
                4 * self.cfg.draft_timeout_ms / 1e3,   # Open also prefills
                client_errors=True)
        except DraftLost:
            return None
        return RemoteDraft(self.draft, answer.method, answer.num_draft_tokens, bool(plan.layer_ids),
                           topk=plan.speculative.topk or 1)

    def _attempt(self) -> AsyncIterator[list[int]]:
        plan = self.plan
        remaining = self.req.max_new_tokens - len(self.history)
        remote = plan.speculative is not None and self.policy.wants_draft(remaining) and self._want_draft()
        if remote or plan.local_ngram or plan.lookahead:
            self.stats.method = plan.method
        elif not self.history:
            self.stats.method = "none"
        width = plan.speculative.num_draft_tokens if plan.speculative is not None else 0
        loop = SpeculativeLoop(
            self.target, self.req, self.stats, self.policy, measurements=self.b.measurements,
            draft_call=self._draft_call, open_draft=self._open_draft if remote else None,
            layer_ids=plan.layer_ids if remote else [], hidden_stream=plan.hidden_stream if remote else "",
            ngram=NgramIndex(1, 4) if plan.local_ngram else None,
            max_width=max(width, plan.max_k + 1), step_timeout_s=self.cfg.draft_timeout_ms / 1e3,
            ngram_tree=plan.ngram_tree, lookahead=plan.lookahead,
            hidden_dtype=self.b.draft_info.hidden_dtype if remote and self.b.draft_info is not None else 0,
            hidden_last=self.b.draft_info.context_window if remote and self.b.draft_info is not None else 0)
        return loop.steps(self.history)
