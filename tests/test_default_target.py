"""The committed default target (models/splitspec-code-target, trained by
`splitspec_tools.train.target`) loads with our loader and with transformers, and greedy generation is
identical token for token between the two."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from target_service.engine import forward_sequences
from target_service.generate import generate
from splitspec.models.loader import load_model, load_tokenizer

MODEL = Path(__file__).resolve().parent.parent / "models" / "splitspec-code-target"
PROMPT = 'def read_lines(path):\n    """Return the lines of the file at path."""\n'

pytestmark = pytest.mark.skipif(
    not (MODEL / "model.safetensors").is_file(),
    reason=f"{MODEL} has not been trained yet (python -m splitspec_tools.train.target)")


@pytest.fixture(scope="module")
def ours():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tok():
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(MODEL)


def test_folder_is_complete_and_small():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md"):
        assert (MODEL / name).is_file(), name
    assert (MODEL / "model.safetensors").stat().st_size <= 40 * 2**20
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]


def test_tokenizers_agree(hf_tok):
    ours_tok = load_tokenizer(MODEL)
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.eos_token_id == ours_tok.token_to_id("<|endoftext|>")
    assert hf_tok(PROMPT)["input_ids"] == ours_tok.encode(PROMPT).ids
    assert hf_tok.decode(hf_tok(PROMPT)["input_ids"]) == PROMPT


def test_logits_match_transformers(ours, hf, hf_tok):
    ids = torch.tensor([hf_tok(PROMPT)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(forward_sequences(ours, ids).logits, hf(ids).logits, rtol=1e-4, atol=1e-4)


def test_greedy_generation_matches_transformers(ours, hf, hf_tok):
    prompt = hf_tok(PROMPT)["input_ids"]
    eos = hf_tok.eos_token_id
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=32, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos)[0, len(prompt):].tolist()
    mine = generate(ours, prompt, 32, eos_ids=(eos,))
    assert mine == theirs
    assert len(mine) >= 8  # a trained model writes code here, not an immediate <|endoftext|>
