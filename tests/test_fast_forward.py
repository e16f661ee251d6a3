"""The serving forward (issue 25: fused projections in the [in, out] layout, table rope, q/k
norm and rope in one pass, one-row attention read in place) against the reference forward
(`CausalLM.forward`, the plain dense path with the checkpoint's own modules), for every dense
family and step kind: prefill chunks, decode, chain and tree verification, batched and alone.
Also the weight bookkeeping the fusion relies on, and the draft's fused Propose."""
from __future__ import annotations

import pytest
import torch

from splitspec.engine.attention import Row, plan_attention
from splitspec.engine.kv_pool import BlockTable
from splitspec.engine.sample import SamplingParams, make_generator
from splitspec.engine.tree import Tree
from splitspec.models.fused import fused, transposed
from splitspec.models.loader import load_model
from splitspec.models.dense import apply_rope, rms_norm, rope_cos_sin, rope_rows
from target_service.pools import make_pool
from target_service.runner import Decode, Prefill, Sequence, Verify, run_batch
from target_service.torch_verifier import TorchVerifier

ATOL = 1e-4


def _reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """Last-position logits of the plain whole-sequence forward (the training pass: plain
    modules, no fused weights, no pool), an independent reference for the serving path."""
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0, -1]


def _paths(tree: Tree) -> list[list[int]]:
    out = []
    for i in range(len(tree)):
        path, j = [], i
        while j >= 0:
            path.append(tree.token_ids[j])
            j = tree.parents[j]
        out.append(path[::-1])
    return out


class _Capture:
    """Wraps the verifier to keep the logits each Verify row scored."""

    def __init__(self):
        self.inner, self.seen = TorchVerifier(), []

    def verify(self, logits, tree, params, generator, probs, position=None):
        self.seen.append(logits.clone())
        return self.inner.verify(logits, tree, params, generator, probs, position)


@pytest.mark.parametrize("variant", ["llama-sharded", "qwen2-bias", "qwen3-qknorm", "llama3-tied"])
def test_serving_forward_equals_the_reference_for_every_step_kind(variant, tiny_model_factory):
    from conftest import TARGET_VARIANTS
    kw = dict(TARGET_VARIANTS[variant])
    model = load_model(tiny_model_factory(kw.pop("arch"), **kw))
    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(3)
    pool = make_pool(model, num_blocks=40, block_size=4)
    seqs = [Sequence(torch.randint(0, V, (n,), generator=g).tolist(), SamplingParams(), make_generator(0),
                     BlockTable(pool), 200) for n in (13, 6, 21)]
    cap = _Capture()
    # Prefill in chunks, rows sharing a forward; the first chunk of the long prompt alone.
    out = run_batch(model, pool, cap, [Prefill(seqs[2], 9)])
    assert out[0].committed == []
    outs = run_batch(model, pool, cap, [Prefill(s, len(s.prompt)) for s in seqs])
    for s, o in zip(seqs, outs):
        assert o.committed == [int(_reference_logits(model, s.prompt).argmax())]
    # Decode: all rows together, then one alone (its blocks are not consecutive: other rows
    # took blocks in between).
    for steps in ([Decode(s) for s in seqs], [Decode(seqs[1])]):
        before = [list(s.tokens) for s in (st.seq for st in steps)]
        for st, o, toks in zip(steps, run_batch(model, pool, cap, steps), before):
            assert o.committed == [int(_reference_logits(model, toks).argmax())]
    # Verify: a tree, a chain and a decode row in one forward, then a tree alone.
    tree = Tree((3, 7, 5, 1, 2), (-1, -1, 0, 0, 2))
    chain = Tree.chain([4, 9, 4])
    for steps in ([Verify(seqs[0], tree), Verify(seqs[1], chain), Decode(seqs[2])], [Verify(seqs[2], tree)]):
        cap.seen.clear()
        ctx = [list(st.seq.tokens) for st in steps]
        run_batch(model, pool, cap, steps)
        verifies = [(st, c) for st, c in zip(steps, ctx) if isinstance(st, Verify)]
        for (st, c), logits in zip(verifies, cap.seen):
            rows = [c] + [c + p for p in _paths(st.tree)]
            want = torch.stack([_reference_logits(model, r) for r in rows])
            assert (logits - want).abs().max().item() < ATOL


def test_fused_weights_are_views_and_follow_parameter_changes(tiny_qwen3_model):
    m = tiny_qwen3_model
    a = m.model.layers[0].self_attn
    before = {k: v.clone() for k, v in m.state_dict().items()}
    w, b = fused(a, ("q_proj", "k_proj", "v_proj"))
    assert b is None and w.shape == (a.q_proj.in_features, a.q_proj.out_features + 2 * a.k_proj.out_features)
    # Parameters now point into the fused matrix: the values and names are unchanged, and
    # memory is not doubled.
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    base = w.untyped_storage().data_ptr()
    assert a.k_proj.weight.untyped_storage().data_ptr() == base
    # An in-place write to a parameter is a write to the fused matrix.
    with torch.no_grad():
        a.k_proj.weight[0, 0] += 1.0
    assert fused(a, ("q_proj", "k_proj", "v_proj"))[0] is w
    assert w[0, a.q_proj.out_features].item() == a.k_proj.weight[0, 0].item()
    # A parameter given new storage is picked up: the next call fuses again.
    new = torch.randn_like(a.v_proj.weight)
    a.v_proj.weight.data = new.clone()
    w2, _ = fused(a, ("q_proj", "k_proj", "v_proj"))
    assert w2 is not w and torch.equal(w2[:, -a.v_proj.out_features:].t(), new)
    o = m.model.layers[0].self_attn.o_proj
    t = transposed(o)
    assert t.shape == (o.in_features, o.out_features) and torch.equal(t.t(), o.weight)
    # Put the module back as it was for the other tests sharing the fixture.
    with torch.no_grad():
        a.k_proj.weight[0, 0] -= 1.0
        a.v_proj.weight.copy_(before["model.layers.0.self_attn.v_proj.weight"])


def test_a_forward_after_the_weights_change_uses_the_new_weights(tiny_model_factory):
    model = load_model(tiny_model_factory("qwen3", seed=5))
    V = model.cfg.vocab_size
    prompt = list(range(1, 12))
    pool = make_pool(model, num_blocks=10, block_size=4)

    def first_token():
        s = Sequence(prompt, SamplingParams(), make_generator(0), BlockTable(pool), 64)
        tok = run_batch(model, pool, TorchVerifier(), [Prefill(s, len(prompt))])[0].committed
        s.table.free()
        return tok

    first_token()
    with torch.no_grad():
        for layer in model.model.layers:        # new storage for some, in-place for others
            layer.mlp.up_proj.weight.data = torch.randn_like(layer.mlp.up_proj.weight)
            layer.self_attn.q_proj.weight.mul_(-1.5)
    assert first_token() == [int(_reference_logits(model, prompt).argmax())]
    assert V == model.cfg.vocab_size


@pytest.mark.parametrize("shape", [(1, 64), (5, 3, 32), (2, 7, 256)])
def test_rms_norm_and_table_rope_equal_the_plain_formulas(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    plain = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.allclose(rms_norm(x, w, 1e-6), plain, atol=1e-6, rtol=1e-5)
    # rope_rows over flat tokens against apply_rope over [B, heads, T, D].
    from splitspec.models.dense import rope_table
    D, N, H = 32, 9, 3
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    pos = torch.tensor([0, 5, 17, 17, 300, 2, 1, 64, 99])
    q = torch.randn(N, H, D, generator=g)
    cos, sin = rope_cos_sin(inv, pos, torch.float32)
    want = apply_rope(q.transpose(0, 1)[None], cos[None], sin[None])[0].transpose(0, 1)
    got = rope_rows(q, rope_table(inv, 512, torch.float32).index_select(0, pos)[:, :, None])
    assert torch.allclose(got, want, atol=1e-5)


def test_one_row_plan_reads_consecutive_blocks_in_place_and_gathers_otherwise(tiny_qwen3_model):
    pool = make_pool(tiny_qwen3_model, num_blocks=12, block_size=4)
    a, b = BlockTable(pool), BlockTable(pool)
    a.ensure(6)
    b.ensure(4)
    a.ensure(10)                    # a: blocks 1, 2, then 4 (b took 3)
    a.length = 9
    plan = plan_attention([Row(a, 1)], "cpu")
    assert plan.groups[0].kv_start == -1 and plan.groups[0].no_mask and plan.groups[0].in_order
    b.length = 3
    plan = plan_attention([Row(b, 1)], "cpu")
    assert plan.groups[0].kv_start == 3 * 4
    b.length = 1
    chain = plan_attention([Row(b, 2)], "cpu")
    assert chain.groups[0].kv_start == 3 * 4 and not chain.groups[0].no_mask
    assert chain.groups[0].mask_for(2).shape == (1, 1, 4, 3)
    b.length = 3
    both = plan_attention([Row(a, 1), Row(b, 1)], "cpu")
    assert both.groups[0].kv_start == -1 and not both.groups[0].no_mask


def test_fused_propose_equals_the_training_path():
    """The draft's serving forward (fused q/k/v and gate/up, no gradient) against the same
    draft's training path (separate projections), on the bundled pair."""
    from pathlib import Path
    from draft_service.architectures import load_draft
    from draft_service.dflash import DraftCache, append_context, block_hidden, new_pool
    root = Path(__file__).resolve().parents[1] / "models"
    d = load_draft(root / "splitspec-code-draft", root / "splitspec-code-target")
    F = d.cfg.target_feature_size
    g = torch.Generator().manual_seed(1)
    pool = new_pool(d, 40)
    caches = [DraftCache(d, 600, pool) for _ in range(2)]
    with torch.no_grad():
        append_context(d, [(c, torch.randn(n, F, generator=g)) for c, n in zip(caches, (300, 40))])
        serving = block_hidden(d, caches, [5, 9], [300, 40])
    with torch.enable_grad():
        training = block_hidden(d, caches, [5, 9], [300, 40]).detach()
    assert (serving - training).abs().max().item() < ATOL
