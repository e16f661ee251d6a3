"""Per-session recurrent state of a hybrid target's KDA layers, and what one forward leaves
pending for it.

`StatePool` holds one slot per running session: for each KDA layer the short-conv window (the
last K-1 conv inputs, [3·H·Dk, K-1]) and the delta-rule state ([H, Dk, Dv]), both fp32. A
session's `BlockTable` takes its slot on first use and gives it back when freed, next to its
KV blocks (`KVPool.states`).

A forward never writes a slot. Each KDA layer records what it computed (`StatePlan.pending`);
once the runner knows which tokens of a row stay (all of them for a prefill chunk or a decode
step, the accepted path for a verify), `StatePlan.commit` writes the state those tokens lead
to. A verify that keeps k of its w drafts so leaves every layer exactly as if only the kept
tokens had been fed, and a row that fails after the forward leaves its state untouched."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from splitspec.engine.kv_pool import PoolExhausted

ROLLBACKS = ("snapshot", "replay")


class StatePool:
    def __init__(self, *, num_layers: int, num_slots: int, conv_channels: int, conv_kernel: int,
                 heads: int, k_dim: int, v_dim: int, device="cpu"):
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.conv = torch.zeros(num_layers, num_slots, conv_channels, conv_kernel - 1, device=device)
        self.rec = torch.zeros(num_layers, num_slots, heads, k_dim, v_dim, device=device)
        self._free = list(range(num_slots - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def bytes_per_slot(self) -> int:
        return (self.conv[:, 0].nbytes + self.rec[:, 0].nbytes) if self.num_slots else 0

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        with self._lock:
            if not self._free:
                raise PoolExhausted(f"all {self.num_slots} recurrent-state slots are in use "
                                    f"(--max-running-requests sizes them)")
            slot = self._free.pop()
        # A new session starts from zero state, as a fresh model would.
        self.conv[:, slot].zero_()
        self.rec[:, slot].zero_()
        return slot

    def reserve(self, n: int) -> list[int]:
        """Take n slots out of circulation for good (the prefix cache's state checkpoints)."""
        with self._lock:
            if n > len(self._free):
                raise ValueError(f"{n} checkpoint slots asked of a state pool with {len(self._free)} free")
            out = self._free[:n]
            del self._free[:n]
            return out

    def copy(self, src: int, dst: int) -> None:
        """Slot dst takes slot src's state (a forked session continues from the same point)."""
        self.conv[:, dst].copy_(self.conv[:, src])
        self.rec[:, dst].copy_(self.rec[:, src])

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)


@dataclass
class StateRow:
    slot: int
    start: int                          # first flat token of the row in the batch
    q_len: int
    parents: list[int] | None = None    # a tree: parent of each token in the row (-1: the committed state)
    verify: bool = False                # keep per-token results: which tokens stay is known only later

    def parent(self, t: int) -> int:
        return t - 1 if self.parents is None else self.parents[t]


@dataclass
class StatePlan:
    """The rows of one forward as the KDA layers see them, and their pending results."""
    pool: StatePool
    rows: list[StateRow]
    rollback: str = "snapshot"
    pending: dict = field(default_factory=dict)     # kda layer index -> that layer's pending record
    layouts: dict = field(default_factory=dict)     # per-forward index layouts every KDA layer shares

    def __post_init__(self):
        if self.rollback not in ROLLBACKS:
            raise ValueError(f"rollback {self.rollback!r}: expected one of {ROLLBACKS}")
        self.slots = torch.tensor([r.slot for r in self.rows], dtype=torch.long, device=self.pool.rec.device)

    def commit(self, row: int, path: list[int]) -> None:
        """Row `row` keeps its tokens `path` (indices within the row, root first, each the parent
        of the next): write the state they lead to, in every KDA layer."""
        for layer, record in self.pending.items():
            record.commit(self.pool, layer, row, path)
        hook = getattr(self.pool, "on_commit", None)
        if hook is not None:        # a tensor-parallel rank 0 replays this commit on its workers
            hook(row, path)

    def pending_bytes(self) -> int:
        """Memory the forward's pending records hold until commit (what rollback costs)."""
        return sum(record.nbytes() for record in self.pending.values())
