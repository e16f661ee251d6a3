"""Serve a llama.cpp GGUF file: the reader, the tensor-name map and the tokenizer builder.

Everything else in splitspec reads a Hugging Face folder (config.json, tokenizer.json,
tokenizer_config.json, generation_config.json, safetensors). A GGUF file carries the same
facts in its metadata, so `model_folder(path)` writes those small JSON files once into a cache
folder beside a pointer to the GGUF file, and every command, service and tool keeps reading a
folder. The weights never leave the GGUF file: `GGUFWeights.get_tensor` dequantizes one tensor
at a time to float32, straight from the memory-mapped file, and the loader casts it into the
parameter (no float copy of the whole model is ever held besides the model itself).

A file is trusted only as far as it has been checked: `gguf_header.scan` bounds every count and
size by the file before gguf-py walks them, `Metadata` reads each field as the type it must
have, `config_dict` holds every size the model is built from to the tensors the file holds, and
`_tokenizer_fields` checks the vocabulary, merges, token types and special ids; each refusal is
a GGUFError naming the file, the field and the value (docs/real-model.md has the list).

Facts this rests on (gguf-py's `constants.py` / `quants.py`, llama.cpp's `convert_hf_to_gguf.py`
and `llama-vocab.cpp`; see ../shared/research/real-model-gguf.md):
* shapes are listed innermost first; gguf-py hands quantized rows as (rows, bytes per row);
* llama.cpp permutes the Q and K rows of `llama` checkpoints for its rotary layout (`qwen2` /
  `qwen3` are not permuted): the rows are un-permuted here so our half-split RoPE is right;
* end-of-generation tokens: the metadata's eos and eot ids, and, as llama.cpp does, the chat
  markers ending a turn (`<|im_end|>`, `<|eot_id|>`, ...). SmolLM2's file says eos = 1
  (`<|im_start|>`), while its turns end with `<|im_end|>` = 2;
* BOS / EOS: added where `tokenizer.ggml.add_bos_token` / `add_eos_token` say; when the file
  does not say, llama.cpp adds BOS for its LLAMA3 pre-tokenizer group (`llama-bpe`, `llama3`).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from splitspec.models import gguf_header as h
from splitspec.models.gguf_header import GGUFError

# Bumped whenever what `model_folder` writes changes, so stale cache folders are rewritten.
FORMAT = 2
POINTER = "gguf_source.json"

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
QUANT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q5_1", "Q5_K")
# gguf-py hands these as typed arrays in the file's byte order; every other type comes as raw
# little-endian blocks its dequantizers read as they are, wrong in a big-endian file.
BYTE_ORDER_SAFE = ("F32", "F16")

# GGUF tensor name (after `blk.N.`) -> our (Hugging Face) name (after `model.layers.N.`).
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}

# Pre-tokenizer split patterns by `tokenizer.ggml.pre` (the public patterns of each family).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("default", "gpt-2", "gpt2", "smollm", "qwen2", "llama-bpe", "llama3")
# llama.cpp's LLAMA3 pre-tokenizer group: BOS added unless the file says otherwise, and a word
# already in the vocabulary taken whole before any merge (Llama 3's tokenizer.json: ignore_merges).
LLAMA3_PRES = ("llama-bpe", "llama3")
# Token texts that end a turn in the common chat formats (llama.cpp treats them as end of generation).
TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>")
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4
TOKEN_TYPES = range(7)           # llama.cpp's: undefined, normal, unknown, control, user-defined, unused, byte
# The special ids this loader uses; llama.cpp warns about and ignores an unused one (pad, unk)
# past the vocabulary, and so does this loader, by not reading it.
SPECIAL_IDS = ("bos", "eos", "eot")

INTS = frozenset({h.UINT8, h.INT8, h.UINT16, h.INT16, h.UINT32, h.INT32, h.UINT64, h.INT64})
NUMBERS = INTS | {h.FLOAT32, h.FLOAT64}


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `.gguf` file in a folder that is
    not a Hugging Face folder (no config.json). None when `path` is not a GGUF checkpoint."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise GGUFError(f"{path}: holds {len(files)} .gguf files ({', '.join(f.name for f in files[:4])}); "
                            "pass the one to serve")
        return files[0] if files else None
    return None


def source_of(folder: str | Path) -> Path | None:
    """The GGUF file behind a folder `model_folder` wrote, else None (a Hugging Face folder)."""
    pointer = Path(folder) / POINTER
    return Path(json.loads(pointer.read_text())["gguf"]) if pointer.is_file() else None


def open_reader(file: Path, header: h.Header | None = None):
    """gguf-py's reader over `file`, after `gguf_header.scan` has checked every count and size it
    will follow against the file (pass the scan's header when there is one)."""
    from gguf import GGUFReader
    if header is None:
        header = h.scan(file)
    try:
        return GGUFReader(file)
    except Exception as exc:     # what the scan does not model (it checks sizes, not every value)
        raise GGUFError(f"{file}: not a readable GGUF file ({type(exc).__name__}: {exc}); "
                        "it may be truncated or corrupt") from None


class Metadata:
    """The file's metadata fields, each read as the type it must have: a wrong type, a value out
    of range or a list of the wrong length is a GGUFError naming the file, the field and the value."""

    def __init__(self, reader, file: Path):
        self.fields, self.file = reader.fields, file

    def refuse(self, key: str, detail: str) -> GGUFError:
        return GGUFError(f"{self.file}: metadata field {key!r} {detail}")

    def _get(self, key: str, kinds, item_kinds=None, required: bool = False):
        f = self.fields.get(key)
        if f is None:
            if required:
                raise GGUFError(f"{self.file}: metadata field {key!r} is missing")
            return None
        types = [int(t) for t in f.types]
        if item_kinds is None and (not types or types[0] not in kinds):
            raise self.refuse(key, f"is {_type_name(types)}; expected {_kinds_name(kinds)}")
        if item_kinds is not None and (types[:1] != [h.ARRAY] or (len(types) > 1 and types[1] not in item_kinds)):
            raise self.refuse(key, f"is {_type_name(types)}; expected an array of {_kinds_name(item_kinds)}")
        try:
            return f.contents()
        except Exception as exc:     # a string that is not UTF-8
            raise self.refuse(key, f"cannot be read ({exc})") from None

    def int(self, key: str, default: int | None = None, *, required: bool = False, minimum: int = 1) -> int | None:
        value = self._get(key, INTS, required=required and default is None)
        if value is None:
            return default
        if value < minimum:
            raise self.refuse(key, f"= {value}; it must be at least {minimum}")
        return int(value)

    def float(self, key: str, default: float | None = None, *, required: bool = False,
              positive: bool = True) -> float | None:
        value = self._get(key, NUMBERS, required=required and default is None)
        if value is None:
            return default
        if not math.isfinite(value) or (positive and value <= 0):
            raise self.refuse(key, f"= {value}; it must be a positive finite number")
        return float(value)

    def str(self, key: str, default: str | None = None, *, required: bool = False) -> str | None:
        value = self._get(key, {h.STRING}, required=required and default is None)
        return default if value is None else value

    def bool(self, key: str, default: bool | None = None) -> bool | None:
        value = self._get(key, {h.BOOL})
        return default if value is None else bool(value)

    def strings(self, key: str, *, required: bool = False) -> list[str] | None:
        return self._get(key, None, {h.STRING}, required=required)

    def ints(self, key: str) -> list[int] | None:
        return self._get(key, None, INTS)

    def per_layer(self, key: str, layers: int, default: int | None = None, *, required: bool = False) -> int | None:
        """A count llama.cpp reads as one number or one per layer (`get_key_or_arr`): per-layer
        values are served when every layer has the same (the only shape our model builds)."""
        f = self.fields.get(key)
        if f is None or int(f.types[0]) != h.ARRAY:
            return self.int(key, default, required=required)
        values = self.ints(key)
        if len(values) != layers:
            raise self.refuse(key, f"has {len(values)} per-layer values for {layers} layers")
        if min(values) < 1:
            raise self.refuse(key, f"has per-layer value {min(values)}; every layer needs at least 1")
        if len(set(values)) > 1:
            raise self.refuse(key, f"differs between layers ({sorted(set(values))[:4]}); this loader serves "
                                   "models whose layers all have the same shape")
        return int(values[0])


def _kinds_name(kinds) -> str:
    if kinds == INTS:
        return "an integer"
    if kinds == NUMBERS:
        return "a number"
    return " or ".join(h.TYPE_NAMES[k] for k in sorted(kinds))


def _type_name(types: list[int]) -> str:
    if types[:1] == [h.ARRAY]:
        return f"an array of {h.TYPE_NAMES.get(types[1], types[1])}" if len(types) > 1 else "an empty array"
    return h.TYPE_NAMES.get(types[0], str(types[0])) if types else "untyped"


def config_dict(reader, file: Path) -> dict:
    """A Hugging Face config.json for the file's model; GGUFError naming the field or tensor
    for an architecture, quant type or value this loader does not serve, or a size the file's
    tensors contradict (before anything is allocated: every size the model is built from is the
    size of a tensor the file holds)."""
    meta = Metadata(reader, file)
    arch = meta.str("general.architecture", required=True)
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{file}: general.architecture {arch!r} is not supported; expected one of "
                        f"{', '.join(ARCHITECTURES)}")
    _check_tensor_types(reader, file)
    layers = meta.int(f"{arch}.block_count", required=True)
    heads = meta.per_layer(f"{arch}.attention.head_count", layers, required=True)
    kv_heads = meta.per_layer(f"{arch}.attention.head_count_kv", layers, default=heads)
    if heads % kv_heads:
        raise GGUFError(f"{file}: metadata field '{arch}.attention.head_count_kv' = {kv_heads} does not divide "
                        f"'{arch}.attention.head_count' = {heads}")
    hidden = meta.int(f"{arch}.embedding_length", required=True)
    head_dim = _head_dim(meta, arch, hidden, heads)
    names = {t.name: t for t in reader.tensors}
    vocab = _vocab_rows(meta, arch, names, file)
    cfg = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta.per_layer(f"{arch}.feed_forward_length", layers, required=True),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": meta.float(f"{arch}.attention.layer_norm_rms_epsilon", required=True),
        "rope_theta": meta.float(f"{arch}.rope.freq_base", default=10000.0),
        "max_position_embeddings": meta.int(f"{arch}.context_length", default=4096),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names and arch != "qwen2",
        "torch_dtype": "bfloat16",
    }
    scaling = meta.str(f"{arch}.rope.scaling.type", default="none")
    if scaling not in ("none", ""):
        raise GGUFError(f"{file}: {arch}.rope.scaling.type {scaling!r} is not supported")
    _check_shapes(reader, file, cfg)
    return cfg


def _check_tensor_types(reader, file: Path) -> None:
    from gguf import GGUFEndian
    big = reader.endianess == GGUFEndian.BIG
    for t in reader.tensors:
        if t.tensor_type.name not in QUANT_TYPES:
            raise GGUFError(f"{file}: tensor {t.name!r} is stored as {t.tensor_type.name}, which this loader does "
                            f"not dequantize; supported: {', '.join(QUANT_TYPES)}")
        if big and t.tensor_type.name not in BYTE_ORDER_SAFE:
            raise GGUFError(f"{file}: tensor {t.name!r} is stored as {t.tensor_type.name} in a big-endian file; "
                            f"this loader reads big-endian files only as {' or '.join(BYTE_ORDER_SAFE)}")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise GGUFError(f"{file}: tensor 'rope_freqs.weight' (Llama-3.1-style rope scaling) is not supported")


def _head_dim(meta: Metadata, arch: str, hidden: int, heads: int) -> int:
    key = f"{arch}.attention.key_length"
    if meta.fields.get(key) is None and hidden % heads:
        raise GGUFError(f"{meta.file}: metadata field '{arch}.embedding_length' = {hidden} is not a multiple of "
                        f"'{arch}.attention.head_count' = {heads}, and '{key}' is missing")
    head_dim = meta.int(key, default=hidden // heads)
    if head_dim % 2:
        raise meta.refuse(key, f"= {head_dim}; rotary embeddings need an even head size")
    value = meta.int(f"{arch}.attention.value_length", default=head_dim)
    if value != head_dim:
        raise meta.refuse(f"{arch}.attention.value_length", f"= {value} differs from '{key}' = {head_dim}; "
                                                            "this loader serves equal key and value heads")
    return head_dim


def _vocab_rows(meta: Metadata, arch: str, names: dict, file: Path) -> int:
    embd = names.get("token_embd.weight")
    if embd is None:
        raise GGUFError(f"{file}: tensor 'token_embd.weight' is missing")
    rows = int(embd.shape[-1]) if len(embd.shape) == 2 else 0
    vocab = meta.int(f"{arch}.vocab_size", default=rows)
    if vocab != rows:
        raise meta.refuse(f"{arch}.vocab_size", f"= {vocab}, but tensor 'token_embd.weight' has {rows} rows")
    return vocab


def expected_shape(name: str, cfg: dict) -> tuple[int, ...] | None:
    """The shape (ours, outermost first) `dense.CausalLM` gives the parameter `name`."""
    hidden, hd, vocab, ff = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.norm.weight": (hidden,), "input_layernorm.weight": (hidden,),
              "post_attention_layernorm.weight": (hidden,), "self_attn.q_proj.weight": (q, hidden),
              "self_attn.k_proj.weight": (kv, hidden), "self_attn.v_proj.weight": (kv, hidden),
              "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
              "self_attn.o_proj.weight": (hidden, q), "self_attn.q_norm.weight": (hd,),
              "self_attn.k_norm.weight": (hd,), "mlp.gate_proj.weight": (ff, hidden),
              "mlp.up_proj.weight": (ff, hidden), "mlp.down_proj.weight": (hidden, ff)}
    if name.startswith("model.layers."):
        name = name.split(".", 3)[3]
    return shapes.get(name)


def _check_shapes(reader, file: Path, cfg: dict) -> None:
    """Every tensor has the shape the metadata implies and belongs to a layer the metadata counts,
    so the model allocated from `cfg` is no larger than what the file holds."""
    arch, layers = cfg["model_type"], cfg["num_hidden_layers"]
    seen = set()
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue                 # refused by name in `GGUFWeights`, with the architecture
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            if layer >= layers:
                raise GGUFError(f"{file}: tensor {t.name!r} is for layer {layer}, but metadata field "
                                f"'{arch}.block_count' = {layers}")
            seen.add(layer)
        want = expected_shape(name, cfg)
        got = tuple(int(d) for d in reversed(t.shape.tolist()))
        if want is not None and got != want:
            raise GGUFError(f"{file}: tensor {t.name!r} has shape {list(got)}; the metadata ({arch}.*) implies "
                            f"{list(want)}")
    if len(seen) != layers:
        missing = [i for i in range(len(seen) + 4) if i not in seen][:4]      # block_count may be 2^64
        raise GGUFError(f"{file}: metadata field '{arch}.block_count' = {layers}, but the file holds no tensors "
                        f"for layers {missing}")


def _tokenizer_fields(meta: Metadata, vocab_rows: int) -> dict:
    model = meta.str("tokenizer.ggml.model", required=True)
    if model != "gpt2":
        raise GGUFError(f"{meta.file}: tokenizer.ggml.model {model!r} is not supported; this loader builds "
                        "byte-level BPE tokenizers ('gpt2', as Llama 3, Qwen and SmolLM files use)")
    tokens = meta.strings("tokenizer.ggml.tokens", required=True)
    if not tokens:
        raise meta.refuse("tokenizer.ggml.tokens", "is empty")
    if len(tokens) > vocab_rows:
        raise meta.refuse("tokenizer.ggml.tokens", f"has {len(tokens)} tokens; tensor 'token_embd.weight' has "
                                                   f"{vocab_rows} rows")
    merges = meta.strings("tokenizer.ggml.merges")
    if not merges:
        raise GGUFError(f"{meta.file}: metadata field 'tokenizer.ggml.merges' is missing or empty: a BPE tokenizer "
                        "needs its merges")
    vocab = set(tokens)
    pairs = [_merge(meta, i, m, vocab) for i, m in enumerate(merges)]
    types = meta.ints("tokenizer.ggml.token_type")
    if types is None:
        types = [1] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFError(f"{meta.file}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    bad = next((i for i, ty in enumerate(types) if ty not in TOKEN_TYPES), None)
    if bad is not None:
        raise meta.refuse("tokenizer.ggml.token_type", f"[{bad}] = {types[bad]} is not a llama.cpp token type (0-6)")
    pre = meta.str("tokenizer.ggml.pre", default="default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{meta.file}: tokenizer.ggml.pre {pre!r} is not supported; expected one of "
                        f"{', '.join(PRE_TOKENIZERS)}")
    ids = {name: special_id(meta, name, len(tokens)) for name in SPECIAL_IDS}
    add_bos = meta.bool("tokenizer.ggml.add_bos_token", default=pre in LLAMA3_PRES)
    add_eos = meta.bool("tokenizer.ggml.add_eos_token", default=False)
    for flag, name in ((add_bos, "bos"), (add_eos, "eos")):
        if flag:
            _check_template_token(meta, name, ids[name], tokens)
    return {"tokens": tokens, "merges": pairs, "types": types, "pre": pre, "ids": ids,
            "add_bos": add_bos, "add_eos": add_eos}


def _check_template_token(meta: Metadata, name: str, token_id: int | None, tokens: list[str]) -> None:
    """A token added around each sequence must exist and be writable in a `tokenizers`
    template, whose pieces are `text:type_id` and `$A` / `$B` (no real BOS or EOS has a colon)."""
    key = f"tokenizer.ggml.{name}_token_id"
    if token_id is None:
        raise GGUFError(f"{meta.file}: metadata field 'tokenizer.ggml.add_{name}_token' is true but {key!r} is missing")
    text = tokens[token_id]
    if not text or ":" in text or text.startswith("$"):
        raise meta.refuse(key, f"= {token_id} names {text!r}, which cannot be added around each sequence "
                               "(empty, a ':' or a leading '$')")


def _merge(meta: Metadata, i: int, merge: str, vocab: set[str]) -> tuple[str, str]:
    """One merge as llama.cpp and `tokenizers` read it: two tokens of the vocabulary joined by
    one space, whose concatenation is a token too (`tokenizers` panics on one that is not)."""
    left, space, right = merge.partition(" ")
    if not space or not left or not right or " " in right:
        raise meta.refuse("tokenizer.ggml.merges", f"[{i}] = {merge!r} is not two tokens separated by one space")
    for part in (left, right, left + right):
        if part not in vocab:
            raise meta.refuse("tokenizer.ggml.merges", f"[{i}] = {merge!r}: {part!r} is not in tokenizer.ggml.tokens")
    return left, right


def special_id(meta: Metadata, name: str, n_tokens: int) -> int | None:
    key = f"tokenizer.ggml.{name}_token_id"
    value = meta.int(key, minimum=0)
    if value is not None and value >= n_tokens:
        raise meta.refuse(key, f"= {value} is past the vocabulary ({n_tokens} tokens)")
    return value


def tokenizer_json(reader, file: Path, vocab_rows: int | None = None) -> str:
    """tokenizer.json (the `tokenizers` library's format) built from the file's vocabulary,
    merges, token types, pre-tokenizer name and BOS / EOS flags, as the model's own tokenizer
    builds it (see `_pre_tokenizer`, `_post_processor`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    meta = Metadata(reader, file)
    f = _tokenizer_fields(meta, vocab_rows or _vocab_rows_of(reader))
    # A text listed twice takes its last id, as llama.cpp's and transformers' readers do.
    vocab = {tok: i for i, tok in enumerate(f["tokens"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=f["merges"], fuse_unk=False, byte_fallback=False,
                               ignore_merges=f["pre"] in LLAMA3_PRES))
    if f["pre"] == "qwen2":          # Qwen2Tokenizer's (transformers) and tokenizer.json's normalizer
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(f["pre"])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(f)
    added = [AddedToken(t, special=ty == TOKEN_CONTROL, normalized=False)
             for t, ty in zip(f["tokens"], f["types"]) if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    tok.add_tokens([a for a in added if not a.special])
    tok.add_special_tokens([a for a in added if a.special])
    return tok.to_str()


def _vocab_rows_of(reader) -> int:
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    return int(embd.shape[-1]) if embd is not None else 0


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers
    if pre == "smollm":          # SmolLM's tokenizer.json: digits one by one, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    if pre in ("qwen2", *LLAMA3_PRES):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return pre_tokenizers.ByteLevel(add_prefix_space=False)


def _post_processor(f: dict):
    """ByteLevel offsets, then BOS / EOS around each sequence where the file says to add them, as
    Llama 3's own tokenizer.json does (a template after the byte-level step); `encode(...,
    add_special_tokens=False)` leaves them out, as callers rendering a chat template need."""
    from tokenizers import processors
    byte_level = processors.ByteLevel(trim_offsets=False)
    if not (f["add_bos"] or f["add_eos"]):
        return byte_level
    tokens, ids = f["tokens"], f["ids"]
    bos = [tokens[ids["bos"]]] if f["add_bos"] else []
    eos = [tokens[ids["eos"]]] if f["add_eos"] else []
    # Lists of pieces, not a spaced string, so a token with a space in it stays one piece.
    single = [f"{t}:0" for t in bos] + ["$A:0"] + [f"{t}:0" for t in eos]
    pair = single + [f"{t}:1" for t in bos] + ["$B:1"] + [f"{t}:1" for t in eos]
    special = sorted({(tokens[ids[n]], ids[n]) for n, on in (("bos", f["add_bos"]), ("eos", f["add_eos"])) if on})
    return processors.Sequence([byte_level, processors.TemplateProcessing(single=single, pair=pair,
                                                                          special_tokens=special)])


def end_ids(reader, file: Path) -> list[int]:
    """End-of-generation ids: the metadata's eos and eot, then the control tokens that end a turn."""
    meta = Metadata(reader, file)
    tokens = meta.strings("tokenizer.ggml.tokens") or []
    types = meta.ints("tokenizer.ggml.token_type") or []
    ids = [i for key in ("eot", "eos") if (i := special_id(meta, key, len(tokens))) is not None]
    ids += [i for i, t in enumerate(tokens) if t in TURN_ENDS and (not types or types[i] == TOKEN_CONTROL)]
    # The turn end goes first: tools that take "the" eos (templates, the bench) take ids[0].
    turn = [i for i in ids if tokens[i] in TURN_ENDS]
    return list(dict.fromkeys(turn + ids))


def tokenizer_config(reader, file: Path, eos: list[int], cfg: dict | None = None) -> dict:
    meta = Metadata(reader, file)
    tokens = meta.strings("tokenizer.ggml.tokens") or []
    bos = special_id(meta, "bos", len(tokens))
    out = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
           "model_max_length": (cfg or config_dict(reader, file))["max_position_embeddings"],
           "eos_token": tokens[eos[0]] if eos else None,
           "bos_token": tokens[bos] if bos is not None else None,
           "add_bos_token": bool(meta.bool("tokenizer.ggml.add_bos_token",
                                           default=meta.str("tokenizer.ggml.pre") in LLAMA3_PRES)),
           "add_eos_token": bool(meta.bool("tokenizer.ggml.add_eos_token", default=False))}
    template = meta.str("tokenizer.chat_template")
    if template:
        out["chat_template"] = template
    return out


@dataclass
class GGUFFile:
    """One GGUF file read for serving: its scanned header, gguf-py's reader over it, the
    config.json its metadata describes and its tensors under our names."""
    file: Path
    header: h.Header
    reader: object
    config: dict
    tensors: dict


# The last file parsed, by identity (path, device, inode, size, modification and change
# times): gguf-py's reader takes seconds and ~170 MB for a 49k-token vocabulary, and start-up
# reads the same file for the folder's build, the memory preflight, the weights' names and the
# weights' load. `release` drops it once the weights are loaded, so it never outlives start-up.
_parsed: dict[tuple, GGUFFile] = {}
_headers: dict[tuple, h.Header] = {}


def _identity(file: Path) -> tuple:
    st = file.stat()
    return str(file), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def header_of(file: Path) -> h.Header:
    """The scanned header of `file`, scanned once per version of the file in this process."""
    key = _identity(file)
    if key not in _headers:
        if len(_headers) >= 8:
            _headers.pop(next(iter(_headers)))
        _headers[key] = h.scan(file)
    return _headers[key]


def parse(file: str | Path) -> GGUFFile:
    """`file` scanned, read by gguf-py and checked, once while it is in use (see `_parsed`)."""
    file = Path(file).resolve()
    try:
        key = _identity(file)
    except OSError as exc:
        raise GGUFError(f"{file}: cannot be read ({exc.strerror or exc})") from None
    if key in _parsed:
        return _parsed[key]
    header = header_of(file)
    reader = open_reader(file, header)
    cfg = config_dict(reader, file)
    tensors = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise GGUFError(f"{file}: tensor {t.name!r} has no counterpart in a {cfg['model_type']} model")
        tensors[name] = t
    _parsed.clear()
    _parsed[key] = GGUFFile(file, header, reader, cfg, tensors)
    return _parsed[key]


def release() -> None:
    """Forget the parsed file (its reader's metadata objects): call once its weights are loaded."""
    _parsed.clear()


def _cache_root() -> Path:
    root = os.environ.get("SPLITSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "splitspec")
    return Path(root) / "gguf"


def _stamp(file: Path, header: h.Header) -> dict:
    """What identifies the file a folder was built from: a folder is reused only when its
    pointer says exactly this (the header's digest covers every byte the folder is built from)."""
    st = file.stat()
    return {"gguf": str(file), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "format": FORMAT,
            "header_sha256": header.digest}


def _pointer(folder: Path) -> dict | None:
    try:
        return json.loads((folder / POINTER).read_text())
    except (OSError, ValueError):
        return None


def model_folder(path: str | Path, cache: Path | None = None) -> Path:
    """The Hugging Face-style folder serving `path` (a .gguf file or a folder holding one): its
    config, tokenizer and generation config built from the metadata, written once per file and
    reused while its pointer matches the file (`_stamp`), rebuilt otherwise; the weights stay in
    the GGUF file (`GGUFWeights`). A path that is not a GGUF checkpoint is returned as it is."""
    file = find_gguf(path)
    if file is None:
        return Path(path)
    file = file.resolve()
    header = header_of(file)
    stamp = _stamp(file, header)
    key = hashlib.sha256(f"{FORMAT}|{file}|{stamp['size']}|{stamp['mtime_ns']}".encode()).hexdigest()[:16]
    out = (cache or _cache_root()) / f"{file.stem}-{key}"
    if _pointer(out) == stamp:
        return out
    _write_folder(out, _folder_files(parse(file)), stamp)
    return out


def _folder_files(parsed: GGUFFile) -> dict[str, str]:
    reader, file, cfg = parsed.reader, parsed.file, dict(parsed.config)
    eos = end_ids(reader, file)
    cfg["eos_token_id"] = eos
    return {
        "config.json": json.dumps(cfg, indent=1),
        "tokenizer.json": tokenizer_json(reader, file, cfg["vocab_size"]),
        "tokenizer_config.json": json.dumps(tokenizer_config(reader, file, eos, cfg), indent=1),
        "generation_config.json": json.dumps({"eos_token_id": eos}),
    }


def _write_folder(out: Path, files: dict[str, str], stamp: dict) -> None:
    # Written into a temporary folder and renamed, so two services starting together never
    # read a half-written folder; a stale folder (its pointer no longer matches) is moved aside
    # first, since a rename does not replace a folder that has files in it.
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (tmp / name).write_text(text)
    (tmp / POINTER).write_text(json.dumps(stamp))
    try:
        tmp.rename(out)
        return
    except OSError:
        pass
    if _pointer(out) != stamp:
        stale = out.with_name(out.name + f".stale{os.getpid()}")
        try:
            out.rename(stale)
            tmp.rename(out)
        except OSError:          # another process replaced it meanwhile: its folder is the same
            pass
        shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith("blk.") and gguf_name.count(".") >= 2:
        _, layer, rest = gguf_name.split(".", 2)
        # Only llama.cpp's spelling of a layer (a decimal without leading zeros), so two
        # spellings of one layer can never name the same parameter.
        if rest in LAYER_NAMES and layer.isascii() and layer.isdigit() and layer == str(int(layer)):
            return f"model.layers.{layer}.{LAYER_NAMES[rest]}"
    return None


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: within each head it stored the rows interleaved
    (pairs of rotary halves); ours keeps the two halves contiguous."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFWeights:
    """The tensors of one GGUF file under our names; `get_tensor` dequantizes one at a time.
    Every instance over the same file shares one parse (`parse`) until `release`."""

    def __init__(self, file: Path, parsed: GGUFFile | None = None):
        self.file = Path(file)
        parsed = parsed or parse(self.file)
        self.reader, self.tensors = parsed.reader, parsed.tensors
        self.arch = parsed.config["model_type"]
        self.heads, self.kv_heads = parsed.config["num_attention_heads"], parsed.config["num_key_value_heads"]

    def keys(self):
        return self.tensors.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        from gguf import GGMLQuantizationType, quants
        t = self.tensors[name]
        qtype = t.tensor_type
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w = np.asarray(t.data, dtype=np.float32)
        else:
            try:
                w = quants.dequantize(t.data, qtype)
            except Exception as exc:
                raise GGUFError(f"{self.file}: tensor {t.name!r} ({qtype.name}) cannot be dequantized: {exc}") from None
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if w.size != int(np.prod(shape)):
            raise GGUFError(f"{self.file}: tensor {t.name!r} holds {w.size} values, its shape {shape} needs "
                            f"{int(np.prod(shape))}; the file may be truncated")
        w = w.reshape(shape)
        if self.arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute(w, self.heads)
        elif self.arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute(w, self.kv_heads)
        w = np.ascontiguousarray(w, dtype=np.float32)
        return torch.from_numpy(w if w.flags.writeable else w.copy())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
