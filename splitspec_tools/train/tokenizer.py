"""Byte-level BPE for Python source, trained with the `tokenizers` library.

Byte-level so that any text (any Unicode, any whitespace) encodes without an unknown token, and
no normaliser, no prefix space and no space clean-up on decode, so that decode(encode(s)) == s
exactly: the draft and target exchange token ids, and code must come back byte for byte.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS = "<|endoftext|>"
MASK = "<|mask|>"   # reserved for the DFlash drafter's masked block positions
SPECIAL_TOKENS = [EOS, MASK]


def train_tokenizer(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Offsets are only cosmetic here, but keep them exact (no trimming of spaces).
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    """tokenizer_config.json for transformers' PreTrainedTokenizerFast / AutoTokenizer."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "mask_token": MASK,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "rstrip": False, "normalized": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)},
    }


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, *, model_max_length: int = 2048) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(model_max_length), indent=2) + "\n")


def special_id(tok: Tokenizer, token: str) -> int:
    idx = tok.token_to_id(token)
    if idx is None:
        raise ValueError(f"tokenizer has no {token!r}")
    return idx
