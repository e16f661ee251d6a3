"""Per-position acceptance bookkeeping, shared by the gateway's stats and the in-process loop
(torch-free, so the gateway does not import the engine)."""
from __future__ import annotations


def count_accepted(per_position: list[int], drafted: int, accepted: int) -> None:
    """Grow `per_position` to `drafted` entries and count one acceptance at each depth 1..accepted."""
    if len(per_position) < drafted:
        per_position.extend([0] * (drafted - len(per_position)))
    for k in range(accepted):
        per_position[k] += 1
