"""Draft trees: validation and ancestor masks (hypothesis), the tree-masked one-pass
forward against decoding each node's path token by token, and `TargetSequence.verify`
keeping exactly the accepted path in the KV cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitspec.engine.attention import Row, plan_attention
from splitspec.engine.kv_pool import BlockTable
from splitspec.engine.sample import SamplingParams
from target_service.engine import TargetSequence, forward_sequences, generate
from splitspec.models.dense import PagedBatch
from target_service.pools import make_pool
from splitspec.engine.tree import Tree, TreeError

# ------------------------------------------------------------------ validation, masks


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(-3, 14), max_size=14))
def test_validate_accepts_exactly_topological_parent_arrays(parents):
    tree = Tree(tuple(range(len(parents))), tuple(parents))
    bad = [i for i, p in enumerate(parents) if not -1 <= p <= i - 1]
    if bad:
        with pytest.raises(TreeError, match=rf"tree\.parents\[{bad[0]}\] = {parents[bad[0]]}"):
            tree.validate()
    else:
        assert tree.validate() is tree


valid_parents = st.integers(0, 14).flatmap(
    lambda n: st.tuples(*[st.integers(-1, i - 1) for i in range(n)]))


def _closure(parents) -> np.ndarray:
    """Reflexive-transitive closure of the child->parent relation over (root, nodes), by
    boolean matrix squaring (not by walking parent pointers as Tree does)."""
    n = len(parents) + 1
    a = np.eye(n, dtype=bool)
    for i, p in enumerate(parents):
        a[i + 1, p + 1] = True            # node i -> its parent (the root is index 0)
    while True:
        nxt = (a.astype(np.int64) @ a.astype(np.int64)) > 0
        if (nxt == a).all():
            return a
        a = nxt


@settings(max_examples=300, deadline=None)
@given(valid_parents)
def test_ancestor_mask_is_the_transitive_closure(parents):
    tree = Tree(tuple([7] * len(parents)), parents).validate()
    mask = tree.ancestor_mask()
    assert mask.dtype == torch.bool and mask.shape == (len(parents) + 1,) * 2
    closure = _closure(parents)
    assert (mask.numpy() == closure).all()
    # Derived views agree with the closure too.
    depths = tree.depths()
    assert depths == [int(closure[i + 1].sum()) - 1 for i in range(len(parents))]
    for i in range(len(parents)):
        assert tree.path_to(i) == [j for j in range(len(parents)) if closure[i + 1, j + 1]]
    for node in range(-1, len(parents)):
        assert tree.children(node) == [i for i, p in enumerate(parents) if p == node]


def test_chain_and_field_errors():
    t = Tree.chain([4, 5, 6])
    assert t.parents == (-1, 0, 1) and t.depths() == [1, 2, 3]
    assert t.ancestor_mask().tolist() == torch.tril(torch.ones(4, 4, dtype=torch.bool)).tolist()
    with pytest.raises(TreeError, match=r"tree\.parents has 2 entries but tree\.token_ids has 3"):
        Tree((1, 2, 3), (-1, 0)).validate()
    with pytest.raises(TreeError, match=r"tree\.token_ids\[1\] = 16 is outside the vocabulary \[0, 16\)"):
        Tree((1, 16), (-1, 0)).validate(vocab_size=16)
    with pytest.raises(TreeError, match=r"tree\.token_ids\[0\] = -2"):
        Tree((-2,), (-1,)).validate(vocab_size=16)
    with pytest.raises(TreeError, match="more than the limit of 2"):
        Tree((1, 2, 3), (-1, 0, 1)).validate(max_nodes=2)
    assert len(Tree((), ()).validate()) == 0


# ------------------------------------------------------------------ tree-masked forward

TREES = {
    "chain": (-1, 0, 1, 2, 3),
    "branchy": (-1, -1, 0, 0, 1, 2, 2, 4, -1),
    "star": (-1, -1, -1, -1),
}


def _path_logits(model, committed, path_tokens):
    """Logits after committed + path: the path as an ordinary causal sequence."""
    return forward_sequences(model, torch.tensor(committed + list(path_tokens))).logits[0, -1]


def _paged_forward(model, pool, table, ids, positions, mask=None):
    """ids at `positions` through forward_batch on one row of `pool` (mask among the new
    tokens; causal when None), appended to the table; all rows' logits."""
    table.ensure(table.length + len(ids))
    plan = plan_attention([Row(table, len(ids), mask)], pool.k.device)
    with torch.inference_mode():
        logits, _ = model.forward_batch(torch.tensor(ids), torch.tensor(positions), PagedBatch(pool, plan))
    table.length += len(ids)
    return logits


def _prefilled_cache(model, tokens):
    """The K/V of `tokens` prefilled by a fresh sequence."""
    ref = TargetSequence(model, list(tokens), max_len=len(tokens) + 2)
    ref.prefill()
    return ref.cache


@pytest.mark.parametrize("shape", list(TREES), ids=list(TREES))
def test_tree_masked_forward_equals_decoding_each_path(tiny_qwen3_model, shape):
    model = tiny_qwen3_model
    parents = TREES[shape]
    gen = torch.Generator().manual_seed(len(parents))
    tokens = torch.randint(0, model.cfg.vocab_size, (len(parents),), generator=gen).tolist()
    tree = Tree(tuple(tokens), parents).validate(model.cfg.vocab_size)
    committed = [9, 30, 2, 77, 41, 5, 18]
    base = len(committed) - 1                         # cached; the last token is the root
    positions = [base + d for d in [0] + tree.depths()]

    def tree_forward(mask):
        pool = make_pool(model, num_blocks=8, block_size=16)
        table = BlockTable(pool)
        _paged_forward(model, pool, table, committed[:-1], list(range(base)))
        return _paged_forward(model, pool, table, [committed[-1], *tokens], positions, mask)

    logits = tree_forward(tree.ancestor_mask())
    assert torch.allclose(logits[0], _path_logits(model, committed, []), atol=1e-5)
    for i in range(len(tree)):
        ref = _path_logits(model, committed, [tokens[j] for j in tree.path_to(i)])
        assert torch.allclose(logits[i + 1], ref, atol=1e-5), f"node {i}"
    if shape == "branchy":
        # Sanity: with a plain causal mask, a node whose earlier siblings are not its
        # ancestors gets different logits, so the comparison above can fail.
        causal = tree_forward(None)
        assert not torch.allclose(causal[2], logits[2], atol=1e-3)


def _oracle_tree(rng: np.random.Generator, truth: list[int], vocab: int) -> Tree:
    """A random tree around the true continuation: a main branch that follows `truth` for a
    random number of steps and then goes wrong, plus random decoy siblings, some before
    the right child so that verification must skip them."""
    depth = int(rng.integers(1, 6))
    right = int(rng.integers(0, depth + 1))          # how many main-branch tokens are correct
    tokens, parents = [], []
    parent = -1
    for d in range(depth):
        for _ in range(int(rng.integers(0, 2))):       # decoy sibling tried first
            decoy = int(rng.integers(0, vocab))
            if decoy != truth[d]:
                tokens.append(decoy)
                parents.append(parent)
        tok = truth[d] if d < right else int((truth[d] + 1 + rng.integers(0, vocab - 1)) % vocab)
        tokens.append(tok)
        parents.append(parent)
        parent = len(tokens) - 1
        if rng.random() < 0.4:                         # decoy sibling after it
            tokens.append(int(rng.integers(0, vocab)))
            parents.append(parents[-1])
    return Tree(tuple(tokens), tuple(parents))


def test_verify_greedy_equals_target_only_greedy_and_keeps_the_accepted_path(tiny_qwen3_model):
    model = tiny_qwen3_model
    prompt = [12, 7, 90, 33, 1, 64, 64, 5]
    n_new = 40
    truth = generate(model, prompt, n_new + 8)
    rng = np.random.default_rng(0)
    seq = TargetSequence(model, prompt, SamplingParams(), max_len=128, hidden_layers=(0, 1))
    assert seq.prefill().committed == [truth[0]]
    steps = accepted = 0
    while seq.length - len(prompt) < n_new:
        done = seq.length - len(prompt)
        tree = _oracle_tree(rng, truth[done:], model.cfg.vocab_size)
        base = seq.length - 1
        out = seq.verify(tree)
        steps += 1
        accepted += out.result.num_accepted
        assert seq.tokens[len(prompt):] == truth[:seq.length - len(prompt)]
        # The cache holds exactly the committed tokens minus the newest one ...
        assert seq.cache.length == seq.length - 1 == base + 1 + out.result.num_accepted
        # ... and the hidden states returned are those of root + accepted nodes, equal to
        # running those tokens one at a time.
        assert out.hidden.shape[0] == 1 + out.result.num_accepted
    assert accepted > steps // 2       # the oracle trees were accepted often enough
    # K/V of the compacted cache equal a fresh sequence prefilled with the same tokens.
    ref = _prefilled_cache(model, seq.tokens[:-1])
    n = seq.cache.length
    assert torch.allclose(seq.cache.k[..., :n, :], ref.k[..., :n, :], atol=1e-5)
    assert torch.allclose(seq.cache.v[..., :n, :], ref.v[..., :n, :], atol=1e-5)


def test_verify_hidden_states_match_sequential_features(tiny_qwen3_model):
    model = tiny_qwen3_model
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    truth = generate(model, prompt, 6)
    seq = TargetSequence(model, prompt, SamplingParams(), max_len=64, hidden_layers=(0, 1))
    seq.prefill()
    tree = Tree((truth[1] ^ 1, truth[1], truth[2], truth[3] ^ 1, truth[3] ^ 2), (-1, -1, 1, 2, 2))
    out = seq.verify(tree)
    assert out.result.accepted == [1, 2]
    assert out.committed == truth[1:4]
    full = forward_sequences(model, torch.tensor(prompt + truth[:3]), hidden_layers=(0, 1)).hidden[0]
    # root (b0 = truth[0]) and the two accepted nodes, at positions len(prompt) .. +2
    assert torch.allclose(out.hidden, full[len(prompt):len(prompt) + 3], atol=1e-5)


def test_sampling_verify_keeps_a_cache_equal_to_prefilling_the_committed_tokens(tiny_qwen3_model):
    """At temperature > 0 the accepted path can go down any branch; whichever it is, the
    compacted cache must equal a cache that never saw the rejected nodes."""
    model = tiny_qwen3_model
    prompt = [8, 6, 7, 5, 3, 0, 9]
    seq = TargetSequence(model, prompt, SamplingParams(temperature=1.0, seed=3), max_len=200)
    seq.prefill()
    rng = np.random.default_rng(1)
    moved = False
    for _ in range(25):
        # Draft from the model's own greedy continuation so that acceptance is likely.
        guess = generate(model, seq.tokens, 5)
        tree = _oracle_tree(rng, guess, model.cfg.vocab_size)
        out = seq.verify(tree)
        # An accepted node whose index is not its depth - 1 had to move down in the cache.
        moved |= any(i != k for k, i in enumerate(out.result.accepted))
    assert moved
    ref = _prefilled_cache(model, seq.tokens[:-1])
    n = seq.cache.length
    assert n == len(seq.tokens) - 1
    assert torch.allclose(seq.cache.k[..., :n, :], ref.k[..., :n, :], atol=1e-5)
    assert torch.allclose(seq.cache.v[..., :n, :], ref.v[..., :n, :], atol=1e-5)


def test_empty_tree_verify_is_one_decode_step(tiny_qwen3_model):
    """No draft (e.g. the draft service is gone): verify commits exactly the bonus, the same
    token and cache state as a target-only decode step."""
    model = tiny_qwen3_model
    prompt = [40, 2, 17, 88]
    params = SamplingParams(temperature=0.9, seed=11)
    a = TargetSequence(model, prompt, params, max_len=32, hidden_layers=(1,))
    b = TargetSequence(model, prompt, params, max_len=32, hidden_layers=(1,))
    a.prefill(), b.prefill()
    for _ in range(5):
        va, db = a.verify(Tree((), ())), b.decode()
        assert va.committed == db.committed and va.result.accepted == []
        assert torch.allclose(va.hidden, db.hidden, atol=1e-5)
    assert a.tokens == b.tokens and a.cache.length == b.cache.length


def test_verify_rejects_draft_probs_of_the_wrong_shape_and_keeps_its_state(tiny_qwen3_model):
    model = tiny_qwen3_model
    V = model.cfg.vocab_size
    seq = TargetSequence(model, [1, 2, 3], SamplingParams(temperature=1.0, seed=0), max_len=32)
    seq.prefill()
    ref = TargetSequence(model, [1, 2, 3], SamplingParams(temperature=1.0, seed=0), max_len=32)
    ref.prefill()
    for bad in (torch.full((3, V), 1.0 / V), torch.full((2, V - 1), 1.0 / (V - 1))):
        with pytest.raises(ValueError, match=rf"draft_probs has shape \({bad.shape[0]}, {bad.shape[1]}\), "
                                             rf"expected \(2, {V}\)"):
            seq.verify(Tree.chain([4, 5]), bad)
        assert seq.cache.length == 3 and seq.tokens == ref.tokens

    class Failing:
        def verify(self, *args, **kwargs):
            raise RuntimeError("backend failure")

    seq.verifier = Failing()
    with pytest.raises(RuntimeError, match="backend failure"):
        seq.verify(Tree.chain([4, 5]))
    assert seq.cache.length == 3 and seq.tokens == ref.tokens
    # The sequence is still usable and in step with one that never saw the errors.
    seq.verifier = ref.verifier
    q = torch.full((2, V), 1.0 / V)
    assert seq.verify(Tree.chain([4, 5]), q).committed == ref.verify(Tree.chain([4, 5]), q).committed
    assert seq.decode().committed == ref.decode().committed
