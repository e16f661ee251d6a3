"""The draft architectures this service loads, in one place: a checkpoint's config.json names
its class (`architectures`), and `load_draft` builds it and attaches the target's embedding and
head. `dflash.py` (the DFlash backbone) and `dflash2.py` (DFlash2, built on it) know nothing of
each other beyond that inheritance; this module is the only one that knows both."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import structlog
import torch
from safetensors import SafetensorError, safe_open

from splitspec.models.config import ConfigError, ModelConfig
from splitspec.models.gguf import release as release_gguf
from splitspec.models.loader import (CheckpointError, load_state, model_folder, open_weights, parse_dtype,
                                     resolve_device, weight_files)

from . import vocab
from .dflash import DFlashConfig, DFlashDraft
from .dflash2 import DFlash2Config, DFlash2Draft

log = structlog.get_logger()

ARCHITECTURES: dict[str, tuple[type, type]] = {
    DFlashConfig.ARCHITECTURE: (DFlashConfig, DFlashDraft),
    DFlash2Config.ARCHITECTURE: (DFlash2Config, DFlash2Draft),
}


def draft_classes(raw: dict) -> tuple[type, type]:
    """(config class, model class) for a draft config.json, by its `architectures`."""
    archs = raw.get("architectures") or []
    for name in archs:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ConfigError(f"draft config.json: architectures={archs!r}; expected one of "
                      f"{[[name] for name in ARCHITECTURES]}")


def load_draft(path: str | Path, target_path: str | Path, *, dtype="float32", device="cpu",
               block_size_means: str = "verify_width") -> DFlashDraft:
    path, target_path = Path(path), model_folder(target_path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{cfg_file}: not found; --model-path must be a DFlash draft folder")
    config_class, model_class = draft_classes(raw := json.loads(cfg_file.read_text()))
    cfg = config_class.from_dict(raw, block_size_means=block_size_means)
    log.info("dflash_block_size", architecture=cfg.ARCHITECTURE, block_size=cfg.block_size, drafted_per_step=cfg.num_draft_tokens,
             stored_as=block_size_means)
    tcfg = ModelConfig.from_dir(target_path)
    if tcfg.hidden_size != cfg.hidden_size or tcfg.vocab_size != cfg.vocab_size:
        raise ConfigError(f"draft expects hidden {cfg.hidden_size} / vocab {cfg.vocab_size}; target "
                          f"{target_path} has hidden {tcfg.hidden_size} / vocab {tcfg.vocab_size}")
    if max(cfg.target_layer_ids) >= tcfg.num_hidden_layers:
        raise ConfigError(f"draft target_layer_ids {list(cfg.target_layer_ids)} exceed the target's "
                          f"{tcfg.num_hidden_layers} layers")
    dt, dev = parse_dtype(dtype), resolve_device(device)
    with readable(path):
        files = weight_files(path)
        kept = read_vocab_map(files, cfg, path)
        with torch.device("meta"):
            model = model_class(cfg)
        model = model.to_empty(device=dev).to(dt)
        load_state(model, files, ignored=lambda name: name == vocab.D2T)
    if kept is not None:
        model.set_vocab(kept)
        log.info("draft_vocab", kept=int(kept.shape[0]), target_vocab=cfg.vocab_size)
    tfiles = weight_files(target_path)
    names = {"embed": "model.embed_tokens.weight",
             "lm_head": "lm_head.weight" if "lm_head.weight" in tfiles else "model.embed_tokens.weight"}
    got = {}
    for name in dict.fromkeys(names.values()):        # a tied head is the embedding: read once
        with open_weights(tfiles[name]) as f:
            got[name] = f.get_tensor(tfiles.stored(name)).to(dev, dt)     # a wrapper's prefix put back
    release_gguf()
    model.attach_target(got[names["embed"]], got[names["lm_head"]])
    return model.eval().requires_grad_(False)


@contextlib.contextmanager
def readable(path: Path):
    """A weights file safetensors cannot parse (truncated by a copy or a kill mid-write) is
    refused as a CheckpointError naming the file, which the service reports and exits on."""
    try:
        yield
    except SafetensorError as exc:
        files = sorted(path.glob("*.safetensors"))
        bad = [f for f in files if not _parses(f)] or files
        raise CheckpointError(f"{', '.join(map(str, bad))}: not a readable safetensors file ({exc}); "
                              f"truncated or corrupt") from None


def _parses(file: Path) -> bool:
    try:
        with safe_open(str(file), framework="pt"):
            return True
    except SafetensorError:
        return False


def read_vocab_map(files, cfg: DFlashConfig, path: Path) -> torch.Tensor | None:
    """The kept target ids of a reduced-vocabulary draft (None for a full one), checked against
    the target's vocabulary and the head's size before anything is built; a mismatch names the
    file and the field."""
    where = files.get(vocab.D2T)
    if cfg.draft_vocab_size is None:
        if where is not None:
            raise ConfigError(f"{where}: holds a {vocab.D2T!r} map but {path / 'config.json'} has no "
                              f"{vocab.SIZE_FIELD}")
        return None
    if where is None:
        raise ConfigError(f"{path}: config.json has {vocab.SIZE_FIELD}={cfg.draft_vocab_size} but no weights "
                          f"file holds the tensor {vocab.D2T!r}")
    with open_weights(where) as f:
        d2t = f.get_tensor(files.stored(vocab.D2T))
    return vocab.check_d2t(d2t, cfg.vocab_size, cfg.draft_vocab_size, str(where))
