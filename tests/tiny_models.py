"""Tiny random Hugging Face checkpoints for tests (CPU, a few hundred KB each).

`save_tiny_model(path, arch=...)` builds a randomly initialised `transformers` model of the
requested family, perturbs every norm weight and bias away from HF's 1/0 init (so a forward
pass that forgot one of them cannot match by luck), saves it with `save_pretrained`
(optionally sharded), writes a `generation_config.json` with the eos id and optionally a
`tokenizer.json` whose vocabulary size equals the model's.

Families (`arch`):
  * ``llama``   - LlamaForCausalLM, GQA, untied lm_head
  * ``llama3``  - Llama with llama3 rope scaling (`rope_parameters.rope_type = llama3`)
  * ``qwen2``   - Qwen2ForCausalLM (q/k/v bias)
  * ``qwen3``   - Qwen3ForCausalLM (q/k RMSNorm, explicit head_dim != hidden / heads)

Importing this module does not import `transformers`; `save_tiny_model` does.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

ARCHS = ("llama", "llama3", "qwen2", "qwen3")

# Special tokens of the tiny tokenizer; they get ids 0, 1, 2 in this order.
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, UNK_TOKEN)
EOS_ID = 0

# Small training text for the tokenizer: code, prose and a few multi-byte characters.
TOKENIZER_CORPUS = """\
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

import os, sys, json
print("hello world", file=sys.stderr)
if __name__ == "__main__":
    print(json.dumps({"key": [1, 2, 3], "value": None}))
The quick brown fox jumps over the lazy dog. Speculative decoding drafts several tokens
and the target model verifies them in one forward pass; the output distribution is unchanged.
Café, naïve, façade, 日本語, emoji 🙂 and the euro sign € are multi-byte in UTF-8.
"""


def _arch_config(arch: str, *, vocab_size: int, hidden_size: int, intermediate_size: int,
                 num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int | None,
                 max_position_embeddings: int, tie_word_embeddings: bool, rope_theta: float,
                 initializer_range: float, rope_scaling: dict | None):
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
                  tie_word_embeddings=tie_word_embeddings, initializer_range=initializer_range,
                  rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if arch == "llama3":
        # original_max_position_embeddings is small so that, with head_dim 16, the rotary
        # frequencies fall in all three llama3 bands (kept, smoothed, divided by factor).
        rope = {"rope_type": "llama3", "rope_theta": rope_theta, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
    if rope_scaling is not None:
        rope = {"rope_theta": rope_theta, **rope_scaling}
    if arch in ("llama", "llama3"):
        cfg = transformers.LlamaConfig(**common, head_dim=head_dim or hidden_size // num_heads,
                                       rope_parameters=rope)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_parameters=rope, use_sliding_window=False)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=head_dim or 2 * hidden_size // num_heads,
                                       rope_parameters=rope, use_sliding_window=False)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS}")
    return cfg, cls


def build_tiny_hf_model(arch: str = "qwen3", *, vocab_size: int = 128, hidden_size: int = 64,
                        intermediate_size: int = 128, num_layers: int = 2, num_heads: int = 4,
                        num_kv_heads: int = 2, head_dim: int | None = None,
                        max_position_embeddings: int = 512, tie_word_embeddings: bool = False,
                        rope_theta: float = 10000.0, initializer_range: float = 0.15,
                        rope_scaling: dict | None = None, seed: int = 0):
    """A randomly initialised float32 `transformers` CausalLM (eval mode).

    `initializer_range` is larger than HF's 0.02 so that logits are far from uniform:
    greedy decisions are then robust to float rounding and verification tests see
    peaked distributions, as with a real model."""
    cfg, cls = _arch_config(arch, vocab_size=vocab_size, hidden_size=hidden_size,
                            intermediate_size=intermediate_size, num_layers=num_layers,
                            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                            max_position_embeddings=max_position_embeddings,
                            tie_word_embeddings=tie_word_embeddings, rope_theta=rope_theta,
                            initializer_range=initializer_range, rope_scaling=rope_scaling)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return model


def save_tiny_tokenizer(path: str | Path, vocab_size: int) -> Path:
    """Write `path/tokenizer.json` with exactly `vocab_size` tokens.

    vocab_size >= 320: byte-level BPE (any text round-trips, multi-byte characters span
    several tokens), trained on `TOKENIZER_CORPUS`. Smaller vocabularies: character-level
    BPE over the corpus' most frequent characters with an unknown token. Ids 0, 1, 2 are
    `<|endoftext|>`, `<|pad|>`, `<|unk|>`. Short of merges, the vocabulary is padded with
    `<|extra_i|>` tokens so its size is exact."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    n_special = len(SPECIAL_TOKENS)
    if vocab_size >= 320:
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
    elif vocab_size >= n_special + 8:
        tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
        tok.decoder = decoders.Fuse()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                      limit_alphabet=min(vocab_size - n_special, 60),
                                      show_progress=False)
    else:
        raise ValueError(f"tiny tokenizer needs vocab_size >= {n_special + 8}, got {vocab_size}")
    tok.train_from_iterator([TOKENIZER_CORPUS] * 4, trainer=trainer)
    have = tok.get_vocab_size(with_added_tokens=True)
    if have > vocab_size:
        raise AssertionError(f"trained tokenizer has {have} tokens, more than {vocab_size}")
    if have < vocab_size:
        tok.add_tokens([f"<|extra_{i}|>" for i in range(vocab_size - have)])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    assert tok.token_to_id(EOS_TOKEN) == EOS_ID
    tok.save(str(path / "tokenizer.json"))
    return path


def save_tiny_model(path: str | Path, arch: str = "qwen3", *, vocab_size: int = 128,
                    hidden_size: int = 64, intermediate_size: int = 128, num_layers: int = 2,
                    num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None,
                    max_position_embeddings: int = 512, tie_word_embeddings: bool = False,
                    rope_theta: float = 10000.0, initializer_range: float = 0.15,
                    rope_scaling: dict | None = None, seed: int = 0,
                    max_shard_size: str | int | None = None,
                    eos_token_id: int | list[int] | None = EOS_ID,
                    tokenizer: bool = False) -> Path:
    """Save a tiny random `arch` checkpoint to `path` (created) and return the path.

    max_shard_size: e.g. "20KB" to write a sharded checkpoint with
    `model.safetensors.index.json`; None writes a single `model.safetensors`.
    eos_token_id: written to `generation_config.json` (None: no eos there).
    tokenizer: also write a `tokenizer.json` with `vocab_size` tokens."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build_tiny_hf_model(arch, vocab_size=vocab_size, hidden_size=hidden_size,
                                intermediate_size=intermediate_size, num_layers=num_layers,
                                num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                max_position_embeddings=max_position_embeddings,
                                tie_word_embeddings=tie_word_embeddings, rope_theta=rope_theta,
                                initializer_range=initializer_range, rope_scaling=rope_scaling,
                                seed=seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(path), **kwargs)
    gen = {"_from_model_config": False, "do_sample": False}
    if eos_token_id is not None:
        gen["eos_token_id"] = eos_token_id
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer:
        save_tiny_tokenizer(path, vocab_size)
    return path


def edit_config(path: str | Path, **changes) -> dict:
    """Rewrite `path/config.json` with `changes` applied (None deletes a key); returns it."""
    file = Path(path) / "config.json"
    raw = json.loads(file.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    file.write_text(json.dumps(raw, indent=2) + "\n")
    return raw


def rough_draft(draft, target, *, seed: int, std: float):
    """`draft` (a fresh DFlash draft) with norms away from 1 and matrices of `std`, so a
    forgotten norm or term cannot match a reference by luck, reading `target`'s embeddings
    and head."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                p.normal_(0, std, generator=g)
    draft.attach_target(target.model.embed_tokens.weight, target.lm_head.weight)
    return draft
