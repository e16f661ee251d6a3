"""A tiny folder in the layout of Kimi-K3's released checkpoint (`moonshotai/Kimi-K3`), written
from the published field and tensor names (shared/research/kimi-k3-target.md §1, and the
release's config as public converters and loaders reproduce it):

* config.json is the multimodal wrapper: `architectures: ["KimiK3ForConditionalGeneration"]`,
  `model_type: kimi_k3`, remote-code `auto_map`, the token ids at the top level, a
  `vision_config` (MoonViT3d + patch merger), and the text model's config nested as
  `text_config` (`model_type: kimi_linear`, `KimiLinearForCausalLM`) carrying the
  compressed-tensors `quantization_config` (`mxfp4-pack-quantized`, one group targeting
  `Linear`, weights 4-bit float, group 32, uint8 scales, no activations; the published `ignore`
  list: attention, shared experts, the dense MLP, lm_head, vision tower, projector).
* safetensors shards with an index: the text model's tensors under `language_model.`, every
  routed expert projection (`block_sparse_moe.experts.E.w1/w2/w3`) as `weight_packed` uint8
  [out, in/2] + `weight_scale` uint8 [out, in/32], the KDA short convs fp32, everything else
  bf16, and a few vision tensors (`vision_tower.*`, `mm_projector.*`) in a trailing shard.

`save_k3_release(release, plain)` also writes `plain`: the same model as a plain text folder
(`KimiLinearForCausalLM`, unprefixed names, fp32) holding exactly what the release decodes to
(experts dequantized, the rest bf16-rounded), so the two must load to identical weights."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hybrid_models import save_tiny_k3
from splitspec.models.fp4 import dequantize_mxfp4, quantize_mxfp4

TEXT_PREFIX = "language_model."
EXPERT = re.compile(r"model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]\.weight")
IGNORE = [r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
          r"re:.*lm_head.*", r"re:.*vision_tower.*", r"re:.*mm_projector.*"]
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized", "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group",
                    "dynamic": False, "observer": "minmax", "scale_dtype": "torch.uint8"},
        "input_activations": None, "output_activations": None}},
    "ignore": IGNORE, "kv_cache_scheme": None,
}
VISION_CONFIG = {"patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4,
                 "pos_emb_type": "divided_fixed", "vt_num_hidden_layers": 1, "vt_hidden_size": 16,
                 "vt_intermediate_size": 32, "vt_num_attention_heads": 2, "merge_kernel_size": [2, 2],
                 "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2", "mm_hidden_size": 16,
                 "text_hidden_size": 64}
# Sizes the tiny text model needs for MXFP4: every expert input dim (the latent width for w1/w3,
# the expert intermediate for w2) a multiple of 32.
TEXT_CHANGES = {"moe_intermediate_size": 64, "routed_expert_hidden_size": 32}   # 32-wide groups at TP=2
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _vision_tensors(gen: torch.Generator) -> dict[str, torch.Tensor]:
    def t(*shape):
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    return {"vision_tower.patch_embed.proj.weight": t(16, 3, 14, 14),
            "vision_tower.encoder.blocks.0.wqkv.weight": t(48, 16),
            "vision_tower.encoder.final_layernorm.weight": t(16),
            "mm_projector.pre_norm.weight": t(16),
            "mm_projector.proj.0.weight": t(64, 64),
            "mm_projector.proj.2.weight": t(64, 64)}


def write_shards(folder: Path, tensors: dict[str, torch.Tensor], groups: list[list[str]]) -> None:
    """One safetensors file per group of names, and model.safetensors.index.json over them."""
    weight_map, total = {}, 0
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in names}, str(folder / fname), metadata={"format": "pt"})
        for n in names:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def release_tensors(plain: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the release's text tensors, prefixed; the plain fp32 tensors they decode to)."""
    out, decoded = {}, {}
    for name, t in plain.items():
        if EXPERT.fullmatch(name):
            packed, scales = quantize_mxfp4(t)
            base = TEXT_PREFIX + name[:-len(".weight")]
            out[base + ".weight_packed"], out[base + ".weight_scale"] = packed, scales
            decoded[name] = dequantize_mxfp4(packed, scales)
        elif "conv1d" in name:
            out[TEXT_PREFIX + name] = t.float()
            decoded[name] = t.float()
        else:
            out[TEXT_PREFIX + name] = t.to(torch.bfloat16)
            decoded[name] = t.to(torch.bfloat16).float()
    return out, decoded


def save_k3_release(release, plain, *, seed: int = 0, shards: int = 3, tokenizer: bool = False,
                    **changes) -> tuple[Path, Path]:
    """Write the tiny released-layout folder at `release` and its plain twin at `plain`."""
    release, plain = Path(release), Path(plain)
    save_tiny_k3(plain, seed=seed, tokenizer=tokenizer, **{**TEXT_CHANGES, **changes})
    text_cfg = json.loads((plain / "config.json").read_text())
    text, decoded = release_tensors(load_file(str(plain / "model.safetensors")))
    save_file(decoded, str(plain / "model.safetensors"))          # the plain twin: what the release decodes to

    release.mkdir(parents=True, exist_ok=True)
    nested = {k: v for k, v in text_cfg.items() if k not in TOKEN_IDS}
    nested.update({"auto_map": {"AutoConfig": "configuration_kimi_linear.KimiLinearConfig",
                                "AutoModel": "modeling_kimi_linear.KimiLinearModel",
                                "AutoModelForCausalLM": "modeling_kimi_linear.KimiLinearForCausalLM"},
                   "torch_dtype": "bfloat16", "quantization_config": QUANTIZATION_CONFIG})
    wrapper = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
               "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiK3Config",
                            "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
                            "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration"},
               **{k: text_cfg[k] for k in TOKEN_IDS}, "media_placeholder_token_id": text_cfg["vocab_size"] - 3,
               "tie_word_embeddings": False, "torch_dtype": "bfloat16",
               "text_config": nested, "vision_config": VISION_CONFIG}
    (release / "config.json").write_text(json.dumps(wrapper, indent=2) + "\n")
    for extra in plain.iterdir():
        if extra.name not in ("config.json", "model.safetensors"):
            shutil.copy(extra, release / extra.name)
    vision = _vision_tensors(torch.Generator().manual_seed(seed + 7))
    names = sorted(text)
    per = -(-len(names) // max(shards - 1, 1))
    groups = [names[i:i + per] for i in range(0, len(names), per)] + [sorted(vision)]
    write_shards(release, {**text, **vision}, groups)
    return release, plain


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (sharded) folder, by its stored name."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return load_file(str(folder / "model.safetensors"))
    out = {}
    for fname in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        out.update(load_file(str(folder / fname)))
    return out


def rewrite(src: Path, dst: Path, edit=None, config=None) -> Path:
    """A copy of folder `src` at `dst` with its tensors passed through `edit(dict) -> dict` (saved as
    one model.safetensors) and its config.json through `config(dict) -> dict`."""
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    if edit is not None:
        tensors = edit(read_folder(src))
        for f in list(dst.glob("model*.safetensors")) + list(dst.glob("model.safetensors.index.json")):
            f.unlink()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    if config is not None:
        raw = config(json.loads((src / "config.json").read_text()))
        (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return dst
