"""The speculative loop of one request on one target session (DESIGN §3, "One speculative step").

    Open on the target            -> b0 and the prompt's features
    Open on the draft             (with those features; DFlash, or n-gram through the draft service)
    per step, the policy chooses  (drafter, k):
        "none"                    -> Decode a run of tokens on the target (target-only steps)
        "ngram", "dflash"         -> a k-token chain from the drafter -> Verify on the target
    each step's committed tokens  -> yielded to the caller, owed to the draft until its next Propose

The draft is told every committed token once, in order, whatever produced it: a Propose carries
the tokens (and their target features) committed since the previous one, so n-gram and target-only
steps can come between two DFlash steps. The gateway's own n-gram index (`method = "auto"`) costs
no round trip. Losing the draft (`DraftLost`, raised by the `draft_call` guard the caller passes)
leaves the loop on the target alone, or on its own n-gram index.

`failover.ResilientSource` wraps this with the recovery from a lost target replica.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from splitspec.ngram import NgramIndex, trie_tree
from splitspec.v1 import common_pb2

from .backends import DraftSession, TargetSession
from .cost_model import Choice
from .generation import TARGET, Stats, Tokens, step_sources
from .policy import AutoPolicy, FixedPolicy, Measurements, Offer
from .request import Request
from .speculative import concat_rows, depths, is_chain, record_step, tree_trials, trim_tree


class DraftLost(Exception):
    """The draft failed this step (the guard already logged and counted it)."""


class RemoteDraft:
    """A draft session and the committed tokens (with their features, for DFlash) it has not
    been told about yet."""

    def __init__(self, session: DraftSession, method: str, width: int, needs_hidden: bool, topk: int = 1):
        self.session, self.method, self.width, self.needs_hidden = session, method, width, needs_hidden
        self.topk = topk
        self.shape: list[int] | None = None      # parents of its last tree: what its proposals look like
        self.owed_ids: list[int] = []
        self.owed_hidden: list[common_pb2.Tensor] = []

    def owe(self, ids: list[int], hidden: common_pb2.Tensor | None) -> None:
        self.owed_ids.extend(ids)
        if self.needs_hidden and hidden is not None and hidden.shape:
            self.owed_hidden.append(hidden)

    def propose(self, length: int):
        ids, hidden = self.owed_ids, concat_rows(self.owed_hidden)
        self.owed_ids, self.owed_hidden = [], []
        return self.session.propose(length, ids, hidden)


@dataclass
class Shadow:
    """A DFlash proposal made while the target decoded, to be scored against the tokens the
    target commits after it was asked for, instead of verified (AutoPolicy's shadow probes)."""
    task: asyncio.Future
    realized: list[int] = field(default_factory=list)     # committed since the Propose was sent


class SpeculativeLoop:
    """One attempt of a request on one target session; see the module doc. `steps()` yields
    lists of committed tokens; the caller owns the sessions' lifetimes."""

    def __init__(self, target: TargetSession, req: Request, stats: Stats, policy: AutoPolicy | FixedPolicy, *,
                 measurements: Measurements, draft_call: Callable[[Awaitable, float], Awaitable],
                 open_draft: Callable[[object, list[int]], Awaitable[RemoteDraft | None]] | None,
                 layer_ids: list[int], ngram: NgramIndex | None, max_width: int, step_timeout_s: float,
                 hidden_stream: str = "", ngram_tree: tuple[int, int, int] | None = None, hidden_dtype: int = 0,
                 hidden_last: int = 0, lookahead: int = 0):
        """ngram_tree: (nodes, depth, topk) when the gateway's own n-gram index drafts tries.
        hidden_dtype: the DType the draft takes hidden states in (DraftInfo.hidden_dtype), asked
        of the target at Open so that features reach the draft as it wants them, never cast there.
        hidden_last: a windowed draft's DraftInfo.context_window (0: the whole prompt): the target's
        Open returns only that many trailing prompt features, all such a draft ever reads.
        lookahead: prompt-lookup tokens the target may verify inside each Decode run (TargetDecode's
        doc): the target then drafts the n-gram chains, and this loop's index (None) does not."""
        self.target, self.req, self.stats, self.policy = target, req, stats, policy
        self.m = measurements
        self.draft_call, self.open_draft = draft_call, open_draft
        self.layer_ids, self.ngram, self.max_width = layer_ids, ngram, max_width
        self.hidden_stream, self.hidden_dtype, self.hidden_last = hidden_stream, hidden_dtype, hidden_last
        self.step_s = step_timeout_s
        self.ngram_tree = ngram_tree if ngram_tree and ngram_tree[2] > 1 else None
        self.lookahead = lookahead
        self.draft: RemoteDraft | None = None
        self.early: Choice | None = None        # the next step, decided before a Decode run's last token
        self.opening: asyncio.Future | None = None   # the draft's Open, while it runs beside the target's steps
        self.held: list[tuple[list[int], common_pb2.Tensor | None]] = []   # committed meanwhile, owed to it once open
        self.shadow: Shadow | None = None

    async def steps(self, history: list[int]) -> AsyncIterator[list[int]]:
        req, stats = self.req, self.stats
        prefix = req.prompt_ids + history
        remaining = req.max_new_tokens - len(history)
        if remaining <= 0 and not req.prompt_only:
            return
        sampling = req.sampling
        if history and sampling.HasField("prompt_logprobs"):
            sampling = type(sampling)()     # a resumed request scored its prompt on the first replica
            sampling.CopyFrom(req.sampling)
            sampling.ClearField("prompt_logprobs")
        t = time.perf_counter()
        opened = await self.target.open(req.request_id, prefix, sampling, hidden_layer_ids=self.layer_ids,
                                        max_new_tokens=remaining + self.max_width, hidden_stream=self.hidden_stream,
                                        hidden_dtype=self.hidden_dtype if self.layer_ids else 0,
                                        generated_tokens=len(history),
                                        hidden_last=self.hidden_last if self.layer_ids else 0,
                                        cache_salt=req.cache_salt)
        if not history:
            # The open that prefilled the request's own prompt. A failover's reopen (prompt + the
            # tokens streamed so far, history non-empty) is not counted: Usage.prompt_tokens counts
            # the prompt once, and so does Usage.cached_tokens.
            stats.cached_tokens = opened.cached_tokens
        stats.model_ms += opened.forward_ms
        stats.queue_ms += opened.queue_ms
        stats.verify_ms += (time.perf_counter() - t) * 1e3
        stats.hidden_state_bytes += len(opened.hidden.data)
        b0 = opened.first_token_id
        yield Tokens([b0], [opened.first_logprob] if opened.HasField("first_logprob") else (),
                     opened.prompt_logprobs, sources=[TARGET])
        if req.prompt_only:
            return
        generated, length = 1, opened.length
        if self.ngram is not None:
            self.ngram.extend(prefix + [b0])
        if self.open_draft is not None and generated < remaining:
            self.held = [([b0], None)]
            self.opening = asyncio.ensure_future(self._open(opened, prefix))
            if not self.policy.opens_in_background:
                await self.opening
        try:
            async for toks in self._loop(generated, remaining, length):
                yield toks
        finally:
            await self._settle()

    async def _loop(self, generated: int, remaining: int, length: int) -> AsyncIterator[list[int]]:
        stats = self.stats
        while generated < remaining:
            self._adopt_draft()
            early, self.early = self.early, None
            if early is not None and (early.method == "none" or (early.method == "dflash" and self.draft is not None)):
                choice, local, match = early, None, 0
            else:       # n-gram drafts are built on the latest tokens: decide again with them
                choice, local, match = self._choose(remaining - generated)
            if choice.method == "none":
                if self._lets_draft_go():
                    await self._end_shadow()
                    await self.draft.session.close()      # frees the draft's cache; no features owed from now
                    self.draft = None
                if self.policy.take_shadow():
                    self._start_shadow(length)
                left = remaining - generated
                async for toks in self._decode(left if self._nothing_to_decide() else self.policy.decode_run(left),
                                               left):
                    generated += len(toks)
                    length += len(toks)
                    yield toks
                continue
            tree, probs = await self._draft(choice, local, match, length, remaining - generated)
            if tree is None:                   # the draft was lost just now: decide again without it
                continue
            t = time.perf_counter()
            verified = await self.target.verify(stats.verify_steps, length, tree, probs)
            ms = (time.perf_counter() - t) * 1e3
            stats.verify_ms += ms
            stats.model_ms += verified.forward_ms
            stats.queue_ms += verified.queue_ms
            stats.hidden_state_bytes += len(verified.hidden.data)
            self.m.target_step(verified.forward_ms, verified.batch_size, verified.batch_tokens, verify=True,
                               verify_rows=verified.batch_verify_rows)
            self.m.verify_round_trip(ms, verified.forward_ms)
            drafted = len(tree.token_ids)
            committed = list(verified.committed_token_ids)
            ran = Choice(choice.method, drafted, choice.tokens, choice.ms)
            branched = not is_chain(tree.parents)
            tried = tree_trials(list(tree.parents), list(tree.token_ids), committed) if branched else None
            # Tokens the target's grammar forced (jump-forward, a branch it added) are not the
            # drafter's: its acceptance counts its own nodes, at most its tree's depth.
            depth = max(depths(tree.parents), default=0)
            own = max(0, min(verified.num_accepted - verified.num_forced, depth))
            self.policy.observe(ran, own, match, tried=tried)
            record_step(stats, choice.method, drafted, own, len(committed), depth=depth)
            self._committed(committed, verified.hidden)
            length = verified.length
            generated += len(committed)
            yield Tokens(committed, verified.logprobs, sources=step_sources(choice.method, own, len(committed)))

    # -- one step -----------------------------------------------------------------------------
    def _choose(self, remaining: int) -> tuple[Choice, common_pb2.TokenTree | None, int]:
        offer, local, match = Offer(), None, 0
        self._adopt_draft()
        if self.draft is not None:
            offer.shadow = self.draft.method == "dflash" and self.shadow is None and self.policy.can_shadow
            if self.draft.method == "dflash":
                offer.dflash = self.draft.width - 1
            else:
                offer.ngram = self.draft.width - 1
            if self.draft.shape:
                offer.shapes[self.draft.method] = self.draft.shape
        if self.ngram is not None:
            if self.ngram_tree is None:
                ids, match = self.ngram.match(self.max_width - 1)
                parents = list(range(-1, len(ids) - 1))
            else:
                nodes, depth, topk = self.ngram_tree
                conts, match = self.ngram.continuations(depth, 4 * topk)
                ids, parents = trie_tree(conts, budget=nodes, max_depth=depth, topk=topk)
                if not is_chain(parents):
                    offer.shapes["ngram"] = parents
            local = common_pb2.TokenTree(token_ids=ids, parents=parents)
            offer.ngram, offer.ngram_match = len(ids), match
        return self.policy.choose(offer, remaining), local, match

    def _fit(self, choice: Choice, tree: common_pb2.TokenTree, probs, remaining: int, match: int = 0):
        """The part of a proposal worth verifying: a chain's first k tokens; a tree cut to the
        depth the request has left and to the size the policy prices best this step."""
        parents = list(tree.parents)
        if is_chain(parents):
            return trim_tree(tree, probs, choice.k)
        tree, probs = trim_tree(tree, probs, len(parents), max_depth=max(1, remaining - 1))
        n = self.policy.cut(choice.method, list(tree.parents), len(tree.parents), match)
        return trim_tree(tree, probs, max(1, n))

    async def _draft(self, choice: Choice, local: common_pb2.TokenTree | None, match: int, length: int,
                     remaining: int):
        """The tree (and its draft_probs) to verify, or (None, None) when the draft was lost."""
        if choice.method == "ngram" and self.ngram is not None:
            return self._fit(choice, local, None, remaining, match)
        await self._end_shadow()               # one Propose at a time on the draft's stream
        if self.draft is None:
            return None, None
        t = time.perf_counter()
        try:
            prop = await self.draft_call(self.draft.propose(length), self.step_s)
        except DraftLost:
            self.draft = None
            return None, None
        ms = (time.perf_counter() - t) * 1e3
        self.stats.draft_ms += ms
        self.stats.model_ms += prop.draft_ms
        self.stats.queue_ms += prop.queue_ms
        self.m.proposal(self.draft.method, ms)
        probs = prop.draft_probs if prop.HasField("draft_probs") else None
        if not is_chain(prop.tree.parents):
            self.draft.shape = list(prop.tree.parents)
        return self._fit(choice, prop.tree, probs, remaining)

    def _nothing_to_decide(self) -> bool:
        """No draft session (none opening either) and the n-gram chains drafted by the target
        inside its runs: every step from here is the target's, so one Decode takes the rest of the
        request, with no decision (and no extension on the wire) between its tokens."""
        return bool(self.lookahead) and self.draft is None and self.opening is None and self.ngram is None

    def _lets_draft_go(self) -> bool:
        return self.draft is not None and self.draft.needs_hidden and not self.policy.keeps_draft()

    async def _decode(self, n: int, left: int) -> AsyncIterator[list[int]]:
        """n target-only steps, each token yielded as it arrives (left: tokens the request still
        needs). When one token of the run is still to come, the next step is decided; if that is
        the target alone again, the run is extended on the target (TargetDecode's doc) rather than
        ended: ended, the session would sit out a batched forward while this loop decides, which
        under load costs a whole step per decision."""
        stats = self.stats
        # Features too while the draft opens: it is owed every committed token's, from b0 on.
        want_hidden = (self.draft is not None and self.draft.needs_hidden
                       or self.opening is not None and bool(self.layer_ids))
        t = time.perf_counter()
        first = True
        pending, left = n, left - n             # this run's tokens still to come; the request's after it
        stats.decode_runs += 1
        async for tok in self.target.decode(n, return_hidden=want_hidden, lookahead=self.lookahead):
            now = time.perf_counter()
            ms = (now - t) * 1e3
            stats.verify_ms += ms
            stats.model_ms += tok.forward_ms
            stats.queue_ms += tok.queue_ms
            self.m.target_step(tok.forward_ms, tok.batch_size, tok.batch_tokens, verify=tok.drafted > 0,
                               verify_rows=tok.batch_verify_rows)
            self.m.decode_gap(ms, tok.forward_ms, first)
            first = False
            ids = [tok.token_id, *tok.more_token_ids]
            # the accepted lookup tokens are the target's own n-gram drafter's, the last its own
            sources = step_sources("ngram", tok.accepted if tok.drafted else 0, len(ids))
            if tok.drafted:         # the target's own prompt lookup verified a chain in this forward
                record_step(stats, "ngram", tok.drafted, tok.accepted, len(ids), depth=tok.drafted)
            else:
                self.policy.observe(Choice("none", 0, 1.0, 0.0), 0)
                record_step(stats, "none", 0, 0, 1)
            self._committed(ids, tok.hidden if want_hidden else None)
            pending -= len(ids)
            # Once per run: at its second-to-last token, or at the first token past it when a
            # lookahead forward committed several (then the run has ended and an extension starts one).
            if pending <= 1 and left > 0 and self.early is None and self.policy.decides_early():
                choice, _, _ = self._choose(left)
                if self.policy.take_shadow():
                    self._start_shadow(tok.length)
                if choice.method == "none" and not self._lets_draft_go():
                    more = self.policy.decode_run(left)
                    if self.opening is not None:
                        more = min(more, 2)     # the draft is about to be ready: decide again soon
                    await self.target.extend(more, return_hidden=want_hidden, lookahead=self.lookahead)
                    stats.decode_extensions += 1
                    pending, left = pending + more, left - more
                else:
                    self.early = choice
            yield Tokens(ids, [tok.logprob, *tok.more_logprobs] if tok.HasField("logprob") else (), sources=sources)
            t = time.perf_counter()

    def _committed(self, ids: list[int], hidden: common_pb2.Tensor | None) -> None:
        if self.ngram is not None:
            self.ngram.extend(ids)
        if self.draft is not None:
            self.draft.owe(ids, hidden)
        elif self.opening is not None:
            self.held.append((ids, hidden))
        if self.shadow is not None:
            self.shadow.realized.extend(ids)
            self._score_shadow()

    # -- the draft beside the target's steps --------------------------------------------------
    async def _open(self, opened, prefix: list[int]) -> RemoteDraft | None:
        t = time.perf_counter()
        draft = await self.open_draft(opened, prefix)
        ms = (time.perf_counter() - t) * 1e3
        self.stats.draft_ms += ms
        if draft is not None:
            self.m.opened_draft(ms)
        return draft

    def _adopt_draft(self) -> None:
        """Once the draft's Open has answered: the draft, owed what was committed meanwhile. A
        refusal of the client's parameters (raised by the Open) ends the request here."""
        if self.opening is None or not self.opening.done():
            return
        draft, self.opening = self.opening.result(), None
        held, self.held = self.held, []
        if draft is not None:
            for ids, hidden in held:
                draft.owe(ids, hidden)
            self.draft = draft

    def _start_shadow(self, length: int) -> None:
        """A DFlash Propose on the committed `length`, run while the target goes on decoding."""
        if self.draft is None or self.draft.method != "dflash" or self.shadow is not None:
            return
        draft, t = self.draft, time.perf_counter()
        call = draft.propose(length)        # takes what is owed now: the Propose is on `length`

        async def propose():
            try:
                prop = await self.draft_call(call, self.step_s)
            except DraftLost:
                if self.draft is draft:
                    self.draft = None
                return None
            finally:
                call.close()                # cancelled before it ran: nothing left unawaited
            self.m.proposal(draft.method, (time.perf_counter() - t) * 1e3)
            return prop

        self.shadow = Shadow(asyncio.ensure_future(propose()))

    def _score_shadow(self, final: bool = False) -> None:
        """Score the shadow proposal once the target has committed enough tokens after its Propose
        to settle every node the walk reaches (or, `final`, with what there is): the nodes a
        verify would have tried, each accepted where the target's own token equals it."""
        sh = self.shadow
        if sh is None or not sh.task.done():
            return
        prop = None if sh.task.cancelled() else sh.task.result()
        if prop is None:
            self.shadow = None
            return
        parents, ids = list(prop.tree.parents), list(prop.tree.token_ids)
        depth = max(depths(parents), default=0)
        tried = tree_trials(parents, ids, sh.realized[:depth + 1])
        accepted = sum(hit for _, _, hit in tried)
        if not final and accepted == len(sh.realized):
            return                  # the walk is still matching: wait for the target's next token
        self.shadow = None
        if tried:
            self.policy.observe(Choice("dflash", len(ids), 0.0, 0.0), accepted, tried=tried, shadow=True)

    async def _end_shadow(self) -> None:
        """Wait for the shadow Propose (the draft's stream takes one at a time) and score it."""
        if self.shadow is None:
            return
        task = self.shadow.task
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise               # the request itself is being cancelled, not the Propose
        self._score_shadow(final=True)

    async def _settle(self) -> None:
        """On the way out: no draft call may outlive the loop (the caller closes the streams)."""
        for task in (self.opening, self.shadow.task if self.shadow else None):
            if task is None:
                continue
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task              # also retrieves an error nobody read (the caller ends the request)
        self.opening, self.shadow = None, None
        self.policy.finished()
