"""The bench's llama.cpp row (splitspec_tools/bench/llamacpp.py): the GGUF conversion keeps the model
llama.cpp runs equal to ours. The logit comparison needs the optional extra
(`pip install -e '.[llamacpp]'`) and skips without it; the rope reordering is checked either way."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from splitspec_tools.bench.llamacpp import _permute_rope_rows, available
from target_service.engine import forward_sequences


def _rotate_half_rope(q: np.ndarray, pos: int, base: float = 10000.0) -> np.ndarray:
    """transformers' rope on one head's [D] vector: pairs (i, i + D/2)."""
    D = q.shape[-1]
    ang = pos / base ** (np.arange(0, D, 2) / D)
    c, s = np.cos(ang), np.sin(ang)
    a, b = q[: D // 2], q[D // 2:]
    return np.concatenate([a * c - b * s, b * c + a * s])


def _interleaved_rope(q: np.ndarray, pos: int, base: float = 10000.0) -> np.ndarray:
    """llama.cpp's rope for llama: pairs (2i, 2i + 1)."""
    D = q.shape[-1]
    ang = pos / base ** (np.arange(0, D, 2) / D)
    c, s = np.cos(ang), np.sin(ang)
    a, b = q[0::2], q[1::2]
    out = np.empty_like(q)
    out[0::2], out[1::2] = a * c - b * s, b * c + a * s
    return out


def test_reordered_q_rows_under_interleaved_rope_give_the_same_attention_scores():
    rng = np.random.default_rng(0)
    heads, D, H = 3, 8, 16
    wq, wk = rng.standard_normal((heads * D, H)), rng.standard_normal((heads * D, H))
    x1, x2 = rng.standard_normal(H), rng.standard_normal(H)
    pq, pk = _permute_rope_rows(wq, heads), _permute_rope_rows(wk, heads)
    for h in range(heads):
        rows = slice(h * D, (h + 1) * D)
        hf = _rotate_half_rope((wq @ x1)[rows], 7) @ _rotate_half_rope((wk @ x2)[rows], 3)
        cpp = _interleaved_rope((pq @ x1)[rows], 7) @ _interleaved_rope((pk @ x2)[rows], 3)
        assert abs(hf - cpp) < 1e-9
    assert not np.allclose(pq, wq)


def test_missing_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    assert "pip install -e '.[llamacpp]'" in available()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_llamacpp_runs_the_converted_model_with_our_logits(arch, tiny_model_factory, tmp_path):
    if available():
        pytest.skip(available())
    from splitspec_tools.bench.llamacpp import load, to_gguf
    from splitspec.models.loader import load_model
    path = tiny_model_factory(arch, seed=31, tokenizer=True)
    gguf = to_gguf(path, tmp_path / "m.gguf", "f32")
    llm = load(gguf, threads=1, n_ctx=64, logits_all=True)
    model = load_model(path)
    prompt = torch.randint(3, model.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    llm.eval(prompt)
    theirs = torch.tensor(np.array(llm.scores[:len(prompt)]), dtype=torch.float32)
    with torch.no_grad():
        ours = forward_sequences(model, torch.tensor(prompt)).logits[0]
    # llama.cpp keeps its KV cache in f16 by default: differences of ~1e-3 on logits of ~1; a
    # wrong rope order or a missing norm weight moves them by ~1.
    assert (theirs - ours).abs().max().item() < 2e-2
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


def test_llamacpp_runner_greedy_tokens_equal_ours(tiny_model_factory, tmp_path):
    if available():
        pytest.skip(available())
    from splitspec_tools.bench.llamacpp import LlamaCppRunner, to_gguf
    from splitspec.engine.sample import SamplingParams
    from target_service.engine import generate
    from splitspec.models.loader import load_model
    path = tiny_model_factory("qwen3", seed=31, tokenizer=True)
    runner = LlamaCppRunner(to_gguf(path, tmp_path / "m.gguf", "f32"), threads=1, n_ctx=64)
    model = load_model(path)
    prompt = torch.randint(3, model.cfg.vocab_size, (10,), generator=torch.Generator().manual_seed(4)).tolist()
    sample = runner.run(prompt, 12, SamplingParams())
    assert sample.tokens == generate(model, prompt, 12)
    assert len(sample.step_times) == 12
