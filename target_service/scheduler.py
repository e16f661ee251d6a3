"""The target's scheduler: admission, the waiting queue, and which pending steps of which
sessions run together in the next forward.

gRPC handlers (asyncio) call `open` / `decode` / `verify` / `close`; each registers the
session's one pending step and awaits it. The engine thread calls `step()`: it takes the
pending steps of the running sessions first come first served under
`--max-num-batched-tokens` (prefill chunks, decode and verify rows mixed), runs them as one
forward (`runner.run_batch`), and hands each result back to its handler.

Admission: a session beyond `--max-running-requests`, or whose KV reservation does not fit
the free pool now, waits in a FIFO queue instead of failing; RESOURCE_EXHAUSTED only when the
queue is full (`--max-queued-requests`) or the request can never fit the pool. A session
reserves blocks for its whole length (prompt + max_new_tokens) at admission, so a running
session never runs out of KV mid-generation; blocks are taken as tokens arrive. Closing frees
the running slot and the reservation at once, ahead of any queued model step.

Threading: `lock` guards the session lists and pending steps, never a forward. A session's
blocks are touched only by the engine thread while its step is in flight, and by `close`
otherwise (the pool's free list has its own lock).

Faults: `_fail` is the one place a step fails. Whatever raises while a step is composed, run or
delivered, its session leaves the scheduler there at once (slot, reservation, KV blocks and
state slot freed) and its waiter gets StepFailed (INTERNAL, naming the cause), so nothing
waits for a result that will never come. A fault that belongs to one session (its tree
rewrite, grammar, sampling, lookahead, prefix reuse) fails that session alone; a fault in the
shared forward fails every session in that forward. The engine serves on either way, and the
gateway, which owns each request's token history, resumes the failed requests exactly."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

import structlog
import torch

from splitspec.engine.batching import take_fifo
from splitspec.engine.kv_pool import BlockTable, KVPool
from splitspec.engine.loop import Deliveries, EngineLoop
from splitspec.engine.sample import SamplingParams, make_generator
from splitspec.metrics import step_kind
from splitspec.serving import AdmissionError, DrainingError  # noqa: F401  (raised here, mapped in serving)
from splitspec.engine.tree import Tree

from target_service import prefix
from splitspec.grammar import rewrite_tree
from target_service.lookahead import Lookahead, SessionLookahead
from splitspec.models.dense import CausalLM
from target_service.parallel import TensorParallelError
from target_service.runner import Decode, Prefill, Sequence, StepOutput, Verify, check_hidden_stream, run_batch
from target_service.verify import DraftProbsError, check_draft_probs

log = structlog.get_logger(__name__)

# How long after a drafted hit found tap rows missing sessions without a draft keep storing them.
STORE_TAPS_S = 600.0


class ContextError(ValueError):
    """The sequence does not fit in the context: OUT_OF_RANGE."""


class StaleError(ValueError):
    """A Verify built on a length the session no longer has: ABORTED."""


class ClosedError(Exception):
    """The session was closed while one of its steps waited."""


class StepFailed(Exception):
    """A step failed inside the target (a bug, or a fault in the forward): INTERNAL. Its session
    is already gone from the scheduler; the request can resume anywhere from its tokens so far."""


@dataclass
class Step:
    out: StepOutput
    forward_ms: float      # the batched forward(s) this step ran in: model + sampling for the whole batch
    queue_ms: float        # time the step waited before its forward started (admission queue included)
    batch_size: int        # rows (sessions' steps) in that forward
    batch_tokens: int      # query tokens in that forward
    length: int = 0        # the session's committed length right after this step
    cached_tokens: int = 0  # prefill: prompt tokens whose K/V came from the prefix cache
    forced: int = 0         # verify: accepted tokens the grammar forced (nodes the target added)
    verify_rows: int = 0    # rows of that forward that verified a draft tree
    drafted: int = 0        # decode with lookahead: prompt-lookup tokens this forward verified
    accepted: int = 0       # ... and of them, accepted


@dataclass
class Work:
    """A session's one pending step."""
    kind: str                          # "prefill", "decode" or "verify"
    loop: asyncio.AbstractEventLoop
    ready_at: float                    # when it became runnable (FIFO order)
    future: asyncio.Future | None = None   # prefill / verify
    queue: asyncio.Queue | None = None     # decode: one Step (or exception) per token
    remaining: int = 0                 # decode tokens still to produce
    total: int = 0                     # decode tokens this run yields in all (extensions included)
    lookahead: int = 0                 # decode: most prompt-lookup tokens one forward may verify (lookahead.py)
    drafted: tuple[int, int] | None = None   # decode: (match length, tokens) drafted in the forward in flight
    tree: Tree | None = None
    draft_probs: torch.Tensor | None = None
    hidden: list = field(default_factory=list)   # prefill features, chunk by chunk
    first_added: int | None = None     # verify: the first tree node the grammar's forced tokens added
    q_checked: bool = False            # verify: draft_probs checked and cast (check_draft_probs)
    forward_ms: float = 0.0
    queue_ms: float = 0.0


@dataclass
class Row:
    """One session's part of the step being run."""
    session: "Session"
    n: int                      # query tokens it was given
    work: Work
    old_len: int                # its table's length before the forward
    step: object = None         # the runner's Prefill / Decode / Verify


@dataclass
class Session:
    session_id: str
    prompt_len: int
    max_len: int
    reserve_blocks: int
    seq: Sequence | None = None
    wire_dtype: torch.dtype | None = None   # dtype of hidden states sent back
    opened_at: float = field(default_factory=time.monotonic)
    state: str = "waiting"                  # waiting -> running -> closed
    work: Work | None = None
    in_flight: bool = False
    prefix: prefix.Track | None = None      # its view of the prefix cache (None: cache off)
    # Whether the caller asked for features. A session that did not may still compute a draft's
    # taps, only to store them with the blocks it publishes (Scheduler.open).
    ships_hidden: bool = True
    look: SessionLookahead | None = None    # its prompt-lookup index, once a Decode asks for lookahead
    failure: Exception | None = None        # why the scheduler failed it (`_fail`): what a later step raises

    @property
    def length(self) -> int:
        return self.seq.length if self.seq is not None else 0


def exact_chunk_end(prefilled: int, n: int, prompt_len: int, span: int = 16) -> int:
    """Where a batch-invariant prefill chunk of at most `n` tokens from `prefilled` ends: on a
    multiple of `span`, the KV block size (or at the prompt's end), where
    `attention.exact_queries` cuts its spans. A chunk ending mid-span would compute that span's
    tokens in two calls, and differ in the last bit from a prefill that ran them in one (as a
    later prefix-cache hit, always whole blocks, would). `prefilled` when no boundary lies
    within the n tokens: the chunk waits for a larger share rather than run past its budget."""
    end = prefilled + n
    if end >= prompt_len:
        return prompt_len
    return max(prefilled, end // span * span)


# Rows of one bf16 GEMM over which this CPU gave a row the same bits whatever the others were
# (docs/speculation.md, "Exact at bf16"): a batch-invariant target's forwards stay inside it.
EXACT_MAX_ROWS = 512
# Nodes a grammar's forced chain may add to a verify tree (grammar.rewrite_tree's room).
FORCED_ROOM = 16


def exact_budgets(max_batched_tokens: int, chunked_prefill_size: int, block_size: int) -> tuple[int, int]:
    """(--max-num-batched-tokens, --chunked-prefill-size) a batch-invariant target runs with:
    forwards of at most EXACT_MAX_ROWS query rows, and prefill shares of at least one KV block
    (its chunks end on block boundaries, so a smaller share would never run). Each change is
    logged; a block too large for the row range is refused (ValueError)."""
    if block_size > EXACT_MAX_ROWS:
        raise ValueError(f"--kv-block-size {block_size}: a batch-invariant target prefills whole blocks in "
                         f"forwards of at most {EXACT_MAX_ROWS} rows; use a block of at most {EXACT_MAX_ROWS} "
                         "tokens or --batch-invariant off")
    budget = min(max(max_batched_tokens, block_size), EXACT_MAX_ROWS)
    if budget != max_batched_tokens:
        log.warning("max_num_batched_tokens_clamped", requested=max_batched_tokens, used=budget,
                    why=f"batch-invariant forwards stay within {block_size}..{EXACT_MAX_ROWS} rows: the range where "
                        "a row's bf16 GEMM bits were measured not to depend on the other rows")
    chunk = max(chunked_prefill_size, block_size)
    if chunk != chunked_prefill_size:
        log.warning("chunked_prefill_size_raised", requested=chunked_prefill_size, used=chunk,
                    why=f"batch-invariant prefill chunks end on {block_size}-token KV block boundaries")
    return budget, chunk


class Scheduler:
    def __init__(self, model: CausalLM, *, verifier, pool: KVPool, max_running: int, max_queued: int,
                 max_batched_tokens: int, chunked_prefill_size: int, max_context: int, engine: EngineLoop,
                 attention: str = "torch", verify_threads: int = 0, model_id: str = ""):
        self.model, self.cfg, self.verifier, self.pool = model, model.cfg, verifier, pool
        self.max_running, self.max_queued = max_running, max_queued
        if attention == "torch-exact":
            max_batched_tokens, chunked_prefill_size = exact_budgets(max_batched_tokens, chunked_prefill_size,
                                                                     pool.block_size)
        self.max_batched_tokens, self.chunked_prefill_size = max_batched_tokens, chunked_prefill_size
        self.max_context = max_context
        self.engine = engine
        self.attention = attention
        self.model_id = model_id        # the prefix cache's namespace, with each request's salt
        # With several sessions a co-located draft computes while the target verifies: the target
        # then gives up threads (--verify-torch-threads) instead of fighting it for every core.
        self.threads = torch.get_num_threads()
        self.verify_threads = verify_threads
        self.exact_threads = self.threads   # a batch-invariant target's forwards, always (_forward_threads)
        self.dtype = next(model.parameters()).dtype
        self.lock = threading.Lock()
        self.running: list[Session] = []
        self.waiting: deque[Session] = deque()
        self.reserved_blocks = 0
        self.accepting = True
        self.forwards = 0           # batched forwards run
        self.rows = 0               # steps run in them (mean batch size = rows / forwards)
        self.busy_ms = 0.0          # time spent in those forwards
        self.prefix_queries = 0     # prompt tokens of finished prefills (vLLM's prefix_cache_queries)
        self.prefix_hits = 0        # of them, taken from the prefix cache
        # The taps (layers, stream) the last session with a draft asked for. Sessions without a
        # draft compute and store them too, but only until `store_taps_until`: a drafted hit that
        # found rows missing pushes it STORE_TAPS_S ahead. Storing costs an undrafted session
        # ~4 % (copies, and memory the forward no longer reuses), so traffic that never hits
        # (unique prompts) pays nothing, while a shared prefix that auto runs undrafted gets its
        # rows from the second drafted hit on.
        self.store_taps: tuple[tuple[int, ...], str] | None = None
        self.store_taps_until = float("-inf")
        # Called on the engine thread after each forward (kind, rows, tokens, forward_ms) when
        # --metrics-port is on; None costs nothing.
        self.on_forward = None
        # Called on the engine thread after each forward ([(session id, kind, tokens)], start,
        # end) when tracing is on (splitspec/tracing.py forward); None costs nothing.
        self.on_batch = None
        self.hook_failures: dict[str, int] = {}     # failures of each hook above, by name ("metrics", "tracing")
        self.lookahead = Lookahead()
        engine.attach(self)

    # --- what GetInfo reports ---------------------------------------------------------------
    @property
    def active_sessions(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def kv_bytes(self) -> int:
        """KV memory held by blocks in use."""
        return self.pool.used_blocks * self.pool.bytes_per_block

    @property
    def kv_budget_bytes(self) -> int:
        return self.pool.capacity_blocks * self.pool.bytes_per_block

    # --- asyncio side -----------------------------------------------------------------------
    async def warmup(self) -> float:
        """One real prefill + decode so the first request pays nothing lazy; wall time in ms."""
        def run():
            t = time.perf_counter()
            seq = Sequence([0, 0], SamplingParams(), make_generator(0), BlockTable(self.pool), 4)
            for step in (Prefill(seq, 2), Decode(seq)):
                out = run_batch(self.model, self.pool, self.verifier, [step], self.attention)[0]
                if isinstance(out, Exception):
                    raise out
            seq.table.free()
            return (time.perf_counter() - t) * 1e3
        return await self.engine.submit("warmup", run)

    async def open(self, session_id: str, prompt: list[int], params: SamplingParams, *,
                   hidden_layers: tuple[int, ...] = (), max_new_tokens: int = 0,
                   hidden_stream: str = "", generated_tokens: int = 0, cache_salt: str = "",
                   hidden_last: int = 0, guide=None, wire_dtype: torch.dtype | None = None) -> tuple[Session, Step]:
        """hidden_last: how many trailing prompt positions' features the caller reads (0: all);
        a prefix-cache hit must still return those. wire_dtype: the dtype its features are
        delivered in (None: the model's)."""
        if not self.accepting:
            raise DrainingError("the target is draining (shutting down); open the session on another replica")
        if len(prompt) >= self.max_context:
            raise ContextError(f"open.prompt_token_ids has {len(prompt)} tokens; the max context is "
                               f"{self.max_context}, which leaves no room for a new token")
        for i, layer in enumerate(hidden_layers):
            if not 0 <= layer < self.cfg.num_hidden_layers:
                raise ValueError(f"open.hidden_layer_ids[{i}] = {layer} is outside the target's layers "
                                 f"0..{self.cfg.num_hidden_layers - 1}")
        check_hidden_stream(self.model, hidden_stream, "open.hidden_stream")
        if max_new_tokens < 0:
            raise ValueError(f"open.max_new_tokens must be >= 0 (0: up to the context), got {max_new_tokens}")
        params.validate()
        for token, _ in params.logit_bias:
            if not 0 <= token < self.cfg.vocab_size:
                raise ValueError(f"open.sampling.logit_bias has token id {token}, outside the vocabulary "
                                 f"[0, {self.cfg.vocab_size})")
        if not 0 <= generated_tokens <= len(prompt):
            raise ValueError(f"open.generated_tokens must be in [0, {len(prompt)}] (the prompt's length), "
                             f"got {generated_tokens}")
        # The cache holds every committed token but the last; + 1 covers a bonus token past the end.
        max_len = self.max_context if max_new_tokens == 0 else min(self.max_context, len(prompt) + max_new_tokens + 1)
        need = self.pool.blocks_for(max_len)
        if need > self.pool.capacity_blocks:
            raise AdmissionError(f"this session needs {need} KV blocks ({max_len} tokens) but the whole pool holds "
                                 f"{self.pool.capacity_blocks} (--kv-cache-budget-mb); lower max_new_tokens")
        loop = asyncio.get_running_loop()
        session = Session(session_id, len(prompt), max_len, need, wire_dtype=wire_dtype)
        session.work = Work("prefill", loop, time.perf_counter(), future=loop.create_future())
        taps, stream = tuple(hidden_layers), hidden_stream
        session.ships_hidden = bool(taps)
        cache = self.pool.cache
        if taps:
            self.store_taps = (taps, stream)
        elif (cache is not None and cache.feature_budget > 0 and self.store_taps is not None
              and time.monotonic() < self.store_taps_until):
            taps, stream = self.store_taps
        session.seq = Sequence(list(prompt), params, make_generator(params.seed, self.pool.k.device),
                               BlockTable(self.pool), max_len, taps, hidden_stream=stream,
                               output_start=len(prompt) - generated_tokens,
                               eos_token_ids=tuple(self.cfg.eos_token_ids))
        session.seq.guide = guide
        if not isinstance(cache_salt, str):
            raise ValueError(f"open.cache_salt must be a string, got {type(cache_salt).__name__}")
        session.prefix = prefix.track(self.pool, session.seq, model_id=self.model_id, salt=cache_salt,
                                      hidden_last=hidden_last, needs_rows=session.ships_hidden,
                                      prefill_only=self.attention == "torch-exact")
        with self.lock:
            self.waiting.append(session)
            self._admit()
            if session.state == "waiting" and len(self.waiting) > self.max_queued:
                self.waiting.remove(session)
                raise AdmissionError(f"the target's waiting queue is full: {len(self.running)} sessions running "
                                     f"(--max-running-requests {self.max_running}), {len(self.waiting)} waiting "
                                     f"(--max-queued-requests {self.max_queued})")
        self.engine.wake()
        try:
            step = await session.work.future
        except BaseException:
            self.close(session)
            raise
        return session, step

    async def decode(self, session: Session, n: int, lookahead: int = 0) -> AsyncIterator[Step]:
        """n target-only tokens, one forward per Step (batched with whatever else is pending). With
        lookahead > 0 a forward may verify up to that many prompt-lookup tokens and commit several
        (lookahead.py); the run still ends at exactly n tokens."""
        if n < 1:
            raise ValueError(f"decode.n must be >= 1, got {n}")
        if lookahead < 0:
            raise ValueError(f"decode.lookahead must be >= 0 (0: plain decoding), got {lookahead}")
        if session.length - 1 + n > session.max_len:
            raise ContextError(f"decode.n = {n} would grow the sequence to {session.length + n} tokens; this "
                               f"session holds at most {session.max_len} (open.max_new_tokens / max context)")
        work = Work("decode", asyncio.get_running_loop(), time.perf_counter(), queue=asyncio.Queue(),
                    remaining=n, total=n, lookahead=lookahead)
        if lookahead and session.look is None:
            session.look = SessionLookahead(sampled=not session.seq.params.greedy)
        self._submit(session, work)
        try:
            yielded = 0
            while yielded < work.total:        # `extend` may raise the total while this runs
                item = await work.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yielded += len(item.out.committed)
                yield item
        finally:
            with self.lock:
                if session.work is work:
                    session.work = None

    def extend(self, session: Session, n: int) -> bool:
        """Add n tokens to the session's running Decode, so that it stays in every forward
        instead of sitting one out while its client decides what to do next (under load, a
        whole step). False when no run is streaming any more (its last token was produced):
        the caller then starts a new one."""
        if n < 1:
            raise ValueError(f"decode.n must be >= 1, got {n}")
        with self.lock:
            w = session.work
            if w is None or w.kind != "decode" or w.remaining <= 0:
                return False
            if session.length - 1 + w.remaining + n > session.max_len:
                raise ContextError(f"decode.n = {n} more would grow the sequence to {session.length + w.remaining + n} "
                                   f"tokens; this session holds at most {session.max_len} (open.max_new_tokens / "
                                   "max context)")
            w.remaining += n
            w.total += n
            return True

    async def verify(self, session: Session, base_len: int, tree: Tree,
                     draft_probs: torch.Tensor | None) -> Step:
        """draft_probs: as they came (any float dtype, a read-only view will do); checked and
        cast on the engine thread, and a bad q refused there (DraftProbsError) with the session
        left as it was."""
        if base_len != session.length:
            raise StaleError(f"verify.base_len = {base_len} but the session has {session.length} committed "
                             f"tokens; the tree was drafted on a stale state")
        if session.length + len(tree) > session.max_len:
            raise ContextError(f"verifying {len(tree)} nodes would grow the sequence past the {session.max_len} "
                               f"tokens this session holds (open.max_new_tokens / max context)")
        loop = asyncio.get_running_loop()
        work = Work("verify", loop, time.perf_counter(), future=loop.create_future(), tree=tree,
                    draft_probs=draft_probs)
        self._submit(session, work)
        step = await work.future
        if work.first_added is not None:
            step.forced = sum(1 for node in step.out.result.accepted if node >= work.first_added)
        return step

    def _submit(self, session: Session, work: Work) -> None:
        with self.lock:
            if session.failure is not None:
                raise session.failure
            if session.state != "running":
                raise ClosedError("the session is closed")
            if session.work is not None:
                raise RuntimeError("a session runs one step at a time; the previous one is still pending")
            session.work = work
        self.engine.wake()

    def close(self, session: Session) -> None:
        """Forget the session now: its running slot and reservation go to the next waiting one at
        once; its blocks return to the pool on the engine thread (after its forward, if one is
        in flight)."""
        with self.lock:
            self._forget(session)
        self.engine.wake()

    def _forget(self, session: Session) -> None:
        """Take the session out (lock held): slot and reservation now, blocks now or, while its
        forward runs, when that ends."""
        if session.state == "closed":
            return
        if session.state == "running":
            self.running.remove(session)
            self.reserved_blocks -= session.reserve_blocks
        else:
            self.waiting.remove(session)
        session.state = "closed"
        session.work = None
        if not session.in_flight:
            session.seq.table.free()    # else the engine frees it when the forward ends
        self._admit()

    def _admit(self) -> None:
        """Move waiting sessions to running, oldest first, while a slot and their reservation fit
        (no overtaking, so a large request is never starved by small ones)."""
        while self.waiting and len(self.running) < self.max_running:
            head = self.waiting[0]
            if self.reserved_blocks + head.reserve_blocks > self.pool.capacity_blocks:
                break
            self.waiting.popleft()
            head.state = "running"
            self.reserved_blocks += head.reserve_blocks
            self.running.append(head)

    # --- engine side ------------------------------------------------------------------------
    def has_work(self) -> bool:
        return any(s.work is not None and not s.in_flight for s in self.running)

    def _demand(self, session: Session) -> tuple[int, bool]:
        w = session.work
        if w.kind == "prefill":
            return prefix.prefill_stop(self.pool, session.seq, session.prefix) - session.seq.prefilled, True
        if w.kind == "decode":
            return 1, False
        forced = FORCED_ROOM if session.seq.guide is not None and w.first_added is None else 0
        return len(w.tree) + 1 + forced, False

    def _fit(self, session: Session, n: int) -> int:
        """Prompt tokens of the n offered a batch-invariant prefill chunk runs (exact_chunk_end)."""
        seq = session.seq
        return exact_chunk_end(seq.prefilled, n, len(seq.prompt), self.pool.block_size) - seq.prefilled

    def _prefill_share(self) -> int:
        """Prompt tokens the next forward may run, all prompts together. Alone, prompts take the
        budget. While sessions decode, a long prompt gets `--chunked-prefill-size` so it cannot
        stall them; the share grows with the prompts waiting per decoding session, so that when
        prompts arrive faster than one chunk per forward drains them (many streams starting at
        once) the decoders slow down a little instead of the waiting ones starving."""
        decoding = sum(1 for s in self.running if s.seq.prefilled == s.prompt_len)
        if not decoding:
            return self.max_batched_tokens
        prefilling = sum(1 for s in self.running if s.seq.prefilled < s.prompt_len)
        return min(self.max_batched_tokens, self.chunked_prefill_size * max(1, -(-prefilling // decoding)))

    def step(self) -> None:
        done = Deliveries()
        rows: list[Row] = []        # every session this step put in flight
        try:
            self._step(done, rows)
        except Exception as exc:  # noqa: BLE001 - a fault no closer guard caught: every session still in this step
            with self.lock:
                for r in rows:
                    if r.session.in_flight:
                        self._fail(done, r.session, exc, "the batched step")
        finally:
            done.flush()

    def _step(self, done: Deliveries, rows: list[Row]) -> None:
        with self.lock:
            pending = sorted((s for s in self.running if s.work is not None and not s.in_flight),
                             key=lambda s: s.work.ready_at)
            if self.pool.cache is not None:
                pending = self._reuse_prefixes(done, pending)
            if not pending:
                return
            chunk = self._prefill_share()
            fit = self._fit if self.attention == "torch-exact" else None
            for session, n in take_fifo(pending, self._demand, budget=self.max_batched_tokens, chunk=chunk, fit=fit):
                session.in_flight = True
                rows.append(Row(session, n, session.work, session.seq.table.length))
            for r in rows:
                self._guarded(done, r.session, "the tree rewrite", self._plan_step, done, r)
            self._look_ahead(done, [r for r in rows if r.session.in_flight])
        live = [r for r in rows if r.session.in_flight]
        if not live:
            return
        steps = [r.step for r in live]
        want = self._forward_threads(steps)
        if want and torch.get_num_threads() != want:
            torch.set_num_threads(want)
        start = time.perf_counter()
        try:
            outputs = run_batch(self.model, self.pool, self.verifier, steps, self.attention)
        except Exception as exc:  # noqa: BLE001 - the shared forward failed: every session in it fails
            with self.lock:
                for r in live:
                    self._fail(done, r.session, exc, "the batched forward")
            return
        end = time.perf_counter()
        forward_ms = (end - start) * 1e3
        tokens = sum(len(r.step.tree) + 1 if isinstance(r.step, Verify) else r.n for r in live)
        verify_rows = sum(isinstance(step, Verify) for step in steps)
        self.lookahead.ran(len(live), tokens, verify_rows, forward_ms)
        with self.lock:
            self.forwards += 1
            self.rows += len(live)
            self.busy_ms += forward_ms
            for r, out in zip(live, outputs):
                session = r.session
                if isinstance(out, Exception):
                    self._fail(done, session, out, "its sampling, grammar or verification")
                    continue
                session.in_flight = False
                if session.state == "closed":
                    session.seq.table.free()
                    continue
                self._guarded(done, session, "delivering its step", self._finish_row, done, r, out, start, end,
                              forward_ms, len(live), tokens, verify_rows)
        if self.on_forward is not None:
            self._hook("metrics", self.on_forward, step_kind(r.work.kind for r in live), len(live), tokens,
                       forward_ms)
        if self.on_batch is not None:
            self._hook("tracing", self.on_batch, [(r.session.session_id, r.work.kind, r.n) for r in live], start, end)

    def _hook(self, name: str, fn, *args) -> None:
        """A metrics or tracing hook after delivery: every step it reports on is already
        delivered, so its failure fails no session and stops no other hook; it is logged, on
        the 1st, 2nd, 4th, 8th... failure of that hook, so a hook failing on every forward
        cannot flood the log."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - observability must never stop the engine
            failures = self.hook_failures[name] = self.hook_failures.get(name, 0) + 1
            if failures & (failures - 1) == 0:
                log.error("forward_hook_failed", hook=name, failures=failures, error=f"{type(exc).__name__}: {exc}",
                          exc_info=exc)

    def _plan_step(self, done: Deliveries, r: Row) -> None:
        """The runner's step for one picked session (lock held)."""
        session, w = r.session, r.work
        if w.kind == "verify" and w.draft_probs is not None and not w.q_checked:
            try:
                w.draft_probs, w.q_checked = check_draft_probs(w.draft_probs, w.tree), True
            except DraftProbsError as exc:
                self._refuse(done, session, exc)
                return
        if w.kind == "prefill":
            r.step = Prefill(session.seq, session.seq.prefilled + r.n)
        elif w.kind == "decode":
            r.step = Decode(session.seq)
        else:
            if session.seq.guide is not None and w.first_added is None:
                # On the engine thread, like every torch op: the grammar prunes and extends
                # the tree (grammar.rewrite_tree) once, against the committed state.
                room = min(session.max_len - session.length, len(w.tree) + FORCED_ROOM)
                w.tree, w.draft_probs, added = rewrite_tree(session.seq.guide, w.tree, w.draft_probs, room)
                w.first_added = len(w.tree) - added
            r.step = Verify(session.seq, w.tree, w.draft_probs)

    def _finish_row(self, done: Deliveries, r: Row, out: StepOutput, start: float, end: float, forward_ms: float,
                    rows: int, tokens: int, verify_rows: int) -> None:
        session = r.session
        if session.prefix is not None:
            prefix.publish(self.pool, session.seq, session.prefix, r.old_len, out.hidden,
                           prefill=r.work.kind == "prefill")
        if session.work is not r.work:
            return          # its waiter left while the step ran (a Decode stream stopped early)
        self._deliver(done, session, out, start, end, forward_ms, rows, tokens, verify_rows)

    def _refuse(self, done: Deliveries, session: Session, exc: Exception) -> None:
        """Refuse a picked step for what its request carried, before it runs (lock held): its
        waiter gets `exc` (INVALID_ARGUMENT), the session stays as it was."""
        w = session.work
        session.work, session.in_flight = None, False
        done.resolve(w.loop, w.future, error=exc)

    def _guarded(self, done: Deliveries, session: Session, where: str, fn, *args) -> None:
        """fn(*args), work that belongs to `session` alone: a fault in it fails that session only."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - this session fails alone; the others go on
            self._fail(done, session, exc, where)

    def _fail(self, done: Deliveries, session: Session, exc: BaseException, where: str) -> None:
        """THE place a step fails (lock held): the session's waiter gets the error, and the session
        leaves the scheduler now, its blocks and state slot back in the pool. Nothing is kept for a
        retry here: the gateway owns the token history and resumes the request from it (on another
        replica, or this one), which a half-run step here could not do more exactly.
        A lost tensor-parallel rank stays UNAVAILABLE (the replica is out of service); anything
        else is StepFailed, INTERNAL."""
        error = exc if isinstance(exc, (TensorParallelError, StepFailed)) else StepFailed(
            f"the target failed this session's step in {where}: {type(exc).__name__}: {exc}; its KV cache "
            "was freed (resume the request from its tokens so far)")
        log.error("step_failed", session_id=session.session_id, where=where, error=f"{type(exc).__name__}: {exc}",
                  exc_info=exc if not isinstance(exc, TensorParallelError) else None)
        session.in_flight = False
        if session.state == "closed":
            session.seq.table.free()    # closed while its forward ran: nobody waits, the blocks go back
            return
        session.failure = error
        w = session.work
        session.work = None
        if w is not None:
            if w.queue is not None:
                done.put(w.loop, w.queue, error)
            else:
                done.resolve(w.loop, w.future, error=error)
        self._forget(session)

    def _look_ahead(self, done: Deliveries, rows: list[Row]) -> None:
        """Turn the decode steps of runs that allow it into verifies of their prompt-lookup
        drafts, where that is priced to raise the batch's tokens per ms (lookahead.py), within
        the forward's token budget. A session's lookup that fails fails that session."""
        n_rows = len(rows)
        tokens = sum(r.n for r in rows)
        verify_rows = sum(isinstance(r.step, Verify) for r in rows)
        produced = float(sum(not isinstance(r.step, Prefill) for r in rows))
        for r in rows:
            r.work.drafted = None
        widest = max((r.work.lookahead for r in rows if r.work.kind == "decode"), default=0)
        if not widest or not self.lookahead.could_pay(min(widest, self.lookahead.max_draft), rows=n_rows,
                                                      tokens=tokens, verify_rows=verify_rows, produced=produced):
            self.lookahead.full += bool(widest)
            return
        for r in rows:
            session, w = r.session, r.work
            if w.kind != "decode" or not w.lookahead or session.look is None or session.seq.guide is not None:
                continue
            k_max = min(w.lookahead, w.remaining - 1, self.max_batched_tokens - tokens)
            if k_max <= 0:
                continue
            try:
                ids, match, e = self.lookahead.plan(session.look, session.seq.tokens, k_max, rows=n_rows,
                                                    tokens=tokens, verify_rows=verify_rows, produced=produced)
            except Exception as exc:  # noqa: BLE001 - this session fails alone; the others go on
                self._fail(done, session, exc, "its prompt lookup")
                continue
            if ids:
                r.step = Verify(session.seq, Tree.chain(ids), None)
                w.drafted = (match, len(ids))
                tokens += len(ids)
                verify_rows += 1
                produced += e

    def _forward_threads(self, steps) -> int:
        """The intra-op threads this forward runs on (0: leave them as they are).

        Batch-invariant: always the count the service started on. A forward's bits depend on it:
        SDPA's CPU kernel splits a call's heads across the OpenMP team and a head can come out
        with other last bits on another thread (measured on SmolLM2: 2 of 24 greedy generations
        left their 2-thread twin when decoded at 1 thread). A verify run on fewer threads than
        the target-only decode it must equal would break the guarantee, so a batch-invariant
        target gives up neither --verify-torch-threads nor a core-sharing change.

        Otherwise, with one session the draft waits while the target verifies: all threads then.
        The draft computes for the other sessions only where they draft with it (they ship it
        features): a forward gives it threads only when such sessions are at least half of those
        running, since every row of the forward pays for them. One n-gram verify or one DFlash
        session among fifteen decoders once halved the whole batch's threads."""
        if self.attention == "torch-exact":
            return self.exact_threads
        if self.verify_threads:
            return self.verify_threads if self._draft_busy(steps) else self.threads
        return 0

    def _draft_busy(self, steps) -> bool:
        drafting = {id(s.seq) for s in self.running if s.ships_hidden}
        return (len(drafting) > 1 and 2 * len(drafting) >= len(self.running)
                and any(isinstance(step, Verify) and id(step.seq) in drafting for step in steps))

    def _reuse_prefixes(self, done: Deliveries, pending: list[Session]) -> list[Session]:
        """Before a forward: every prefill waiting to run takes the cached blocks that continue
        it; of prefills that would compute the same next block, only the oldest runs this time
        (the others take that block from the cache in the next forward instead of computing it
        twice: n > 1 samples and bursts of one system prompt)."""
        out, computing = [], set()
        for s in pending:
            if s.work.kind == "prefill" and s.prefix is not None:
                try:
                    key = self._reuse_prefix(s)
                except Exception as exc:  # noqa: BLE001 - this session fails alone; the others go on
                    self._fail(done, s, exc, "its prefix-cache lookup")
                    continue
                if key is not None:
                    if key in computing:
                        continue
                    computing.add(key)
            out.append(s)
        return out

    def _reuse_prefix(self, s: Session):
        """Take the cached blocks that continue one prefill; the key of the block it computes next."""
        _, rows, drop = prefix.reuse(self.pool, s.seq, s.prefix)
        if s.prefix.rows_missing:
            self.store_taps_until = time.monotonic() + STORE_TAPS_S
        if drop:
            s.work.hidden.clear()
        if s.ships_hidden:
            s.work.hidden.extend(rows)
        return prefix.next_key(self.pool, s.seq, s.prefix)

    @staticmethod
    def _shipped(session: Session, hidden: torch.Tensor) -> torch.Tensor:
        """Features in the dtype the session's caller takes them in, cast here on the engine
        thread: the server only copies their bytes out (a torch op on its event loop would start
        a second OpenMP team there, which slowed forwards 2.8x)."""
        wire = session.wire_dtype
        return hidden if wire is None or hidden.dtype == wire else hidden.to(wire)

    def _deliver(self, done: Deliveries, session: Session, out: StepOutput, start: float, end: float,
                 forward_ms: float, rows: int, tokens: int, verify_rows: int = 0) -> None:
        w = session.work
        if not session.ships_hidden and out.hidden is not None:
            out = StepOutput(out.committed, None, out.result, out.logprobs, out.logits)     # computed for the cache only
        elif out.hidden is not None and w.kind != "prefill":
            out = replace(out, hidden=self._shipped(session, out.hidden))
        w.queue_ms += (start - w.ready_at) * 1e3
        w.forward_ms += forward_ms
        if w.kind == "decode":
            drafted = accepted = 0
            if w.drafted is not None:
                (match, drafted), accepted = w.drafted, out.result.num_accepted
                self.lookahead.observe(session.look, match, drafted, accepted)
            w.drafted = None
            done.put(w.loop, w.queue, Step(out, forward_ms, w.queue_ms, rows, tokens, session.length,
                                           verify_rows=verify_rows, drafted=drafted, accepted=accepted))
            w.remaining -= len(out.committed)
            w.ready_at, w.queue_ms = end, 0.0
            if w.remaining == 0:
                session.work = None
            return
        if w.kind == "prefill":
            if out.hidden is not None:
                w.hidden.append(out.hidden)
            if not out.committed:
                w.ready_at = end        # the next chunk queues from here
                return
            out = StepOutput(out.committed, self._shipped(session, torch.cat(w.hidden)) if w.hidden else None,
                             logprobs=out.logprobs)
            cached = session.prefix.cached_tokens if session.prefix is not None else 0
            self.prefix_queries += session.prompt_len
            self.prefix_hits += cached
            session.work = None
            done.resolve(w.loop, w.future, Step(out, w.forward_ms, w.queue_ms, rows, tokens, session.length,
                                                cached_tokens=cached))
            return
        session.work = None
        done.resolve(w.loop, w.future, Step(out, w.forward_ms, w.queue_ms, rows, tokens, session.length,
                                            verify_rows=verify_rows))
