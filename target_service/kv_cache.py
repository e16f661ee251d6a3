"""Per-sequence KV cache: preallocated, appended to by the forward pass, rolled back by
`truncate`, and compacted by `keep` after a tree verification so that only the accepted
path stays, contiguous, in place."""
from __future__ import annotations

import torch

from .config import ModelConfig


class CacheFullError(ValueError):
    """The sequence would grow past the cache's preallocated max length."""


class KVCache:
    def __init__(self, cfg: ModelConfig, max_len: int, *, batch: int = 1,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if max_len <= 0:
            raise ValueError(f"max_len must be positive, got {max_len}")
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0

    @staticmethod
    def bytes_needed(cfg: ModelConfig, max_len: int, dtype: torch.dtype, batch: int = 1) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * max_len * cfg.head_dim * elem

    @property
    def nbytes(self) -> int:
        """Memory held by this cache (preallocated, not just the used part)."""
        return self.k.numel() * self.k.element_size() * 2

    @property
    def used_bytes(self) -> int:
        return self.nbytes * self.length // self.max_len

    def fork(self, batch: int) -> "KVCache":
        """A batch-`batch` cache whose every row holds this batch-1 cache's prefix (to branch one
        context into several continuations)."""
        if self.k.shape[1] != 1:
            raise ValueError(f"fork needs a batch-1 cache, this one holds {self.k.shape[1]} rows")
        out = KVCache.__new__(KVCache)
        out.max_len, out.length = self.max_len, self.length
        out.k, out.v = (t.expand(-1, batch, -1, -1, -1).clone() for t in (self.k, self.v))
        return out

    def reserve(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise CacheFullError(
                f"sequence length {self.length + n} exceeds the KV cache max length {self.max_len}")

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' K/V (after `length`) and return all K/V up to them.
        The length only moves on `advance`, once every layer has written."""
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int) -> None:
        self.reserve(n)
        self.length += n

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"truncate({n}) outside the cached length 0..{self.length}")
        self.length = n

    def keep(self, start: int, offsets: list[int]) -> None:
        """Keep entries `start + offsets[j]` as `start + j` and drop everything after.

        `offsets` must be strictly increasing (a tree path in topological order), so each
        entry moves down or stays; the gather copies before the write, so overlap is safe.
        """
        if any(b <= a for a, b in zip(offsets, offsets[1:])) or (offsets and offsets[0] < 0):
            raise ValueError(f"keep offsets must be strictly increasing and >= 0, got {offsets}")
        if not 0 <= start <= self.length:
            raise ValueError(f"keep start {start} outside the cached length 0..{self.length}")
        if offsets and start + offsets[-1] >= self.length:
            raise ValueError(f"keep offset {offsets[-1]} beyond the cached length {self.length} "
                             f"(start {start})")
        if offsets and offsets != list(range(len(offsets))):
            idx = torch.tensor(offsets, device=self.k.device) + start
            n = len(offsets)
            self.k[:, :, :, start:start + n] = self.k[:, :, :, idx]
            self.v[:, :, :, start:start + n] = self.v[:, :, :, idx]
        self.length = start + len(offsets)
