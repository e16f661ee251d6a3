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

from . import native
from .kv_pool import BlockTable

LONG_QUERY = 32     # rows with more new tokens than this attend in a group of their own (or of their exact shape)


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
    kv_stride: int = 0       # > 0 (with kv_start): row r's range starts kv_stride slots after row r-1's (a strided view)
    no_mask: bool = False    # every cell of `mask` is True (one decode row): SDPA runs without one
    causal: bool = False     # rows of one length, no context, no tree mask: `mask` is plain causal (SDPA's is_causal)
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
    # Batch-invariant mode: every token's attention as (first, end, keys, mask) calls that depend
    # on nothing else in the batch (see `exact_queries`); the plan then has no groups.
    exact: list[tuple[int, int, object, torch.Tensor | None]] = field(default_factory=list)
    # Slots of the rows whose blocks are not consecutive in the pool: each gathered once a layer
    # for all its calls (a call's keys (g, 0, n) read the first n of gather g).
    exact_gathers: list[torch.Tensor] = field(default_factory=list)
    # Batch-invariant mode with the native kernel (`kernel_keys`): the decode and verify tokens
    # attended by one call a layer; token kernel_tokens[i] reads the pool slots
    # key_slots[key_offsets[i]:key_offsets[i + 1]].
    kernel_tokens: torch.Tensor | None = None
    key_slots: torch.Tensor | None = None
    key_offsets: torch.Tensor | None = None

    def repeat_first_token(self) -> None:
        """The plan of a one-token forward run as two copies of that token (runner.py), both
        attended as the one would be and writing their K/V to its slot."""
        self.slot_mapping = self.slot_mapping.repeat(2)
        if self.kernel_tokens is not None:
            n = self.key_slots.numel()
            self.kernel_tokens = torch.arange(2, device=self.kernel_tokens.device)
            self.key_slots = self.key_slots.repeat(2)
            self.key_offsets = torch.tensor([0, n, 2 * n], device=self.key_offsets.device)
        else:
            self.exact.append((1, 2, *self.exact[0][2:]))


def exact_queries(row: Row, start: int, gathers: list) -> list[tuple[int, int, object, torch.Tensor | None]]:
    """Batch-invariant attention for one row, as (first, end) flat tokens, their keys and a mask:
    every token is computed by a call that depends only on its own position and keys, never on
    what else shares its forward, so a token's bits are the same decoded alone, verified in a
    tree, decoded among other sessions, or prefilled in any chunking (a prefix-cache hit resumes
    mid-prompt). Padding a key list with masked keys changes SDPA's reduction order in its last
    block (measured: 31 of 192 bf16 rows differ in some bit from the exact call), and a bit
    flips a near-tied argmax.

    * A verify row (a tree mask): each node alone, over the context then its ancestors in
      position order: the keys a target-only decode of that token attends.
    * A decode or prefill row (causal): its tokens in spans of one KV block aligned to absolute
      positions (where prefix-cache hits resume), each span one call over keys [0, span end)
      with the causal mask among its queries; a decode token is a span of one, unmasked.

    Keys are (source, first slot, length): the pool itself (source -1) where the row's blocks
    are consecutive, else the row's slots gathered once a layer (source g, appended to
    `gathers`); a tree node whose ancestors are not the tokens right before it gathers its own
    slots (a tensor)."""
    c, q = row.table.length, row.q_len
    bs = span = row.table.pool.block_size
    used = row.table.blocks[:-(-(c + q) // bs)]
    if used == list(range(used[0], used[0] + len(used))):
        src, base = -1, used[0] * bs
    else:
        src, base = len(gathers), 0
        gathers.append(row.table.slots(0, c + q))

    out = []
    if row.mask is not None:
        mask = row.mask.cpu()
        slots = None
        for i in range(q):
            if bool(mask[i, :i + 1].all()) and not bool(mask[i, i + 1:].any()):
                # Its ancestors are the i tokens before it (a chain, a tree's first branch): the
                # keys are a prefix of the row's, read in place.
                out.append((start + i, start + i + 1, (src, base, c + i + 1), None))
                continue
            if slots is None:
                slots = row.table.slots(0, c + q)
            out.append((start + i, start + i + 1, torch.cat([slots[:c], slots[c:c + q][mask[i]]]), None))
        return out
    a = c
    while a < c + q:
        b = min((a // span + 1) * span, c + q)
        causal = None
        if b - a > 1:
            causal = torch.arange(b)[None, :] <= torch.arange(a, b)[:, None]
        out.append((start + a - c, start + b - c, (src, base, b), causal))
        a = b
    return out


def kernel_keys(row: Row, start: int) -> list[tuple[int, torch.Tensor]]:
    """(flat token, its key slots) for each new token of a decode or verify row, for the native
    kernel that attends every such token of a forward in one call (csrc/exact_attention.cpp):
    a decode token reads its context and itself, a tree node its context then its ancestors and
    itself, in position order: the keys a target-only decode of that token attends. The kernel
    reduces each token over its own keys in one fixed order, so these are the only inputs that
    decide its bits."""
    c, q = row.table.length, row.q_len
    slots = row.table.slots(0, c + q)
    if row.mask is None:
        return [(start + i, slots[:c + i + 1]) for i in range(q)]
    mask = row.mask.cpu()
    out = []
    for i in range(q):
        chain = bool(mask[i, :i + 1].all()) and not bool(mask[i, i + 1:].any())
        out.append((start + i, slots[:c + i + 1] if chain else torch.cat([slots[:c], slots[c:c + q][mask[i]]])))
    return out


def _kernel_plan(keys: list[tuple[int, torch.Tensor]], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = torch.tensor([t for t, _ in keys], dtype=torch.long)
    lengths = torch.tensor([0] + [k.numel() for _, k in keys], dtype=torch.long)
    return tokens.to(device), torch.cat([k for _, k in keys]).to(device), lengths.cumsum(0).to(device)


def _block_matrix(rows: list[Row]) -> torch.Tensor:
    """[R, max blocks] block ids of each row, padded with 0 (the zero block)."""
    width = max(len(r.table.blocks) for r in rows)
    return torch.tensor([r.table.blocks + [0] * (width - len(r.table.blocks)) for r in rows], dtype=torch.long)


def _slots_of(blocks: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, bs: int) -> torch.Tensor:
    """Slot of token index tokens[i, j] of row i (0 where not valid)."""
    col = (tokens // bs).clamp(max=blocks.shape[1] - 1)
    return torch.where(valid, blocks.gather(1, col) * bs + tokens % bs, 0)


def _group(rows: list[Row], starts: list[int], n: int, device) -> Group:
    """The rows' queries padded to the longest, their keys (context then new tokens) padded to the
    longest context, built with tensor ops over all rows at once (a per-row loop cost more than
    the attention itself at 32+ decode rows)."""
    if len(rows) == 1:
        row = rows[0]
        return _one_row(row, starts[0], row.table.slots(0, row.table.length + row.q_len), n, device)
    R = len(rows)
    c = torch.tensor([r.table.length for r in rows])
    q = torch.tensor([r.q_len for r in rows])
    Q, C = int(q.max()), int(c.max())
    qpos, cpos = torch.arange(Q), torch.arange(C)
    qvalid = qpos < q[:, None]                                          # [R, Q]
    q_index = torch.where(qvalid, torch.tensor(starts)[:, None] + qpos, n)
    tokens = torch.cat([cpos.expand(R, C), c[:, None] + qpos], 1)       # [R, C + Q] token index of each key
    kvalid = torch.cat([cpos < c[:, None], qvalid], 1)
    kv_index = _slots_of(_block_matrix(rows), tokens, kvalid, rows[0].table.pool.block_size)
    ctx = qvalid[:, :, None] & (cpos < c[:, None])[:, None, :]
    inner = torch.ones(Q, Q, dtype=torch.bool).tril() & qvalid[:, :, None] & qvalid[:, None, :]
    for i, row in enumerate(rows):
        if row.mask is not None:
            inner[i, :row.q_len, :row.q_len] = row.mask.cpu()
    # Padding queries look at their own zero-block key only: finite, and thrown away.
    inner |= torch.eye(Q, dtype=torch.bool) & ~qvalid[:, :, None]
    mask = torch.cat([ctx, inner], dim=2)[:, None]
    valid = q_index < n
    in_order = R * Q == n and bool(valid.all()) and starts == list(range(0, n, Q))
    kv_start, kv_stride = _strided(rows, C + Q)
    causal = C == 0 and Q > 1 and bool(qvalid.all()) and all(r.mask is None for r in rows)
    return Group(q_index.to(device), kv_index.to(device), mask.to(device), valid.to(device), q_index[valid].to(device),
                 in_order=in_order, kv_start=kv_start, kv_stride=kv_stride, no_mask=bool(mask.all()), causal=causal)


def _strided(rows: list[Row], K: int) -> tuple[int, int]:
    """(start, stride) when rows of one length, each on consecutive blocks, start at evenly spaced
    slots (sequences that took their blocks together, as the trainer's lockstep batches do): their
    K/V are then one strided view of the pool. (-1, 0) otherwise."""
    if any(r.table.length + r.q_len != K for r in rows):
        return -1, 0
    bs = rows[0].table.pool.block_size
    nb = -(-K // bs)
    starts = []
    for r in rows:
        used = r.table.blocks[:nb]
        if used != list(range(used[0], used[0] + nb)):
            return -1, 0
        starts.append(used[0] * bs)
    stride = starts[1] - starts[0]
    if stride < K or any(b - a != stride for a, b in zip(starts, starts[1:])):
        return -1, 0
    return starts[0], stride


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
                 q_index.view(q), in_order=start == 0 and q == n, kv_start=kv_start, no_mask=q == 1,
                 causal=c == 0 and row.mask is None and q > 1)


def plan_attention(rows: list[Row], device, *, groups: bool = True, exact: bool = False,
                   kernel: bool | None = None) -> AttentionPlan:
    """Slots and gather indices for `rows`, whose new tokens are laid out one row after another
    (groups=False: slots only, for a backend that reads the block tables itself). exact: every
    row attends batch-invariantly: decode and verify rows through the native kernel in one call
    a layer (`kernel_keys`) where it is built (kernel=None: wherever it loads on this CPU), the
    rest as per-span SDPA calls (`exact_queries`)."""
    starts, n = [], 0
    for r in rows:
        starts.append(n)
        n += r.q_len
    if rows:
        # Each new token's slot, rows one after another (valid cells in row-major order).
        c = torch.tensor([r.table.length for r in rows])
        qvalid = torch.arange(max(r.q_len for r in rows)) < torch.tensor([r.q_len for r in rows])[:, None]
        slots = _slots_of(_block_matrix(rows), c[:, None] + torch.arange(qvalid.shape[1]), qvalid,
                          rows[0].table.pool.block_size)
        slot_mapping = slots[qvalid]
    else:
        slot_mapping = torch.zeros(0, dtype=torch.long)
    if not groups:
        return AttentionPlan(slot_mapping.to(device), [])
    if exact:
        if kernel is None:
            kernel = torch.device(device).type == "cpu" and exact_kernel() is not None
        gathers: list[torch.Tensor] = []
        calls, keys = [], []
        for i, r in enumerate(rows):
            if kernel and (r.mask is not None or r.q_len == 1):
                keys += kernel_keys(r, starts[i])
            else:
                calls += exact_queries(r, starts[i], gathers)
        plan = AttentionPlan(slot_mapping.to(device), [],
                             exact=[(t0, t1, k if isinstance(k, tuple) else k.to(device),
                                     None if m is None else m.to(device)) for t0, t1, k, m in calls],
                             exact_gathers=[g.to(device) for g in gathers])
        if keys:
            plan.kernel_tokens, plan.key_slots, plan.key_offsets = _kernel_plan(keys, device)
        return plan
    # Rows pad to the longest query of their group, so decode rows (1 query) must not share a
    # group with 8-token verify rows or a prompt chunk: bucket by query length (powers of two).
    buckets: dict[int, list[int]] = {}
    # Long rows group only with rows of exactly their shape (nothing padded): the trainer's lockstep
    # batches then run as one SDPA call per layer, not one per sequence.
    long: dict[tuple[int, int], list[int]] = {}
    sets = []
    for i, r in enumerate(rows):
        if r.q_len > LONG_QUERY:
            long.setdefault((r.q_len, r.table.length), []).append(i)
        else:
            buckets.setdefault(1 << (r.q_len - 1).bit_length(), []).append(i)
    sets += list(long.values()) + list(buckets.values())
    return AttentionPlan(slot_mapping.to(device),
                         [_group([rows[i] for i in g], [starts[i] for i in g], n, device) for g in sets])


def paged_attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """q: [N, Hq, D]; k_all / v_all: one layer of the pool, [slots, Hkv, D], with this batch's
    new K/V already written. Returns [N, Hq, D]."""
    if plan.flashinfer is not None:
        return plan.flashinfer.run(q, k_all, v_all)
    N, Hq, D = q.shape
    Hkv = k_all.shape[1]
    rep = Hq // Hkv
    if plan.exact or plan.kernel_tokens is not None:
        out = q.new_empty(N, Hq, v_all.shape[-1])
        if plan.kernel_tokens is not None:
            _kernel_attention(q, k_all, v_all, plan, out)
        return _exact_attention(q, k_all, v_all, plan, out)
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


def exact_kernel():
    """The native batch-invariant attention (csrc/exact_attention.cpp), or None where it is not built."""
    module = native.load("exact_attention")
    return None if module is None else module.exact_attention


def _kernel_attention(q, k_all, v_all, plan: AttentionPlan, out) -> None:
    tokens = plan.kernel_tokens
    whole = tokens.numel() == q.shape[0]        # every token of the forward (decode and verify only)
    qq = q if whole else q.index_select(0, tokens)
    with torch.profiler.record_function("exact_attention"):     # named in bench-forward profile
        o = exact_kernel()(qq, k_all, v_all, plan.key_slots, plan.key_offsets, q.shape[-1] ** -0.5)
    if whole:
        out.copy_(o)
    else:
        out.index_copy_(0, tokens, o)


def _exact_attention(q, k_all, v_all, plan: AttentionPlan, out):
    """The calls of `exact_queries`: each the same SDPA, on the same values, wherever its tokens
    sit in the batch (a decode token's call is the call a verify makes for that token). Keys are
    read in place or from their row's gathered slots: contiguous [keys, Hkv, D] either way, so the
    kernel sees the same layout."""
    Hq, D = q.shape[1:]
    Hkv = k_all.shape[1]
    rep = Hq // Hkv
    pool = (k_all.transpose(0, 1), v_all.transpose(0, 1))          # [Hkv, slots, D] views
    gathered, held = None, -1
    for t0, t1, keys, mask in plan.exact:
        if isinstance(keys, tuple):
            src, first, n_keys = keys
            if src >= 0 and src != held:
                # A row's slots are gathered once for all its calls (a verify's nodes, a prompt's
                # spans) and dropped at the next row's. A first version that gathered every row's
                # blocks up front, held for the whole layer, made a step of 16 sessions at 2,000
                # tokens 2.7x slower.
                slots = plan.exact_gathers[src]
                gathered, held = tuple(x.index_select(0, slots).transpose(0, 1) for x in (k_all, v_all)), src
            kT, vT = pool if src < 0 else gathered
            kk, vv = kT.narrow(1, first, n_keys), vT.narrow(1, first, n_keys)
        else:
            kk, vv = (x.index_select(0, keys).transpose(0, 1) for x in (k_all, v_all))
        n = t1 - t0
        # Query heads sharing a KV head become extra query rows of it (rep-major), as in groups.
        qq = q[t0:t1].view(n, Hkv, rep, D).permute(1, 2, 0, 3).reshape(1, Hkv, rep * n, D)
        m = None if mask is None else mask.repeat(rep, 1)
        o = F.scaled_dot_product_attention(qq, kk[None], vv[None], attn_mask=m)
        out[t0:t1] = o.view(Hkv, rep, n, D).permute(2, 0, 1, 3).reshape(n, Hq, D)
    return out


def _group_attention(qq: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, g: Group, rep: int) -> torch.Tensor:
    """qq [R, Q, Hq, D], the group's queries; returns [R, Q, Hq, D]."""
    R, Q, Hq, D = qq.shape
    Hkv = Hq // rep
    K = g.kv_index.shape[1]
    if g.kv_stride and k_all.is_contiguous() and v_all.is_contiguous():
        kk, vv = (t.as_strided((R, K, Hkv, t.shape[-1]), (g.kv_stride * t.stride(0), t.stride(0), t.stride(1), 1),
                               t.storage_offset() + g.kv_start * t.stride(0)).transpose(1, 2) for t in (k_all, v_all))
    elif g.kv_start >= 0 and not g.kv_stride:
        kk, vv = (t.narrow(0, g.kv_start, K).view(1, K, Hkv, D).transpose(1, 2) for t in (k_all, v_all))
    else:
        # index_select copies whole rows; advanced indexing (t[idx]) is several times slower on CPU.
        kk, vv = (t.index_select(0, g.kv_index.view(-1)).view(R, K, Hkv, D).transpose(1, 2) for t in (k_all, v_all))
    if g.causal:
        # Whole sequences from position 0 (a first prefill chunk, the trainer's feature pass):
        # SDPA's causal kernel, 1.5-1.8x the masked one on this CPU, query heads grouped in it.
        o = F.scaled_dot_product_attention(qq.transpose(1, 2), kk, vv, is_causal=True, enable_gqa=rep > 1)
        return o.transpose(1, 2)
    # Grouped-query attention without copying K/V per query head: the `rep` query heads of a
    # KV head become extra query rows of that head (query head h uses KV head h // rep).
    qq = qq.reshape(R, Q, Hkv, rep, D).permute(0, 2, 3, 1, 4).reshape(R, Hkv, rep * Q, D)
    o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=g.mask_for(rep))
    return o.view(R, Hkv, rep, Q, D).permute(0, 3, 1, 2, 4).reshape(R, Q, Hq, D)
