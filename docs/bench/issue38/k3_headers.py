"""A Kimi-K3-shaped text model folder with every tensor's real name, dtype and shape but no
weights: config.json with K3's published sizes (93 layers = 69 KDA + 24 gated MLA, hidden 7168,
896 routed experts top-16 in a 3584-wide latent, expert intermediate 3072, 2 shared experts,
vocab 163,840), the routed experts compressed-tensors `mxfp4-pack-quantized` (uint8 codes and
E8M0 scales) and the rest BF16 (conv weights fp32), as the release stores them, in safetensors
files whose data is a sparse hole. `splitspec preflight` reads only config.json and the
headers, so it computes K3's per-rank memory from this folder exactly as from the release.

    python docs/bench/issue38/k3_headers.py --out runs/k3-headers
    splitspec preflight runs/k3-headers --tensor-parallel-size 8 --device-memory-gb 288 ...
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))
from hybrid_models import K3_CONFIG  # noqa: E402 - the published field names, tiny sizes

# K3_CONFIG at the published sizes (research: shared/research/kimi-k3-target.md)
K3 = {**K3_CONFIG,
      "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 33792, "moe_intermediate_size": 3072,
      "num_hidden_layers": 93, "num_attention_heads": 96, "num_key_value_heads": 96,
      "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
      "linear_attn_config": {**K3_CONFIG["linear_attn_config"], "head_dim": 128, "num_heads": 96,
                             "full_attn_layers": list(range(4, 93, 4)) + [93],
                             "kda_layers": [i for i in range(1, 94) if i % 4 and i != 93]},
      "num_experts": 896, "num_experts_per_token": 16, "routed_expert_hidden_size": 3584,
      "attn_res_block_size": 12, "max_position_embeddings": 1048576,
      "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
      "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                              "ignore": ["lm_head"],
                              "config_groups": {"group_0": {"targets": [r"re:.*\.experts\.\d+\.w[123]$"],
                                                            "weights": {"num_bits": 4, "type": "float",
                                                                        "group_size": 32, "symmetric": True}}}}}
DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32", torch.uint8: "U8"}


def tensors(raw: dict) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype, shape) of every tensor of the checkpoint: the model built on the
    meta device with two experts, expert 0's tensors then repeated for all 896."""
    from splitspec.models.config import ModelConfig
    from splitspec.models.hybrid import HybridLM
    small = {**raw, "num_experts": 2, "num_experts_per_token": 2}
    small.pop("quantization_config")
    with torch.device("meta"):
        model = HybridLM(ModelConfig.from_dict(small))
    E = raw["num_experts"]
    out = {}
    for name, p in model.state_dict().items():
        dtype = "F32" if "conv1d" in name else "BF16"
        shape = list(p.shape)
        if name.endswith(("gate.weight", "e_score_correction_bias")) and ".experts." not in name:
            shape[0] = E
        m = name.split(".experts.")
        if len(m) == 2:
            idx, rest = m[1].split(".", 1)
            if idx != "0":
                continue
            out_f, in_f = shape
            for e in range(E):
                base = f"{m[0]}.experts.{e}.{rest[:-len('.weight')]}"
                out[base + ".weight_packed"] = ("U8", [out_f, in_f // 2])
                out[base + ".weight_scale"] = ("U8", [out_f, in_f // 32])
            continue
        if name.endswith("A_log"):
            shape = [raw["linear_attn_config"]["head_dim"]]    # K3 pads A_log to the head dim
        out[name] = (dtype, shape)
    return out


def write(folder: Path, table: dict, shards: int) -> int:
    names = sorted(table)
    per = -(-len(names) // shards)
    weight_map, total = {}, 0
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {}, 0
        for n in names[s * per:(s + 1) * per]:
            dtype, shape = table[n]
            size = {"BF16": 2, "F32": 4, "U8": 1}[dtype]
            for d in shape:
                size *= d
            header[n] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[n] = fname
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        with open(folder / fname, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            f.truncate(8 + len(blob) + offset)          # the data: a sparse hole, no disk used
        total += offset
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shards", type=int, default=64)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(K3, indent=2) + "\n")
    table = tensors(K3)
    total = write(out, table, a.shards)
    print(f"wrote {out}: {len(table):,} tensors, {total / 1e12:.3f} TB as stored (sparse files)")


if __name__ == "__main__":
    main()
