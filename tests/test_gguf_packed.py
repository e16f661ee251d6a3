"""GGUF weights kept packed on CPU (splitspec/models/gguf_packed.py): Q4_0 / Q4_1 blocks reach
torch's int4 kernel with their nibbles unchanged; the packed model's rows are bit-identical at
every row count and thread count (the batch-invariant guarantee), on this host's kernel and on
the AVX2 kernel; the packed model agrees with the dequantized reference; no float copy of a
packed projection is held; a quant type the kernel cannot take stays dequantized, said once."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from gguf_models import save_tiny_gguf
from service_helpers import ROOT
from splitspec.models import gguf_packed
from splitspec.models.gguf_packed import Int4Linear, Int8Linear, Q8Embedding, q4_groups, quantize_int4
from splitspec.models.loader import load_model
from target_service.engine import forward_sequences
from tiny_models import build_tiny_hf_model, save_tiny_tokenizer

pytestmark = pytest.mark.skipif(not gguf_packed.kernel_available(), reason="this CPU has no AVX2: no packed path")
VOCAB = 512
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return save_tiny_tokenizer(tmp_path_factory.mktemp("tok"), VOCAB)


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory, tok_dir):
    file = tmp_path_factory.mktemp("q4") / "m.gguf"
    save_tiny_gguf(file, build_tiny_hf_model("llama", seed=5, tie_word_embeddings=True, **SHAPE),
                   tok_dir / "tokenizer.json", qtype="Q4_1")
    return file


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_blocks_map_exactly_onto_the_int4_formula(qtype):
    from gguf import GGMLQuantizationType, quants
    w = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    blocks = quants.quantize(w, getattr(GGMLQuantizationType, qtype))
    want = torch.from_numpy(quants.dequantize(blocks, getattr(GGMLQuantizationType, qtype)).reshape(w.shape))
    q, scale, zero = q4_groups(blocks, qtype, 48, 96)
    got = (q.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-6)
    assert int(q.min()) >= 0 and int(q.max()) <= 15


def test_the_kernel_multiplies_by_the_weight_its_scales_say():
    w = torch.randn(64, 96)
    q, scale, zero = quantize_int4(w)
    lin = Int4Linear(q, scale, zero)
    s, z = scale.bfloat16().float().repeat_interleave(32, 1), zero.bfloat16().float().repeat_interleave(32, 1)
    # dequantized() reads the weight back through the kernel, whose output is bf16.
    torch.testing.assert_close(lin.dequantized(), ((q.float() - 8) * s + z).bfloat16().float(), rtol=2 ** -8, atol=1e-6)
    x = torch.randn(5, 96)
    want = x.bfloat16().float() @ ((q.float() - 8) * s + z).t()
    assert (lin(x) - want).abs().max() <= 2 ** -7 * want.abs().max()      # the output's bf16 rounding
    assert (lin.dequantized() - w).abs().max() <= scale.max() * 0.51 + 1e-3    # within half a step of the grid


ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64)


def _rows_invariant(module, width: int) -> None:
    x = torch.randn(64, width, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([module(x[i:i + 1]) for i in range(64)])
    for m in ROWS:
        assert torch.equal(module(x[:m]), alone[:m]), f"a row changed bits at {m} rows"


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_rows_bits_do_not_depend_on_the_row_count_or_threads(kind):
    w = torch.randn(1536, 576, generator=torch.Generator().manual_seed(2))
    module = Int4Linear(*quantize_int4(w)) if kind == "int4" else Int8Linear(w)
    _rows_invariant(module, 576)
    x = torch.randn(8, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = module(x)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(module(x), one)
    finally:
        torch.set_num_threads(threads)


AVX2_CHECK = """
import torch
assert torch.backends.cpu.get_cpu_capability() == "AVX2", torch.backends.cpu.get_cpu_capability()
from splitspec.models.gguf_packed import Int4Linear, Int8Linear, quantize_int4
w = torch.randn(1536, 576, generator=torch.Generator().manual_seed(2))
for module in (Int4Linear(*quantize_int4(w)), Int8Linear(w)):
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([module(x[i:i + 1]) for i in range(64)])
    for m in (1, 3, 4, 5, 8, 9, 17, 64):
        assert torch.equal(module(x[:m]), alone[:m]), (type(module).__name__, m)
print("ok")
"""


def test_rows_are_invariant_on_the_avx2_kernel_too():
    """An AVX2-only host (AMD Zen 3) runs the kernel's other path; torch picks it here when told."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", AVX2_CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def test_the_q8_embedding_reads_the_rows_of_the_dequantized_table():
    from gguf import GGMLQuantizationType, quants
    w = np.random.default_rng(3).standard_normal((40, 64)).astype(np.float32)
    blocks = quants.quantize(w, GGMLQuantizationType.Q8_0)
    table = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q8_0).reshape(w.shape))
    emb = Q8Embedding(blocks, 40, 64, torch.float32)
    ids = torch.tensor([[3, 0, 39], [7, 7, 1]])
    assert torch.equal(emb(ids), table[ids])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_packed_model_agrees_with_the_dequantized_reference(tmp_path, tok_dir, arch):
    """Same file, both paths: the packed one only rounds the group scales to bf16 and runs bf16
    activations (llama: Q/K rows un-permuted with their scales; qwen2: the biases)."""
    hf = build_tiny_hf_model(arch, seed=7, **SHAPE)
    save_tiny_gguf(tmp_path / "m.gguf", hf, tok_dir / "tokenizer.json", qtype="Q4_0")
    ref = load_model(tmp_path / "m.gguf", dtype="float32", gguf_weights="dequantized")
    packed = load_model(tmp_path / "m.gguf", dtype="float32")
    assert packed.model.layers[0].self_attn.q_proj is None and isinstance(packed.lm_head, Int4Linear)
    ids = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(0))
    want, got = forward_sequences(ref, ids).logits, forward_sequences(packed, ids).logits
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_no_float_copy_of_a_packed_projection_is_held(q4_file):
    model = load_model(q4_file, dtype="bfloat16")
    # A Q4_1 embedding is looked up in its dequantized table; the head it ties to stays Q4_1.
    dense = [n for n, p in model.named_parameters() if p.dim() == 2]
    assert dense == ["model.embed_tokens.weight"], dense
    assert isinstance(model.lm_head, Int4Linear)
    held = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    assert held <= 1.3 * q4_file.stat().st_size + VOCAB * 64 * 2


def test_a_packed_models_verify_rows_are_its_decode_rows_and_speculation_is_exact(q4_file):
    """The whole model at bf16 with batch-invariant attention, not one matmul: a token verified as
    a row of a draft chain gets the logits it gets decoded alone, so greedy speculation equals
    target-only decoding."""
    from splitspec.engine.tree import Tree
    from target_service.engine import TargetSequence
    model = load_model(q4_file, dtype="bfloat16")
    rows, orig = [], model.lm_head.forward
    model.lm_head.forward = lambda x: rows.append(x.detach().clone()) or orig(x)
    try:
        for i in range(3):
            prompt = [(7 * i + 3 * j) % 500 + 3 for j in range(20 + 17 * i)]
            ref = TargetSequence(model, prompt, max_len=len(prompt) + 40, attention="torch-exact")
            greedy = [ref.prefill().committed[0]]
            rows.clear()
            for _ in range(12):
                greedy.append(ref.decode().committed[0])
            decoded = torch.cat([r[:1] for r in rows])
            spec = TargetSequence(model, prompt, max_len=len(prompt) + 40, attention="torch-exact")
            got = [spec.prefill().committed[0]]
            rows.clear()
            out = spec.verify(Tree.chain(greedy[1:9]))
            assert torch.equal(rows[-1][:8], decoded[:8])
            got += out.committed
            while len(got) < len(greedy):
                got += spec.verify(Tree.chain(greedy[len(got):len(got) + 4])).committed
            assert got[:len(greedy)] == greedy
    finally:
        model.lm_head.forward = orig


def test_a_quant_type_the_kernel_cannot_take_stays_dequantized_and_says_so(tmp_path, tok_dir, capsys):
    hf = build_tiny_hf_model("qwen3", seed=8, **SHAPE)
    save_tiny_gguf(tmp_path / "m.gguf", hf, tok_dir / "tokenizer.json", qtype="Q8_0")
    model = load_model(tmp_path / "m.gguf", dtype="float32")
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)
    log = capsys.readouterr()
    text = log.out + log.err
    assert "gguf_weights" in text and "Q8_0 has no exact int4 form" in text
    ref = load_model(tmp_path / "m.gguf", dtype="float32", gguf_weights="dequantized")
    ids = torch.tensor([[5, 17, 300, 42]])
    assert torch.equal(forward_sequences(model, ids).logits.argmax(-1), forward_sequences(ref, ids).logits.argmax(-1))


def test_an_unknown_weights_mode_or_head_format_is_refused(q4_file):
    with pytest.raises(ValueError, match="gguf weights 'int3'"):
        load_model(q4_file, gguf_weights="int3")
    with pytest.raises(ValueError, match="head format 'fp8'"):
        load_model(q4_file, gguf_head="fp8")


def test_a_cpu_without_the_kernels_fast_paths_loads_dequantized_and_says_so(q4_file, monkeypatch, capsys):
    monkeypatch.setattr(gguf_packed, "kernel_available", lambda: False)
    model = load_model(q4_file, dtype="float32")
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)
    text = "".join(capsys.readouterr())
    assert "gguf_weights" in text and "weights=dequantized" in text and "has no AVX2" in text
