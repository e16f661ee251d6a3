"""The draft's scheduler: every pending DFlash Open and Propose of every session, first come
first served under `--max-num-batched-tokens`, run together by the engine thread: one fused
projection appends all new target features to the sessions' context caches (in the draft's
shared KV pool) and one block forward drafts every session's block. One draft replica can so
serve the sessions of several target replicas.

gRPC handlers await their own item; a session's blocks go back to the pool when it closes
(after its forward, if one is in flight). n-gram sessions never come here: they take
microseconds and no model."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from splitspec.engine.batching import take_fifo
from splitspec.engine.loop import Deliveries, EngineLoop
from splitspec.metrics import step_kind

from .dflash import DFlashDraft, append_context, ensure_room
from .proposer import DFlashProposer, Proposal, propose_batch


@dataclass
class Work:
    proposer: DFlashProposer
    kind: str                        # "open" or "propose"
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    ready_at: float
    ids: list[int]                   # open: the prompt; propose: the newly committed tokens
    hidden: torch.Tensor | None
    base_len: int = 0


@dataclass
class Drafted:
    proposal: Proposal
    queue_ms: float
    batch_size: int


class DraftScheduler:
    def __init__(self, model: DFlashDraft, *, max_batched_tokens: int, engine: EngineLoop):
        self.model, self.engine = model, engine
        self.max_batched_tokens = max_batched_tokens
        self.lock = threading.Lock()
        self.pending: deque[Work] = deque()
        self.in_flight: set[int] = set()      # id() of proposers whose item runs now
        self.closed: set[int] = set()         # ... and that were closed meanwhile
        self.forwards = 0
        self.rows = 0
        self.busy_ms = 0.0                    # time spent in those forwards
        self.on_forward = None      # (kind, rows, tokens, forward_ms) after each forward, for metrics
        # Intra-op threads for the forwards (0: leave as is). Set from the host's core share
        # (splitspec/colocation.py) and applied here, on the engine thread: torch keeps the
        # OpenMP thread count per thread, so setting it from the event loop would not reach us.
        self.threads = 0
        engine.attach(self)

    async def open(self, proposer: DFlashProposer, prompt: list[int], hidden: torch.Tensor, start: int = 0) -> None:
        """hidden: the features of prompt positions start .. len(prompt) - 1 (a windowed draft's tail)."""
        proposer.check_open(prompt, hidden, start)
        proposer.cache.offset = start       # the cache is still empty: nothing before start is ever stored
        await self._submit(proposer, "open", prompt, hidden)

    async def propose(self, proposer: DFlashProposer, base_len: int, new_ids: list[int],
                      hidden: torch.Tensor | None) -> Drafted:
        return await self._submit(proposer, "propose", new_ids, hidden, base_len)

    async def _submit(self, proposer, kind, ids, hidden, base_len=0):
        loop = asyncio.get_running_loop()
        work = Work(proposer, kind, loop, loop.create_future(), time.perf_counter(), ids, hidden, base_len)
        with self.lock:
            self.pending.append(work)
        self.engine.wake()
        return await work.future

    def close(self, proposer: DFlashProposer) -> None:
        """Drop the session's pending item and hand its blocks back (now, or after its forward)."""
        with self.lock:
            self.pending = deque(w for w in self.pending if w.proposer is not proposer)
            if id(proposer) in self.in_flight:
                self.closed.add(id(proposer))
            else:
                proposer.close()

    # --- engine side ------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.pending)

    def _demand(self, w: Work) -> tuple[int, bool]:
        rows = 0 if w.hidden is None else w.hidden.shape[0]
        return rows + (self.model.cfg.block_size if w.kind == "propose" else 0), False

    def step(self) -> None:
        with self.lock:
            # One item per session per forward (a session's items are sequential anyway).
            seen, order = set(), []
            for w in self.pending:
                if id(w.proposer) not in seen:
                    seen.add(id(w.proposer))
                    order.append(w)
            picked = [w for w, _ in take_fifo(order, self._demand, budget=self.max_batched_tokens, chunk=0)]
            for w in picked:
                self.pending.remove(w)
                self.in_flight.add(id(w.proposer))
        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        start = time.perf_counter()
        results = self._run(picked)
        forward_ms = (time.perf_counter() - start) * 1e3
        done = Deliveries()
        with self.lock:
            self.forwards += 1
            self.rows += len(picked)
            self.busy_ms += forward_ms
            for w, res in zip(picked, results):
                self.in_flight.discard(id(w.proposer))
                if id(w.proposer) in self.closed:
                    self.closed.discard(id(w.proposer))
                    w.proposer.close()
                    continue
                queue_ms = (start - w.ready_at) * 1e3
                if isinstance(res, Exception):
                    done.resolve(w.loop, w.future, error=res)
                else:
                    done.resolve(w.loop, w.future, Drafted(res, queue_ms, len(picked)) if w.kind == "propose" else None)
        done.flush()
        if self.on_forward is not None and picked:
            tokens = sum(self._demand(w)[0] for w in picked)
            self.on_forward(step_kind(w.kind for w in picked), len(picked), tokens, forward_ms)

    def _run(self, picked: list[Work]) -> list:
        results: list = [None] * len(picked)
        opens = []
        for i, w in enumerate(picked):
            if w.kind == "open":
                try:
                    ensure_room(w.proposer.cache, w.hidden.shape[0])
                    opens.append(i)
                except Exception as exc:  # noqa: BLE001 - this session fails alone
                    results[i] = exc
        try:
            with torch.inference_mode():
                append_context(self.model, [(picked[i].proposer.cache, picked[i].hidden) for i in opens])
            for i in opens:
                picked[i].proposer.tokens = list(picked[i].ids)
        except Exception as exc:  # noqa: BLE001
            for i in opens:
                results[i] = exc
        props = [i for i, w in enumerate(picked) if w.kind == "propose"]
        if props:
            outs = propose_batch(self.model, [(picked[i].proposer, picked[i].base_len, picked[i].ids,
                                               picked[i].hidden) for i in props])
            for i, out in zip(props, outs):
                results[i] = out
        return results
