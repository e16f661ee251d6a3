"""FP4-packed twins of tiny MoE checkpoints for tests: every routed expert's weight of a saved
folder rewritten as compressed-tensors `mxfp4-pack-quantized` or `nvfp4-pack-quantized`
(`X.weight_packed`, `X.weight_scale`[, `X.weight_global_scale`]) with the quantization_config
that declares it, and the *dequantized twin*: the same folder with those experts stored as the
plain float tensors they decode to, which transformers and our plain path load."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from splitspec.models.fp4 import (FORMAT, NV_FORMAT, dequantize_mxfp4, dequantize_nvfp4, quantize_mxfp4,
                                       quantize_nvfp4)

EXPERT = re.compile(r".*\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight")


def quantization_config(fmt: str) -> dict:
    group = 16 if fmt == NV_FORMAT else 32
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": [r"re:.*\.experts\.\d+\..*"], "format": fmt,
                                          "weights": {"num_bits": 4, "type": "float", "group_size": group,
                                                      "symmetric": True, "strategy": "group"}}}}


def save_packed_twin(src: Path, packed: Path, twin: Path, fmt: str = FORMAT) -> tuple[Path, Path]:
    """(packed folder, dequantized twin folder) of the single-file checkpoint at `src`."""
    tensors = load_file(str(Path(src) / "model.safetensors"))
    out, plain = {}, {}
    for name, t in tensors.items():
        if EXPERT.fullmatch(name):
            base = name[:-len(".weight")]
            if fmt == NV_FORMAT:
                p, s, g = quantize_nvfp4(t)
                out[base + ".weight_packed"], out[base + ".weight_scale"], out[base + ".weight_global_scale"] = p, s, g
                plain[name] = dequantize_nvfp4(p, s, g).to(t.dtype)
            else:
                p, s = quantize_mxfp4(t)
                out[base + ".weight_packed"], out[base + ".weight_scale"] = p, s
                plain[name] = dequantize_mxfp4(p, s).to(t.dtype)
        else:
            out[name] = plain[name] = t
    for folder, data in ((packed, out), (twin, plain)):
        folder = Path(folder)
        shutil.copytree(src, folder, dirs_exist_ok=True)
        save_file({k: v.contiguous() for k, v in data.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((Path(packed) / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(fmt)
    (Path(packed) / "config.json").write_text(json.dumps(cfg, indent=2))
    return Path(packed), Path(twin)
