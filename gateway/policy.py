"""What the adaptive policy knows, and the per-step decision of a request.

* `Acceptance`: how often the draft at each position was accepted (decayed counts), per request
  and per drafter (the n-gram drafter per matched suffix length: a 4-token match is a far
  better bet than a 1-token one), starting from the gateway-wide estimate so a new request does
  not start blind.
* `Measurements` (one per gateway, shared by its requests): the target's forward-time model
  fitted on what the target reports with every step (forward_ms, batch_size, batch_tokens), the
  current batch size, the round-trip overheads and the cost of a proposal, as the gateway sees
  them.
* `AutoPolicy` (one per request): each step, `cost_model.choose` over those numbers, bounded by
  what the request allows; a run of target-only steps grows while the target stays the better
  choice, and a long run is interrupted by one speculative probe so the acceptance estimates
  and overheads stay current. A DFlash probe runs in the shadow where it can (`Offer.shadow`):
  the draft proposes while the target decodes, and the proposal is scored against the tokens
  the target then commits, so measuring DFlash costs the request no verify and no stream break.
* `FixedPolicy`: what an explicit method (dflash, ngram, none) runs: always the same step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from splitspec.estimates import PRIOR_WEIGHT, Acceptance, ByLoad, DecayedMean, Ema, ForwardModel

from .cost_model import Choice, Costs, choose, expected_tree_tokens

MAX_DECODE_RUN = 64          # longest target-only run between two decisions
KEEP_DRAFT_FOR = 32          # decisions without DFlash chosen on its merits after which its session is let go
PROBE_EVERY = 16             # decisions after which a drafter not chosen since gets one step
MAX_PROBE_GAP = 256          # ... growing to this while its probes keep losing
NGRAM_WATCH = 0.25           # share of recent decisions choosing n-gram above which runs stay 1 token
DRAFT_WORTH = 0.05           # share of decisions DFlash wins on its merits below which requests skip its session
WORTH_AFTER = 16             # ... once that share rests on this many decisions of the bucket (a few sessions)
REOPEN_EVERY = 8             # while skipped, every this-many-th request of the bucket opens one to re-measure
MAX_REOPEN_GAP = 64          # ... growing to this while the re-measured sessions keep finding DFlash not worth it
SHADOW_FIRST = 3.0           # DFlash acceptance trials (decayed) a bucket needs before DFlash is verified on its merits
EXPLORE_S = 10.0             # while DFlash's prices are unmeasured, one request at a time (at most this long) opens a session


class Measurements:
    """The gateway-wide numbers every request's policy reads (module doc)."""

    def __init__(self, max_positions: int = 16):
        self.forward = ForwardModel()
        self.rows = Ema(alpha=0.2)
        self.sessions = 1.0                  # requests in flight per target replica (set by the servicer)
        self.verify_overhead = ByLoad(self.load)  # a Verify's round trip beyond its forward: wire, the wait for a forward
        self.decode_first = ByLoad(self.load)     # first token of a Decode: its request's round trip, beyond the forward
        self.decode_stream = ByLoad(self.load)    # later tokens of a Decode stream
        self.draft_ms: dict[str, ByLoad] = {}  # a Propose's round trip, queueing in a busy draft service included
        self.draft_open = ByLoad(self.load)       # a DFlash session's Open round trip (its prefill of the prompt)
        self.max_positions = max_positions
        self.accept: dict[tuple, Acceptance] = {}
        # The exploration schedule is the gateway's, not a request's: short requests make few
        # decisions each, and must still get a drafter re-measured now and then.
        self.decisions = 0
        self.last_tried: dict[str, int] = {}     # drafter -> decision number it last ran at
        self.probe_gap: dict[str, int] = {}      # drafter -> decisions between two probes of it
        # Per sampling bucket (greedy / sampled with greedy or sampled drafts): how often DFlash
        # wins a decision on its merits, and how many requests skipped its session since.
        self.dflash_worth: dict[str, DecayedMean] = {}
        self.worth_seen: dict[str, int] = {}
        self.skipped: dict[str, int] = {}
        self.reopen_gap: dict[str, int] = {}     # bucket -> skipped requests between two re-measuring ones
        self.exploring_until = 0.0               # monotonic time before which no other request opens DFlash to explore
        self.measuring_until: dict[str, float] = {}   # bucket -> ... no other request opens one on the prior alone

    def load(self) -> float:
        """What the by-load prices are read at: requests in flight per target replica."""
        return self.sessions

    # -- what the services reported ---------------------------------------------------------
    def target_step(self, forward_ms: float, batch_size: int, batch_tokens: int, verify: bool = False,
                    verify_rows: int = 0) -> None:
        self.forward.add(batch_size, batch_tokens, forward_ms, verify, verify_rows)
        if batch_size > 0:
            self.rows.add(batch_size)

    def verify_round_trip(self, ms: float, forward_ms: float) -> None:
        self.verify_overhead.add(max(0.0, ms - forward_ms))

    def decode_gap(self, ms: float, forward_ms: float, first: bool) -> None:
        (self.decode_first if first else self.decode_stream).add(max(0.0, ms - forward_ms))

    def opened_draft(self, ms: float) -> None:
        self.draft_open.add(ms)

    def proposal(self, method: str, ms: float) -> None:
        self.draft_ms.setdefault(method, ByLoad(self.load)).add(ms)

    def acceptance(self, key: tuple) -> Acceptance:
        if key not in self.accept:
            self.accept[key] = Acceptance(self.max_positions, prior_weight=PRIOR_WEIGHT)
        return self.accept[key]

    def snapshot(self) -> dict:
        """The numbers behind the decisions, for a debug log line."""
        c = self.costs()
        return {"fixed_ms": round(c.fixed_ms, 2), "row_ms": round(c.row_ms, 2), "token_ms": round(c.token_ms, 3),
                "verify_row_ms": round(c.verify_row_ms, 2),
                "rows": round(c.rows, 1), "sessions": round(c.sessions, 1),
                "verify_overhead_ms": round(c.verify_overhead_ms, 2),
                "decode_overhead_ms": round(c.decode_overhead_ms, 2), "rejoin_ms": round(c.rejoin_ms, 2),
                "draft_open_ms": round(self.draft_open.get(0.0), 2),
                "draft_ms": {m: round(v, 2) for m, v in c.draft_ms.items()},
                "accept": {"/".join(map(str, k)): [round(r, 2) for r in a.rates()[:8]] for k, a in self.accept.items()}}

    # -- what a step costs now ----------------------------------------------------------------
    def costs(self, decode_run: int = MAX_DECODE_RUN) -> Costs:
        """decode_run: the Decode run a target-only step would be part of (its round trip is
        shared by the run's tokens)."""
        first, stream = self.decode_first.get(0.0), self.decode_stream.get(0.0)
        coef = self.forward.coef()
        a, b, c, v = coef if coef is not None else (1.0, 1.0, 0.1, 0.0)   # unmeasured: drafting looks cheap, so it is tried
        decode_overhead = (first + stream * (decode_run - 1)) / decode_run
        # A drafted step makes the next Decode a fresh one: the first-token gap beyond what a
        # decode step is already charged (nothing when runs are one token long anyway).
        return Costs(fixed_ms=a, row_ms=b, token_ms=c, rows=max(1.0, self.rows.get(1.0)),
                     verify_overhead_ms=self.verify_overhead.get(0.0), decode_overhead_ms=decode_overhead,
                     draft_ms={m: e.get(0.0) for m, e in self.draft_ms.items()}, verify_row_ms=v,
                     sessions=max(1.0, self.sessions), rejoin_ms=max(0.0, first - decode_overhead))


@dataclass
class Offer:
    """What the drafters can offer this step: the most tokens each can draft (0: nothing), and
    for tree drafters the shape (parents list) of their proposals: the n-gram trie built now,
    the DFlash draft's last tree."""
    dflash: int = 0
    ngram: int = 0
    ngram_match: int = 0          # length of the matched suffix behind the n-gram offer
    shapes: dict = field(default_factory=dict)
    shadow: bool = False          # DFlash can be probed in the shadow now (a session, no shadow probe in flight)


def sampling_bucket(temperature: float, draft_sampling: str) -> str:
    """Requests whose DFlash acceptance is alike: greedy ones, and sampled ones per draft mode
    (greedy drafts rarely survive a sampled target; sampled drafts verified against q do better)."""
    return "greedy" if temperature == 0 else f"sampled/{draft_sampling}"


class FixedPolicy:
    """An explicit method: always that drafter at the request's full width (or always decode)."""

    opens_in_background = False     # an explicit dflash waits for its session: every step drafts
    can_shadow = False

    def __init__(self, method: str):
        self.method = method
        self.drafter_gone = False

    def take_shadow(self) -> bool:
        return False

    def wants_draft(self, remaining: int | None = None) -> bool:
        return True

    def choose(self, offer: Offer, remaining: int) -> Choice:
        k = offer.dflash if self.method == "dflash" else offer.ngram if self.method == "ngram" else 0
        if k == 0:
            # No drafter (the draft was lost), or no n-gram match this step.
            self.drafter_gone = self.method == "none" or (self.method == "dflash" and offer.dflash == 0)
            return Choice("none", 0, 1.0, 0.0)
        return Choice(self.method, min(k, max(0, remaining - 1)), 0.0, 0.0)

    def keeps_draft(self) -> bool:
        return True

    def cut(self, method: str, parents: list[int], budget: int, ngram_match: int = 0) -> int:
        return min(len(parents), budget)       # the whole tree the request asked for

    def decides_early(self) -> bool:
        return True

    def decode_run(self, remaining: int) -> int:
        # Target-only for good: one Decode for the rest of the request; else one token, then draft again.
        return remaining if self.drafter_gone else 1

    def observe(self, choice: Choice, accepted: int, ngram_match: int = 0, tried=None, shadow: bool = False) -> None:
        pass

    def finished(self) -> None:
        pass


class AutoPolicy:
    """method = "auto" for one request (module doc)."""

    def __init__(self, measurements: Measurements, *, max_k: int, bucket: str = "greedy"):
        self.m = measurements
        self.max_k = max_k                      # the request's upper bound on drafted tokens
        self.bucket = bucket                    # sampling_bucket of the request
        self.local: dict[tuple, Acceptance] = {}
        self.run = 1
        self.decisions = 0                      # this request's, for keeps_draft
        self.probing = False                    # the last choice was a probe, not the best step
        self.last_natural: dict[str, int] = {}  # drafter -> decision number it last won on its merits
        self.ngram_chosen = Ema(0.0, alpha=0.2)  # how often an n-gram draft was worth a step lately
        self.shadow_wanted = False              # a DFlash probe is due, to run in the shadow
        # A session opened only to (re-)measure DFlash opens while the target decodes: the
        # draft's prefill (on a long prompt, many decode steps) is then off the request's
        # critical path. One opened because DFlash pays on measured acceptance is waited for:
        # it drafts from step one.
        self.opens_in_background = False
        # A shadow probe counts the target's own tokens matching the draft's, which is what a
        # verify accepts (in distribution) for greedy drafts only: a sampled draft is accepted
        # with min(1, p/q), more often than its token is sampled again.
        self.can_shadow = not bucket.endswith("/sample")
        self.measuring = False                  # this request holds its bucket's measuring session

    def _acceptance(self, key: tuple) -> Acceptance:
        if key not in self.local:
            shared = self.m.acceptance(key)
            self.local[key] = Acceptance(self.m.max_positions, prior=shared.table())
        return self.local[key]

    def _key(self, method: str, ngram_match: int) -> tuple:
        # Acceptance depends on how the target samples (and the drafts are drawn): per bucket.
        return ("ngram", ngram_match, self.bucket) if method == "ngram" else (method, self.bucket)

    def wants_draft(self, remaining: int | None = None) -> bool:
        """Whether this request opens a DFlash session. Opening one costs a draft prefill and
        the target's features on the wire for every committed token, paid even by a request that
        then never drafts. It opens one only where that is expected to pay back over its
        `remaining` tokens (`session_pays`) and where DFlash has been winning at least WORTH of
        the decisions of this bucket lately (sampled requests with greedy drafts rarely do);
        otherwise only every REOPEN_EVERY-th request of the bucket opens one, to keep the
        estimates current. Before any Open and Propose were measured, one request at a time
        opens a session to measure them. Without a session a request sends no features and
        verifies no DFlash probe: it runs target-only and n-gram steps, which cost nothing to
        offer."""
        m, b = self.m, self.bucket
        if m.draft_open.value is None or "dflash" not in m.draft_ms:
            # Nothing measured yet: one request finds the prices (an Open, a Propose) for all;
            # a burst on a fresh gateway would otherwise open a session for every request.
            now = time.monotonic()
            if now < m.exploring_until:
                return False
            m.exploring_until = now + EXPLORE_S
            self.opens_in_background = True
            return True
        worth = m.worth_seen.get(b, 0) < WORTH_AFTER or m.dflash_worth[b].get() >= DRAFT_WORTH
        if worth and (remaining is None or self.session_pays(remaining)):
            m.skipped[b] = 0
            m.reopen_gap[b] = REOPEN_EVERY
            if self.can_shadow and self._dflash_unmeasured():
                # Paying on the prior alone (a bucket's first requests, T=1 say) is still
                # measuring: one request of the bucket at a time, beside the target. A burst of
                # sixteen once opened 9-13 sessions here, each a draft prefill on shared cores.
                now = time.monotonic()
                if now < m.measuring_until.get(b, 0.0):
                    return False
                m.measuring_until[b] = now + EXPLORE_S
                self.measuring = self.opens_in_background = True
            return True
        # Each re-measuring session costs an Open and features on the wire; while they keep
        # confirming the skip, they come less and less often (8, 16, 32, 64 requests).
        m.skipped[b] = m.skipped.get(b, 0) + 1
        gap = m.reopen_gap.setdefault(b, REOPEN_EVERY)
        if m.skipped[b] < gap:
            return False
        m.skipped[b] = 0
        m.reopen_gap[b] = min(2 * gap, MAX_REOPEN_GAP)
        self.opens_in_background = True
        return True

    def finished(self) -> None:
        """The request ended: a measuring session it held lets the bucket's next request open one."""
        if self.measuring:
            self.m.measuring_until[self.bucket] = 0.0
            self.measuring = False

    def session_pays(self, remaining: int) -> bool:
        """Whether a DFlash session should save more than it costs over `remaining` tokens, at
        the prices measured now (the batch's size included) and the bucket's acceptance learnt
        across requests: the time DFlash's best step saves per token, times the tokens, against
        the Open's round trip."""
        costs = self.m.costs()
        best = choose({"dflash": self.m.acceptance(("dflash", self.bucket)).rates()},
                      {"dflash": max(1, self.max_k)}, costs, decode=False)
        saved_per_token = costs.step_ms("none", 0) - best.ms / best.tokens
        return saved_per_token * max(0, remaining - 1) > self.m.draft_open.get(0.0)

    def choose(self, offer: Offer, remaining: int) -> Choice:
        cap = min(self.max_k, max(0, remaining - 1))     # the bonus is always one of the remaining
        max_k = {"dflash": min(offer.dflash, cap), "ngram": min(offer.ngram, cap)}
        accept = {"dflash": self._rates("dflash", 0, "dflash" in offer.shapes),
                  "ngram": self._rates("ngram", offer.ngram_match, "ngram" in offer.shapes) if offer.ngram else []}
        shapes = offer.shapes
        costs = replace(self.m.costs(1 if self._watching() else MAX_DECODE_RUN), remaining=remaining)
        self.decisions += 1
        m = self.m
        m.decisions += 1
        unmeasured = offer.shadow and self._dflash_unmeasured()
        if unmeasured:
            # DFlash's acceptance rests on the prior alone: measure it in the shadow before a
            # verify is spent on it (a fresh gateway would otherwise pay for the prior's optimism).
            max_k["dflash"] = 0
            self.shadow_wanted = True
        best = choose(accept, max_k, costs, shapes=shapes)
        # Exploration: an estimate that is never re-measured can stay wrong forever (one
        # unlucky first step would rule a drafter out for good). A drafter that keeps losing
        # is probed less and less often (16, 32, 64 … decisions); DFlash in the shadow where
        # the loop can, so the probe costs no verify.
        natural, self.probing = best.method, False
        for method, k in max_k.items():
            gap = m.probe_gap.setdefault(method, PROBE_EVERY)
            if k and method != best.method and m.decisions - m.last_tried.setdefault(method, 0) >= gap:
                m.probe_gap[method] = min(2 * gap, MAX_PROBE_GAP)
                if method == "dflash" and offer.shadow:
                    self.shadow_wanted = True
                    m.last_tried[method] = m.decisions
                    continue
                best = choose(accept, {method: k}, costs, decode=False, shapes=shapes)
                self.probing = True
                break
        if natural != "none":
            m.probe_gap[natural] = PROBE_EVERY
            self.last_natural[natural] = self.decisions
        if max_k["dflash"]:
            m.dflash_worth.setdefault(self.bucket, DecayedMean()).add(1.0 if natural == "dflash" else 0.0)
            m.worth_seen[self.bucket] = m.worth_seen.get(self.bucket, 0) + 1
        if best.method != "none":
            m.last_tried[best.method] = m.decisions
        self.ngram_chosen.add(1.0 if best.method == "ngram" else 0.0)
        return best

    def take_shadow(self) -> bool:
        """Whether the loop should probe DFlash in the shadow now (asked once per due probe)."""
        wanted, self.shadow_wanted = self.shadow_wanted, False
        return wanted

    def _dflash_unmeasured(self) -> bool:
        return self.m.acceptance(self._key("dflash", 0)).trials[0][0] < SHADOW_FIRST

    def _rates(self, method: str, ngram_match: int, tree: bool):
        acc = self._acceptance(self._key(method, ngram_match))
        return acc.table() if tree else acc.rates()

    def cut(self, method: str, parents: list[int], budget: int, ngram_match: int = 0) -> int:
        """How many of a proposed tree's nodes to verify (its nodes come best first, so a prefix
        is the best tree of its size): the most expected committed tokens per second, the
        proposal's own cost included, at most `budget`. A chain is cut the same way."""
        if budget <= 0 or not parents:
            return 0
        costs = self.m.costs()
        tokens = expected_tree_tokens(parents, self._acceptance(self._key(method, ngram_match)).table())
        best, best_rate = 1, -1.0
        for n in range(1, min(budget, len(parents)) + 1):
            rate = tokens[n] / max(costs.step_ms(method, n), 1e-9)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = n, rate
        return best

    def decode_run(self, remaining: int) -> int:
        """How many target-only tokens to decode before deciding again: doubling while the
        target alone stays the better choice, so a loaded server pays few extra round trips;
        one at a time while n-gram drafts keep being worth a step (a run cannot be cut short,
        and a match found one token too late is a free draft lost)."""
        if self._watching():
            return 1
        # Two at least: the next step is decided at a run's second-to-last token, so a run that
        # goes on is extended without a gap; a one-token run ends before anything can be
        # decided, and the session sits out a forward while the gateway decides.
        n = min(max(self.run, 2), MAX_DECODE_RUN, remaining)
        self.run = min(max(self.run, 2) * 2, MAX_DECODE_RUN)
        return n

    def decides_early(self) -> bool:
        """Whether the next step may be decided one token before a Decode run ends (so a run
        that goes on is extended without a gap): not while n-gram drafts keep paying, whose
        matches need the latest token."""
        return not self._watching()

    def keeps_draft(self) -> bool:
        """Whether to keep the DFlash session: feeding it costs every target-only token its
        features on the wire. Let go once DFlash has not won on its merits for KEEP_DRAFT_FOR
        decisions (T > 0 with greedy drafts, say); n-gram and the target go on."""
        return self.decisions - self.last_natural.get("dflash", 0) < KEEP_DRAFT_FOR

    def _watching(self) -> bool:
        """Decode one token at a time, to catch the next n-gram match: only while n-gram drafts
        keep paying and the target is not shared (under load, round trips cost more than the
        matches a run misses)."""
        return self.ngram_chosen.get(0.0) > NGRAM_WATCH and self.m.sessions < 2

    def observe(self, choice: Choice, accepted: int, ngram_match: int = 0, tried=None, shadow: bool = False) -> None:
        """tried: the verify's (depth - 1, rank, accepted) per tried node, for trees. shadow: a
        proposal scored against the tokens the target committed after it, not a step that ran."""
        if choice.method == "none":
            return
        if not self.probing and not shadow and accepted > 0:
            # Drafting pays again: decide after every token. A natural draft that was wholly
            # rejected does not cut the target-only run short (at T > 0 an occasional n-gram
            # match would otherwise restart runs from one token, a Decode round trip each).
            self.run = 1
        key = self._key(choice.method, ngram_match)
        for acc in (self._acceptance(key), self.m.acceptance(key)):
            if tried is None:
                acc.update(choice.k, accepted)
            else:
                acc.update_tried(tried)
