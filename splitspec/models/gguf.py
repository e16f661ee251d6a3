"""Serve a llama.cpp GGUF file: the reader, the tensor-name map and the tokenizer builder.

Everything else in splitspec reads a Hugging Face folder (config.json, tokenizer.json,
tokenizer_config.json, generation_config.json, safetensors). A GGUF file carries the same
facts in its metadata, so `model_folder(path)` writes those small JSON files once into a cache
folder beside a pointer to the GGUF file, and every command, service and tool keeps reading a
folder. The weights never leave the GGUF file: `GGUFWeights.get_tensor` dequantizes one tensor
at a time to float32, straight from the memory-mapped file, and the loader casts it into the
parameter (no float copy of the whole model is ever held besides the model itself).

Facts this rests on (gguf-py's `constants.py` / `quants.py`, llama.cpp's `convert_hf_to_gguf.py`
and `llama-vocab.cpp`; see ../shared/research/real-model-gguf.md):
* shapes are listed innermost first; gguf-py hands quantized rows as (rows, bytes per row);
* llama.cpp permutes the Q and K rows of `llama` checkpoints for its rotary layout (`qwen2` /
  `qwen3` are not permuted): the rows are un-permuted here so our half-split RoPE is right;
* end-of-generation tokens: the metadata's eos and eot ids, and, as llama.cpp does, the chat
  markers ending a turn (`<|im_end|>`, `<|eot_id|>`, ...). SmolLM2's file says eos = 1
  (`<|im_start|>`), while its turns end with `<|im_end|>` = 2.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

# Bumped whenever what `model_folder` writes changes, so stale cache folders are rewritten.
FORMAT = 1
POINTER = "gguf_source.json"

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
QUANT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q5_1", "Q5_K")

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
# Token texts that end a turn in the common chat formats (llama.cpp treats them as end of generation).
TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>")
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4


class GGUFError(ValueError):
    """A GGUF file that cannot be served; the message names the file and the field or tensor."""


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


def open_reader(file: Path):
    from gguf import GGUFReader
    try:
        return GGUFReader(file)
    except Exception as exc:     # gguf-py raises ValueError, struct.error, IndexError, ... on bad bytes
        raise GGUFError(f"{file}: not a readable GGUF file ({type(exc).__name__}: {exc}); "
                        "it may be truncated or corrupt") from None


def _field(reader, file: Path, key: str, default=None, *, required: bool = False):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise GGUFError(f"{file}: metadata field {key!r} is missing")
        return default
    try:
        return f.contents()
    except Exception as exc:
        raise GGUFError(f"{file}: metadata field {key!r} cannot be read ({exc})") from None


def config_dict(reader, file: Path) -> dict:
    """A Hugging Face config.json for the file's model; GGUFError naming the field or tensor
    for an architecture or quant type this loader does not serve (before anything is allocated)."""
    arch = _field(reader, file, "general.architecture", required=True)
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{file}: general.architecture {arch!r} is not supported; expected one of "
                        f"{', '.join(ARCHITECTURES)}")
    for t in reader.tensors:
        if t.tensor_type.name not in QUANT_TYPES:
            raise GGUFError(f"{file}: tensor {t.name!r} is stored as {t.tensor_type.name}, which this loader does "
                            f"not dequantize; supported: {', '.join(QUANT_TYPES)}")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise GGUFError(f"{file}: tensor 'rope_freqs.weight' (Llama-3.1-style rope scaling) is not supported")

    def get(key, default=None, required=True):
        return _field(reader, file, f"{arch}.{key}", default, required=required and default is None)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = get("vocab_size", default=0, required=False) or len(_field(reader, file, "tokenizer.ggml.tokens", ()))
    head_dim = int(get("attention.key_length", default=hidden // heads, required=False))
    cfg = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", default=heads, required=False)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", default=10000.0, required=False)),
        "max_position_embeddings": int(get("context_length", default=4096, required=False)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names and arch != "qwen2",
        "torch_dtype": "bfloat16",
    }
    scaling = get("rope.scaling.type", default="none", required=False)
    if scaling not in ("none", ""):
        raise GGUFError(f"{file}: {arch}.rope.scaling.type {scaling!r} is not supported")
    return cfg


def _tokenizer_fields(reader, file: Path) -> dict:
    model = _field(reader, file, "tokenizer.ggml.model", required=True)
    if model != "gpt2":
        raise GGUFError(f"{file}: tokenizer.ggml.model {model!r} is not supported; this loader builds byte-level "
                        "BPE tokenizers ('gpt2', as Llama 3, Qwen and SmolLM files use)")
    tokens = _field(reader, file, "tokenizer.ggml.tokens", required=True)
    merges = _field(reader, file, "tokenizer.ggml.merges")
    if not merges:
        raise GGUFError(f"{file}: metadata field 'tokenizer.ggml.merges' is missing or empty: a BPE tokenizer "
                        "needs its merges")
    types = _field(reader, file, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFError(f"{file}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    pre = _field(reader, file, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{file}: tokenizer.ggml.pre {pre!r} is not supported; expected one of "
                        f"{', '.join(PRE_TOKENIZERS)}")
    return {"tokens": list(tokens), "merges": list(merges), "types": [int(t) for t in types], "pre": pre}


def tokenizer_json(reader, file: Path) -> str:
    """tokenizer.json (the `tokenizers` library's format) built from the file's vocabulary,
    merges, token types and pre-tokenizer name."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    f = _tokenizer_fields(reader, file)
    vocab = {tok: i for i, tok in enumerate(f["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in f["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    if f["pre"] == "smollm":       # digits one by one, then GPT-2's split
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    elif f["pre"] in ("qwen2", "llama-bpe", "llama3"):
        split = _QWEN2_SPLIT if f["pre"] == "qwen2" else _LLAMA3_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [AddedToken(t, special=ty == TOKEN_CONTROL, normalized=False)
             for t, ty in zip(f["tokens"], f["types"]) if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    tok.add_tokens([a for a in added if not a.special])
    tok.add_special_tokens([a for a in added if a.special])
    return tok.to_str()


def end_ids(reader, file: Path) -> list[int]:
    """End-of-generation ids: the metadata's eos and eot, then the control tokens that end a turn."""
    tokens = _field(reader, file, "tokenizer.ggml.tokens", ())
    types = _field(reader, file, "tokenizer.ggml.token_type") or []
    ids = [int(i) for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eos_token_id")
           if (i := _field(reader, file, key)) is not None]
    ids += [i for i, t in enumerate(tokens) if t in TURN_ENDS and (not types or types[i] == TOKEN_CONTROL)]
    # The turn end goes first: tools that take "the" eos (templates, the bench) take ids[0].
    turn = [i for i in ids if tokens and tokens[i] in TURN_ENDS]
    return list(dict.fromkeys(turn + ids))


def tokenizer_config(reader, file: Path, eos: list[int]) -> dict:
    tokens = _field(reader, file, "tokenizer.ggml.tokens", ())
    bos = _field(reader, file, "tokenizer.ggml.bos_token_id")
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
           "model_max_length": config_dict(reader, file)["max_position_embeddings"],
           "eos_token": tokens[eos[0]] if eos else None,
           "bos_token": tokens[bos] if bos is not None and bos < len(tokens) else None}
    template = _field(reader, file, "tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    return cfg


def _cache_root() -> Path:
    root = os.environ.get("SPLITSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "splitspec")
    return Path(root) / "gguf"


def model_folder(path: str | Path, cache: Path | None = None) -> Path:
    """The Hugging Face-style folder serving `path` (a .gguf file or a folder holding one): its
    config, tokenizer and generation config built from the metadata, written once per file
    (keyed by the file's path, size and modification time) and reused; the weights stay in the
    GGUF file (`weights`). A path that is not a GGUF checkpoint is returned as it is."""
    file = find_gguf(path)
    if file is None:
        return Path(path)
    file = file.resolve()
    st = file.stat()
    key = hashlib.sha256(f"{FORMAT}|{file}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = (cache or _cache_root()) / f"{file.stem}-{key}"
    if (out / POINTER).is_file():
        return out
    reader = open_reader(file)
    cfg = config_dict(reader, file)
    eos = end_ids(reader, file)
    cfg["eos_token_id"] = eos
    files = {
        "config.json": json.dumps(cfg, indent=1),
        "tokenizer.json": tokenizer_json(reader, file),
        "tokenizer_config.json": json.dumps(tokenizer_config(reader, file, eos), indent=1),
        "generation_config.json": json.dumps({"eos_token_id": eos}),
    }
    # Written into a temporary folder and renamed, so two services starting together never
    # read a half-written folder.
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (tmp / name).write_text(text)
    (tmp / POINTER).write_text(json.dumps({"gguf": str(file), "size": st.st_size}))
    try:
        tmp.rename(out)
    except OSError:              # another process won the race: its folder is the same
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        if rest in LAYER_NAMES:
            return f"model.layers.{layer}.{LAYER_NAMES[rest]}"
    return None


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: within each head it stored the rows interleaved
    (pairs of rotary halves); ours keeps the two halves contiguous."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFWeights:
    """The tensors of one GGUF file under our names; `get_tensor` dequantizes one at a time."""

    def __init__(self, file: Path):
        self.file = Path(file)
        self.reader = open_reader(self.file)
        cfg = config_dict(self.reader, self.file)
        self.arch = cfg["model_type"]
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.tensors = {}
        for t in self.reader.tensors:
            name = hf_name(t.name)
            if name is None:
                raise GGUFError(f"{self.file}: tensor {t.name!r} has no counterpart in a {self.arch} model")
            self.tensors[name] = t

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
