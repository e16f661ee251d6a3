"""The arithmetic of the adaptive policy (`method = "auto"`), as plain functions: how many tokens a
step of k drafted tokens commits on average, what that step costs, and which (drafter, k) gives
the most committed tokens per second. `policy.py` feeds it what the gateway measured.

A step's cost is modelled on what the services report about their batched forwards:

    target forward_ms  ≈  a  +  b · rows  +  c · tokens  +  v · verify rows

(a: fixed per forward; b: per session row, mostly reading that row's KV context; c: per query
token; v: what a verify row costs beyond its tokens: its own attention group, tree mask,
acceptance, rollback; the target reports how many rows of each forward verified, so v is a lone
verify's price among decoders, not a share of the batch). A decode step is priced as if every
session on the target decoded (streamed Decode steps put all of them in every forward):
a + sessions · (b + c). A verify of width w is priced at what it costs everyone: its own forward
(a + sessions · (b + c) + c · (w - 1) + v) plus the time its extra width adds to the forward
of each of the other sessions, (sessions - 1) · (c · (w - 1) + v): in all
a + sessions · (b + c · w + v), the same as if every session sent width w (`rows`, the sessions
met in recent forwards, stands in where it is larger). Charging the others' time is what keeps
one session's 8-token n-gram verify out of a forward of fifteen decoders where its τ does not
cover what it slows them by; with one session it reduces to "how much does one more token of
width cost".

A drafted step also breaks the session's Decode stream: the target-only tokens after it come
from a fresh Decode, whose first token waits for a forward boundary (with other sessions on the
target, the forward already running does not wait for it) and a round trip. That gap
(`rejoin_ms`, the measured first-token gap of a Decode beyond its forward, less what a decode
step is charged for its share of it) is charged to every drafted step; while runs are one token
long (n-gram watching on an idle target) every decode step pays the whole gap and a drafted
step nothing more. With one session it is a round trip, ~1 ms; with a busy target it is most of a
forward, and it is what made `auto` lose to target-only at 8-16 short requests: each n-gram step
cost the session the verify's wait, the verify, and then a missed forward to get back in.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from splitspec.estimates import expected_tokens


def expected_tree_tokens(parents: Sequence[int], accept: Sequence[Sequence[float]]) -> list[float]:
    """Tokens committed on average by a verify of each prefix of a tree (out[n]: its first n
    nodes; nodes come parents first, siblings in the order the verifier tries them).
    accept[r][d] = P(the sibling of rank r at depth d + 1 is accepted | its parent was, and
    the r siblings tried before it were rejected); ranks and depths past the table's end reuse
    its last entry. A node is on the accepted path with its parent's probability times its
    own conditional one: the bonus is always committed, and each node adds that probability."""
    def rate(rank: int, depth: int) -> float:
        row = accept[min(rank, len(accept) - 1)] if accept else ()
        return row[min(depth, len(row) - 1)] if row else 0.0

    reach: list[float] = []                 # P(node on the accepted path)
    depth: list[int] = []
    rejected: dict[int, float] = {}         # parent -> P(every child listed so far rejected)
    seen: dict[int, int] = {}               # parent -> children listed so far
    out = [1.0]
    for p in parents:
        d = 0 if p < 0 else depth[p] + 1
        rank = seen.get(p, 0)
        seen[p] = rank + 1
        a = rate(rank, d)
        none_before = rejected.get(p, 1.0)
        reach.append((1.0 if p < 0 else reach[p]) * none_before * a)
        rejected[p] = none_before * (1.0 - a)
        depth.append(d)
        out.append(out[-1] + reach[-1])
    return out


@dataclass(frozen=True)
class Costs:
    """What a step costs now, in milliseconds (see the module doc)."""
    fixed_ms: float                 # a
    row_ms: float                   # b
    token_ms: float                 # c
    rows: float                     # sessions' rows in recent target forwards (>= 1)
    verify_overhead_ms: float       # a Verify round trip beyond its forward: wire, (de)serialisation, queue
    decode_overhead_ms: float       # the same for one streamed Decode token (small: the stream never waits)
    draft_ms: dict[str, float] = field(default_factory=dict)   # per drafter: what getting a proposal costs
    verify_row_ms: float = 0.0      # v
    sessions: float = 1.0           # sessions sharing the target: the rows of an all-decode forward
    rejoin_ms: float = 0.0          # what a drafted step costs the Decode stream it breaks (module doc)
    remaining: int = 0              # tokens the request still needs (0: unbounded): no rejoin after its last step

    def forward_ms(self, width: int, verify: bool = True) -> float:
        if not verify:
            return self.fixed_ms + max(self.sessions, 1.0) * (self.row_ms + self.token_ms * width)
        return self.fixed_ms + max(self.rows, self.sessions) * (self.row_ms + self.token_ms * width + self.verify_row_ms)

    def step_ms(self, method: str, k: int) -> float:
        if k == 0:
            return self.forward_ms(1, verify=False) + self.decode_overhead_ms
        rejoin = self.rejoin_ms if not self.remaining or k + 1 < self.remaining else 0.0
        return self.draft_ms.get(method, 0.0) + self.forward_ms(k + 1) + self.verify_overhead_ms + rejoin


@dataclass(frozen=True)
class Choice:
    method: str                     # "dflash", "ngram", or "none" (a target-only decode step)
    k: int                          # drafted tokens to verify (0 for "none")
    tokens: float                   # expected committed tokens
    ms: float                       # expected step time

    @property
    def rate(self) -> float:
        return self.tokens / self.ms if self.ms > 0 else float("inf")


def options(accept: dict[str, Sequence], max_k: dict[str, int], costs: Costs, *,
            decode: bool = True, shapes: dict[str, Sequence[int]] | None = None) -> list[Choice]:
    """Every step the policy could run: a decode step (unless `decode` is False), and each
    drafter with k = 1..max_k[method] (0 or absent: that drafter has nothing to offer now).
    A drafter with a tree shape (its parents list: what its proposals look like) offers the
    shape's first k nodes, and accept[method] is then its table by sibling rank and depth."""
    out = [Choice("none", 0, 1.0, costs.step_ms("none", 0))] if decode else []
    for method, kmax in max_k.items():
        shape = (shapes or {}).get(method)
        if shape:
            tokens = expected_tree_tokens(shape, accept.get(method, ()))
            for k in range(1, min(kmax, len(shape)) + 1):
                out.append(Choice(method, k, tokens[k], costs.step_ms(method, k)))
            continue
        for k in range(1, kmax + 1):
            out.append(Choice(method, k, expected_tokens(accept.get(method, ()), k), costs.step_ms(method, k)))
    return out


def choose(accept: dict[str, Sequence], max_k: dict[str, int], costs: Costs, *,
           decode: bool = True, shapes: dict[str, Sequence[int]] | None = None) -> Choice | None:
    """The step with the most expected committed tokens per second; on a tie, the cheaper one
    (fewer drafted tokens, the target alone before any drafter). None only when `decode` is
    False and no drafter offers anything."""
    best = None
    for c in options(accept, max_k, costs, decode=decode, shapes=shapes):
        if best is None or c.rate > best.rate * (1 + 1e-9):
            best = c
    return best
