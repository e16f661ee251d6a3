"""Which pending steps go into the next forward: first come, first served, under a token budget.

Steps are offered oldest first (by the time they became ready). A step that cannot be split
(a decode or verify row) goes in whole or stops the batch there, so nothing younger jumps
ahead of it and nothing starves; a splittable step (a prompt still prefilling) takes what is
left of the budget, capped at the chunk size, so a long prompt never fills a forward on its
own and running decoders keep their pace (chunked prefill)."""
from __future__ import annotations

from typing import Callable, Iterable, TypeVar

T = TypeVar("T")


def take_fifo(pending: Iterable[T], demand: Callable[[T], tuple[int, bool]], *, budget: int,
              chunk: int, max_rows: int | None = None) -> list[tuple[T, int]]:
    """[(step, tokens it runs)] for the next forward. demand(step) -> (tokens wanted, splittable).
    The oldest step always goes in, even over the budget, so a budget smaller than one step
    slows the engine down but never stalls it."""
    picked: list[tuple[T, int]] = []
    used = 0
    for step in pending:
        if max_rows is not None and len(picked) >= max_rows:
            break
        want, splittable = demand(step)
        if splittable:
            want = min(want, chunk, budget - used) if picked else min(want, chunk, max(budget, 1))
            if want <= 0:
                break
        elif picked and used + want > budget:
            break
        picked.append((step, want))
        used += want
    return picked
