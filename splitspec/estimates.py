"""Running estimates that both the gateway's policy and the target's own prompt lookup price
their steps with (torch-free): per-position acceptance, a forward's time as a function of its
shape, a few decayed means, and the tokens a chain is expected to commit."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

DECAY = 0.97                 # per observation: about the last 30 steps count
PRIOR_ACCEPT = 0.7           # before anything is measured: optimistic, so drafting gets tried
PRIOR_WEIGHT = 2.0           # a request's estimate starts as this many steps of the gateway's
RANKS = 4                    # sibling ranks whose acceptance is kept apart (later ones share the last)
SIBLING_PRIOR = 0.4          # before anything is measured: each further sibling is this much less likely


class Acceptance:
    """Decayed per-position counts, by sibling rank: at depth i, rank r counts a trial when
    the node above was accepted and the r siblings tried before were rejected (for a chain,
    rank 0 only: draft i+1 was looked at), and a success when that sibling was accepted."""

    def __init__(self, size: int, prior: list | None = None, prior_weight: float = PRIOR_WEIGHT):
        self.trials = [[0.0] * size for _ in range(RANKS)]
        self.hits = [[0.0] * size for _ in range(RANKS)]
        if prior is None:
            prior = [[PRIOR_ACCEPT * SIBLING_PRIOR ** r] * size for r in range(RANKS)]
        elif prior and not isinstance(prior[0], (list, tuple)):
            prior = [[x * SIBLING_PRIOR ** r for x in prior] for r in range(RANKS)]
        self.prior = [list(row) for row in prior]
        self.prior_weight = prior_weight

    def update(self, k: int, accepted: int) -> None:
        """A chain of k drafts of which the first `accepted` were accepted."""
        self.update_tried([(i, 0, i < accepted) for i in range(min(k, accepted + 1))])

    def update_tried(self, tried: list[tuple[int, int, bool]]) -> None:
        """One verify's (depth - 1, rank, accepted) per tried node (`speculative.tree_trials`)."""
        for t_row, h_row in zip(self.trials, self.hits):
            for i in range(len(t_row)):
                t_row[i] *= DECAY
                h_row[i] *= DECAY
        size = len(self.trials[0])
        for depth, rank, hit in tried:
            if depth < size:
                r = min(rank, RANKS - 1)
                self.trials[r][depth] += 1.0
                self.hits[r][depth] += 1.0 if hit else 0.0

    def rates(self, rank: int = 0) -> list[float]:
        w = self.prior_weight
        return [(h + w * p) / (t + w) for h, t, p in zip(self.hits[rank], self.trials[rank], self.prior[rank])]

    def table(self) -> list[list[float]]:
        """rates by [rank][depth - 1], for `cost_model.expected_tree_tokens`."""
        return [self.rates(r) for r in range(RANKS)]


class Ema:
    def __init__(self, value: float | None = None, alpha: float = 0.1):
        self.value, self.alpha = value, alpha

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


class ByLoad:
    """An Ema per load bucket (sessions on the target replica: 1, 2-3, 4-7, 8-15, 16+), read and
    fed at the current load. Round trips and waits depend on it (a Verify among fifteen decoders
    waits for the forward in flight; alone it does not), and a price measured under a burst must
    not stand for the idle target after it: the policy stops running what looks dear, so that
    estimate would never be measured again. An unmeasured bucket reads its nearest measured one."""

    BUCKETS = 5

    def __init__(self, load):
        self.load = load                     # () -> sessions now
        self.emas = [Ema() for _ in range(self.BUCKETS)]

    def _bucket(self) -> int:
        return min(self.BUCKETS - 1, int(math.log2(max(1.0, self.load()))))

    def add(self, x: float) -> None:
        self.emas[self._bucket()].add(x)

    @property
    def value(self) -> float | None:
        b = self._bucket()
        for d in range(self.BUCKETS):
            for i in (b - d, b + d):
                if 0 <= i < self.BUCKETS and self.emas[i].value is not None:
                    return self.emas[i].value
        return None

    def get(self, default: float) -> float:
        v = self.value
        return default if v is None else v


class DecayedMean:
    """Mean of the recent observations (weights decay^age), unbiased from the first one on."""

    def __init__(self, decay: float = 0.98):
        self.decay, self.num, self.den = decay, 0.0, 0.0

    def add(self, x: float) -> None:
        self.num = self.decay * self.num + x
        self.den = self.decay * self.den + 1.0

    def get(self, default: float = 1.0) -> float:
        return self.num / self.den if self.den else default


# A forward's fixed and per-row costs are shrunk less than its per-token and per-verify-row ones:
# where the data cannot tell them apart (decodes only: every forward has as many tokens as
# rows), the time goes to the rows, as a decode's does (reading weights and each row's context),
# and an unmeasured verify's extra width starts cheap (a width-8 verify ≈ 1.5x a decode instead
# of the 3.3x an even split makes it), so n-gram drafts get verified and the width's real price
# is then learnt. An even split kept a fresh gateway from drafting for its first ~10 requests.
RIDGE_WEIGHTS = np.diag([1.0, 1.0, 6.0, 6.0])


class ForwardModel:
    """forward_ms ≈ a + b·rows + c·tokens + v·verify_rows, least squares over exponentially
    decayed sufficient statistics, with a light ridge so that directions the data does not
    separate (one session: rows is always 1) stay finite. Coefficients are kept >= 0: a negative
    per-token cost would make wider verifies look free. The target reports how many of a
    forward's rows verified (`batch_verify_rows`); a target that does not (0 on a verify) has
    the reporting session's own kind stand for all of them, which overstates v's share of rows
    and understates a lone verify's price among decoders by the batch size."""

    def __init__(self, decay: float = 0.99, ridge: float = 1e-3):
        self.decay, self.ridge = decay, ridge
        self.xtx = np.zeros((4, 4))
        self.xty = np.zeros(4)
        self.n = 0.0
        self._coef: np.ndarray | None = None

    def add(self, rows: int, tokens: int, ms: float, verify: bool = False, verify_rows: int = 0) -> None:
        if rows <= 0 or tokens <= 0 or ms <= 0:
            return
        if verify and verify_rows <= 0:
            verify_rows = rows          # not reported: the symmetric reading (class doc)
        x = np.array([1.0, float(rows), float(tokens), float(min(verify_rows, rows))])
        self.xtx = self.decay * self.xtx + np.outer(x, x)
        self.xty = self.decay * self.xty + x * ms
        self.n = self.decay * self.n + 1.0
        self._coef = None

    def coef(self) -> tuple[float, float, float, float] | None:
        if self.n < 1.0:
            return None
        if self._coef is None:
            a = self.xtx + self.ridge * max(self.n, 1.0) * RIDGE_WEIGHTS
            self._coef = np.clip(np.linalg.solve(a, self.xty), 0.0, None)
        return tuple(float(x) for x in self._coef)


def expected_tokens(accept: Sequence[float], k: int) -> float:
    """Tokens committed on average by a verify of a k-token chain: the bonus token always, plus
    draft i when drafts 1..i are all accepted. accept[i] = P(draft i+1 accepted | drafts
    1..i accepted); positions past the end of `accept` reuse its last value."""
    total, p = 1.0, 1.0
    for i in range(k):
        p *= accept[min(i, len(accept) - 1)] if accept else 0.0
        total += p
    return total
