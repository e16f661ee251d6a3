"""Per-session proposers. Each keeps the committed tokens it has been told about and turns
them (plus, for DFlash, the target features) into a draft tree for the next verify step.

Both follow one protocol: `open(prompt_ids, prompt_hidden)` once, then
`propose(base_len, new_token_ids, new_hidden)` per step, where the new tokens are those
committed since the last call and `base_len` is the committed length afterwards."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from splitspec.engine.sample import (SamplingParams, draft_stream_seed, gumbel_argmax, make_generator, probs_from_logits,
                                     sample_from_probs)
from splitspec.engine.kv_pool import KVPool
from splitspec.engine.tree import MAX_DRAFT_NODES, Tree
from splitspec.ngram import NgramIndex, trie_tree

from .dflash import DFlashDraft, DraftCache, append_context, block_hidden, ensure_room
from .dflash2 import DFlash2Draft
from .dflash2_tree import dflash2_tree
from .dflash_tree import dflash_tree

MAX_DFLASH_TOPK = 16          # DFlash trees: children per node, from one position's top-k
MAX_NGRAM_TOPK = 8            # n-gram tries: continuations rarely differ in more ways than this


class ProposerError(ValueError):
    """A malformed Open or Propose (shapes, sizes): nothing was changed."""


class StaleProposeError(ProposerError):
    """base_len disagrees with what the draft knows: the caller's state moved on without it."""


@dataclass
class Proposal:
    tree: Tree
    draft_probs: torch.Tensor | None   # [N, V] when drafts were sampled
    draft_ms: float


@dataclass(frozen=True)
class TreeShape:
    """What a session's proposals may be (SGLang's meanings): `nodes` drafted tokens at most
    (num_draft_tokens - 1), `depth` at most (num_steps), `topk` children a node at most; a
    chain when topk is 1."""
    nodes: int
    depth: int
    topk: int = 1

    @classmethod
    def resolve(cls, *, num_draft_tokens: int, num_steps: int | None, topk: int, max_depth: int,
                max_topk: int, what: str) -> "TreeShape":
        """Checked against the drafter's limits (max_depth: its block; max_topk: its candidates);
        a value past one raises ProposerError naming it."""
        topk = topk or 1
        if not 1 <= topk <= max_topk:
            raise ProposerError(f"speculative.topk = {topk} is above what {what} offers per node ({max_topk})")
        if num_steps is not None and not 1 <= num_steps <= max_depth:
            raise ProposerError(f"speculative.num_steps = {num_steps} must be in 1..{max_depth} ({what} drafts "
                                f"at most {max_depth} tokens deep)")
        if topk == 1:
            if not 2 <= num_draft_tokens <= max_depth + 1:
                raise ProposerError(f"speculative.num_draft_tokens = {num_draft_tokens} must be in "
                                    f"2..{max_depth + 1} for a chain ({what} drafts at most {max_depth} tokens)")
            depth = min(num_draft_tokens - 1, num_steps or max_depth)
            return cls(depth, depth, 1)
        if not 2 <= num_draft_tokens <= MAX_DRAFT_NODES + 1:
            raise ProposerError(f"speculative.num_draft_tokens = {num_draft_tokens} must be in "
                                f"2..{MAX_DRAFT_NODES + 1} (the verify cap: root + {MAX_DRAFT_NODES} nodes)")
        return cls(num_draft_tokens - 1, num_steps or max_depth, topk)


class _Tokens:
    def _check_len(self, base_len: int, new_ids: list[int]) -> None:
        if len(self.tokens) + len(new_ids) != base_len:
            raise StaleProposeError(f"propose.base_len = {base_len} but the draft knows {len(self.tokens)} "
                                    f"tokens + {len(new_ids)} new ones")

    def _commit(self, base_len: int, new_ids: list[int]) -> None:
        self._check_len(base_len, new_ids)
        self.tokens.extend(new_ids)


class DFlashProposer(_Tokens):
    """One session's DFlash drafter state: the tokens it knows and its context cache (on a
    pool of its own, or the draft service's shared pool). `propose` runs it alone;
    `propose_batch` runs many sessions' proposals as one draft forward."""

    def __init__(self, model: DFlashDraft, *, num_draft_tokens: int | None = None, max_len: int = 4096,
                 sampling: SamplingParams | None = None, pool: KVPool | None = None,
                 num_steps: int | None = None, topk: int = 1):
        self.shape = TreeShape.resolve(num_draft_tokens=num_draft_tokens or model.cfg.block_size,
                                       num_steps=num_steps, topk=topk, max_depth=model.cfg.block_size - 1,
                                       max_topk=max_topk(model), what="this draft")
        self.model, self.width = model, self.shape.nodes + 1
        self.sampling = sampling if sampling is not None and not sampling.greedy else None
        device = next(model.parameters()).device
        seed = sampling.seed if sampling else None
        # Coupled sampling: the draft proposes argmax(log q + g) with the target's own noise g
        # (same seed, same positions), the token the target will choose wherever q is close to p.
        self.coupled = self.sampling is not None and self.sampling.coupled
        self.generator = make_generator(seed if self.coupled or seed is None else draft_stream_seed(seed), device)
        self.cache = DraftCache(model, max_len, pool)
        self.tokens: list[int] = []
        self.guide = None       # structured output: a splitspec.grammar.Guide over the output so far

    @property
    def context_window(self) -> int:
        return context_window(self.model)

    def check_open(self, prompt_ids: list[int], prompt_hidden: torch.Tensor | None, start: int = 0) -> None:
        """prompt_hidden holds the features of prompt positions start .. len(prompt_ids) - 1."""
        check_hidden_start(self.model, len(prompt_ids), start)
        want = self.model.cfg.target_feature_size
        rows = len(prompt_ids) - start
        if prompt_hidden is None or tuple(prompt_hidden.shape) != (rows, want):
            got = None if prompt_hidden is None else list(prompt_hidden.shape)
            raise ProposerError(f"prompt_hidden has shape {got}, expected [{rows}, {want}]")

    def open(self, prompt_ids: list[int], prompt_hidden: torch.Tensor | None, start: int = 0) -> None:
        self.check_open(prompt_ids, prompt_hidden, start)
        self.cache.offset = start
        self.cache.append(self.model, prompt_hidden)
        self.tokens = list(prompt_ids)

    def check_propose(self, base_len: int, new_ids: list[int], new_hidden: torch.Tensor | None) -> None:
        """Everything that can be wrong with a Propose, checked before anything changes."""
        self._check_len(base_len, new_ids)
        rows = 0 if new_hidden is None else new_hidden.shape[0]
        want = self.model.cfg.target_feature_size
        if rows and (new_hidden.dim() != 2 or new_hidden.shape[1] != want):
            raise ProposerError(f"propose.new_hidden has shape {list(new_hidden.shape)}, expected [k, {want}]")
        # Features exist for every committed token but the last one (it has not been run yet).
        if self.cache.length + rows != base_len - 1:
            raise ProposerError(f"propose.new_hidden has {rows} rows; the draft has features for "
                                f"{self.cache.length} tokens and base_len {base_len} needs {base_len - 1}")
        if base_len - 1 > self.cache.max_len:
            raise ProposerError(f"propose.base_len = {base_len} is past the draft's context ({self.cache.max_len} tokens)")

    def finish(self, hidden: torch.Tensor, logits: torch.Tensor) -> tuple[Tree, torch.Tensor | None]:
        """The tree (and q when sampling) from this session's block hidden states [B - 1, H]
        and logits [B - 1, V]. The spine is the chain the draft would propose alone; in sampled
        mode only the spine is sampled (its rows of q are the distributions it was drawn from),
        and the other nodes are chosen deterministically (their rows are zero): the verifier
        tests each kind by its own rule (`target_service/verify.py`)."""
        shape = self.shape
        dflash2 = isinstance(self.model, DFlash2Draft)
        if self.guide is not None and shape.topk == 1 and not dflash2:
            spine, q = self._grammar_spine(logits[:shape.nodes])
            if spine:
                return Tree.chain(spine), q
        if dflash2:
            # The selector's q ignores the request's top-k/top-p (they shape the target's p only).
            temp = 0.0 if self.sampling is None else self.sampling.temperature
            noise = self._noise()
            spine, q = self.model.walk(hidden, logits, self.tokens[-1], shape.depth, temp, self.generator,
                                       guide=self.guide, noise=noise)
            if not spine and self.guide is not None:     # nothing allowed among its candidates
                spine, q = self.model.walk(hidden, logits, self.tokens[-1], shape.depth, temp, self.generator,
                                           noise=noise)
        elif self.sampling is None:
            spine, q = logits[:shape.depth].argmax(-1).tolist(), None
        else:
            q = probs_from_logits(logits[:shape.depth], self.sampling)
            spine = [self._draw(row, t) for t, row in enumerate(q)]
        if shape.topk == 1:
            return Tree.chain(spine[:shape.nodes]), None if q is None else q[:shape.nodes]
        # Greedy drafts: no spine laid first. The argmax walk is every level's best child, so
        # the best-first search keeps it to the depth its score earns and spends the rest on
        # siblings (15 nodes, T=0 and T=1, 64- and 512-token prompts: τ ÷ chain 1.22-1.39 for
        # the DFlash twin against 1.18-1.35 with the whole walk laid first, and about even for
        # DFlash2; docs/bench/trees/spine.txt). A sampled walk carries q, so it stays.
        kw = dict(root_token=self.tokens[-1], spine=spine if q is not None else [], budget=shape.nodes,
                  max_depth=shape.depth, topk=shape.topk)
        built = (dflash2_tree(self.model.candidate_selector, hidden, logits, **kw) if dflash2
                 else dflash_tree(logits, **kw))
        tree = Tree(tuple(built.token_ids), tuple(built.parents))
        if q is None:
            return tree, None
        probs = q.new_zeros(len(tree), q.shape[-1])
        probs[:built.spine] = q[:built.spine]
        return tree, probs

    def _noise(self) -> tuple[int, int] | None:
        """(seed, absolute position of the first drafted token) when drafts share the target's
        noise: the block's slot t drafts position len(tokens) + t, as the target's root row
        predicts position len(tokens)."""
        return (self.generator.initial_seed(), len(self.tokens)) if self.coupled else None

    def _draw(self, q: torch.Tensor, t: int) -> int:
        """The sampled draft token of block slot t from its distribution q [V]."""
        if not self.coupled:
            return sample_from_probs(q, self.generator)
        kept = (q > 0).nonzero()[:, 0]
        seed, position = self._noise()
        return gumbel_argmax(q[kept].double().log(), kept, seed, position + t)

    def _grammar_spine(self, logits: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
        """A chain that stays inside the request's grammar: position j chooses among the tokens
        allowed after the chain so far (its argmax, or a sample from q masked and renormalised,
        whose row is what the verifier then tests it against: min(1, p/q') with the q' it was
        drawn from is exact for any q'). It stops where the grammar ends or the masked q has no
        mass left. The state is left as the committed tokens set it."""
        g, spine, rows = self.guide, [], []
        try:
            for row in logits:
                if g.done:
                    break
                masked = row.masked_fill(~g.allowed().to(row.device), float("-inf"))
                if self.sampling is None:
                    tok = int(masked.argmax())
                else:
                    q = probs_from_logits(masked, self.sampling)
                    if not bool(torch.isfinite(q).all()) or float(q.sum()) <= 0:
                        break
                    tok = self._draw(q, len(spine))
                    rows.append(q)
                if not g.matcher.accept_token(tok):
                    break
                spine.append(tok)
        finally:
            if spine:
                g.matcher.rollback(len(spine))
        rows = rows[:len(spine)]
        return spine, (torch.stack(rows) if rows else None) if self.sampling is not None else None

    def extend(self, new_ids: list[int]) -> None:
        """Committed tokens since the last Propose."""
        self.tokens.extend(new_ids)
        if self.guide is not None:
            self.guide.advance(new_ids)

    def propose(self, base_len: int, new_ids: list[int], new_hidden: torch.Tensor | None) -> Proposal:
        out = propose_batch(self.model, [(self, base_len, new_ids, new_hidden)])[0]
        if isinstance(out, Exception):
            raise out
        return out

    def close(self) -> None:
        self.cache.free()


def propose_batch(model: DFlashDraft, items: list[tuple]) -> list[Proposal | Exception]:
    """Proposals for many sessions (each item: proposer, base_len, new_ids, new_hidden) in one
    context append and one block forward. A bad item fails alone, before anything of it changed."""
    t0 = time.perf_counter()
    out: list[Proposal | Exception | None] = [None] * len(items)
    live = []
    for i, (prop, base_len, new_ids, new_hidden) in enumerate(items):
        try:
            prop.check_propose(base_len, new_ids, new_hidden)
            ensure_room(prop.cache, 0 if new_hidden is None else new_hidden.shape[0])
        except Exception as exc:  # noqa: BLE001 - this item fails alone
            out[i] = exc
            continue
        live.append(i)
    if not live:
        return out
    with torch.inference_mode():
        append_context(model, [(items[i][0].cache, items[i][3]) for i in live])
        for i in live:
            items[i][0].extend(items[i][2])
        hidden = block_hidden(model, [items[i][0].cache for i in live], [items[i][0].tokens[-1] for i in live],
                              [items[i][1] - 1 for i in live])
        W = model.cfg.common_window
        if W:
            # Later Proposes sit no earlier, so their windows start no earlier: blocks wholly
            # before this one's window are never read again.
            for i in live:
                items[i][0].cache.drop_before(items[i][1] - 1 - W + 1)
        # Only the slots a session's tree may reach are scored: the head is most of a Propose.
        depth = max(items[i][0].shape.depth for i in live)
        logits = model.logits(hidden[:, :depth].contiguous()).float()
        trees = [items[i][0].finish(hidden[row], logits[row]) for row, i in enumerate(live)]
    ms = (time.perf_counter() - t0) * 1e3
    for (tree, q), i in zip(trees, live):
        out[i] = Proposal(tree, q, ms)
    return out


class NgramProposer(_Tokens):
    """Prompt lookup through the draft service (the gateway's `auto` method runs the same
    lookup itself, without a round trip)."""

    def __init__(self, *, num_draft_tokens: int = 8, min_n: int = 1, max_n: int = 4,
                 num_steps: int | None = None, topk: int = 1, max_depth: int = MAX_DRAFT_NODES):
        if num_draft_tokens < 1:
            raise ProposerError(f"num_draft_tokens={num_draft_tokens} must be >= 1")
        self.shape = TreeShape.resolve(num_draft_tokens=max(num_draft_tokens, 2), num_steps=num_steps, topk=topk,
                                       max_depth=max_depth, max_topk=MAX_NGRAM_TOPK, what="n-gram lookup")
        self.width = self.shape.nodes + 1
        self.index = NgramIndex(min_n, max_n)

    @property
    def tokens(self) -> list[int]:
        return self.index.tokens

    def open(self, prompt_ids: list[int], prompt_hidden=None) -> None:
        self.index.extend(list(prompt_ids))

    def propose(self, base_len: int, new_ids: list[int], new_hidden=None) -> Proposal:
        t0 = time.perf_counter()
        self._check_len(base_len, new_ids)
        self.index.extend(new_ids)
        shape = self.shape
        if shape.topk == 1:
            ids, _ = self.index.match(shape.nodes)
            return Proposal(Tree.chain(ids), None, (time.perf_counter() - t0) * 1e3)
        conts, _ = self.index.continuations(shape.depth, 4 * shape.topk)
        ids, parents = trie_tree(conts, budget=shape.nodes, max_depth=shape.depth, topk=shape.topk)
        return Proposal(Tree(tuple(ids), tuple(parents)), None, (time.perf_counter() - t0) * 1e3)


def context_window(model: DFlashDraft | None) -> int:
    """The most trailing context positions a Propose reads (DraftInfo.context_window): W - 1
    when every layer slides over a window W, else 0 (all of them; ngram: None model)."""
    W = model.cfg.common_window if model is not None else None
    return max(W - 1, 0) if W else 0


def check_hidden_start(model: DFlashDraft, prompt_len: int, start: int) -> None:
    """A prompt_hidden that starts at prompt position `start` must still hold every position
    a Propose reads: only a windowed draft may be sent a tail, and at least its window of it."""
    if start == 0:
        return
    cw = context_window(model)
    if start < 0 or start > prompt_len:
        raise ProposerError(f"prompt_hidden_start = {start} is outside the prompt's {prompt_len} positions: "
                            f"send 0 (the whole prompt's features) or a start in 0 .. {prompt_len}")
    if cw == 0:
        raise ProposerError(f"prompt_hidden_start = {start}, but this draft attends to the whole context "
                            f"(DraftInfo.context_window = 0): send prompt_hidden_start = 0 and every prompt "
                            f"position's features")
    need = min(prompt_len, cw)
    if prompt_len - start < need:
        raise ProposerError(f"prompt_hidden_start = {start} leaves {prompt_len - start} prompt positions' "
                            f"features, but this draft reads the last {cw} (DraftInfo.context_window): send "
                            f"prompt_hidden_start <= {prompt_len - need} with the features from there on")


def max_topk(model: DFlashDraft) -> int:
    """Children a node may get: DFlash2 chooses among its selector's K candidates."""
    return model.cfg.selector_top_k if isinstance(model, DFlash2Draft) else MAX_DFLASH_TOPK
