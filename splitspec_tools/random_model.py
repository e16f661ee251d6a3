"""A small randomly initialised Qwen3 checkpoint with a byte-level BPE tokenizer, in the same
Hugging Face folder layout as a real model. `splitspec up` serves it when the trained default
model is missing, so the whole system can be tried on a fresh checkout; its output is noise."""
from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

import torch
from safetensors.torch import save_file

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "float32",
    "eos_token_id": 0, "bos_token_id": None,
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>"]
VERSION = 1   # bump when the recipe changes, so cached copies are rebuilt


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "splitspec" / f"random-qwen3-v{VERSION}"


def _corpus() -> list[str]:
    """A few standard-library modules: real code, present wherever Python is."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name in ("textwrap.py", "functools.py", "json/encoder.py", "heapq.py", "bisect.py"):
        f = lib / name
        if f.is_file():
            texts.append(f.read_text(encoding="utf-8", errors="replace"))
    return texts or ["def f(x):\n    return x + 1\n"]


def write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    have = tok.get_vocab_size(with_added_tokens=True)
    if have < vocab_size:   # a small corpus may run out of merges; the model's vocab must match
        tok.add_tokens([f"<|extra_{i}|>" for i in range(vocab_size - have)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0], "bos_token": None, "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONFIG["max_position_embeddings"]}, indent=2) + "\n")


def write_random_model(out: str | Path, seed: int = 0) -> Path:
    """Write config.json, model.safetensors, generation_config.json and the tokenizer files."""
    from splitspec.models.config import ModelConfig
    from splitspec.models.dense import CausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig.from_dict(CONFIG))
    with torch.no_grad():   # a wider init than torch's default, so the output is not uniform noise
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08 if "embed" not in name else 1.0)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}) + "\n")
    write_tokenizer(out, CONFIG["vocab_size"])
    (out / "README.md").write_text("Random weights, for trying splitspec without the trained model. "
                                   "Its output is noise.\n")
    return out


def ensure_random_model(cache_dir: Path | None = None) -> Path:
    path = cache_dir or default_cache_dir()
    if (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file():
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    write_random_model(tmp)
    shutil.rmtree(path, ignore_errors=True)
    try:
        tmp.rename(path)       # publish whole, so a concurrent reader never sees half a folder
    except OSError:            # another process published first
        shutil.rmtree(tmp, ignore_errors=True)
    return path
