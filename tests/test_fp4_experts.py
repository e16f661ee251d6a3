"""Issue 38: routed experts stay FP4-packed in memory (compressed-tensors MXFP4 and NVFP4) and the
forward dequantizes only the experts a batch routes to, exactly.

* dequantization against hand-computed bytes for both formats (negative zero, NaN scales, odd
  shapes refused);
* a packed MoE target equals its dequantized twin per layer and end to end, also at TP=2, and
  greedy output through the services equals transformers on the twin; T=1 through the services
  follows the target's distribution;
* memory: the packed model holds the packed bytes, not float experts."""
from __future__ import annotations

import collections
import math

import pytest
import torch

from fp4_models import save_packed_twin
from hybrid_models import save_tiny_deepseek
from target_service.engine import forward_sequences, generate, load_model
from splitspec.models.fp4 import (FORMAT, NV_FORMAT, PackedLinear, dequantize_mxfp4, dequantize_nvfp4,
                                       quantize_nvfp4)

PROMPTS = [[5, 6, 7, 8, 9], [40, 3, 3, 17, 90, 2, 61]]


# ------------------------------------------------------------------ formats, by hand


def test_nvfp4_decodes_hand_computed_bytes():
    # byte 0xA1: low nibble 0x1 = +0.5 (element 0), high nibble 0xA = -1.0 (element 1);
    # 0x08: -0 then +0; 0x7F: -6 is 0xF (high), +6 is 0x7 (low)
    packed = torch.tensor([[0xA1, 0x08, 0xF7, 0x00, 0x00, 0x00, 0x00, 0x00]], dtype=torch.uint8)
    scales = torch.tensor([[2.0]]).to(torch.float8_e4m3fn)        # one scale per 16 elements
    got = dequantize_nvfp4(packed, scales, torch.tensor([4.0]))    # x = code * 2.0 / 4.0
    assert got[0, :6].tolist() == [0.25, -0.5, 0.0, 0.0, 3.0, -3.0]
    assert torch.signbit(got[0, 2]) and not torch.signbit(got[0, 3])     # negative zero is kept
    nan_scale = torch.tensor([[float("nan")]]).to(torch.float8_e4m3fn)
    assert torch.isnan(dequantize_nvfp4(packed, nan_scale, torch.tensor([4.0]))).all()
    with pytest.raises(ValueError, match=r"packed shape \(1, 7\) and scale shape \(1, 1\) disagree"):
        dequantize_nvfp4(packed[:, :7], scales, torch.tensor([4.0]))
    with pytest.raises(ValueError, match="scales torch.float8_e4m3fn"):
        dequantize_nvfp4(packed, torch.ones(1, 1, dtype=torch.uint8), torch.tensor([4.0]))
    with pytest.raises(ValueError, match="one per tensor"):
        dequantize_nvfp4(packed, scales, torch.tensor([4.0, 2.0]))


def test_mxfp4_keeps_negative_zero_and_nan_scales():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x8F                                          # -6.0, then -0.0
    got = dequantize_mxfp4(packed, torch.tensor([[128]], dtype=torch.uint8))     # 2^(128-127) = 2
    assert got[0, 0].item() == -12.0 and got[0, 1].item() == 0.0 and torch.signbit(got[0, 1])
    assert torch.isnan(dequantize_mxfp4(packed, torch.tensor([[255]], dtype=torch.uint8))).all()


def test_nvfp4_quantizer_is_a_fixpoint_of_its_own_values():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    p, s, g = quantize_nvfp4(w)
    assert p.shape == (8, 32) and s.shape == (8, 4) and s.dtype == torch.float8_e4m3fn and g.shape == (1,)
    d = dequantize_nvfp4(p, s, g)
    assert (d - w).abs().max() <= w.abs().max() / 6          # at most half a step at the largest scale
    p2, s2, g2 = quantize_nvfp4(d)
    torch.testing.assert_close(dequantize_nvfp4(p2, s2, g2), d)


def test_packed_linear_refuses_shapes_its_groups_do_not_divide_and_keeps_its_dtypes():
    with pytest.raises(ValueError, match="in_features 24 is not a multiple of 32"):
        PackedLinear(24, 8, FORMAT)
    with pytest.raises(ValueError, match="in_features 24 is not a multiple of 16"):
        PackedLinear(24, 8, NV_FORMAT)
    lin = PackedLinear(32, 4, NV_FORMAT).to(torch.bfloat16)
    assert lin.weight_packed.dtype == torch.uint8 and lin.weight_scale.dtype == torch.float8_e4m3fn
    assert lin.weight_global_scale.dtype == torch.float32


# ------------------------------------------------------------------ a packed MoE target


@pytest.fixture(scope="module", params=[FORMAT, NV_FORMAT], ids=["mxfp4", "nvfp4"])
def packed_pair(request, tmp_path_factory):
    """(packed folder, dequantized twin folder): a DeepSeek-V3 MoE whose 64-wide experts split
    into 32-element groups at TP=2."""
    root = tmp_path_factory.mktemp("fp4-" + request.param[:5])
    src = save_tiny_deepseek(root / "src", moe_intermediate_size=64)
    return save_packed_twin(src, root / "packed", root / "twin", request.param)


def test_packed_target_equals_its_dequantized_twin_layer_by_layer(packed_pair):
    packed_dir, twin_dir = packed_pair
    packed, twin = load_model(packed_dir), load_model(twin_dir)
    experts = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    assert len(experts) == 2 * 8 * 3                      # MoE layers x experts x (gate, up, down)
    assert not any(n.endswith("experts.0.gate_proj.weight") for n, _ in packed.named_parameters())
    ids = torch.randint(3, 128, (2, 19), generator=torch.Generator().manual_seed(1))
    layers = list(range(packed.cfg.num_hidden_layers))
    a = forward_sequences(packed, ids, hidden_layers=layers)
    b = forward_sequences(twin, ids, hidden_layers=layers)
    H = packed.cfg.hidden_size
    for i in layers:                                       # every layer's output, position by position
        torch.testing.assert_close(a.hidden[..., i * H:(i + 1) * H], b.hidden[..., i * H:(i + 1) * H],
                                   atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
    for p in PROMPTS:
        assert generate(packed, p, 16) == generate(twin, p, 16)


def test_only_the_routed_experts_are_dequantized(packed_pair, monkeypatch):
    packed = load_model(packed_pair[0])
    seen = []
    real = PackedLinear.dequantized
    monkeypatch.setattr(PackedLinear, "dequantized", lambda self, *a: seen.append(self) or real(self, *a))
    forward_sequences(packed, torch.tensor([[5, 6, 7]]))
    # 3 tokens x top-2 experts per MoE layer: at most 6 of 8 experts run, each dequantizes its
    # gate, up and down once (the shared experts are plain)
    per_layer = collections.Counter(id(m) for m in seen)
    assert set(per_layer.values()) == {1} and len(seen) <= 2 * 6 * 3 and len(seen) % 3 == 0


def test_packed_target_holds_packed_bytes_not_float_experts(packed_pair):
    packed, twin = load_model(packed_pair[0]), load_model(packed_pair[1])

    def nbytes(m):
        return sum(p.numel() * p.element_size() for p in m.parameters())
    expert_floats = sum(p.numel() * 4 for n, p in twin.named_parameters() if ".experts." in n)
    expert_packed = sum(p.numel() * p.element_size() for n, p in packed.named_parameters() if ".experts." in n)
    assert expert_packed <= expert_floats * 4.5 / 32 * 1.01       # ~4.25-4.5 bits a weight
    assert nbytes(twin) - nbytes(packed) == expert_floats - expert_packed


def test_packed_target_at_tensor_parallel_size_2_equals_one_process(packed_pair):
    from target_service.engine import close_model
    packed_dir, twin_dir = packed_pair
    twin = load_model(twin_dir)
    drv = load_model(packed_dir, tensor_parallel_size=2)
    try:
        assert isinstance(drv.inner.get_submodule("model.layers.1.mlp.experts.0.down_proj"), PackedLinear)
        for p in PROMPTS:
            assert generate(drv, p, 12) == generate(twin, p, 12)
    finally:
        close_model(drv)


# ------------------------------------------------------------------ through the services


@pytest.fixture(scope="module")
def mx_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp4-services")
    src = save_tiny_deepseek(root / "src", moe_intermediate_size=64)
    from tiny_models import save_tiny_tokenizer
    save_tiny_tokenizer(src, 128)
    return save_packed_twin(src, root / "packed", root / "twin", FORMAT)


def test_services_on_a_packed_target_equal_transformers_and_follow_its_distribution(mx_pair, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoModelForCausalLM

    from service_helpers import collect, gateway_stub, running_stack
    from splitspec_tools.client import build_request
    from splitspec.engine.sample import SamplingParams
    from sampling_law import chi_square_pvalue, exact_joint
    packed_dir, twin_dir = mx_pair
    hf = AutoModelForCausalLM.from_pretrained(str(twin_dir), dtype=torch.float32).eval()
    model = load_model(packed_dir)
    with running_stack(packed_dir, tmp_path, None, service_args=("--torch-threads", "1")) as (_, _, gw):
        ch, stub = gateway_stub(gw.address)
        try:
            for p in PROMPTS:
                with torch.no_grad():
                    ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                      max_new_tokens=12, do_sample=False, pad_token_id=1,
                                      eos_token_id=None)[0, len(p):].tolist()
                for method in ("none", "ngram"):
                    ids, _, _ = collect(stub.Generate(build_request(p, max_new_tokens=12, ignore_eos=True,
                                                                    method=method), timeout=120))
                    assert ids == ref, method
            prompt, n, samples = [7, 8, 9, 7, 8], 2, 240
            joint = exact_joint(model, prompt, SamplingParams(temperature=1.0, top_k=3), n)

            def run(seed):
                req = build_request(prompt, max_new_tokens=n, ignore_eos=True, temperature=1.0, top_k=3, seed=seed)
                return tuple(collect(stub.Generate(req, timeout=120))[0])
            with ThreadPoolExecutor(4) as pool:
                counts = collections.Counter(pool.map(run, range(samples)))
            assert set(counts) <= set(joint) and math.isclose(sum(joint.values()), 1.0, rel_tol=1e-4)
            assert chi_square_pvalue(counts, joint, samples) > 1e-3
        finally:
            ch.close()


# ------------------------------------------------------------------ memory preflight


def _param_bytes(model) -> tuple[int, int]:
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    return experts, sum(p.numel() * p.element_size() for p in model.parameters()) - experts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_preflight_estimate_is_what_the_loaded_ranks_hold(packed_pair, dtype):
    from target_service.engine import close_model
    from target_service.preflight import estimate
    for folder in packed_pair:
        est = estimate(folder, dtype=dtype)
        assert (est.experts, est.trunk) == _param_bytes(load_model(folder, dtype=dtype)), folder.name
    est = estimate(packed_pair[0], world=2, dtype=dtype)
    drv = load_model(packed_pair[0], dtype=dtype, tensor_parallel_size=2)
    try:
        assert (est.experts, est.trunk) == _param_bytes(drv.inner)
    finally:
        close_model(drv)
    packed, twin = estimate(packed_pair[0], dtype=dtype), estimate(packed_pair[1], dtype=dtype)
    assert packed.experts_dequantized == twin.experts > 3.5 * packed.experts     # 16 or 32 bits vs ~4.25-4.5


def test_the_target_refuses_a_model_that_does_not_fit_before_loading_anything(packed_pair, monkeypatch):
    import target_service.server as server
    from target_service.preflight import PreflightError, main as preflight_main
    args = server.build_parser().parse_args(["--model-path", str(packed_pair[0]), "--kv-cache-budget-mb", "64",
                                             "--device-memory-gb", "0.05"])
    loaded = []
    monkeypatch.setattr(server, "load_model", lambda *a, **k: loaded.append(a))
    with pytest.raises(PreflightError) as err:
        server._load(args)
    msg = str(err.value)
    assert "does not fit" in msg and "KV pool" in msg and "a device with at least" in msg and not loaded
    assert preflight_main([str(packed_pair[0]), "--kv-cache-budget-mb", "64", "--device-memory-gb", "0.05"]) == 1
    assert preflight_main([str(packed_pair[0]), "--kv-cache-budget-mb", "8", "--device-memory-gb", "1"]) == 0


def test_the_service_exits_at_once_naming_the_numbers(packed_pair):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "target_service.server", "--model-path", str(packed_pair[0]),
                        "--port", "0", "--device-memory-gb", "0.01"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "does not fit" in r.stdout + r.stderr and "per rank needed" in r.stdout + r.stderr
