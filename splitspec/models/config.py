"""Model configuration read from a Hugging Face `config.json`.

Only what the forward pass needs is kept, normalised across the Llama, Qwen2 and Qwen3
families and across transformers' old (`rope_theta`/`rope_scaling`) and new
(`rope_parameters`) spellings, so the rest of the engine never looks at raw JSON.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from splitspec.models.hybrid_config import HYBRID_ARCHITECTURES, WRAPPERS, HybridConfig, HybridConfigError, parse_hybrid, text_config

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM") + HYBRID_ARCHITECTURES
SUPPORTED_ROPE_TYPES = ("default", "llama3")


class ConfigError(ValueError):
    """A checkpoint's config cannot be served; the message names the field."""


@dataclass(frozen=True)
class TransformerShape:
    """The sizes a decoder stack is built from: a target's (ModelConfig) and a draft's
    (draft_service/dflash.py DFlashConfig) alike."""
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


@dataclass(frozen=True)
class ModelConfig(TransformerShape):
    architecture: str
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    hybrid: HybridConfig | None = None   # Kimi / DeepSeek-V3 families: layer kinds, MLA, KDA, MoE fields

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", "default")

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        """`raw` is a config.json: a text model's, or a multimodal wrapper's (Kimi-K3's
        `KimiK3ForConditionalGeneration`), whose `text_config` is read instead."""
        try:
            raw = text_config(raw)
        except HybridConfigError as exc:
            raise ConfigError(str(exc)) from None
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"config.json: architectures={archs!r} is not supported; expected one of "
                f"{', '.join(SUPPORTED_ARCHITECTURES + tuple(WRAPPERS))}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if not isinstance(raw.get(key), int) or raw[key] <= 0:
                raise ConfigError(f"config.json: {key} must be a positive integer, got {raw.get(key)!r}")
        if arch in HYBRID_ARCHITECTURES:
            return cls._from_hybrid(raw, arch)
        heads = raw["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ConfigError(f"config.json: num_attention_heads={heads} is not a multiple of "
                              f"num_key_value_heads={kv_heads}")
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads

        # transformers >= 5 nests rope settings in `rope_parameters`; older files use
        # top-level `rope_theta` and an optional `rope_scaling` dict.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.setdefault("rope_type", "default")
        if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"config.json: rope type {rope['rope_type']!r} is not supported; "
                              f"expected one of {', '.join(SUPPORTED_ROPE_TYPES)}")
        if rope["rope_type"] == "llama3":
            for key in ("factor", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings"):
                if key not in rope:
                    raise ConfigError(f"config.json: llama3 rope scaling needs {key!r}")
        theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))

        attention_bias = bool(raw.get("attention_bias", False))
        if arch == "Qwen2ForCausalLM":
            if raw.get("use_sliding_window"):
                raise ConfigError("config.json: use_sliding_window=true is not supported")
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = attention_bias
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
        )

    @classmethod
    def _from_hybrid(cls, raw: dict, arch: str) -> "ModelConfig":
        try:
            hybrid = parse_hybrid(raw, arch)
        except HybridConfigError as exc:
            raise ConfigError(str(exc)) from None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        heads = raw["num_attention_heads"]
        # head_dim / num_key_value_heads describe the MLA latent row (one shared "head"), so code that
        # sizes per-token K/V from them sees the latent cache.
        return cls(architecture=arch, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
                   intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
                   num_attention_heads=heads, num_key_value_heads=1, head_dim=hybrid.kv_lora_rank,
                   rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                   rope_theta=float(hybrid.rope.get("rope_theta", 10000.0)), rope_scaling=hybrid.rope,
                   max_position_embeddings=int(raw.get("max_position_embeddings") or raw.get("model_max_length")
                                               or 4096),
                   tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                   eos_token_ids=eos_ids, hybrid=hybrid)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"{cfg_file}: not found; --model-path must be a Hugging Face model folder")
        return cls.from_dict(json.loads(cfg_file.read_text()))
