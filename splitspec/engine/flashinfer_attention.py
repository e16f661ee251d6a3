"""FlashInfer attention over the paged KV pool (CUDA only, `pip install splitspec[cuda]`).

The same ragged batch as `attention.py`, run by FlashInfer's
`BatchPrefillWithPagedKVCacheWrapper`: the pool's per-layer slot axis viewed as
[blocks, block_size, kv_heads, head_dim] is the NHD paged layout, a row's pages are its block
table, and each row's mask (the whole context, then causal or the tree's ancestor mask among
its new tokens) goes in as a custom mask, flattened query-major and concatenated over rows,
which FlashInfer packs to bits. One `plan` per forward serves every layer.

FlashInfer is imported only when this backend is chosen, so CPU installs never need it."""
from __future__ import annotations

import torch

from .attention import Row

WORKSPACE_BYTES = 128 * 1024 * 1024


class AttentionBackendError(RuntimeError):
    """The requested attention backend cannot run here."""


def require_flashinfer(device: torch.device, flag: str, error: type[Exception] = AttentionBackendError):
    """The `flashinfer` module, or `error` saying what `flag flashinfer` is missing here."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise error(f"{flag} flashinfer needs a CUDA device (use --device cuda on a GPU machine, or {flag} torch)")
    try:
        import flashinfer
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise error(f"{flag} flashinfer needs FlashInfer: pip install 'splitspec[cuda]'") from exc
    return flashinfer


def check_available(device: torch.device):
    return require_flashinfer(device, "--attention-backend")


class FlashInferPlan:
    """The FlashInfer side of one batch's AttentionPlan: planned once, run per layer."""

    _wrappers: dict = {}

    def __init__(self, rows: list[Row], *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, device: torch.device):
        flashinfer = check_available(device)
        wrapper = self._wrappers.get(device)
        if wrapper is None:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            wrapper = self._wrappers[device] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        qo, kv_indptr, indices, last, masks = [0], [0], [], [], []
        for row in rows:
            c, q = row.table.length, row.q_len
            pages = -(-(c + q) // block_size)
            indices += row.table.blocks[:pages]
            kv_indptr.append(kv_indptr[-1] + pages)
            last.append(c + q - (pages - 1) * block_size)
            qo.append(qo[-1] + q)
            inner = row.mask if row.mask is not None else torch.ones(q, q, dtype=torch.bool).tril()
            masks.append(torch.cat([torch.ones(q, c, dtype=torch.bool), inner.cpu()], dim=1).flatten())
        i32 = dict(dtype=torch.int32, device=device)
        wrapper.plan(torch.tensor(qo, **i32), torch.tensor(kv_indptr, **i32), torch.tensor(indices, **i32),
                     torch.tensor(last, **i32), num_qo_heads, num_kv_heads, head_dim, block_size,
                     custom_mask=torch.cat(masks).to(device), q_data_type=dtype, kv_data_type=dtype)
        self.wrapper, self.block_size = wrapper, block_size

    def run(self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D]; k_all / v_all one layer of the pool [slots, Hkv, D]."""
        shape = (-1, self.block_size, k_all.shape[1], k_all.shape[2])
        return self.wrapper.run(q, (k_all.view(shape), v_all.view(shape)))
