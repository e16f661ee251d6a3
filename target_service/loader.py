"""Load a local Hugging Face checkpoint folder: config, safetensors weights (single file or
sharded with an index, always memory-mapped, never pickle), generation config and tokenizer."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ConfigError, ModelConfig
from .model import CausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class CheckpointError(ValueError):
    """Weights are missing or misshapen; the message names the tensor."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; expected one of float32, bfloat16, float16")
    return DTYPES[name]


def resolve_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported; expected cpu or cuda")
    return dev


def weight_files(path: Path) -> dict[str, Path]:
    """Map tensor name -> file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / fname for name, fname in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{path}: neither model.safetensors nor model.safetensors.index.json found")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def load_state(module: torch.nn.Module, files: dict[str, Path], *, prefix: str = "",
               strict: bool = True, skip: tuple[str, ...] = (), source=None, adapt=None,
               ignored=None) -> None:
    """Copy tensors named `prefix + param_name` from safetensors files into `module`,
    checking every name and shape, converting dtype on the way. Hooks for families whose
    checkpoints spell things their own way: source(name, files) -> the checkpoint's name of a
    parameter; adapt(name, tensor, param) -> the tensor reshaped to the parameter;
    ignored(checkpoint name) -> True for tensors that may be present but are not used."""
    params = dict(module.named_parameters(remove_duplicate=True))
    by_file: dict[Path, list[str]] = {}
    names = {}
    for name in params:
        if name in skip:
            continue
        full = prefix + name if source is None else source(prefix + name, files)
        if full not in files:
            raise CheckpointError(f"tensor {full!r} is missing from the checkpoint")
        names[name] = full
        by_file.setdefault(files[full], []).append(name)
    if strict:
        # Skipped names (a tied lm_head.weight some exports store anyway) are not "unexpected".
        known = set(names.values()) | {prefix + n for n in skip}
        extra = sorted(n for n in files if n.startswith(prefix) and n not in known
                       and not n.endswith("rotary_emb.inv_freq") and not (ignored and ignored(n)))
        if extra:
            raise CheckpointError(f"unexpected tensors in the checkpoint: {extra[:5]}")
    with torch.no_grad():
        for fname, pnames in by_file.items():
            with safe_open(fname, framework="pt") as f:
                for name in pnames:
                    t = f.get_tensor(names[name])
                    p = params[name]
                    if adapt is not None:
                        t = adapt(name, t, p)
                    if tuple(t.shape) != tuple(p.shape):
                        raise CheckpointError(f"tensor {names[name]!r} has shape {tuple(t.shape)}, "
                                              f"expected {tuple(p.shape)} from config.json")
                    p.copy_(t.to(p.dtype))


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    if cfg.hybrid is not None:
        from .hybrid import HybridLM
        with torch.device("meta"):
            model = HybridLM(cfg)
        model = model.to_empty(device=device).to(dtype)
        for p in model.fp32_parameters():
            p.data = p.data.float()
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:  # to_empty unties shared parameters
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def load_model(path: str | Path, *, dtype="float32", device="cpu") -> CausalLM:
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    eos = read_eos_ids(path) or cfg.eos_token_ids
    if eos != cfg.eos_token_ids:
        cfg = ModelConfig(**{**cfg.__dict__, "eos_token_ids": eos})
    model = build_model(cfg, parse_dtype(dtype), resolve_device(device))
    files = weight_files(path)
    skip = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    if cfg.hybrid is not None:
        from .hybrid_weights import adapt_tensor, checkpoint_name, ignored
        load_state(model, files, skip=skip, source=checkpoint_name, adapt=adapt_tensor,
                   ignored=lambda n: ignored(cfg, n))
    else:
        load_state(model, files, skip=skip)
    return model.eval().requires_grad_(False)


def read_eos_ids(path: Path) -> tuple[int, ...]:
    gen = path / "generation_config.json"
    if not gen.is_file():
        return ()
    eos = json.loads(gen.read_text()).get("eos_token_id")
    if isinstance(eos, int):
        return (eos,)
    return tuple(eos or ())


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise ConfigError(f"{file}: not found")
    return Tokenizer.from_file(str(file))


def tokenizer_hash(path: str | Path) -> str:
    """Content hash of tokenizer.json, used to check that a draft and gateway agree with the target."""
    file = Path(path) / "tokenizer.json"
    return hashlib.sha256(file.read_bytes()).hexdigest()[:16] if file.is_file() else ""


@dataclass
class Checkpoint:
    path: Path
    model: CausalLM
    tokenizer: object | None

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg


def load_checkpoint(path: str | Path, *, dtype="float32", device="cpu") -> Checkpoint:
    path = Path(path)
    tok = load_tokenizer(path) if (path / "tokenizer.json").is_file() else None
    return Checkpoint(path, load_model(path, dtype=dtype, device=device), tok)
