"""Our Llama / Qwen2 / Qwen3 forward against Hugging Face `transformers` on the same tiny
random checkpoints (float32 on CPU), through the one forward path every caller uses (the
runner over the paged pool): prefill logits, decode logits step by step, greedy
generation token for token, plus bf16 loading and chunked prefill.

The measured max |logit difference| of every check is printed with a `PARITY` prefix
(`pytest -s -k parity` shows them)."""
from __future__ import annotations

import pytest
import torch

from target_service.engine import SequenceBatch, TargetSequence, forward_sequences, generate
from splitspec.models.loader import load_model
from splitspec.engine.sample import SamplingParams

transformers = pytest.importorskip("transformers")

ATOL = 1e-4


def _report(kind: str, variant: str, diff: float) -> None:
    print(f"PARITY {kind:<14} {variant:<14} max|dlogit| = {diff:.3e}")


@pytest.fixture(scope="module")
def models(target_variant):
    """(variant, path, ours fp32, HF fp32) - loaded once per variant."""
    name, path = target_variant
    ours = load_model(path, dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return name, path, ours, hf


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_variant_checkpoint_layout(models):
    name, path, ours, _ = models
    if name.startswith("llama-sharded"):
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("model-*-of-*.safetensors"))) > 2
    else:
        assert (path / "model.safetensors").is_file()
    cfg = ours.cfg
    assert cfg.eos_token_ids == (0,)            # from generation_config.json
    if name.startswith("llama3"):
        assert cfg.rope_type == "llama3" and cfg.tie_word_embeddings
        assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    if name.startswith("qwen2"):
        assert cfg.qkv_bias and not cfg.o_bias
    if name.startswith("qwen3"):
        assert cfg.qk_norm and cfg.head_dim == 32 != cfg.hidden_size // cfg.num_attention_heads


def test_prefill_logits_match_transformers(models):
    name, _, ours, hf = models
    ids = torch.tensor([_prompt(29, ours.cfg.vocab_size, 1)])
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        out = forward_sequences(ours, ids, hidden_layers=[0])
    diff = (out.logits - ref.logits).abs().max().item()
    _report("prefill", name, diff)
    assert diff <= ATOL
    # Layer 0's output is the feature a drafter taps (HF's hidden_states[1]); the last entry
    # of HF's tuple is after the final norm, so only inner layers compare one to one.
    assert torch.allclose(out.hidden, ref.hidden_states[1], atol=ATOL)


def test_cached_decode_logits_match_transformers(models):
    """Prefill into the paged pool, then 20 single-token decode steps on it, each fed a token of
    our choosing; every step's logits equal HF's full (uncached) forward at that position."""
    name, _, ours, hf = models
    prompt = _prompt(13, ours.cfg.vocab_size, 2)
    cont = _prompt(20, ours.cfg.vocab_size, 3)
    P = len(prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + cont])).logits[0]          # [33, V]
    batch = SequenceBatch(ours, [prompt], [SamplingParams()], max_len=64, keep_logits=True)
    first = batch.prefill()[0].logits[0]
    steps = [batch.decode(feed=[t])[0].logits[0] for t in cont[:-1]]
    assert batch.seqs[0].table.length == P + len(cont) - 1
    diff_prefill = (first - ref[P - 1]).abs().max().item()
    diff_decode = (torch.stack(steps) - ref[P:-1]).abs().max().item()
    _report("cached-decode", name, diff_decode)
    assert diff_prefill <= ATOL
    assert diff_decode <= ATOL


def test_greedy_generation_matches_transformers(models):
    name, _, ours, hf = models
    prompt = _prompt(11, ours.cfg.vocab_size, 4)
    hf.generation_config.eos_token_id = None      # no early stop: compare all 32 tokens
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=32, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    got = generate(ours, prompt, 32)
    print(f"PARITY greedy-32     {name:<14} identical = {got == ref}")
    assert len(ref) == 32
    assert got == ref
    assert len(set(got)) > 1    # a degenerate constant output would make this check weak


def test_bf16_load_smoke(models):
    name, path, ours, _ = models
    bf = load_model(path, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in bf.parameters())
    ids = torch.tensor(_prompt(17, ours.cfg.vocab_size, 5))
    ref = forward_sequences(ours, ids).logits[0]
    got = forward_sequences(bf, ids).logits[0].float()
    assert torch.isfinite(got).all()
    diff = (got - ref).abs().max().item()
    _report("bf16-vs-fp32", name, diff)
    assert diff < 0.1 * ref.abs().max().item()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.75
    out = generate(bf, ids.tolist(), 4)
    assert len(out) == 4 and all(0 <= t < bf.cfg.vocab_size for t in out)


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_chunked_prefill_equals_unchunked(tiny_qwen3_model, chunk):
    model = tiny_qwen3_model
    prompt = _prompt(23, model.cfg.vocab_size, 6)
    layers = (0, 1)
    params = SamplingParams(temperature=0.8, seed=5)

    def run(prefill_chunk):
        seq = TargetSequence(model, prompt, params, max_len=64, hidden_layers=layers,
                             prefill_chunk=prefill_chunk)
        out = seq.prefill()
        return seq, out

    ref_seq, ref = run(512)
    seq, out = run(chunk)
    assert out.committed == ref.committed
    assert out.hidden.shape == (len(prompt), 2 * model.cfg.hidden_size)
    assert torch.allclose(out.hidden, ref.hidden, atol=1e-5)
    n = len(prompt)
    assert seq.cache.length == ref_seq.cache.length == n
    assert torch.allclose(seq.cache.k[..., :n, :], ref_seq.cache.k[..., :n, :], atol=1e-5)
    assert torch.allclose(seq.cache.v[..., :n, :], ref_seq.cache.v[..., :n, :], atol=1e-5)
    assert [seq.decode().committed[0] for _ in range(6)] == [ref_seq.decode().committed[0] for _ in range(6)]


def test_draft_taps_follow_transformers_hidden_states(models):
    """A draft's tap of layer i is transformers' `hidden_states[i + 1]` for every i, the last
    layer (stored after the final norm) included, one forward or chunk by chunk, so a draft trained
    here reads the same features in vLLM, SGLang or the reference loop."""
    name, _, ours, hf = models
    L = ours.cfg.num_hidden_layers
    prompt = _prompt(13, ours.cfg.vocab_size, 5)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        whole = forward_sequences(ours, torch.tensor([prompt]), hidden_layers=tuple(range(L))).hidden[0]
    seq = TargetSequence(ours, prompt, SamplingParams(temperature=0.0), hidden_layers=tuple(range(L)))
    paged = seq.prefill().hidden
    H = ours.cfg.hidden_size
    for i in range(L):
        want = ref[i + 1][0]
        for got in (whole[:, i * H:(i + 1) * H], paged[:, i * H:(i + 1) * H]):
            diff = (got - want).abs().max().item()
            assert diff < ATOL, f"{name}: layer {i} tap differs from hidden_states[{i + 1}] by {diff}"
    _report("taps", name, max((whole[:, -H:] - ref[L][0]).abs().max().item(), 0.0))
