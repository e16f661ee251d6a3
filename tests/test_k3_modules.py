"""Kimi-K3's own parts, each against a direct formula written out here: the safe-gate decay,
KDA with the full-rank output gate (matrix form of the delta rule), gated MLA (expanded K/V,
not absorbed), the latent MoE, SiTU-GLU and the Attention-Residuals mix; then a tiny K3-shaped
folder (K3's config fields and tensor names) loads, generates, and verifies with exact rollback."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import splitspec.models.hybrid as hybrid
import target_service.runner as runner
from hybrid_models import K3_CONFIG, save_tiny_k3
from splitspec.engine.attention import Row, plan_attention
from splitspec.engine.kv_pool import BlockTable
from splitspec.engine.tree import Tree
from target_service.engine import TargetSequence, forward_sequences, generate
from splitspec.models.kda import kda_decay
from splitspec.models.loader import load_model
from splitspec.models.dense import PagedBatch
from splitspec.models.moe import situ_glu
from target_service.pools import make_pool
from splitspec.engine.state_pool import StatePlan, StateRow

TOL = 1e-5


# Many tiny forwards: thread start-up costs more than it saves.
pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    return save_tiny_k3(tmp_path_factory.mktemp("k3") / "tiny-k3")


@pytest.fixture(scope="module")
def k3(k3_dir):
    return load_model(k3_dir)


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_safe_gate_decay_is_the_bounded_sigmoid():
    gen = torch.Generator().manual_seed(0)
    H, D = 3, 4
    f = torch.randn(5, H, D, generator=gen) * 3
    a_log, dt = torch.randn(H, generator=gen), torch.randn(H * D, generator=gen)
    got = kda_decay(f, a_log, dt, -5.0)
    for n in range(5):
        for h in range(H):
            for d in range(D):
                x = float(f[n, h, d] + dt[h * D + d])
                want = -5.0 / (1.0 + torch.exp(torch.tensor(-torch.exp(a_log[h]).item() * x)))
                assert abs(got[n, h, d].item() - want.item()) < TOL
    assert (got > -5).all() and (got < 0).all()
    plain = kda_decay(f, a_log, dt, None)       # Kimi-Linear: -exp(A) softplus(.)
    assert torch.allclose(plain, -a_log.exp()[:, None] * torch.log1p(torch.exp(f + dt.view(H, D))), atol=TOL)


def test_situ_glu_formula():
    g, u = torch.linspace(-30, 30, 101), torch.linspace(-80, 80, 101)
    want = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    assert torch.allclose(situ_glu(g, u), want, atol=TOL)


def one_layer_batch(model, tokens: int):
    """A pool and a batch of one fresh session running `tokens` new tokens."""
    pool = make_pool(model, num_blocks=8, max_sessions=1)
    table = BlockTable(pool)
    table.ensure(tokens)
    states = None if pool.states is None else StatePlan(pool.states, [StateRow(table.state, 0, tokens)])
    return PagedBatch(pool, plan_attention([Row(table, tokens)], "cpu"), states)


def test_kda_with_safe_gate_and_full_rank_gate_matches_the_matrix_form(k3):
    layer = k3.model.layers[1].self_attn            # a KDA layer
    cfg = k3.cfg.hybrid
    assert cfg.gate_lower_bound == -5.0 and cfg.full_rank_gate and hasattr(layer, "g_proj")
    H, D, K = layer.heads, layer.head_dim, layer.kernel
    T = 6
    x = torch.randn(T, k3.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = layer(x, one_layer_batch(k3, T).states)
        # Direct: causal depthwise conv over zero history, SiLU, L2 norm, safe gate, matrix-form update.
        proj = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], -1)
        w = torch.cat([layer.q_conv1d.weight, layer.k_conv1d.weight, layer.v_conv1d.weight])
        conv = F.silu(F.conv1d(F.pad(proj.t()[None], (K - 1, 0)), w, groups=3 * H * D)[0].t())
        q, k, v = (t.view(T, H, D) for t in conv.split(H * D, -1))
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / D ** 0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        a = torch.exp(layer.A_log)
        f = layer.f_b_proj(layer.f_a_proj(x)).view(T, H, D) + layer.dt_bias.view(H, D)
        gk = -5.0 * torch.sigmoid(a[:, None] * f)
        beta = torch.sigmoid(layer.b_proj(x))
        S = torch.zeros(H, D, D)
        outs = []
        for t in range(T):
            per_head = []
            for h in range(H):
                kk = k[t, h][:, None]
                S[h] = (torch.eye(D) - beta[t, h] * kk @ kk.t()) @ torch.diag(gk[t, h].exp()) @ S[h] \
                    + beta[t, h] * kk @ v[t, h][None]
                per_head.append(S[h].t() @ q[t, h])
            outs.append(torch.stack(per_head))
        o = torch.stack(outs)
        o = rms(o, layer.o_norm.weight, layer.eps) * torch.sigmoid(layer.g_proj(x).view(T, H, D))
        want = layer.o_proj(o.reshape(T, -1))
    assert (got - want).abs().max() < 1e-4


def test_gated_mla_matches_expanded_attention(k3):
    layer = k3.model.layers[3].self_attn            # an MLA layer (NoPE, output gate)
    c = k3.cfg.hybrid
    assert c.mla_output_gate and not c.use_rope and hasattr(layer, "g_proj")
    T, H = 5, c.num_heads
    x = torch.randn(T, k3.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = layer(x, torch.arange(T), one_layer_batch(k3, T))
        q = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x))).view(T, H, -1)
        lat, k_pe = layer.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        kv = layer.kv_b_proj(layer.kv_a_layernorm(lat)).view(T, H, -1)
        k = torch.cat([kv[..., :c.qk_nope_head_dim], k_pe[:, None].expand(T, H, -1)], -1)
        v = kv[..., c.qk_nope_head_dim:]
        s = torch.einsum("thd,shd->hts", q, k) / c.qk_head_dim ** 0.5
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        o = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, -1)
        want = layer.o_proj(o * torch.sigmoid(layer.g_proj(x)))
    assert (got - want).abs().max() < 1e-4


def test_latent_moe_matches_its_formula(k3):
    moe = k3.model.layers[2].block_sparse_moe
    c = k3.cfg.hybrid
    assert c.latent_dim == 32 and c.latent_norm and c.hidden_act == "situ"
    x = torch.randn(7, k3.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = moe(x)
        want = []
        for tok in x:
            scores = torch.sigmoid(moe.gate.weight @ tok)
            top = (scores + moe.gate.e_score_correction_bias).topk(c.top_k).indices
            w = scores[top] / scores[top].sum() * c.routed_scaling_factor
            z = moe.routed_expert_down_proj(tok)
            acc = torch.zeros_like(z)
            for wi, e in zip(w, top.tolist()):
                ex = moe.experts[e]
                acc += wi * ex.w2(situ_glu(ex.w1(z), ex.w3(z)))
            y = moe.routed_expert_up_proj(rms(acc, moe.routed_expert_norm.weight, k3.cfg.rms_norm_eps))
            sh = moe.shared_experts
            want.append(y + sh.down_proj(situ_glu(sh.gate_proj(tok), sh.up_proj(tok))))
    assert (got - torch.stack(want)).abs().max() < 1e-4


def test_attention_residual_mix_and_block_schedule(k3, monkeypatch):
    layer = k3.model.layers[0]
    srcs = [torch.randn(4, k3.cfg.hidden_size, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    with torch.no_grad():
        got = hybrid.attn_res_mix(srcs, layer.self_attention_res_norm, layer.self_attention_res_proj)
        logits = torch.stack([(rms(s, layer.self_attention_res_norm.weight, k3.cfg.rms_norm_eps)
                               @ layer.self_attention_res_proj.weight[0]) for s in srcs])   # [S, N]
        want = (logits.softmax(0)[..., None] * torch.stack(srcs)).sum(0)
    assert (got - want).abs().max() < TOL
    # Every mix reads [b_0 = embedding, sealed block sums..., the current block's partial sum]:
    # recorded sublayer outputs rebuild each source list exactly.
    seen, outs = [], []
    real = hybrid.attn_res_mix
    monkeypatch.setattr(hybrid, "attn_res_mix", lambda s, n, p: seen.append([t.clone() for t in s]) or real(s, n, p))
    for lay in k3.model.layers:
        for name in ("attn", "ffn"):
            f = getattr(lay, name)
            monkeypatch.setattr(lay, name, lambda *a, f=f: outs.append(f(*a)) or outs[-1])
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        forward_sequences(k3, ids)
        emb = k3.model.embed_tokens(ids)[0]
    B, L = k3.cfg.hybrid.attn_res_block_size, k3.cfg.num_hidden_layers
    assert len(seen) == 2 * L + 1 and len(outs) == 2 * L       # before every sublayer, and the output mix
    for j, srcs in enumerate(seen):                             # j sublayers have run before mix j
        done = j // (2 * B)                                     # blocks sealed so far
        want = [emb] + [sum(outs[2 * B * n:2 * B * (n + 1)]) for n in range(done)]
        if j % (2 * B):
            want.append(sum(outs[2 * B * done:j]))
        assert len(srcs) == len(want), j
        for got_s, want_s in zip(srcs, want):
            assert (got_s.reshape(want_s.shape) - want_s).abs().max() < TOL, j


def test_tap_streams_differ_and_the_last_layer_is_normed(k3):
    ids = torch.tensor([[5, 6, 7, 8]])
    last = k3.cfg.num_hidden_layers - 1
    k3.tap_stream = "prefix"
    a = forward_sequences(k3, ids, hidden_layers=[2, last])
    k3.tap_stream = "attn_res"
    b = forward_sequences(k3, ids, hidden_layers=[2, last])
    k3.tap_stream = "prefix"
    H = k3.cfg.hidden_size
    assert torch.equal(a.logits, b.logits)
    assert not torch.allclose(a.hidden[..., :H], b.hidden[..., :H])
    assert torch.equal(a.hidden[..., H:], b.hidden[..., H:])
    assert torch.equal(k3.lm_head(a.hidden[..., H:]), a.logits)      # the last tap is what lm_head reads


def test_k3_folder_has_k3_names_loads_and_generates(k3_dir, k3):
    raw = json.loads((k3_dir / "config.json").read_text())
    for key in ("gate_lower_bound", "use_full_rank_gate"):
        assert key in raw["linear_attn_config"]
    for key in ("mla_use_output_gate", "routed_expert_hidden_size", "attn_res_block_size", "hidden_act"):
        assert key in raw and raw[key] == K3_CONFIG[key]
    from safetensors import safe_open
    with safe_open(str(k3_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert tuple(f.get_tensor("model.layers.1.self_attn.A_log").shape) == (16,)     # padded to head_dim
        assert f.get_tensor("model.layers.1.self_attn.q_conv1d.weight").dtype == torch.float32
    L = raw["num_hidden_layers"]
    assert all(f"model.layers.{i}.self_attn.g_proj.weight" in names for i in range(L))
    for suffix in ("block_sparse_moe.routed_expert_down_proj.weight", "block_sparse_moe.routed_expert_norm.weight",
                   "block_sparse_moe.experts.0.w1.weight", "self_attention_res_proj.weight", "mlp_res_norm.weight"):
        assert f"model.layers.2.{suffix}" in names
    assert "model.output_attn_res_proj.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names
    out = generate(k3, [5, 6, 7, 8], 12)
    assert len(out) == 12 and len(set(out)) > 1


def test_k3_verify_rolls_back_exactly(k3, monkeypatch):
    real = runner.sample
    prompt = [5, 17, 9, 33, 2]
    g = generate(k3, prompt, 6)
    for k in (0, 2, 4):
        drafts = g[1:5]
        drafts[k:] = [(t + 3) % 128 for t in drafts[k:]]
        seq = TargetSequence(k3, prompt, max_len=64)
        seq.prefill()
        assert len(seq.verify(Tree.chain(drafts)).result.accepted) == k
        seen = []
        monkeypatch.setattr(runner, "sample",
                            lambda lg, *a, _seen=seen, **kw: _seen.append(lg.clone()) or real(lg, *a, **kw))
        seq.decode()
        monkeypatch.setattr(runner, "sample", real)
        with torch.no_grad():
            want = forward_sequences(k3, torch.tensor([seq.tokens[:-1]])).logits[0, -1]
        assert (seen[0] - want).abs().max() < 1e-4


def test_a_session_reads_the_stream_its_draft_declares(k3, tmp_path):
    prompt = [5, 6, 7, 8, 9]
    feats = {}
    for stream in ("prefix", "attn_res"):
        seq = TargetSequence(k3, prompt, max_len=32, hidden_layers=(2, 5), hidden_stream=stream)
        feats[stream] = seq.prefill().hidden
        k3.tap_stream = stream
        want = forward_sequences(k3, torch.tensor([prompt]), hidden_layers=[2, 5]).hidden[0]
        k3.tap_stream = "prefix"
        assert (feats[stream] - want).abs().max() < 1e-5
    assert not torch.allclose(feats["prefix"], feats["attn_res"])
    from hybrid_models import save_tiny_kimi
    plain = load_model(save_tiny_kimi(tmp_path / "kimi"))
    with pytest.raises(ValueError, match="no Attention Residuals"):
        TargetSequence(plain, prompt, hidden_layers=(1,), hidden_stream="attn_res")
