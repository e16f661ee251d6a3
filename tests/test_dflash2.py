"""DFlash2 drafter: the grouped dynamic conv and the candidate selector against direct
computations, the public checkpoint layout, warm starts from DFlash, the per-layer masks, and
lossless speculation (greedy equality, the T>0 distribution test in both draft modes)."""
from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import save_file

from draft_service.architectures import load_draft
from draft_service.dflash import DraftCache, block_hidden, layer_masks, new_draft, save_draft
from draft_service.dflash2 import (DFlash2Config, DFlash2Draft, GroupedDynamicConv, grouped_dynamic_conv,
                                   new_dflash2)
from draft_service.proposer import DFlashProposer
from splitspec.engine.sample import SamplingParams, make_generator
from splitspec_tools.speculate import speculative_generate
from splitspec.models.config import ConfigError
from target_service.engine import TargetSequence, generate
from splitspec.models.loader import load_model

from sampling_law import chi_square_pvalue
from test_dflash import exact_joint


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    return load_model(tiny_model_factory("qwen3", vocab_size=64, seed=31))


def make_dflash2(target, block_size=6, seed=0, **kw):
    base = new_draft(target.cfg, num_layers=2, block_size=block_size, mask_token_id=target.cfg.vocab_size - 1,
                     seed=seed, target_layer_ids=[0, target.cfg.num_hidden_layers - 1])
    kw = {"conv_group_size": 16, "selector_rank": 8, "selector_top_k": 5, **kw}
    d = new_dflash2(base, seed=seed, **kw)
    g = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():          # every parameter away from its identity init
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif "base_kernel" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.normal_(0, 0.2, generator=g)
    d.attach_target(target.model.embed_tokens.weight, target.lm_head.weight)
    return d.eval()


def direct_conv(x, base, proj, k, G, block):
    """prepare and finish written as loops over positions, taps and groups ([T, H] rows)."""
    T, H = x.shape
    g = H // G
    d = (x @ proj.T).view(T, 2, k, G)
    out = []
    for side in range(2):
        y = torch.zeros_like(x)
        for t in range(T):
            for tau in range(k):
                if t % block - tau < 0:       # before the block start: zero
                    continue
                for c in range(H):
                    y[t, c] += (base[side, tau, c] + d[t, side, tau, c // g]) * x[t - tau, c]
        out.append(y)
    return out, d[:, 1]


def test_conv_matches_direct_loop_and_starts_as_identity(target):
    d = make_dflash2(target, block_size=4)
    conv: GroupedDynamicConv = d.layers[0].attention_conv
    x = torch.randn(2, 8, d.cfg.hidden_size)         # two rows, two blocks of 4 each
    with torch.no_grad():
        prep, dyn = conv.prepare(x)
        fin = conv.finish(x, dyn)
    for r in range(2):
        (want_prep, want_fin_side), _ = direct_conv(x[r], conv.base_kernel, conv.kernel_projection.weight,
                                                    conv.k, conv.groups, 4)
        torch.testing.assert_close(prep[r], want_prep, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fin[r], want_fin_side, atol=1e-5, rtol=1e-5)
    # zero taps across the block start: block 2 does not see block 1
    x2 = x.clone()
    x2[:, :4] = torch.randn(2, 4, d.cfg.hidden_size)
    with torch.no_grad():
        assert torch.equal(conv.prepare(x2)[0][:, 4:], prep[:, 4:])
    # group sharing: one dynamic coefficient per group of conv_group_size channels
    k, G, H = conv.k, conv.groups, d.cfg.hidden_size
    dyn = torch.randn(1, 4, k, G)
    base = torch.zeros(k, H)
    ones = grouped_dynamic_conv(torch.ones(1, 4, H), dyn, base, 4)
    assert torch.equal(ones[0, 0].view(G, -1), dyn[0, 0, 0][:, None].expand(G, H // G))
    conv.reset_identity()
    with torch.no_grad():
        v, dd = conv.prepare(x)
        assert torch.equal(v, x) and torch.equal(conv.finish(x, dd), x)


def test_warm_start_drafts_exactly_like_its_dflash_backbone(target):
    base = new_draft(target.cfg, num_layers=2, block_size=6, mask_token_id=63, seed=4,
                     target_layer_ids=[0, target.cfg.num_hidden_layers - 1])
    base.attach_target(target.model.embed_tokens.weight, target.lm_head.weight)
    d2 = new_dflash2(base, selector_rank=8, selector_top_k=5).eval()
    feats = torch.randn(7, base.cfg.target_feature_size)
    out = []
    for d in (base.eval(), d2):
        cache = DraftCache(d, 64)
        cache.append(d, feats)
        with torch.no_grad():
            out.append(block_hidden(d, [cache], [5], [7])[0])
    torch.testing.assert_close(out[0], out[1], atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        logits = d2.logits(out[1])
        chain, q = d2.walk(out[1], logits, 5, 5)
    assert chain == logits.argmax(-1).tolist() and q is None     # zero successor codebook: pure unary


def brute_force_scores(d, h, unary, prev):
    """S(prev, b) for the K unary candidates b, straight from the definition."""
    sel = d.candidate_selector
    ids = unary.topk(sel.top_k).indices
    A, B, W = sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight
    return ids, torch.stack([unary[b] + (A[prev] * (W @ h) * B[b]).sum() for b in ids])


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_selector_walk_and_q_match_brute_force(target, temperature):
    d = make_dflash2(target, block_size=6, output_multiplier=0.5, final_logit_softcapping=3.0)
    h = torch.randn(5, d.cfg.hidden_size)
    with torch.no_grad():
        unary = d.logits(h)
        z = h @ d._target["lm_head"].T
        torch.testing.assert_close(unary, 3.0 * torch.tanh(0.5 * z / 3.0))          # multiply, then cap
        chain, q = d.walk(h, unary, 9, 5, temperature, make_generator(3, torch.device("cpu")))
        prev = 9
        for t in range(5):
            ids, s = brute_force_scores(d, h[t], unary[t], prev)
            if temperature == 0:
                assert chain[t] == int(ids[s.argmax()])
            else:
                want = torch.zeros(d.cfg.vocab_size)
                want[ids] = torch.softmax(s / temperature, -1)
                torch.testing.assert_close(q[t], want, atol=1e-5, rtol=1e-5)
                assert abs(float(q[t].sum()) - 1) < 1e-5 and int((q[t] > 0).sum()) == d.cfg.selector_top_k
                assert chain[t] in ids.tolist()
            prev = chain[t]


def write_public_checkpoint(path, target, block_size=6):
    """A DFlash2 folder written by hand in the public layout (config fields under dflash_config,
    bare codebook keys), independent of save_draft."""
    cfg, H, V = target.cfg, target.cfg.hidden_size, target.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    G, r, kv = H // 16, 8, cfg.num_key_value_heads * cfg.head_dim
    t = {"fc.weight": (H, 2 * H), "hidden_norm.weight": (H,), "norm.weight": (H,),
         "candidate_selector.predecessor_codebook": (V, r), "candidate_selector.successor_codebook": (V, r),
         "candidate_selector.hidden_projection.weight": (r, H)}
    for i in range(2):
        p = f"layers.{i}."
        for conv in ("attention_conv", "mlp_conv"):
            t[p + conv + ".base_kernel"] = (2, 2, H)
            t[p + conv + ".kernel_projection.weight"] = (2 * 2 * G, H)
        t.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                  p + "self_attn.q_proj.weight": (cfg.num_attention_heads * cfg.head_dim, H),
                  p + "self_attn.k_proj.weight": (kv, H), p + "self_attn.v_proj.weight": (kv, H),
                  p + "self_attn.o_proj.weight": (H, cfg.num_attention_heads * cfg.head_dim),
                  p + "self_attn.q_norm.weight": (cfg.head_dim,), p + "self_attn.k_norm.weight": (cfg.head_dim,),
                  p + "mlp.gate_proj.weight": (cfg.intermediate_size, H),
                  p + "mlp.up_proj.weight": (cfg.intermediate_size, H),
                  p + "mlp.down_proj.weight": (H, cfg.intermediate_size)})
    path.mkdir(parents=True)
    save_file({k: 0.1 * torch.randn(s, generator=g) for k, s in t.items()}, str(path / "model.safetensors"))
    config = {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "is_causal": False,
        "hidden_size": H, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 2,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "vocab_size": V, "rms_norm_eps": 1e-6, "num_target_layers": 2,
        "layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 2048,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "max_position_embeddings": 512,
        "dflash_config": {"block_size": block_size, "conv_group_size": 16, "conv_kernel_size": 2,
                          "final_logit_softcapping": 20.0, "mask_token_id": V - 1, "output_multiplier": 0.25,
                          "selector_rank": r, "selector_top_k": 4, "target_layer_ids": [0, 1]},
    }
    (path / "config.json").write_text(json.dumps(config))
    return t


def test_public_layout_loads_and_round_trips(tmp_path, target, tiny_model_factory):
    tdir = tiny_model_factory("qwen3", vocab_size=64, seed=31)
    shapes = write_public_checkpoint(tmp_path / "public", target)
    d = load_draft(tmp_path / "public", tdir)
    assert isinstance(d, DFlash2Draft)
    cfg = d.cfg
    assert (cfg.block_size, cfg.selector_top_k, cfg.output_multiplier, cfg.final_logit_softcapping) == (6, 4, 0.25, 20.0)
    assert cfg.is_causal is False and cfg.layer_window(0) == 2048 and not cfg.layer_causal(1)
    assert {k: tuple(v.shape) for k, v in d.state_dict().items()} == shapes
    save_draft(d, tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert saved["dflash_config"]["block_size"] == 6 and "block_size" not in saved
    again = load_draft(tmp_path / "again", tdir)
    for (n, a), (_, b) in zip(d.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    assert again.cfg == cfg
    as_count = load_draft(tmp_path / "public", tdir, block_size_means="draft_count")
    assert as_count.cfg.block_size == 7


@pytest.mark.parametrize("field,value,match", [
    ("conv_group_size", 24, "conv_group_size=24 must divide hidden_size"),
    ("selector_top_k", 0, "selector_top_k must be a positive integer"),
    ("attention_mode", "mla", "attention_mode='mla' is not supported"),
    ("use_beam", True, "dflash_config.use_beam is not supported"),
])
def test_unsupported_fields_are_named(tmp_path, target, field, value, match):
    write_public_checkpoint(tmp_path / "d", target)
    good = json.loads((tmp_path / "d" / "config.json").read_text())
    raw = json.loads(json.dumps(good))
    raw["dflash_config"][field] = value
    with pytest.raises(ConfigError, match=match):
        DFlash2Config.from_dict(raw)
    del good["dflash_config"]["selector_rank"]
    with pytest.raises(ConfigError, match="selector_rank is missing"):
        DFlash2Config.from_dict(good)


def test_layer_masks_causal_and_symmetric_window(target):
    d = make_dflash2(target, block_size=4)
    cfg = d.cfg.__class__(**{**d.cfg.__dict__, "is_causal": None,
                             "layer_types": ("sliding_attention", "full_attention"), "sliding_window": 3})
    pos = torch.tensor([[5, 6, 7, 8]])
    sliding, full = layer_masks(cfg, torch.tensor([5]), pos, 6)
    keys = list(range(6)) + [5, 6, 7, 8]
    for qi, q in enumerate(pos[0].tolist()):
        for j, k in enumerate(keys):
            in_ctx = j < 5
            own = j >= 6 and (j - 6) <= qi                      # sliding layers are causal here
            assert bool(sliding[0, 0, qi, j]) == ((in_ctx or own) and abs(q - k) < 3), (qi, j)
            assert bool(full[0, 0, qi, j]) == (in_ctx or j >= 6), (qi, j)


@pytest.mark.parametrize("width", [3, 6])
def test_greedy_dflash2_speculation_equals_target_only(target, width):
    d = make_dflash2(target, block_size=6, seed=2)
    rng = random.Random(width)
    for _ in range(3):
        prompt = [rng.randrange(60) for _ in range(rng.randrange(1, 12))]
        seq = TargetSequence(target, prompt, max_len=128, hidden_layers=d.cfg.target_layer_ids)
        out, st = speculative_generate(seq, DFlashProposer(d, num_draft_tokens=width, max_len=128), 30)
        assert out == generate(target, prompt, 30)
        assert 1.0 <= st.accept_length <= width


@pytest.mark.parametrize("draft_sampling", ["greedy", "sample"])
def test_dflash2_sampling_matches_target_distribution(tiny_model_factory, one_thread, draft_sampling):
    target = load_model(tiny_model_factory("qwen3", vocab_size=24, seed=41))
    d = make_dflash2(target, block_size=4, seed=5)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    prompt = [3, 8, 1]
    exact = exact_joint(target, prompt, params)
    n, counts = 2000, {}
    for seed in range(n):
        p = SamplingParams(params.temperature, params.top_p, seed=seed)
        seq = TargetSequence(target, prompt, p, max_len=32, hidden_layers=d.cfg.target_layer_ids)
        prop = DFlashProposer(d, max_len=32, sampling=SamplingParams(1.0, 0.9, seed=10_000 + seed)
                              if draft_sampling == "sample" else None)
        out, _ = speculative_generate(seq, prop, 2)
        counts[tuple(out[:2])] = counts.get(tuple(out[:2]), 0) + 1
    assert chi_square_pvalue(counts, exact, n) > 1e-3
