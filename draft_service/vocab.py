"""A reduced draft vocabulary: the draft's head scores only a kept subset of the target's tokens
(EAGLE-3's `d2t` / `t2d`, FR-Spec, SpecForge), while every token it proposes and every q it sends
stays in the target's vocabulary, so verification is unchanged.

The map is stored as EAGLE-3 stores it: `d2t` [K] int64, one entry per draft id d, an *offset*:
the target id of draft id d is `d + d2t[d]`. Draft ids follow the target ids in increasing order
(the kept set sorted), so the offsets never decrease and a map is one well-defined tensor per kept
set; a map whose target ids are not strictly increasing is refused rather than sorted, because its
draft ids would no longer name the rows the head was trained with. `t2d` (bool [V], True for kept
target ids) is derived, never stored.

The kept set comes from the target's own outputs: the tokens it produces as argmax (its greedy
continuations), ranked by count, the smallest prefix of that ranking holding a given share of
them (`kept_by_coverage`)."""
from __future__ import annotations

from pathlib import Path

import torch

from splitspec.models.config import ConfigError

D2T = "d2t"                       # the tensor's name in model.safetensors (EAGLE-3's buffer name)
SIZE_FIELD = "draft_vocab_size"   # the config.json field (EAGLE-3's name): rows of the draft's head


def target_ids_of(d2t: torch.Tensor) -> torch.Tensor:
    """Target id of every draft id: d + d2t[d]."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t.long()


def d2t_of(target_ids: torch.Tensor) -> torch.Tensor:
    """The offsets d2t for kept target ids given in draft-id order."""
    return target_ids.long() - torch.arange(target_ids.shape[0], device=target_ids.device)


def check_d2t(d2t: torch.Tensor, target_vocab: int, head_size: int | None, where: str) -> torch.Tensor:
    """The kept target ids of a stored d2t, or a ConfigError naming `where` (the file) and the field.
    head_size: the draft's head rows (config.json's draft_vocab_size), which d2t must match."""
    field = f"{where}: tensor {D2T!r}"
    if d2t.dim() != 1 or d2t.dtype.is_floating_point or d2t.dtype == torch.bool or d2t.numel() == 0:
        raise ConfigError(f"{field} must be a non-empty 1-D integer tensor; got {d2t.dtype} of shape {list(d2t.shape)}")
    if head_size is not None and d2t.shape[0] != head_size:
        raise ConfigError(f"{field} has {d2t.shape[0]} entries but config.json's {SIZE_FIELD} is {head_size} "
                          f"(one entry per row of the draft's head)")
    ids = target_ids_of(d2t)
    bad = ((ids < 0) | (ids >= target_vocab)).nonzero()
    if len(bad):
        d = int(bad[0])
        raise ConfigError(f"{field} maps draft id {d} to target id {int(ids[d])}, outside the target's "
                          f"vocabulary 0..{target_vocab - 1}: a map made for another target")
    ordered = ids.sort().values
    repeats = (ordered.diff() == 0).nonzero()
    if len(repeats):
        dup = int(ordered[int(repeats[0])])
        raise ConfigError(f"{field} maps two draft ids to target id {dup}; each kept token must appear once")
    step = ids.diff()
    if len(step) and bool((step <= 0).any()):
        d = int((step <= 0).nonzero()[0]) + 1
        raise ConfigError(f"{field}: target ids must increase with the draft id (draft id {d} maps to "
                          f"{int(ids[d])}, after {int(ids[d - 1])})")
    return ids


def t2d_mask(target_ids: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """t2d: bool [V], True for the kept target ids."""
    mask = torch.zeros(target_vocab, dtype=torch.bool, device=target_ids.device)
    mask[target_ids] = True
    return mask


def t2d_index(target_ids: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """Draft id of every target id, -1 where the token is not kept: long [V]."""
    index = torch.full((target_vocab,), -1, dtype=torch.long, device=target_ids.device)
    index[target_ids] = torch.arange(target_ids.shape[0], device=target_ids.device)
    return index


def kept_by_coverage(counts: torch.Tensor, coverage: float, *, max_size: int | None = None,
                     min_size: int = 0, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The smallest set of target ids whose counts hold at least `coverage` of the total (the most
    counted first), grown to `min_size` and capped at `max_size`, plus `always` (ids the draft must
    be able to propose however rarely they were counted); sorted ascending. Ties, never-counted
    tokens included, go to the lower id: in a BPE vocabulary the earlier merge, the more frequent
    token in the tokenizer's own corpus. A small sample's smallest set fits that sample; `min_size`
    fills the head's budget with the next most likely tokens instead."""
    if not 0 < coverage <= 1:
        raise ValueError(f"coverage {coverage} must be in (0, 1]")
    total = float(counts.sum())
    if total <= 0:
        raise ValueError("no tokens were counted")
    values, order = counts.double().sort(descending=True, stable=True)
    held = values.cumsum(0) / total
    n = max(min(int((held < coverage - 1e-12).sum()) + 1, int((values > 0).sum())), min_size)
    chosen = order[:n].tolist()
    extra = sorted(set(always) - set(chosen))
    if max_size is not None:
        chosen = chosen[:max(max_size - len(extra), 0)]
    kept = set(chosen) | set(always)
    return torch.tensor(sorted(kept), dtype=torch.long)


def coverage_of(counts: torch.Tensor, target_ids: torch.Tensor) -> float:
    """Share of the counted tokens that the kept set holds."""
    return float(counts[target_ids].sum()) / max(float(counts.sum()), 1.0)


def top_k_coverage(counts: torch.Tensor, sizes) -> dict[int, float]:
    """Coverage of the K most counted tokens, for each K in sizes."""
    values = counts.double().sort(descending=True).values
    total = max(float(values.sum()), 1.0)
    return {int(k): float(values[:k].sum()) / total for k in sizes}


def save_vocab(path: str | Path, target_ids: torch.Tensor, counts: torch.Tensor, metadata: dict[str, str]) -> None:
    """A map file (`splitspec draft-vocab`, or a trainer's run folder): d2t, and the counts it was
    chosen from, so coverage can be recomputed."""
    from safetensors.torch import save_file
    save_file({D2T: d2t_of(target_ids).contiguous(), "counts": counts.long().contiguous()}, str(path),
              metadata={k: str(v) for k, v in metadata.items()})


def load_vocab(path: str | Path, target_vocab: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(kept target ids, counts or None) of a map file, checked against the target's vocabulary."""
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        if D2T not in names:
            raise ConfigError(f"{path}: tensor {D2T!r} is missing")
        d2t = f.get_tensor(D2T)
        counts = f.get_tensor("counts") if "counts" in names else None
    return check_d2t(d2t, target_vocab, None, str(path)), counts
