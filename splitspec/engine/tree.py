"""Draft token trees: `token_ids[N]` and `parents[N]` in topological order, parent -1
meaning a child of the last committed token (the implicit root). A chain is
`parents = [-1, 0, 1, ...]`. Row/column 0 of every tensor built here is the root."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Drafted nodes one proposal may hold (a verify of root + 64 tokens): past this a tree's extra
# nodes are accepted too rarely to pay for their rows in every batched forward.
MAX_DRAFT_NODES = 64


class TreeError(ValueError):
    """A draft tree is malformed; the message names the field and node."""


@dataclass(frozen=True)
class Tree:
    token_ids: tuple[int, ...]
    parents: tuple[int, ...]

    @classmethod
    def chain(cls, token_ids) -> "Tree":
        return cls(tuple(token_ids), tuple(range(-1, len(token_ids) - 1)))

    def __len__(self) -> int:
        return len(self.token_ids)

    def validate(self, vocab_size: int | None = None, max_nodes: int | None = None) -> "Tree":
        n = len(self.token_ids)
        if len(self.parents) != n:
            raise TreeError(f"tree.parents has {len(self.parents)} entries but tree.token_ids has {n}")
        if max_nodes is not None and n > max_nodes:
            raise TreeError(f"tree has {n} nodes, more than the limit of {max_nodes}")
        for i, p in enumerate(self.parents):
            # parent < i is what makes the order topological, and it also rules out cycles.
            if not -1 <= p < i:
                raise TreeError(f"tree.parents[{i}] = {p}: must be -1 or the index of an earlier "
                                f"node (0..{i - 1}); nodes must be in topological order")
        if vocab_size is not None:
            for i, t in enumerate(self.token_ids):
                if not 0 <= t < vocab_size:
                    raise TreeError(f"tree.token_ids[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
        return self

    def depths(self) -> list[int]:
        """Depth of each node; children of the root have depth 1."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 = root) in index order, which is the order they are tried."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def ancestor_mask(self) -> torch.Tensor:
        """Bool [N+1, N+1] over (root, nodes): each sees the root, its ancestors and itself."""
        n = len(self)
        m = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        m[:, 0] = True
        m[0, 0] = True
        for i, p in enumerate(self.parents):
            row = i + 1
            if p >= 0:
                m[row] = m[p + 1]
            m[row, row] = True
        return m

    def path_to(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]
