"""The Kimi / DeepSeek-V3 family decoder: per layer a KDA or an MLA token mixer, then a dense
GLU or a routed MoE; optionally K3's Attention Residuals. Same `forward_batch` / `tap` interface
as `dense.CausalLM`, so the runner, the scheduler and the services do not branch on the family.

Attention Residuals (`attn_res_block_size` B, K3). Our reading of the public description (to
check against the released modeling code before serving K3 weights): `prefix` is the running
residual sum (embedding plus every sublayer output); before layers 0, B, 2B, ... it is
snapshotted into a block list; before each attention, each MLP and once at the end, the
sublayer reads a softmax-weighted mix of [snapshots..., prefix], weighted by
proj(RMSNorm(source)) with a learned [1, hidden] `*_res_proj` per site. Draft taps read either
stream (`tap_stream`): `prefix` (the running sum after layer i) or `attn_res` (the mix layer
i + 1's attention consumes; after the last layer, the output mix)."""
from __future__ import annotations

import torch
from torch import nn

from splitspec.models.config import ModelConfig
from splitspec.models.hybrid_config import TAP_STREAMS
from splitspec.models.kda import KimiDeltaAttention
from splitspec.models.mla import MLAttention
from splitspec.models.dense import PagedBatch, RMSNorm
from splitspec.models.moe import GLU, MoE


def attn_res_mix(sources: list[torch.Tensor], norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """Σ_j softmax_j(proj(norm(s_j))) · s_j over the sources [N, H] (softmax in fp32)."""
    v = torch.stack(sources)                                    # [S, N, H]
    w = torch.softmax(proj(norm(v)).float().squeeze(-1), dim=0)   # [S, N]
    return (w[..., None] * v.float()).sum(0).to(v.dtype)


class HybridLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, kda_index: int, mla_index: int):
        super().__init__()
        h, hidden, eps = cfg.hybrid, cfg.hidden_size, cfg.rms_norm_eps
        situ = (h.situ_beta, h.situ_linear_beta)
        self.kind = h.layer_types[i]
        if self.kind == "kda":
            self.self_attn = KimiDeltaAttention(h, hidden, eps, kda_index)
        else:
            self.self_attn = MLAttention(h, hidden, mla_index, cfg.max_position_embeddings)
        if h.mlp_types[i] == "moe":
            self.mlp_name = h.moe_name
            setattr(self, h.moe_name, MoE(h, hidden, eps, situ))
        else:
            self.mlp_name = "mlp"
            self.mlp = GLU(hidden, h.intermediate_size, h.hidden_act, situ)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        if h.attn_res_block_size:
            self.self_attention_res_norm = RMSNorm(hidden, eps)
            self.self_attention_res_proj = nn.Linear(hidden, 1, bias=False)
            self.mlp_res_norm = RMSNorm(hidden, eps)
            self.mlp_res_proj = nn.Linear(hidden, 1, bias=False)

    def attn(self, x: torch.Tensor, positions: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        x = self.input_layernorm(x)
        if self.kind == "kda":
            return self.self_attn(x, batch.states)
        return self.self_attn(x, positions, batch)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.mlp_name)(self.post_attention_layernorm(x))


class HybridBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hybrid
        kda, mla = h.kda_layers, h.mla_layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            HybridLayer(cfg, i, kda.index(i) if i in kda else -1, mla.index(i) if i in mla else -1)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if h.attn_res_block_size:
            self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(cfg.hidden_size, 1, bias=False)


class HybridLM(nn.Module):
    is_hybrid = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = HybridBackbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.tap_stream = cfg.hybrid.tap_stream

    def fp32_parameters(self) -> list[nn.Parameter]:
        """Kept in fp32 whatever the serving dtype: routing decisions and the decay bias are
        sensitive to rounding (the reference keeps them fp32 too)."""
        return [p for n, p in self.named_parameters()
                if n.endswith(("gate.weight", "e_score_correction_bias", "dt_bias", "A_log"))
                or "conv1d" in n]

    def tap(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Plain residual stack: a draft's feature of layer `layer` is transformers'
        hidden_states[layer + 1]; the last layer's is after the final norm."""
        return self.model.norm(x) if layer == self.cfg.num_hidden_layers - 1 else x

    def forward_batch(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch, *,
                      hidden_layers=(), logits_index: torch.Tensor | None = None, max_position: int | None = None):
        """As `CausalLM.forward_batch`; `batch.states` carries the KDA rows (None: no KDA layer)."""
        if self.cfg.hybrid.attn_res_block_size:
            return self._forward_attn_res(input_ids, positions, batch, list(hidden_layers), logits_index)
        x = self.model.embed_tokens(input_ids)
        wanted, hidden = {}, {}
        for key in hidden_layers:       # a plain residual stack has one stream: (layer, stream) reads it too
            wanted.setdefault(key if isinstance(key, int) else key[0], []).append(key)
        for i, layer in enumerate(self.model.layers):
            x = x + layer.attn(x, positions, batch)
            x = x + layer.ffn(x)
            for key in wanted.get(i, ()):
                hidden[key] = self.tap(i, x)
        if logits_index is not None:
            x = x[logits_index]
        return self.lm_head(self.model.norm(x)), hidden

    def _forward_attn_res(self, input_ids, positions, batch, wanted, logits_index):
        streams = {}        # layer -> [(key, stream)]: an int key reads the model's default stream
        for key in wanted:
            layer, stream = (key, self.tap_stream) if isinstance(key, int) else key
            if stream not in TAP_STREAMS:
                raise ValueError(f"tap stream {stream!r}: expected one of {TAP_STREAMS}")
            streams.setdefault(layer, []).append((key, stream))
        B = self.cfg.hybrid.attn_res_block_size
        layers, last = self.model.layers, self.cfg.num_hidden_layers - 1
        # Block Attention Residuals (K3 report §2.2, Eq. 8-10): every sublayer reads a softmax mix,
        # by its own pseudo-query, over the block representations: b_0 = the token embedding, each
        # sealed block's sum of sublayer outputs, and the current block's partial sum (absent at a
        # block's first sublayer). A block seals after every B layers.
        blocks, partial = [self.model.embed_tokens(input_ids)], None
        prefix = blocks[0]          # what a plain residual stream would hold: the "prefix" tap stream
        hidden = {}

        def sources():
            return blocks if partial is None else blocks + [partial]

        def add(out):
            nonlocal partial, prefix
            partial = out if partial is None else partial + out
            prefix = prefix + out

        mix = attn_res_mix(sources(), layers[0].self_attention_res_norm, layers[0].self_attention_res_proj)
        for i, layer in enumerate(layers):
            add(layer.attn(mix, positions, batch))
            add(layer.ffn(attn_res_mix(sources(), layer.mlp_res_norm, layer.mlp_res_proj)))
            if (i + 1) % B == 0:
                blocks.append(partial)
                partial = None
            # the mix the next attention reads (the "attn_res" tap of layer i), or the output mix
            q = (layers[i + 1].self_attention_res_norm, layers[i + 1].self_attention_res_proj) if i < last else \
                (self.model.output_attn_res_norm, self.model.output_attn_res_proj)
            mix = attn_res_mix(sources(), *q)
            for key, stream in streams.get(i, ()):
                feat = prefix if stream == "prefix" else mix
                hidden[key] = self.model.norm(mix) if i == last else feat
        x = mix if logits_index is None else mix[logits_index]
        return self.lm_head(self.model.norm(x)), hidden
