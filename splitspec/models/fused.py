"""One matmul where the checkpoint has several: q/k/v and gate/up projections fused for the
serving forward, in the layout this CPU multiplies fastest.

A step of a small model is dominated by per-operator cost, and x @ W with W stored [in, out]
runs 1.3-1.6x faster than `F.linear` over the checkpoint's [out, in] at one to eight rows on
this machine's BLAS (docs/benchmarks.md, "Fast steps"). So the serving forward keeps each
group of projections as one contiguous [in, sum(out)] matrix, and the original parameters
become transposed views into it: memory is not doubled, `state_dict()` and the checkpoint
names are unchanged, and an in-place write to a parameter is a write to the fused matrix. A
parameter whose storage was replaced (`.data = ...`, `.to(...)`) no longer points into the
fused matrix; the next call sees that and fuses again."""
from __future__ import annotations

import torch
from torch import nn


def _pointers(linears: list[nn.Linear]) -> tuple:
    return tuple((m.weight.data_ptr(), None if m.bias is None else m.bias.data_ptr()) for m in linears)


def fused(owner: nn.Module, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [in, sum(out)], bias [sum(out)] or None) of `owner`'s linears `names`, in that
    order; built on first use and whenever a parameter stopped pointing into it."""
    return _fuse(owner, [getattr(owner, n) for n in names])


def transposed(linear: nn.Linear) -> torch.Tensor:
    """One linear's weight stored [in, out] (its parameter becomes a view): `F.linear` then
    multiplies in the faster layout with no other change."""
    return _fuse(linear, [linear])[0]


def _fuse(holder: nn.Module, linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused matrix of `linears`, cached on `holder` under the parameters' pointers."""
    cache = holder.__dict__.get("_fused_cache")
    if cache is not None and cache[0] == _pointers(linears):
        return cache[1], cache[2]
    # Parameters must stay ordinary tensors (a serving forward runs under inference_mode) and
    # their autograd flags must not change.
    with torch.inference_mode(False), torch.no_grad():
        weight = torch.cat([m.weight.detach().t() for m in linears], dim=1).contiguous()
        bias = None
        if any(m.bias is not None for m in linears):
            bias = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                              for m in linears])
        at = 0
        for m in linears:
            out = m.out_features
            m.weight.data = weight[:, at:at + out].t()
            if m.bias is not None:
                m.bias.data = bias[at:at + out]
            at += out
    holder.__dict__["_fused_cache"] = (_pointers(linears), weight, bias)
    return weight, bias
