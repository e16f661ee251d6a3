"""Which pending steps go into the next forward: first come, first served, under a token budget.

Steps are offered oldest first (by the time they became ready). A step that cannot be split
(a decode or verify row) goes in whole or stops the batch there, so nothing younger jumps
ahead of it and nothing starves; splittable steps (prompts still prefilling) share at most
`chunk` tokens per forward, oldest first, so prompts arriving together never fill a forward
and running decoders keep their pace (chunked prefill). A prompt that gets no share this
time keeps its place in the queue for the next forward."""
from __future__ import annotations

from typing import Callable, Iterable, TypeVar

T = TypeVar("T")


def take_fifo(pending: Iterable[T], demand: Callable[[T], tuple[int, bool]], *, budget: int,
              chunk: int, max_rows: int | None = None,
              fit: Callable[[T, int], int] | None = None) -> list[tuple[T, int]]:
    """[(step, tokens it runs)] for the next forward. demand(step) -> (tokens wanted, splittable).
    The oldest step always goes in, even over the budget, so a budget smaller than one step
    slows the engine down but never stalls it. fit(step, n) -> how many of the n tokens a
    splittable step may give it may run (fewer where its chunks must end on boundaries; 0 sits
    this forward out)."""
    picked: list[tuple[T, int]] = []
    used = split_used = 0
    for step in pending:
        if max_rows is not None and len(picked) >= max_rows:
            break
        want, splittable = demand(step)
        if splittable:
            room = max(budget, 1) if not picked else budget - used
            want = min(want, chunk - split_used, room)
            if fit is not None and want > 0:
                want = min(want, fit(step, want))
            if want <= 0:
                continue
            split_used += want
        elif picked and used + want > budget:
            break
        picked.append((step, want))
        used += want
    return picked
