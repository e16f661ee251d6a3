"""How one target session uses the prefix cache (splitspec/engine/prefix_cache.py): the
scheduler asks `reuse` before each prefill chunk, and calls `publish` after every step.

A hit is taken only where the session can go on exactly as if it had computed it:
- at most up to the prompt's last full block before its last token (the token whose logits
  sample b0 is always computed);
- for a recurrent (KDA) target, only up to a block after which a state checkpoint exists, whose
  copy becomes the session's own state (so its exact rollback works on its own slot);
- for a session whose drafter reads the prompt's tap rows (`hidden_layers`), only where every
  row the Open must return was stored with the cached blocks, by a session with the same taps.
  The drafter thus gets the very rows it would have got without the cache, never fewer.
- never for a request that wants prompt log-probs (they need logits of every prompt row).

A batch-invariant target publishes only the blocks its prefills wrote (`Track.prefill_only`):
their bits are what any block-aligned prefill of those tokens computes, so a later turn's
output does not depend on what the cache held."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitspec.engine.prefix_cache import block_keys, namespace_key

from target_service.runner import Sequence


@dataclass
class Track:
    root: bytes                      # the namespace: model + cache_salt
    keys: list[bytes]                # chained keys of the sequence's full blocks, as far as known
    need_from: int                   # first prompt position whose tap rows the Open returns
    needs_rows: bool = True          # the caller reads tap rows (a session computing them only to store them does not)
    published: int = 0               # leading blocks of the table already in the cache (published or adopted)
    cached_tokens: int = 0           # prompt tokens taken from the cache
    feat_from: int = 0               # position of the first buffered tap row
    feats: list = field(default_factory=list)     # tap rows of positions [feat_from, table.length)
    rows_missing: bool = False       # a hit was cut short because cached blocks lacked this session's tap rows
    # Publish only blocks a prefill wrote (batch-invariant targets): a decode or verify computes
    # a token's K/V in another call than a prefill span does, so a later prompt taking those
    # blocks would not be computing what a fresh prefill of the same tokens computes.
    prefill_only: bool = False

    @property
    def buffered(self) -> int:
        return sum(f.shape[0] for f in self.feats)


def track(pool, seq: Sequence, *, model_id: str, salt: str, hidden_last: int, needs_rows: bool = True,
          prefill_only: bool = False) -> Track | None:
    if pool.cache is None:
        return None
    n = len(seq.prompt)
    root = namespace_key(model_id, salt)
    return Track(root, block_keys(root, seq.prompt, pool.block_size),
                 need_from=0 if hidden_last <= 0 else max(0, n - hidden_last), needs_rows=needs_rows,
                 prefill_only=prefill_only)


def _tap(seq: Sequence):
    return (seq.hidden_layers, seq.hidden_stream)


def hit_limit(pool, seq: Sequence) -> int:
    """Blocks of the prompt a hit may cover: all full ones before the last token."""
    return (len(seq.prompt) - 1) // pool.block_size


def next_key(pool, seq: Sequence, tr: Track | None) -> bytes | None:
    """The key of the block this session's next prefill chunk computes first, when that chunk
    starts on a block boundary and could publish it (two sessions computing the same block in
    one forward would compute it twice: the second waits a forward and hits instead)."""
    if tr is None or seq.params.prompt_logprobs is not None:
        return None
    k, bs = seq.prefilled // pool.block_size, pool.block_size
    if seq.prefilled % bs or k >= hit_limit(pool, seq):
        return None
    return tr.keys[k]


def prefill_stop(pool, seq: Sequence, tr: Track | None) -> int:
    """Where the next prefill chunk must end at the latest: for a recurrent target, on the
    prompt's last full block before its last token, so a state checkpoint can be taken there."""
    end = len(seq.prompt)
    if tr is None or pool.states is None:
        return end
    last = hit_limit(pool, seq) * pool.block_size
    return last if seq.prefilled < last else end


def reuse(pool, seq: Sequence, tr: Track | None) -> tuple[int, list[torch.Tensor], bool]:
    """Take the cached blocks that continue this session's prefill. Returns (tokens taken, tap
    rows to append to the Open's features, drop): with drop, the rows gathered so far end
    before the first row the Open returns and must go first (they would leave a gap)."""
    if tr is None or seq.params.prompt_logprobs is not None:
        return 0, [], False
    table, bs, cache = seq.table, pool.block_size, pool.cache
    k0 = len(table.blocks)
    if seq.prefilled != k0 * bs or table.length != seq.prefilled:
        return 0, [], False
    with pool.lock:
        found = cache.longest(tr.keys, k0, hit_limit(pool, seq))
        k = k0 + len(found)
        while k > k0 and not _resumable(pool, seq, tr, found, k0, k):
            k -= 1
        if k == k0:
            return 0, [], False
        blocks = found[:k - k0]
        rows = [cache.features_of(found[j - k0], _tap(seq)) for j in _row_blocks(seq, tr, bs, k0, k)]
        cache.share(blocks)
        slot = cache.checkpoint(tr.keys[k - 1]) if pool.states is not None else None
    table.adopt(blocks)
    if pool.states is not None:
        table.ensure(table.length)          # the session's own state slot, taken on first use
        pool.states.copy(slot, table.state)
    seq.prefilled = table.length
    tr.published = k
    tr.cached_tokens += (k - k0) * bs
    tr.feats, tr.feat_from = [], table.length
    return (k - k0) * bs, rows, tr.needs_rows and tr.need_from // bs > k0


def _row_blocks(seq, tr, bs: int, k0: int, k: int) -> range:
    """The blocks of a hit over [k0, k) whose tap rows the Open must return."""
    if not tr.needs_rows or not seq.hidden_layers:
        return range(0)
    return range(max(k0, tr.need_from // bs), k)


def _resumable(pool, seq, tr, found, k0: int, k: int) -> bool:
    """Whether the session could go on exactly after a hit ending with block k: a state
    checkpoint there (recurrent targets) and every tap row the Open returns stored."""
    cache = pool.cache
    if pool.states is not None and cache.checkpoint(tr.keys[k - 1]) is None:
        return False
    if all(cache.has_features(found[j - k0], _tap(seq)) for j in _row_blocks(seq, tr, pool.block_size, k0, k)):
        return True
    tr.rows_missing = True
    return False


def publish(pool, seq: Sequence, tr: Track | None, old_len: int, hidden: torch.Tensor | None,
            prefill: bool) -> None:
    """After a step grew the table from old_len to table.length committed tokens: make its newly
    full blocks findable, with their tap rows, and (recurrent targets, prefill) checkpoint the
    state on a block boundary."""
    if tr is None or (tr.prefill_only and not prefill):
        return
    table, bs, cache = seq.table, pool.block_size, pool.cache
    new_len = table.length
    if seq.hidden_layers and hidden is not None and hidden.shape[0] == new_len - old_len:
        if tr.feat_from + tr.buffered != old_len:
            tr.feats, tr.feat_from = [], old_len
        tr.feats.append(hidden)
    full = new_len // bs
    if full > len(tr.keys):
        tr.keys = block_keys(tr.root, seq.tokens[:full * bs], bs, tr.keys)
    rows = torch.cat(tr.feats) if len(tr.feats) > 1 else (tr.feats[0] if tr.feats else None)
    if rows is not None and tr.feat_from + rows.shape[0] != new_len:
        rows, tr.feats, tr.feat_from = None, [], new_len     # a step without rows: start again here
    with pool.lock:
        for j in range(tr.published, full):
            cache.publish(table.blocks[j], tr.keys[j])
            # An equal block cached before (by a session without taps, say) gets this one's rows.
            held = cache.block_of[tr.keys[j]]
            if rows is not None and j * bs >= tr.feat_from and not cache.has_features(held, _tap(seq)):
                cache.add_features(held, _tap(seq), rows[j * bs - tr.feat_from:(j + 1) * bs - tr.feat_from])
        tr.published = max(tr.published, full)
        slot = None
        if prefill and pool.states is not None and new_len % bs == 0 and new_len:
            slot = cache.take_checkpoint_slot(tr.keys[full - 1])
    if slot is not None:
        pool.states.copy(table.state, slot)
    if rows is not None:
        # Keep only the rows of the block still filling.
        keep_from = full * bs
        tr.feats = [rows[keep_from - tr.feat_from:]] if keep_from > tr.feat_from else [rows]
        tr.feat_from = max(tr.feat_from, keep_from)
