"""Prompt lookup inside Decode runs: the target's own n-gram drafts (TargetDecode.lookahead).

A Decode run that allows it may turn any of its steps into a verify of the tokens that followed
the latest earlier occurrence of the sequence's last n tokens (`splitspec.ngram`), inside the
same batched forward. Done here rather than at the gateway, a draft costs no round trip and no
decision between two Decode runs, and every token is a chance: the gateway only sees its
n-gram matches where it decides, and watching for them there meant one-token runs, a round
trip each.

Whether a step drafts, and how many tokens, is priced against the forward it would run in:
`estimates.ForwardModel` fits this target's forward time on every forward it runs (rows,
tokens, verify rows), and the chain's acceptance is learnt per matched suffix length, apart for
greedy and sampled sessions (each session's own estimate starts from the target-wide one). For
the batch as composed so far, k drafted tokens pay when the tokens they are expected to add per
millisecond they add to the forward beat the batch's own rate by MIN_GAIN, E_k / (c·k + v) >
1.1 · produced / ms (so a wide verify that slows every other row of a full batch is run only
for as many tokens as it costs them), and they are expected to add MIN_TOKENS (1) at least; of
those, the k with the most tokens per ms.

Exact: the chain is a deterministic draft, verified like any other (`verify.py`: at T > 0 a
token is accepted with the target's own probability of it), so outputs keep the target's
distribution; only the number of forwards changes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from splitspec.estimates import Acceptance, ForwardModel, expected_tokens
from splitspec.ngram import NgramIndex

MAX_DRAFT = 15          # longest chain one forward verifies (TargetInfo.max_lookahead)
MIN_N, MAX_N = 1, 4     # matched suffix lengths looked up, longest first
# A draft runs only where it is expected to add at least MIN_TOKENS accepted tokens, and the
# tokens it adds per millisecond it adds to the forward beat the batch's own rate by MIN_GAIN.
# Near break-even the estimates' errors decide, and they lean one way: a key is drafted exactly
# where its estimate came out high, and a verify's fixed price (v) rests on the few forwards that
# verified. At T = 1 on this CPU, drafting at any expected gain (a draft adds ~0.5 tokens there)
# ran 3-5 % slower than none. A 30 % margin on the rate instead of the token floor kept out the
# 4-token matches that carry T = 0 at 16 streams of long prompts (0.95-1.01x; the floor: 1.94x).
MIN_TOKENS = 1.0
MIN_GAIN = 1.1


def expected_accepted(rates: list[float], k: int) -> float:
    """Expected accepted tokens of a k-token chain whose i-th token is accepted with rates[i]
    once all before it were (`expected_tokens` without the bonus)."""
    return expected_tokens(rates, k) - 1.0


def best_k(rates: list[float], k_max: int, coef: tuple[float, float, float, float], *, rows: int, tokens: int,
           verify_rows: int, produced: float) -> tuple[int, float]:
    """(draft tokens, their expected accepted count) that maximise the batch's tokens per ms,
    among the chains expected to add MIN_TOKENS at least, at a rate (per added ms) MIN_GAIN above the batch's.
    coef: the forward's (fixed, per row, per token, per verify row) ms; rows / tokens /
    verify_rows: the batch so far, this session's decode row included; produced: the tokens the
    batch is expected to commit without this draft. (0, 0.0) when plain decoding is best."""
    a, b, c, v = coef
    base = max(a + b * rows + c * tokens + v * verify_rows, 1e-6)
    rate = produced / base
    best, best_e, best_rate = 0, 0.0, rate
    e, p = 0.0, 1.0
    for k in range(1, k_max + 1):
        p *= rates[k - 1]               # E_k from E_{k-1}: one pass, on the engine thread's path
        e += p
        added = c * k + v                               # the decode row turns into a verify row
        if e < MIN_TOKENS or e <= MIN_GAIN * rate * added:
            continue
        r = (produced + e) / (base + added)
        if r > best_rate * (1 + 1e-9):
            best, best_e, best_rate = k, e, r
    return best, best_e


@dataclass
class SessionLookahead:
    """One session's n-gram index over its committed tokens, and its own acceptance estimates."""
    sampled: bool
    index: NgramIndex = field(default_factory=lambda: NgramIndex(MIN_N, MAX_N))
    local: dict[int, Acceptance] = field(default_factory=dict)

    def match(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens continuing the longest earlier match of the sequence's suffix, and that
        suffix's length (0: none)."""
        if len(self.index) < len(tokens):
            self.index.extend(tokens[len(self.index):])
        return self.index.match(k)


class Lookahead:
    """The target-wide half: its forward-time model and acceptance per (sampled, match length)."""

    def __init__(self, max_draft: int = MAX_DRAFT):
        self.max_draft = max_draft
        self.forward = ForwardModel()
        self.shared: dict[tuple[bool, int], Acceptance] = {}
        self.drafts = self.draft_tokens = self.accepted_tokens = 0    # totals, for the metrics
        self.lookups = self.matches = self.full = 0     # lookups made, those that matched; batches too full to try

    def ran(self, rows: int, tokens: int, verify_rows: int, ms: float) -> None:
        """Every forward this target ran, whatever ran in it."""
        self.forward.add(rows, tokens, ms, verify_rows > 0, verify_rows)

    def could_pay(self, k_max: int, *, rows: int, tokens: int, verify_rows: int, produced: float) -> bool:
        """Whether a k_max-token chain accepted whole would pay in this batch: where not (a full
        batch), no session's lookup is worth its time (tens of microseconds on a long sequence)."""
        coef = self.forward.coef() or (1.0, 1.0, 0.1, 0.0)
        return best_k([1.0] * k_max, k_max, coef, rows=rows, tokens=tokens, verify_rows=verify_rows,
                      produced=produced)[0] > 0

    def _acceptance(self, look: SessionLookahead, match: int) -> tuple[Acceptance, Acceptance]:
        key = (look.sampled, match)
        if key not in self.shared:
            self.shared[key] = Acceptance(self.max_draft)
        if match not in look.local:
            look.local[match] = Acceptance(self.max_draft, prior=self.shared[key].table())
        return look.local[match], self.shared[key]

    def plan(self, look: SessionLookahead, tokens_so_far: list[int], k_max: int, *, rows: int, tokens: int,
             verify_rows: int, produced: float) -> tuple[list[int], int, float]:
        """(draft tokens to verify in this forward (empty: decode), the matched suffix length,
        their expected accepted count)."""
        k_max = min(k_max, self.max_draft)
        if k_max <= 0:
            return [], 0, 0.0
        ids, match = look.match(tokens_so_far, k_max)
        self.lookups += 1
        if not ids:
            return [], 0, 0.0
        self.matches += 1
        coef = self.forward.coef() or (1.0, 1.0, 0.1, 0.0)   # unmeasured: drafting looks cheap, so it is tried
        local, _ = self._acceptance(look, match)
        k, e = best_k(local.rates(), len(ids), coef, rows=rows, tokens=tokens, verify_rows=verify_rows,
                      produced=produced)
        return ids[:k], match, e

    def snapshot(self) -> dict:
        """The numbers behind the decisions, for a log line."""
        coef = self.forward.coef()
        return {"coef_ms": None if coef is None else [round(x, 3) for x in coef], "lookups": self.lookups,
                "matches": self.matches, "drafts": self.drafts, "full_batches": self.full,
                "accept": {f"{'sampled' if s else 'greedy'}/{m}": [round(r, 2) for r in a.rates()[:4]]
                           for (s, m), a in sorted(self.shared.items())}}

    def observe(self, look: SessionLookahead, match: int, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        for acc in self._acceptance(look, match):
            acc.update(drafted, accepted)
