"""Structured output in the target: a grammar (xgrammar) per session that masks the target's
distribution at every position, so that every emitted token keeps the output inside the
grammar and the answer ends (eos) where the grammar does.

Exactness under speculation: every verified row is masked with the grammar state *of its own
path* (the root with the committed tokens' state, each tree node with the state after the
tokens from the root to it), then the usual verifier runs. The output distribution is then the
masked target distribution, as in target-only constrained decoding, whatever the drafter
proposed: a draft token the grammar forbids has p = 0 and is always rejected. Two rewrites of
the tree before the forward save work without changing that law:

- *pruning*: a node whose token the grammar forbids (and its subtree) is dropped when it was
  chosen deterministically (greedy and n-gram drafts: no draft probability). Such a node is
  rejected with certainty, and a rejected deterministic node leaves its siblings' test
  unchanged (p'(x) = 0 removes nothing from the residual). A *sampled* node (row of q) stays:
  its rejection changes the residual to norm(max(p' - q, 0)), which the bonus must be drawn
  from, so dropping it would change the law.
- *jump-forward*: where the grammar allows exactly one token, a chain of such tokens is added
  under the root as a deterministic branch (merged with a drafted branch where the tokens
  agree). The verifier tests it like any deterministic node (p = 1 there, so it is accepted);
  it is never committed without being verified.

The matcher only ever advances by committed tokens, and stops at the grammar's end."""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import structlog
import torch

from splitspec.engine.loop import settle
from splitspec.engine.tree import Tree
from splitspec.limits import CONSTRAINT_KINDS, MAX_SPEC_BYTES

log = structlog.get_logger(__name__)

COMPILE_TIMEOUT_S = 10.0    # of compiling, from when a worker starts it (not of waiting for one)
COMPILE_QUEUE = 64          # compiles waiting for a worker; one more is refused (RESOURCE_EXHAUSTED)
MAX_ABANDONED = 4           # timed-out compiles left running at once, each with a worker replaced


class GrammarError(ValueError):
    """A constraint that cannot be compiled (INVALID_ARGUMENT, naming sampling.constraint.<kind>)."""


class GrammarBusy(Exception):
    """Every compile worker is busy and the queue is full: RESOURCE_EXHAUSTED (retry, or another replica)."""


@dataclass
class _Job:
    fn: Callable
    loop: asyncio.AbstractEventLoop
    started: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Future | None = None
    abandoned: bool = False         # its waiter timed out; the worker leaves once the compile ends
    cancelled: bool = False         # its waiter left before a worker took it
    finished: bool = False          # its compile ended (set under the pool's lock)


class CompilePool:
    """Worker threads for grammar compiles, with a bounded queue and a timeout on compile time.

    Threads, not processes: a compiled grammar holds the tokenizer's tables and lives in the
    process that masks with it (sending one across would mean serialising it per compile and a
    tokenizer per process), and an xgrammar compile always ends, however long a hostile schema
    makes it. So a compile that times out is abandoned, not killed: its waiter is refused at
    once, the pool starts a replacement worker so later compiles never queue behind it, and the
    abandoned thread exits when its compile ends (its result still goes into the cache). At most
    MAX_ABANDONED run at once; past that no replacement is started, so hostile specs cost a
    bounded number of threads and the queue (bounded too) refuses what it cannot hold."""

    def __init__(self, workers: int, *, queue_size: int = COMPILE_QUEUE, max_abandoned: int = MAX_ABANDONED):
        self._jobs: queue.Queue = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        self.abandoned = 0
        self.max_abandoned = max_abandoned
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> None:
        threading.Thread(target=self._work, name="grammar", daemon=True).start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job.cancelled:
                continue
            job.loop.call_soon_threadsafe(job.started.set)
            try:
                result, error = job.fn(), None
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
                result, error = None, exc
            job.loop.call_soon_threadsafe(settle, job.done, result, error)
            with self._lock:
                job.finished = True
                if job.abandoned:
                    self.abandoned -= 1
                    return          # a replacement took this worker's place when it was abandoned

    async def run(self, fn: Callable, timeout_s: float, on_timeout: Callable[[], Exception]):
        """fn() on a worker; on_timeout() is raised when it computes for longer than timeout_s."""
        loop = asyncio.get_running_loop()
        job = _Job(fn, loop)
        job.done = loop.create_future()
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise GrammarBusy(f"{self._jobs.maxsize} grammar compiles are already waiting for a worker; "
                              "retry, or send the request to another replica") from None
        try:
            await job.started.wait()
        except BaseException:
            job.cancelled = True
            raise
        try:
            return await asyncio.wait_for(asyncio.shield(job.done), timeout_s)
        except asyncio.TimeoutError:
            self._abandon(job)
            raise on_timeout() from None

    def _abandon(self, job: _Job) -> None:
        with self._lock:
            if job.finished:
                return      # it ended just now: this worker carries on
            job.abandoned = True
            self.abandoned += 1
            replace = self.abandoned <= self.max_abandoned
        log.warning("grammar_compile_abandoned", abandoned=self.abandoned, replaced=replace)
        if replace:
            self._spawn()


def _ebnf_string(s: str) -> str:
    return '"' + "".join({"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c, c) for c in s) + '"'


def choice_grammar(choices) -> str:
    """EBNF accepting exactly one of `choices`."""
    return "root ::= " + " | ".join(_ebnf_string(c) for c in choices)


class Grammars:
    """Compiles constraints for one model's tokenizer and vocabulary, off the engine thread,
    and keeps the compiled grammars by (kind, spec) so a schema sent again costs nothing."""

    def __init__(self, model_path, vocab_size: int, stop_token_ids, *, cache_size: int = 256, threads: int = 2):
        self.model_path, self.vocab_size = Path(model_path), vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache: OrderedDict = OrderedDict()
        self.cache_size = cache_size
        self._compiler = None
        self._lock = threading.Lock()
        self._pool = CompilePool(threads)
        self.timeout_s = COMPILE_TIMEOUT_S

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                if not (self.model_path / "tokenizer.json").is_file():
                    raise GrammarError(f"sampling.constraint: the target {self.model_path} has no tokenizer.json, "
                                       "which grammars are compiled against")
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast
                tok = PreTrainedTokenizerFast(tokenizer_file=str(self.model_path / "tokenizer.json"))
                info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    @staticmethod
    def key(c) -> tuple[str, str, bool]:
        """(kind, spec, strict) of a common_pb2.Constraint; GrammarError when it is malformed."""
        kind = c.WhichOneof("kind")
        if kind is None:
            raise GrammarError("sampling.constraint: set one of " + ", ".join(CONSTRAINT_KINDS))
        if kind == "json_object":
            if not c.json_object:
                raise GrammarError("sampling.constraint.json_object must be true (unset the constraint for free text)")
            return kind, "", False
        if kind == "choice":
            choices = list(c.choice.choices)
            if not choices or any(not x for x in choices):
                raise GrammarError("sampling.constraint.choice needs at least one non-empty string")
            spec = json.dumps(choices)
        else:
            spec = getattr(c, kind)
            if not spec:
                raise GrammarError(f"sampling.constraint.{kind} is empty")
        if len(spec.encode()) > MAX_SPEC_BYTES:
            raise GrammarError(f"sampling.constraint.{kind} is {len(spec.encode())} bytes; at most "
                               f"{MAX_SPEC_BYTES} are accepted")
        return kind, spec, bool(c.strict) if kind == "json_schema" else False

    def _compile(self, key):
        kind, spec, strict = key
        comp = self._get_compiler()
        try:
            if kind == "json_schema":
                try:
                    schema = json.loads(spec)
                except json.JSONDecodeError as exc:
                    raise GrammarError(f"sampling.constraint.json_schema is not valid JSON: {exc}") from None
                if not isinstance(schema, dict):
                    raise GrammarError("sampling.constraint.json_schema must be a JSON object (a schema)")
                return comp.compile_json_schema(spec, strict_mode=strict, any_whitespace=False)
            if kind == "json_object":
                return comp.compile_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=False)
            if kind == "regex":
                return comp.compile_regex(spec)
            if kind == "choice":
                return comp.compile_grammar(choice_grammar(json.loads(spec)))
            if kind == "grammar":
                return comp.compile_grammar(spec)
            return comp.compile_structural_tag(spec)
        except GrammarError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar reports bad specs as RuntimeError / ValueError
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise GrammarError(f"sampling.constraint.{kind} does not compile: {msg}") from None

    def compile(self, c):
        key = self.key(c)
        with self._lock:
            hit = self.cache.get(key)
            if hit is not None:
                self.cache.move_to_end(key)
                return hit
        compiled = self._compile(key)
        with self._lock:
            self.cache[key] = compiled
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return compiled

    async def compile_async(self, c):
        """Compile on the grammar threads (xgrammar drops the GIL), refusing a spec whose
        compile takes longer than `timeout_s` instead of holding the request (CompilePool)."""
        self.key(c)         # a malformed message is refused at once
        kind = c.WhichOneof("kind")
        return await self._pool.run(lambda: self.compile(c), self.timeout_s, lambda: GrammarError(
            f"sampling.constraint.{kind} took more than {self.timeout_s:g} s to compile; simplify it"))


class Guide:
    """One session's grammar state: which tokens may come next, advanced by committed tokens."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr
        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size

    @property
    def done(self) -> bool:
        return self.matcher.is_terminated()

    def _bitmask(self, rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next (all, once it has ended)."""
        bm = self._bitmask(1)
        if not self.done:
            self.matcher.fill_next_token_bitmask(bm, 0)
        return self._bool(bm)[0]

    def _bool(self, bm: torch.Tensor) -> torch.Tensor:
        # numpy, not torch: a torch op this large enters an OpenMP region, and one entered from a
        # thread other than the engine's (the server's) leaves a second OpenMP team behind that
        # slows every later forward of the process (2.8x on 2 cores).
        bits = np.unpackbits(bm.numpy().view(np.uint8), axis=-1, bitorder="little")
        return torch.from_numpy(bits[..., :self.vocab_size].astype(bool))

    def _tree_rows(self, tree: Tree) -> torch.Tensor:
        """[1 + len(tree), vocab] bool as the grammar sees the tree: row 0 the root's allowed
        tokens, row i + 1 those after the path to node i; all false for a node that is
        forbidden, lies below one, or follows the grammar's end."""
        n = len(tree) + 1
        bm = self._bitmask(n)
        bm.zero_()
        if self.done:
            return self._bool(bm)
        first_child = [-1] * n
        next_sibling = [-1] * n
        last_child = {}
        for i, p in enumerate(tree.parents):
            node, parent = i + 1, p + 1
            if parent in last_child:
                next_sibling[last_child[parent]] = node
            else:
                first_child[parent] = node
            last_child[parent] = node
        tokens = torch.tensor([0, *tree.token_ids], dtype=torch.int64)
        self.matcher.traverse_draft_tree(torch.tensor(first_child, dtype=torch.int64),
                                         torch.tensor(next_sibling, dtype=torch.int64), tokens, bm)
        return self._bool(bm)

    def tree_allowed(self, tree: Tree) -> torch.Tensor:
        """The rows of `_tree_rows`, with an empty row (a node never accepted, or past the end)
        made all true so that its masked logits stay finite."""
        out = self._tree_rows(tree)
        out[~out.any(-1)] = True
        return out

    def valid_nodes(self, tree: Tree) -> list[bool]:
        """Whether each node's token is allowed after its path."""
        rows = self._tree_rows(tree)
        ok: list[bool] = []
        for tok, p in zip(tree.token_ids, tree.parents):
            ok.append((p < 0 or ok[p]) and bool(rows[p + 1, tok]))
        return ok

    def forced(self, limit: int) -> list[int]:
        """Tokens the grammar allows one at a time from here (jump-forward), at most `limit`;
        the state is left as it was."""
        out = []
        m = self.matcher
        while len(out) < limit and not m.is_terminated():
            allowed = self.allowed()
            if int(allowed.sum()) != 1:
                break
            tok = int(allowed.nonzero()[0])
            if not m.accept_token(tok):
                break
            out.append(tok)
        if out:
            m.rollback(len(out))
        return out

    def resume(self, tokens, field: str) -> None:
        """Advance through tokens generated before (a resumed answer); GrammarError naming
        `field` when the grammar refuses one, since then the rest could not be masked rightly."""
        for i, t in enumerate(tokens):
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(t)):
                raise GrammarError(f"{field}: generated token {i} (id {int(t)}) is not allowed by "
                                   "sampling.constraint after the ones before it")

    def advance(self, tokens) -> None:
        for t in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(t)):
                break


def mask_rows(scored: torch.Tensor, raw: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """`scored` (the processed logits) with the tokens the grammar forbids at -inf. A row the
    processors had already emptied of every allowed token (min_tokens banning the eos that
    ends the grammar) falls back to the raw logits under the grammar: the grammar wins."""
    out = scored.masked_fill(~allowed.to(scored.device), float("-inf"))
    empty = torch.isinf(out).all(-1) if out.is_floating_point() else None
    if empty is not None and bool(empty.any()):
        out[empty] = raw[empty].masked_fill(~allowed[empty].to(raw.device), float("-inf"))
    return out


def rewrite_tree(guide: Guide, tree: Tree, draft_probs: torch.Tensor | None,
                 room: int) -> tuple[Tree, torch.Tensor | None, int]:
    """Prune deterministic nodes the grammar forbids and add the forced chain under the root
    (module doc). Returns (tree, draft probs re-indexed, forced nodes added); `room` bounds
    the tree's size."""
    if guide.done:
        return tree, draft_probs, 0
    valid = guide.valid_nodes(tree) if len(tree) else []
    sampled = ([bool(draft_probs[i].any()) for i in range(len(tree))] if draft_probs is not None
               else [False] * len(tree))
    keep, new_index = [], {}
    for i, p in enumerate(tree.parents):
        if (p < 0 or p in new_index) and (valid[i] or sampled[i]):
            new_index[i] = len(keep)
            keep.append(i)
    tokens = [tree.token_ids[i] for i in keep]
    parents = [-1 if tree.parents[i] < 0 else new_index[tree.parents[i]] for i in keep]
    rows = list(keep)
    added = 0
    forced = guide.forced(max(0, room - len(tokens)))
    node = -1
    for tok in forced:
        child = next((c for c, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == tok), None)
        if child is None:
            tokens.append(tok)
            parents.append(node)
            rows.append(None)
            child = len(tokens) - 1
            added += 1
        node = child
    if draft_probs is not None and (added or len(keep) != len(tree)):
        zero = draft_probs.new_zeros(draft_probs.shape[1])
        draft_probs = torch.stack([draft_probs[r] if r is not None else zero for r in rows]) if rows else \
            draft_probs[:0]
    return Tree(tuple(tokens), tuple(parents)), draft_probs, added
