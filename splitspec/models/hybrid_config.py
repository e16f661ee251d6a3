"""What the Kimi-family targets (KimiLinear, Kimi-K3's text model, DeepSeek-V3 / Kimi-K2) need
beyond `ModelConfig`: which layers are KDA and which MLA, which MLPs are MoE, and the MLA, KDA,
router and K3 fields, read once from `config.json` so the modules never look at raw JSON.

Spellings: checkpoints write `linear_attn_config` with 1-based `kda_layers` / `full_attn_layers`
and `first_k_dense_replace`; transformers re-saves them as `layer_types` / `mlp_layer_types` and
renames router fields (`num_experts`, `num_experts_per_token`, `num_expert_group`,
`moe_renormalize`, `num_shared_experts`, `model_max_length`). Both are accepted.

A multimodal wrapper whose text model is one of these (Kimi-K3's release,
`KimiK3ForConditionalGeneration`) is read through its `text_config` (`text_config()`); `WRAPPERS`
also says which tensor prefix is the text model's and which parts (vision) the loader skips."""
from __future__ import annotations

from dataclasses import dataclass, field

KIMI_ARCHITECTURES = ("KimiLinearForCausalLM",)
DEEPSEEK_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
HYBRID_ARCHITECTURES = KIMI_ARCHITECTURES + DEEPSEEK_ARCHITECTURES


@dataclass(frozen=True)
class Wrapper:
    """A multimodal folder whose text model is one of ours: its config.json nests the text config
    under `text_config`, its safetensors prefix the text model's tensors with `text_prefix`, and
    the tensors under `other_prefixes` (vision tower, projector) are not the target's."""
    text_model_types: dict                 # text_config.model_type -> our architecture
    text_prefix: str
    other_prefixes: tuple[str, ...]


# Kimi-K3's release: model_type kimi_k3, text_config.model_type kimi_linear (KimiLinearForCausalLM
# by remote code), tensors `language_model.model.…` / `language_model.lm_head.weight`, MoonViT
# under `vision_tower.` and its patch merger under `mm_projector.`.
WRAPPERS = {
    "KimiK3ForConditionalGeneration": Wrapper({"kimi_linear": "KimiLinearForCausalLM"}, "language_model.",
                                              ("vision_tower.", "mm_projector.")),
}
# Read from the wrapper when its text_config does not say (the release has them at the top level).
_WRAPPER_FALLBACKS = ("eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings")


def wrapper_of(raw: dict) -> Wrapper | None:
    archs = raw.get("architectures") or []
    return WRAPPERS.get(archs[0]) if archs else None


def text_config(raw: dict) -> dict:
    """The text model's config out of a wrapper's config.json (`raw` itself when it is no wrapper),
    with `architectures` set to ours; HybridConfigError naming the field when it cannot be read."""
    wrapper = wrapper_of(raw)
    if wrapper is None:
        return raw
    arch = raw["architectures"][0]
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise HybridConfigError(f"config.json: {arch} needs a text_config object (the text model's config.json "
                                f"fields); found {type(text).__name__}")
    mtype, archs = text.get("model_type"), text.get("architectures") or []
    if mtype not in wrapper.text_model_types and not (archs and archs[0] in wrapper.text_model_types.values()):
        raise HybridConfigError(f"config.json: text_config.model_type {mtype!r} of {arch} is not supported; "
                                f"expected one of {', '.join(wrapper.text_model_types)}")
    out = {k: raw[k] for k in _WRAPPER_FALLBACKS if k in raw}
    out.update(text)
    out["architectures"] = [archs[0] if archs and archs[0] in wrapper.text_model_types.values()
                            else wrapper.text_model_types[mtype]]
    return out
ACTIVATIONS = ("silu", "situ")
TAP_STREAMS = ("prefix", "attn_res")


class HybridConfigError(ValueError):
    pass


def _first(raw: dict, *keys, default=None):
    for k in keys:
        if raw.get(k) is not None:
            return raw[k]
    return default


@dataclass(frozen=True)
class HybridConfig:
    family: str                          # "kimi_linear" or "deepseek_v3"
    layer_types: tuple[str, ...]         # "kda" or "mla", per layer
    mlp_types: tuple[str, ...]           # "dense" or "moe", per layer
    hidden_act: str = "silu"
    # MLA
    num_heads: int = 1
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    attention_bias: bool = False
    use_rope: bool = False               # DeepSeek: rotary on the rope slice; Kimi: NoPE
    rope_interleave: bool = True
    rope: dict = field(default_factory=dict)
    mla_output_gate: bool = False        # K3: sigmoid(g_proj x) before o_proj
    # KDA
    linear_num_heads: int = 32
    linear_head_dim: int = 128
    conv_kernel: int = 4
    gate_lower_bound: float | None = None   # K3 safe gate: g = lb * sigmoid(exp(A) * (f + dt_bias))
    full_rank_gate: bool = False             # K3: output gate g_proj [H*Dv, hidden] instead of g_a/g_b
    # MoE
    intermediate_size: int = 0           # dense MLP
    moe_intermediate_size: int = 0
    num_experts: int = 0
    top_k: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    latent_dim: int | None = None        # K3 latent MoE: experts run at this width
    latent_norm: bool = False
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    # K3 Attention Residuals
    attn_res_block_size: int | None = None
    tap_stream: str = "prefix"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "mla"]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "kda"]

    @property
    def expert_names(self) -> tuple[str, str, str]:
        """(gate, up, down) names of a routed expert's projections in the checkpoint."""
        return ("w1", "w3", "w2") if self.family == "kimi_linear" else ("gate_proj", "up_proj", "down_proj")

    @property
    def moe_name(self) -> str:
        return "block_sparse_moe" if self.family == "kimi_linear" else "mlp"

    def latent_bytes_per_token(self, elem: int) -> int:
        """MLA cache per token, all layers: the normed latent and the rope key slice."""
        return len(self.mla_layers) * (self.kv_lora_rank + self.qk_rope_head_dim) * elem

    def expanded_kv_bytes_per_token(self, elem: int) -> int:
        """What the same layers would cache as expanded per-head K and V."""
        return len(self.mla_layers) * self.num_heads * (self.qk_head_dim + self.v_head_dim) * elem

    def state_bytes_per_session(self) -> int:
        """KDA state of one session, all layers, fp32: recurrent H x Dk x Dv plus the conv window."""
        h, d = self.linear_num_heads, self.linear_head_dim
        return len(self.kda_layers) * 4 * (h * d * d + 3 * h * d * (self.conv_kernel - 1))


def _layer_types(raw: dict, n: int, family: str) -> tuple[str, ...]:
    if family == "deepseek_v3":
        return ("mla",) * n
    lac = raw.get("linear_attn_config") or {}
    if raw.get("layer_types"):
        types = raw["layer_types"]
        if len(types) != n:
            raise HybridConfigError(f"config.json: layer_types has {len(types)} entries, num_hidden_layers is {n}")
        out = []
        for i, t in enumerate(types):
            if t not in ("linear_attention", "full_attention"):
                raise HybridConfigError(f"config.json: layer_types[{i}] = {t!r}; expected linear_attention "
                                        f"or full_attention")
            out.append("kda" if t == "linear_attention" else "mla")
        return tuple(out)
    if "kda_layers" in lac and "full_attn_layers" in lac:
        out = [None] * n
        for key, kind in (("kda_layers", "kda"), ("full_attn_layers", "mla")):
            for layer in lac[key]:      # 1-based in checkpoints
                if not 1 <= layer <= n:
                    raise HybridConfigError(f"config.json: linear_attn_config.{key} has {layer}; layers are 1..{n}")
                out[layer - 1] = kind
        missing = [i + 1 for i, t in enumerate(out) if t is None]
        if missing:
            raise HybridConfigError(f"config.json: layers {missing} (1-based) are in neither kda_layers nor "
                                    f"full_attn_layers")
        return tuple(out)
    # transformers' default when nothing is given (0-based i % 4 == 0, i > 0, is full attention)
    return tuple("mla" if i and i % 4 == 0 else "kda" for i in range(n))


def parse_hybrid(raw: dict, arch: str) -> HybridConfig:
    family = "kimi_linear" if arch in KIMI_ARCHITECTURES else "deepseek_v3"
    n = raw["num_hidden_layers"]
    layer_types = _layer_types(raw, n, family)
    if raw.get("mlp_layer_types"):
        mlp_types = tuple("moe" if t == "sparse" else "dense" for t in raw["mlp_layer_types"])
    else:
        # absent: transformers' class defaults (KimiLinear 1, DeepSeek-V3 3)
        k = _first(raw, "first_k_dense_replace", default=1 if family == "kimi_linear" else 3)
        mlp_types = tuple("dense" if i < k else "moe" for i in range(n))
    lac = raw.get("linear_attn_config") or {}
    heads = raw["num_attention_heads"]
    act = raw.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise HybridConfigError(f"config.json: hidden_act {act!r} is not supported; expected one of "
                                f"{', '.join(ACTIVATIONS)}")
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", float(raw.get("rope_theta", 10000.0)))
    if rope["rope_type"] not in ("default", "yarn"):
        raise HybridConfigError(f"config.json: rope type {rope['rope_type']!r} is not supported for MLA; "
                                f"expected default or yarn")
    use_rope = family == "deepseek_v3" or not raw.get("mla_use_nope", True)
    experts = _first(raw, "n_routed_experts", "num_experts", "num_local_experts", default=0)
    cfg = HybridConfig(
        family=family, layer_types=layer_types, mlp_types=mlp_types, hidden_act=act,
        num_heads=heads, q_lora_rank=raw.get("q_lora_rank"), kv_lora_rank=raw.get("kv_lora_rank", 512),
        qk_nope_head_dim=raw.get("qk_nope_head_dim", 128), qk_rope_head_dim=raw.get("qk_rope_head_dim", 64),
        v_head_dim=raw.get("v_head_dim") or 128, attention_bias=bool(raw.get("attention_bias", False)),
        use_rope=use_rope, rope_interleave=bool(raw.get("rope_interleave", True)), rope=rope,
        mla_output_gate=bool(raw.get("mla_use_output_gate", False)),
        linear_num_heads=_first(lac, "num_heads", default=raw.get("linear_num_heads", 32)),
        linear_head_dim=_first(lac, "head_dim", default=raw.get("linear_head_dim", 128)),
        conv_kernel=_first(lac, "short_conv_kernel_size", default=raw.get("linear_conv_kernel_dim", 4)),
        gate_lower_bound=_first(lac, "gate_lower_bound", default=raw.get("gate_lower_bound")),
        full_rank_gate=bool(_first(lac, "use_full_rank_gate", default=raw.get("use_full_rank_gate", False))),
        intermediate_size=raw["intermediate_size"],
        moe_intermediate_size=raw.get("moe_intermediate_size", 0),
        num_experts=experts,
        top_k=_first(raw, "num_experts_per_tok", "num_experts_per_token", default=1),
        n_group=_first(raw, "n_group", "num_expert_group", default=1),
        topk_group=_first(raw, "topk_group", default=1),
        norm_topk_prob=bool(_first(raw, "norm_topk_prob", "moe_renormalize", default=True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        n_shared_experts=_first(raw, "n_shared_experts", "num_shared_experts", default=0),
        latent_dim=raw.get("routed_expert_hidden_size"),
        latent_norm=bool(raw.get("latent_moe_use_norm", False)),
        situ_beta=float(raw.get("activation_situ_beta", 4.0)),
        situ_linear_beta=float(raw.get("activation_situ_linear_beta", 25.0)),
        attn_res_block_size=raw.get("attn_res_block_size"),
        tap_stream=raw.get("aux_hidden_stream", "prefix"),
    )
    if "moe" in mlp_types:
        if cfg.num_experts < 1 or not 1 <= cfg.top_k <= cfg.num_experts:
            raise HybridConfigError(f"config.json: {cfg.num_experts} experts with top-{cfg.top_k} routing")
        if cfg.num_experts % cfg.n_group or cfg.topk_group > cfg.n_group:
            raise HybridConfigError(f"config.json: {cfg.num_experts} experts in {cfg.n_group} groups, "
                                    f"top {cfg.topk_group} groups: not a valid grouping")
    if cfg.tap_stream not in TAP_STREAMS:
        raise HybridConfigError(f"config.json: aux_hidden_stream {cfg.tap_stream!r}; expected one of {TAP_STREAMS}")
    return cfg
