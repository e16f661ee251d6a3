"""Load a local Hugging Face checkpoint folder: config, safetensors weights (single file or
sharded with an index, always memory-mapped, never pickle), generation config and tokenizer.

**Kimi-K3's released folder** loads as it is published:

* The multimodal wrapper (`KimiK3ForConditionalGeneration`): the text model's config is its
  `text_config` (`ModelConfig.from_dict`), its tensors are read without their `language_model.`
  prefix, and the vision tower / projector (`vision_tower.*`, `mm_projector.*`) are skipped with
  one log line (`checkpoint_tensors_skipped`); any other tensor outside the text model is an error
  naming it (`hybrid_config.WRAPPERS`).
* MXFP4 routed experts (compressed-tensors `mxfp4-pack-quantized`: `X.weight_packed` uint8 and
  `X.weight_scale` E8M0 per 32 inputs, see `mxfp4.py`) are **dequantized at load**, one tensor
  at a time, to the model's dtype; tensor parallelism then cuts the dequantized tensor along the
  expert intermediate like any other (the `adapt` hook runs after dequantizing). Only modules the
  `quantization_config` covers (a config group's `targets`, minus `ignore`) may be stored packed;
  a covered module stored as a plain `X.weight` loads as it is (the release keeps its routers and
  latent projections BF16 although they are Linear-class targets), everything else loads as today.
  The cost is memory: at K3's shape the routed experts (2.72T weights) are 5.45 TB in bf16
  against 1.45 TB packed (4.25 bits a weight): 681 GB against 181 GB per rank at TP=8; see
  docs/hybrid-targets.md ("The released Kimi-K3 folder"). A dequantizing matmul that keeps them
  packed is not built: this engine serves the test-sized models on CPU."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from safetensors import safe_open

from splitspec.models import gguf, gguf_packed
from splitspec.models.config import ConfigError, ModelConfig
from splitspec.models.hybrid_config import wrapper_of
from splitspec.models.dense import CausalLM
from splitspec.models.fp4 import Fp4Scheme, PackedLinear, QuantizationConfigError, parse_quantization

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PACKED, SCALE, GLOBAL = ".weight_packed", ".weight_scale", ".weight_global_scale"
PACKED_PARTS = (PACKED, SCALE, GLOBAL)     # the tensors one FP4-packed weight is stored as

log = structlog.get_logger(__name__)


class CheckpointError(ValueError):
    """Weights are missing or misshapen; the message names the tensor."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; expected one of float32, bfloat16, float16")
    return DTYPES[name]


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bf16 matmuls natively (AVX512-BF16 or AMX-BF16). Without them
    torch emulates bf16 and it runs many times slower than float32 (pytorch issue 146508)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device, packed: bool = False) -> str:
    """--dtype auto: bfloat16 on CUDA and on CPUs with native bf16, float32 elsewhere; float32 for
    a target whose weights stay packed (`serves_packed`): its matmuls cost the same at either
    dtype (the int4 kernel takes bf16 activations), and a float32 residual stream keeps near-tied
    logits from being decided by bf16 rounding."""
    if name != "auto":
        return name
    if packed:
        return "float32"
    return "bfloat16" if device.type == "cuda" or cpu_has_native_bf16() else "float32"


def serves_packed(path, device: torch.device, gguf_weights: str = "packed") -> bool:
    """Whether `load_model` keeps this checkpoint's projections packed (a GGUF file on a CPU the
    int4 kernel runs on), before anything is loaded."""
    if gguf_weights != "packed" or device.type != "cpu" or not gguf_packed.kernel_available():
        return False
    try:
        return gguf.find_gguf(path) is not None or gguf.source_of(path) is not None
    except (gguf.GGUFError, OSError, ValueError):
        return False        # load_model reports a bad path with the file and the reason


def resolve_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported; expected cpu or cuda")
    return dev


class WeightFiles(dict):
    """Tensor name (the text model's own, a wrapper's prefix removed) -> file holding it;
    `stored(name)` is the name inside the file."""

    def __init__(self, items=(), prefix: str = ""):
        super().__init__(items)
        self.prefix = prefix

    def stored(self, name: str) -> str:
        return self.prefix + name


def _read_config(path: Path) -> dict:
    cfg = path / "config.json"
    return json.loads(cfg.read_text()) if cfg.is_file() else {}


def model_folder(path: str | Path) -> Path:
    """The folder to read a checkpoint from: a Hugging Face folder as it is; a `.gguf` file (or
    a folder holding one) as the folder of JSON files built from its metadata (`gguf.py`),
    whose weights stay in the GGUF file. Every command and service resolves --model-path /
    --target-model-path through this once; it is also safe to call on a resolved folder."""
    try:
        return gguf.model_folder(path)
    except gguf.GGUFError as exc:
        raise CheckpointError(str(exc)) from None


def open_weights(file: Path):
    """A context manager over one weights file with `get_tensor(name)`: safetensors, or a GGUF
    file whose tensors come out under our names, dequantized one at a time."""
    if Path(file).suffix == ".gguf":
        try:
            return gguf.GGUFWeights(file)
        except gguf.GGUFError as exc:
            raise CheckpointError(str(exc)) from None
    return safe_open(file, framework="pt")


def weight_files(path: Path) -> WeightFiles:
    """Map tensor name -> file holding it. In a multimodal wrapper's folder (config.json's
    architectures, `hybrid_config.WRAPPERS`) the names are the text model's, its prefix removed,
    and the vision tower / projector tensors are left out (logged)."""
    path = model_folder(path)
    source = gguf.source_of(path)
    if source is not None:
        with open_weights(source) as f:
            return WeightFiles({name: source for name in f.keys()})
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        stored = {name: path / fname for name, fname in weight_map.items()}
    else:
        single = path / "model.safetensors"
        if not single.is_file():
            raise CheckpointError(f"{path}: neither model.safetensors nor model.safetensors.index.json found")
        with safe_open(single, framework="pt") as f:
            stored = {name: single for name in f.keys()}
    wrapper = wrapper_of(_read_config(path))
    if wrapper is None:
        return WeightFiles(stored)
    files, skipped, unknown = WeightFiles(prefix=wrapper.text_prefix), {}, []
    for name, file in stored.items():
        if name.startswith(wrapper.text_prefix):
            files[name[len(wrapper.text_prefix):]] = file
        elif name.startswith(wrapper.other_prefixes):
            part = next(p for p in wrapper.other_prefixes if name.startswith(p))
            skipped[part] = skipped.get(part, 0) + 1
        else:
            unknown.append(name)
    if unknown:
        raise CheckpointError(f"{path}: tensors {sorted(unknown)[:5]} are neither the text model's "
                              f"({wrapper.text_prefix}*) nor the vision parts this target skips "
                              f"({', '.join(p + '*' for p in wrapper.other_prefixes)})")
    if skipped:
        log.info("checkpoint_tensors_skipped", path=str(path), why="vision tower / projector of a multimodal "
                 "folder: the target serves its text model", tensors=skipped, text_prefix=wrapper.text_prefix)
    return files


def quantization_scheme(path: Path) -> Fp4Scheme | None:
    """The folder's FP4 scheme (its config.json's quantization_config), or None; ConfigError
    naming the field for a quantization this loader does not read."""
    try:
        return parse_quantization(_read_config(Path(path)))
    except QuantizationConfigError as exc:
        raise ConfigError(str(exc)) from None


def _stored(files: dict, name: str) -> str:
    return files.stored(name) if isinstance(files, WeightFiles) else name


def _read(f, files: dict, name: str) -> torch.Tensor:
    return f.get_tensor(_stored(files, name))


def load_state(module: torch.nn.Module, files: dict[str, Path], *, prefix: str = "",
               strict: bool = True, skip: tuple[str, ...] = (), source=None, adapt=None,
               ignored=None) -> None:
    """Copy tensors named `prefix + param_name` from safetensors files into `module`,
    checking every name and shape, converting dtype on the way. Hooks for families whose
    checkpoints spell things their own way: source(name, files) -> the checkpoint's name of a
    parameter; adapt(name, tensor, param) -> the tensor reshaped to the parameter (it sees a
    dequantized MXFP4 tensor whole, so tensor parallelism cuts it like any other);
    ignored(checkpoint name) -> True for tensors that may be present but are not used.
    FP4 modules were swapped for `PackedLinear` beforehand (`pack_fp4`): their packed bytes and
    scales load as they are stored, like any other tensor."""
    params = dict(module.named_parameters(remove_duplicate=True))
    by_file: dict[Path, list[str]] = {}
    names = {}
    for name in params:
        if name in skip:
            continue
        full = prefix + name if source is None else source(prefix + name, files)
        if full not in files:
            raise CheckpointError(f"tensor {_stored(files, full)!r} is missing from the checkpoint")
        names[name] = full
        by_file.setdefault(files[full], []).append(name)
    if strict:
        # Skipped names (a tied lm_head.weight some exports store anyway) are not "unexpected".
        known = set(names.values()) | {prefix + n for n in skip}
        extra = sorted(n for n in files if n.startswith(prefix) and n not in known
                       and not n.endswith("rotary_emb.inv_freq") and not (ignored and ignored(n)))
        if extra:
            raise CheckpointError(f"unexpected tensors in the checkpoint: {[_stored(files, n) for n in extra[:5]]}")
    with torch.no_grad():
        for fname, pnames in by_file.items():
            with open_weights(fname) as f:
                for name in pnames:
                    p = params[name]
                    t, label = _read(f, files, names[name]), _stored(files, names[name])
                    if adapt is not None:
                        t = adapt(name, t, p)
                    if tuple(t.shape) != tuple(p.shape):
                        raise CheckpointError(f"tensor {label!r} has shape {tuple(t.shape)}, "
                                              f"expected {tuple(p.shape)} from config.json")
                    p.copy_(t.to(p.dtype))


def pack_fp4(model: torch.nn.Module, files: dict, quant: Fp4Scheme | None, *, source=None) -> int:
    """Swap every nn.Linear whose weight the checkpoint stores FP4-packed (`X.weight_packed`) for
    a `PackedLinear` of the same shape, on the meta model before anything is allocated, so the
    experts stay packed in memory and no dequantized copy is ever made. Errors name the tensor:
    a packed tensor the config does not declare, a missing scale. Returns how many were swapped."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        full = name + ".weight" if source is None else source(name + ".weight", files)
        base = full[:-len(".weight")]
        if full in files or base + PACKED not in files:
            continue
        stored = _stored(files, base)
        if quant is None:
            raise CheckpointError(f"tensor {stored + PACKED!r} is FP4-packed but config.json has no "
                                  f"quantization_config (compressed-tensors mxfp4- or nvfp4-pack-quantized) saying so")
        fmt = quant.format_of(stored, module)
        if fmt is None:
            raise CheckpointError(f"tensor {stored + PACKED!r} is FP4-packed but config.json's "
                                  f"quantization_config does not quantize {stored!r} (its targets / ignore lists)")
        need = (SCALE, GLOBAL) if fmt == "nvfp4-pack-quantized" else (SCALE,)
        for suffix in need:
            if base + suffix not in files:
                raise CheckpointError(f"tensor {stored + suffix!r} is missing from the checkpoint: the {fmt} tensor "
                                      f"{stored + PACKED!r} needs it")
        if module.bias is not None:
            raise CheckpointError(f"tensor {stored + PACKED!r}: FP4 layers with a bias are not supported")
        try:
            packed = PackedLinear(module.in_features, module.out_features, fmt)
        except ValueError as exc:
            raise CheckpointError(f"tensor {stored + PACKED!r}: {exc}") from None
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, packed)
        swapped += 1
    return swapped


def stored_head_wins(cfg: ModelConfig, files: dict) -> ModelConfig:
    """The Kimi family's reference modeling code never ties its head (transformers'
    KimiLinearForCausalLM has no tied weights whatever `tie_word_embeddings` says), so a hybrid
    checkpoint that stores an lm_head uses it; dense families tie as their config says."""
    if cfg.hybrid is not None and cfg.tie_word_embeddings and "lm_head.weight" in files:
        return ModelConfig(**{**cfg.__dict__, "tie_word_embeddings": False})
    return cfg


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, files: dict | None = None,
                quant: Fp4Scheme | None = None, packed: gguf_packed.PackPlan | None = None) -> CausalLM:
    """The model's modules, allocated on `device` but not loaded; with `files`, FP4-packed
    tensors of the checkpoint get `PackedLinear` modules (never a dequantized weight); with
    `packed`, the GGUF projections it packs are left out (`gguf_packed.attach` fills them)."""
    if cfg.hybrid is not None:
        from splitspec.models.hybrid_weights import checkpoint_name
        from splitspec.models.hybrid import HybridLM
        with torch.device("meta"):
            model = HybridLM(cfg)
        if files is not None:
            pack_fp4(model, files, quant, source=checkpoint_name)
        model = model.to_empty(device=device).to(dtype)
        for p in model.fp32_parameters():
            p.data = p.data.float()
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model
    with torch.device("meta"):
        model = CausalLM(cfg)
    if files is not None:
        pack_fp4(model, files, quant)
    if packed is not None:
        gguf_packed.strip(model, packed)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings and model.lm_head is not None and model.model.embed_tokens is not None:
        model.lm_head.weight = model.model.embed_tokens.weight   # to_empty unties shared parameters
    return model


GGUF_WEIGHTS = ("packed", "dequantized")


def pack_plan(weights, cfg: ModelConfig, device: torch.device, gguf_weights: str,
              gguf_head: str) -> gguf_packed.PackPlan | None:
    """How a GGUF target's weights are held: packed for the CPU's int4 kernel (the default), or
    dequantized (the reference, and the only way on CUDA or on a CPU without AVX2), said once
    at start-up with the tensors that stay dequantized and why."""
    if gguf_weights not in GGUF_WEIGHTS:
        raise ValueError(f"gguf weights {gguf_weights!r}: expected one of {', '.join(GGUF_WEIGHTS)}")
    if weights is None or gguf_weights == "dequantized" or cfg.hybrid is not None:
        return None
    why = None
    if device.type != "cpu":
        why = f"the int4 kernel runs on CPU, the device is {device}"
    elif not gguf_packed.kernel_available():
        why = f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no AVX2, the int4 kernel's fast paths"
    if why:
        log.info("gguf_weights", weights="dequantized", requested=gguf_weights, why=why)
        return None
    plan = gguf_packed.make_plan(weights, cfg, gguf_head)
    if not plan.groups and plan.head is None and not plan.embed:
        log.info("gguf_weights", weights="dequantized", requested=gguf_weights,
                 why="no tensor of the file maps onto the int4 kernel", dequantized_count=len(plan.kept))
        return None
    log.info("gguf_weights", weights="packed", head=plan.head and f"{plan.head_format} ({plan.head})",
             packed_groups=len(plan.groups), embedding="Q8_0 blocks" if plan.embed else "dequantized",
             dequantized={k: v for k, v in list(plan.kept.items())[:8]}, dequantized_count=len(plan.kept))
    return plan


def load_model(path: str | Path, *, dtype="float32", device="cpu", gguf_weights: str = "packed",
               gguf_head: str = "int8") -> CausalLM:
    """A checkpoint's model, ready to serve. A GGUF file on CPU keeps its 4-bit projections packed
    (`gguf_weights="packed"`, gguf_packed.py); "dequantized" loads float weights, the reference."""
    path = model_folder(path)
    cfg = ModelConfig.from_dir(path)
    quant = quantization_scheme(path)
    eos = read_eos_ids(path) or cfg.eos_token_ids
    if eos != cfg.eos_token_ids:
        cfg = ModelConfig(**{**cfg.__dict__, "eos_token_ids": eos})
    files = weight_files(path)
    cfg = stored_head_wins(cfg, files)
    device = resolve_device(device)
    source = gguf.source_of(path) if gguf_weights != "dequantized" else None
    weights = open_weights(source) if source is not None else None
    plan = pack_plan(weights, cfg, device, gguf_weights, gguf_head)
    model = build_model(cfg, parse_dtype(dtype), device, files, quant, plan)
    skip = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    if plan is not None:
        load_state(model, files, skip=skip + plan.skipped())
        gguf_packed.attach(model, plan, weights, parse_dtype(dtype))
    elif cfg.hybrid is not None:
        from splitspec.models.hybrid_weights import adapt_tensor, checkpoint_name, ignored
        load_state(model, files, skip=skip, source=checkpoint_name, adapt=adapt_tensor,
                   ignored=lambda n: ignored(cfg, n))
    else:
        load_state(model, files, skip=skip)
    gguf.release()      # a GGUF file's parse serves start-up only (gguf.parse)
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
    file = model_folder(path) / "tokenizer.json"
    if not file.is_file():
        raise ConfigError(f"{file}: not found")
    return Tokenizer.from_file(str(file))


def tokenizer_hash(path: str | Path) -> str:
    """Content hash of tokenizer.json, used to check that a draft and gateway agree with the target."""
    file = model_folder(path) / "tokenizer.json"
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
    path = model_folder(path)
    tok = load_tokenizer(path) if (path / "tokenizer.json").is_file() else None
    return Checkpoint(path, load_model(path, dtype=dtype, device=device), tok)
