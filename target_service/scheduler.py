"""The target's engine loop: ONE worker thread runs every model call, taking work items from a
queue that all sessions feed. gRPC handlers never touch the model; they submit an item and
await its asyncio future. Each item is one step of one session today; because every step
passes through this queue, batching the pending steps of many sessions into one forward pass
can be added here later without touching the server.

The scheduler also owns the session registry and the admission checks (max sessions, KV
cache budget, context length), so GetInfo can report counts and bytes."""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import torch

from .engine import StepOutput, TargetSequence
from .kv_cache import KVCache
from .model import CausalLM
from splitspec.engine.sample import SamplingParams
from splitspec.engine.tree import Tree


class AdmissionError(Exception):
    """The service is full (max sessions or KV budget): RESOURCE_EXHAUSTED."""


class ContextError(ValueError):
    """The sequence does not fit in the context: OUT_OF_RANGE."""


class StaleError(ValueError):
    """A Verify built on a length the session no longer has: ABORTED."""


class DrainingError(Exception):
    """The service is shutting down and takes no new sessions: UNAVAILABLE."""


@dataclass
class Step:
    out: StepOutput
    forward_ms: float          # time inside the engine loop for this item (model + sampling)


def _timed(fn: Callable[[], StepOutput]) -> Callable[[], Step]:
    def run() -> Step:
        t = time.perf_counter()
        out = fn()
        return Step(out, (time.perf_counter() - t) * 1e3)
    return run


@dataclass
class WorkItem:
    kind: str                      # "load", "open", "decode", "verify", "close", ...: what a batcher would group by
    fn: Callable
    future: asyncio.Future | None
    loop: asyncio.AbstractEventLoop | None
    session: "Session | None" = None


class EngineLoop:
    """A single worker thread draining a FIFO of work items. torch releases the GIL inside
    kernels, so the asyncio side stays responsive (health checks, new streams) meanwhile."""

    def __init__(self, name: str = "engine-loop"):
        self._queue: queue.Queue[WorkItem | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, kind: str, fn: Callable, session: "Session | None" = None) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.put(WorkItem(kind, fn, fut, loop, session))
        return fut

    def post(self, kind: str, fn: Callable, session: "Session | None" = None) -> None:
        """Fire and forget (freeing a session's memory after its in-flight step)."""
        self._queue.put(WorkItem(kind, fn, None, None, session))

    def stop(self, timeout: float | None = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if item.future is not None and item.future.cancelled():
                continue            # the caller is gone (client cancelled): skip the forward
            try:
                result, error = item.fn(), None
            except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting handler
                result, error = None, exc
            if item.future is not None:
                try:
                    item.loop.call_soon_threadsafe(_resolve, item.future, result, error)
                except RuntimeError:
                    pass            # the event loop has closed (shutdown); nobody is waiting


def _resolve(fut: asyncio.Future, result, error) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


@dataclass
class Session:
    session_id: str
    prompt_len: int
    max_len: int
    kv_bytes: int
    seq: TargetSequence | None = None
    wire_dtype: torch.dtype | None = None   # dtype of hidden states sent back
    opened_at: float = field(default_factory=time.monotonic)

    @property
    def length(self) -> int:
        return self.seq.length if self.seq is not None else 0


class Scheduler:
    def __init__(self, model: CausalLM, *, verifier, max_sessions: int, kv_budget_bytes: int,
                 max_context: int, engine: EngineLoop):
        self.model = model
        self.cfg = model.cfg
        self.verifier = verifier
        self.max_sessions = max_sessions
        self.kv_budget_bytes = kv_budget_bytes
        self.max_context = max_context
        self.engine = engine
        self.dtype = next(model.parameters()).dtype
        self.sessions: dict[int, Session] = {}     # keyed by object id: session ids are the client's and may repeat
        self.accepting = True

    @property
    def active_sessions(self) -> int:
        return len(self.sessions)

    @property
    def kv_bytes(self) -> int:
        return sum(s.kv_bytes for s in self.sessions.values())

    async def warmup(self) -> float:
        """One real forward (prefill + decode of a 2-token sequence) so the first request does
        not pay for lazy initialisation; returns its wall time in ms."""
        def run():
            t = time.perf_counter()
            seq = TargetSequence(self.model, [0], max_len=4, verifier=self.verifier)
            seq.prefill()
            seq.decode()
            return (time.perf_counter() - t) * 1e3
        return await self.engine.submit("warmup", run)

    async def open(self, session_id: str, prompt: list[int], params: SamplingParams, *,
                   hidden_layers: tuple[int, ...] = (), max_new_tokens: int = 0) -> tuple[Session, Step]:
        if not self.accepting:
            raise DrainingError("the target is draining (shutting down); open the session on another replica")
        if len(prompt) >= self.max_context:
            raise ContextError(f"open.prompt_token_ids has {len(prompt)} tokens; the max context is "
                               f"{self.max_context}, which leaves no room for a new token")
        for i, layer in enumerate(hidden_layers):
            if not 0 <= layer < self.cfg.num_hidden_layers:
                raise ValueError(f"open.hidden_layer_ids[{i}] = {layer} is outside the target's layers "
                                 f"0..{self.cfg.num_hidden_layers - 1}")
        if max_new_tokens < 0:
            raise ValueError(f"open.max_new_tokens must be >= 0 (0: up to the context), got {max_new_tokens}")
        # The cache holds every committed token but the last; + 1 covers a bonus token past the end.
        max_len = self.max_context if max_new_tokens == 0 else min(self.max_context, len(prompt) + max_new_tokens + 1)
        need = KVCache.bytes_needed(self.cfg, max_len, self.dtype)
        if len(self.sessions) >= self.max_sessions:
            raise AdmissionError(f"the target already has {len(self.sessions)} open sessions "
                                 f"(--max-sessions {self.max_sessions})")
        if self.kv_bytes + need > self.kv_budget_bytes:
            mib = 1024 * 1024
            raise AdmissionError(f"KV cache budget exhausted: this session needs {need / mib:.1f} MiB "
                                 f"for {max_len} tokens, {(self.kv_budget_bytes - self.kv_bytes) / mib:.1f} "
                                 f"of {self.kv_budget_bytes / mib:.1f} MiB are free (--kv-cache-budget-mb)")
        session = Session(session_id, len(prompt), max_len, need)
        self.sessions[id(session)] = session   # reserve before the await so admission stays exact

        def run():
            session.seq = TargetSequence(self.model, prompt, params, max_len=max_len,
                                         hidden_layers=tuple(hidden_layers), verifier=self.verifier)
            return session.seq.prefill()
        try:
            step = await self.engine.submit("open", _timed(run), session)
        except BaseException:
            self.close(session)
            raise
        return session, step

    async def decode(self, session: Session, n: int) -> AsyncIterator[Step]:
        """n target-only steps, each its own work item so sessions interleave step by step."""
        if n < 1:
            raise ValueError(f"decode.n must be >= 1, got {n}")
        if session.length - 1 + n > session.max_len:
            raise ContextError(f"decode.n = {n} would grow the sequence to {session.length + n} tokens; this "
                               f"session holds at most {session.max_len} (open.max_new_tokens / max context)")
        for _ in range(n):
            yield await self.engine.submit("decode", _timed(session.seq.decode), session)

    async def verify(self, session: Session, base_len: int, tree: Tree,
                     draft_probs: torch.Tensor | None) -> Step:
        if base_len != session.length:
            raise StaleError(f"verify.base_len = {base_len} but the session has {session.length} committed "
                             f"tokens; the tree was drafted on a stale state")
        if session.length + len(tree) > session.max_len:
            raise ContextError(f"verifying {len(tree)} nodes would grow the sequence past the {session.max_len} "
                               f"tokens this session holds (open.max_new_tokens / max context)")
        return await self.engine.submit("verify", _timed(lambda: session.seq.verify(tree, draft_probs)), session)

    def close(self, session: Session) -> None:
        """Forget the session now; its KV memory is freed by the worker right after any step
        of it still in flight (same FIFO), never under it."""
        if self.sessions.pop(id(session), None) is None:
            return

        def free():
            session.seq = None
        self.engine.post("close", free, session)
