"""How Kimi / DeepSeek-V3 checkpoints spell our parameters.

* A dense MLP is `mlp.` in released checkpoints and `block_sparse_moe.` when transformers
  re-saves a KimiLinear model (its rename of `block_sparse_moe` to `mlp` runs in reverse on every
  layer); either is accepted, as is `mlp.` for a Kimi MoE.
* `A_log` is [H] per KDA layer: transformers saves it [1, 1, H, 1], K3 pads it with zeros to the
  head dim; the first H values are the heads'.
* DeepSeek-V3 checkpoints carry the multi-token-prediction layer(s) after the last decoder
  layer (`model.layers.{num_hidden_layers}...`); they are not part of the target's forward."""
from __future__ import annotations

import re

import torch

_SWAPS = ((".mlp.", ".block_sparse_moe."), (".block_sparse_moe.", ".mlp."))


def checkpoint_name(name: str, files) -> str:
    if name in files:
        return name
    for a, b in _SWAPS:
        if a in name and name.replace(a, b) in files:
            return name.replace(a, b)
    return name


def adapt_tensor(name: str, t: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
    if name.endswith("A_log") and t.shape != p.shape and t.numel() >= p.numel():
        return t.reshape(-1)[:p.numel()].reshape(p.shape)
    return t


def ignored(cfg, name: str) -> bool:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return m is not None and int(m.group(1)) >= cfg.num_hidden_layers
