"""Attention for a ragged batch over the paged KV pool, with torch SDPA.

A batch is a flat list of N new tokens: row r contributes `q_len` tokens that see the row's
`context` cached tokens plus, among themselves, a causal mask or a tree's ancestor mask. The
new tokens' K/V are written to their slots first (`slot_mapping`); then each group of rows
gathers its K/V through the block tables into a padded [rows, context + new] layout and runs
one SDPA with an explicit boolean mask (never SDPA's `is_causal`, which is aligned top-left
and wrong when the query is shorter than the keys).

Rows with similar query lengths share one padded group (decode steps together, verify trees
of one width together); a long row (a prefill chunk) gets a group of its own, so one long
prompt does not pad every decode row to its length."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .kv_pool import BlockTable

LONG_QUERY = 32     # rows with more new tokens than this attend in a group of their own


@dataclass
class Row:
    table: BlockTable                 # holds blocks for table.length + q_len tokens
    q_len: int
    mask: torch.Tensor | None = None  # [q_len, q_len] bool among the new tokens (True: attend); None: causal


@dataclass
class Group:
    q_index: torch.Tensor    # [R, Q] indices into the flat tokens; N (a zero row) for padding
    kv_index: torch.Tensor   # [R, C + Q] slots: context then the new tokens; 0 (the zero block) for padding
    mask: torch.Tensor       # [R, 1, Q, C + Q] bool
    valid: torch.Tensor      # [R, Q] which query cells are real tokens
    flat: torch.Tensor       # flat index of each real cell, in valid's row-major order
    # Shortcuts the plan finds once for every layer (each is also what the general path computes):
    in_order: bool = False   # the group is every flat token, in order, unpadded: no gather or scatter of q
    kv_start: int = -1       # >= 0: kv_index is the one contiguous range kv_start + arange(C + Q): a view, no gather
    no_mask: bool = False    # every cell of `mask` is True (one decode row): SDPA runs without one
    _masks: dict = field(default_factory=dict, repr=False, compare=False)

    def mask_for(self, rep: int) -> torch.Tensor | None:
        """The mask with each query row repeated `rep` times (grouped-query heads as extra query
        rows), built once per batch rather than once per layer; None when nothing is masked."""
        if self.no_mask:
            return None
        if rep not in self._masks:
            self._masks[rep] = self.mask if rep == 1 else self.mask.repeat(1, 1, rep, 1)
        return self._masks[rep]


@dataclass
class AttentionPlan:
    slot_mapping: torch.Tensor        # [N] where each new token's K/V is written
    groups: list[Group]
    flashinfer: object = None         # a FlashInferPlan when that backend runs the batch


def _group(rows: list[Row], starts: list[int], slots: list[torch.Tensor], n: int, device) -> Group:
    """slots[i]: row i's slots for its context and its new tokens."""
    if len(rows) == 1:
        return _one_row(rows[0], starts[0], slots[0], n, device)
    R = len(rows)
    Q = max(r.q_len for r in rows)
    C = max(r.table.length for r in rows)
    q_index = torch.full((R, Q), n, dtype=torch.long)
    kv_index = torch.zeros((R, C + Q), dtype=torch.long, device=device)
    inner = torch.ones(Q, Q, dtype=torch.bool).tril().repeat(R, 1, 1)
    ctx = torch.zeros(R, Q, C, dtype=torch.bool)
    for i, (row, start, row_slots) in enumerate(zip(rows, starts, slots)):
        c, q = row.table.length, row.q_len
        q_index[i, :q] = torch.arange(start, start + q)
        kv_index[i, :c] = row_slots[:c]
        kv_index[i, C:C + q] = row_slots[c:]
        if row.mask is not None:
            inner[i, :q, :q] = row.mask
        inner[i, :, q:] = False
        inner[i, q:] = False
        # Padding queries look at their own zero-block key only: finite, and thrown away.
        inner[i, range(q, Q), range(q, Q)] = True
        ctx[i, :q, :c] = True
    valid = q_index < n
    mask = torch.cat([ctx, inner], dim=2)[:, None]
    in_order = R * Q == n and bool(valid.all()) and starts == list(range(0, n, Q))
    return Group(q_index.to(device), kv_index, mask.to(device), valid.to(device), q_index[valid].to(device),
                 in_order=in_order)


def _one_row(row: Row, start: int, row_slots: torch.Tensor, n: int, device) -> Group:
    """The group of a row alone (one stream, a long prefill chunk): no padding, so no loops; and
    when its blocks are consecutive in the pool its K/V are read in place."""
    c, q = row.table.length, row.q_len
    q_index = torch.arange(start, start + q, device=device).view(1, q)
    inner = torch.ones(q, q, dtype=torch.bool).tril_() if row.mask is None else row.mask.cpu()
    mask = torch.cat([torch.ones(q, c, dtype=torch.bool), inner], dim=1).view(1, 1, q, c + q)
    bs = row.table.pool.block_size
    used = row.table.blocks[:-(-(c + q) // bs)]
    kv_start = used[0] * bs if used == list(range(used[0], used[0] + len(used))) else -1
    return Group(q_index, row_slots.view(1, c + q), mask.to(device), torch.ones(1, q, dtype=torch.bool, device=device),
                 q_index.view(q), in_order=start == 0 and q == n, kv_start=kv_start, no_mask=q == 1)


def plan_attention(rows: list[Row], device, *, groups: bool = True) -> AttentionPlan:
    """Slots and gather indices for `rows`, whose new tokens are laid out one row after another
    (groups=False: slots only, for a backend that reads the block tables itself)."""
    starts, n = [], 0
    for r in rows:
        starts.append(n)
        n += r.q_len
    slots = [r.table.slots(0, r.table.length + r.q_len) for r in rows]
    slot_mapping = torch.cat([s[r.table.length:] for r, s in zip(rows, slots)]) if rows \
        else torch.zeros(0, dtype=torch.long, device=device)
    if not groups:
        return AttentionPlan(slot_mapping.to(device), [])
    # Rows pad to the longest query of their group, so decode rows (1 query) must not share a
    # group with 8-token verify rows or a prompt chunk: bucket by query length (powers of two).
    buckets: dict[int, list[int]] = {}
    sets = []
    for i, r in enumerate(rows):
        if r.q_len > LONG_QUERY:
            sets.append([i])
        else:
            buckets.setdefault(1 << (r.q_len - 1).bit_length(), []).append(i)
    sets += buckets.values()
    return AttentionPlan(slot_mapping.to(device),
                         [_group([rows[i] for i in g], [starts[i] for i in g], [slots[i] for i in g], n, device)
                          for g in sets])


def paged_attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """q: [N, Hq, D]; k_all / v_all: one layer of the pool, [slots, Hkv, D], with this batch's
    new K/V already written. Returns [N, Hq, D]."""
    if plan.flashinfer is not None:
        return plan.flashinfer.run(q, k_all, v_all)
    N, Hq, D = q.shape
    Hkv = k_all.shape[1]
    rep = Hq // Hkv
    if len(plan.groups) == 1 and plan.groups[0].in_order:
        g = plan.groups[0]
        return _group_attention(q.reshape(g.q_index.shape + (Hq, D)), k_all, v_all, g, rep).reshape(N, Hq, D)
    out = q.new_empty(N, Hq, D)
    padded = torch.cat([q, q.new_zeros(1, Hq, D)])
    for g in plan.groups:
        R, Q = g.q_index.shape
        o = _group_attention(padded.index_select(0, g.q_index.view(-1)).view(R, Q, Hq, D), k_all, v_all, g, rep)
        out.index_copy_(0, g.flat, o[g.valid])
    return out


def _group_attention(qq: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, g: Group, rep: int) -> torch.Tensor:
    """qq [R, Q, Hq, D], the group's queries; returns [R, Q, Hq, D]."""
    R, Q, Hq, D = qq.shape
    Hkv = Hq // rep
    # Grouped-query attention without copying K/V per query head: the `rep` query heads of a
    # KV head become extra query rows of that head (query head h uses KV head h // rep).
    qq = qq.reshape(R, Q, Hkv, rep, D).permute(0, 2, 3, 1, 4).reshape(R, Hkv, rep * Q, D)
    K = g.kv_index.shape[1]
    if g.kv_start >= 0:
        kk, vv = (t.narrow(0, g.kv_start, K).view(1, K, Hkv, D).transpose(1, 2) for t in (k_all, v_all))
    else:
        # index_select copies whole rows; advanced indexing (t[idx]) is several times slower on CPU.
        kk, vv = (t.index_select(0, g.kv_index.view(-1)).view(R, K, Hkv, D).transpose(1, 2) for t in (k_all, v_all))
    o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=g.mask_for(rep))
    return o.view(R, Hkv, rep, Q, D).permute(0, 3, 1, 2, 4).reshape(R, Q, Hq, D)
