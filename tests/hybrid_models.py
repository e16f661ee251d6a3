"""Tiny random Kimi-family checkpoints for tests (CPU, a few hundred KB each).

* `save_tiny_kimi(path, kda=..., mla=...)`: transformers' own `KimiLinearForCausalLM` (1-based
  `linear_attn_config` layer lists, `first_k_dense_replace`), saved with `save_pretrained`, so the
  folder has the checkpoint tensor names (q/k/v_conv1d, f_a/f_b_proj, block_sparse_moe experts
  w1/w2/w3) that transformers writes back.
* `save_tiny_deepseek(path, yarn=...)`: transformers' `DeepseekV3ForCausalLM` (q low-rank, rotary
  with interleaved pairs, grouped top-k routing; YaRN optional).
* `save_tiny_k3(path)`: a K3-shaped text model (no transformers class exists): K3's config fields
  (`gate_lower_bound`, `use_full_rank_gate`, `mla_use_output_gate`, `routed_expert_hidden_size`,
  `latent_moe_use_norm`, `hidden_act: situ`, `attn_res_block_size`, ...) and its tensor names
  (`g_proj`, `routed_expert_*`, `*_res_norm` / `*_res_proj`, A_log zero-padded to the head dim,
  fp32 conv weights), random weights written with safetensors.

Every norm weight and the router's correction bias are perturbed away from their 1 / 0 init so a
forward that forgot one cannot match by luck."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tiny_models import EOS_ID, save_tiny_tokenizer

KIMI_DIMS = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=2,
                 num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)


def _perturb(model, seed: int, scale: float = 0.15) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and "conv" not in name and "A_log" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "norm" in name and name.endswith("weight"):
                t.copy_(1.0 + 0.3 * torch.randn(t.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=gen))


def _finish(path: Path, vocab: int, tokenizer: bool) -> Path:
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID, "do_sample": False}) + "\n")
    if tokenizer:
        save_tiny_tokenizer(path, vocab)
    return path


def save_tiny_kimi(path, *, kda=(1, 2, 3), mla=(4,), vocab_size: int = 128, experts: int = 4, top_k: int = 2,
                   seed: int = 0, tokenizer: bool = False, max_position_embeddings: int = 1024,
                   tie_word_embeddings: bool = False) -> Path:
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    path = Path(path)
    torch.manual_seed(seed)
    cfg = KimiLinearConfig(vocab_size=vocab_size, num_hidden_layers=len(kda) + len(mla), q_lora_rank=None,
                           num_local_experts=experts, num_experts_per_tok=top_k, n_shared_experts=1,
                           linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4,
                                               "kda_layers": list(kda), "full_attn_layers": list(mla)},
                           first_k_dense_replace=1, pad_token_id=1, bos_token_id=2, eos_token_id=EOS_ID,
                           max_position_embeddings=max_position_embeddings,
                           tie_word_embeddings=tie_word_embeddings, **KIMI_DIMS)
    model = KimiLinearForCausalLM(cfg).eval()
    _perturb(model, seed)
    model.save_pretrained(str(path))
    return _finish(path, vocab_size, tokenizer)


def save_tiny_deepseek(path, *, yarn: bool = False, vocab_size: int = 128, seed: int = 0, **dims) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    path = Path(path)
    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg = DeepseekV3Config(**{**dict(vocab_size=vocab_size, num_hidden_layers=3, q_lora_rank=32, n_routed_experts=8,
                                     num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                                     n_shared_experts=1, routed_scaling_factor=2.5, rope_parameters=rope,
                                     max_position_embeddings=256, pad_token_id=1, bos_token_id=2,
                                     eos_token_id=EOS_ID),
                              **KIMI_DIMS, **dims})
    model = DeepseekV3ForCausalLM(cfg).eval()
    _perturb(model, seed)
    model.save_pretrained(str(path))
    return _finish(path, vocab_size, False)


# K3's text config with the sizes shrunk (field names as the released config spells them).
K3_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 24,
    "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 2,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "mla_use_nope": True, "mla_use_output_gate": True,
    "linear_attn_config": {"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4,
                           "use_full_rank_gate": True, "gate_lower_bound": -5.0,
                           "kda_layers": [1, 2, 3, 5, 6], "full_attn_layers": [4, 7, 8]},
    "first_k_dense_replace": 1, "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2,
    "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True, "routed_scaling_factor": 1.0,
    "topk_method": "noaux_tc", "routed_expert_hidden_size": 32, "latent_moe_use_norm": True,
    "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
    "attn_res_block_size": 3, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "max_position_embeddings": 1024, "num_nextn_predict_layers": 0,
    "bos_token_id": 2, "eos_token_id": EOS_ID, "pad_token_id": 1,
}


def save_tiny_k3(path, *, seed: int = 0, tokenizer: bool = False, **changes) -> Path:
    from safetensors.torch import save_file

    from splitspec.models.config import ModelConfig
    from splitspec.models.hybrid import HybridLM
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = {**K3_CONFIG, **changes}
    torch.manual_seed(seed)
    model = HybridLM(ModelConfig.from_dict(raw))
    _perturb(model, seed)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    heads, dim = raw["linear_attn_config"]["num_heads"], raw["linear_attn_config"]["head_dim"]
    gen = torch.Generator().manual_seed(seed + 1)
    for name in list(state):
        if name.endswith("A_log"):      # K3 stores the per-head A_log zero-padded to the head dim
            padded = torch.zeros(dim)
            padded[:heads] = torch.rand(heads, generator=gen) * 2
            state[name] = padded
        elif name.endswith("dt_bias"):
            state[name] = torch.randn(state[name].shape, generator=gen) * 0.5
        elif "conv1d" in name:
            state[name] = (torch.randn(state[name].shape, generator=gen) * 0.5).float()
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return _finish(path, raw["vocab_size"], tokenizer)
