"""Kimi-K3's released folder loads (issue 26, part 6): the MXFP4 codec against hand-computed bytes
(nibble order, sign, E8M0 exponent, OCP rounding and saturation) and a round trip; a tiny folder
in the release's layout (`k3_release.py`: the multimodal wrapper, `language_model.` names, vision
tensors, MXFP4 routed experts) loads to exactly the weights of its plain twin and generates the
same greedy tokens, in one process and at tensor parallel size 2; broken folders fail naming the
tensor or field to fix."""
from __future__ import annotations

import json

import pytest
import torch
from structlog.testing import capture_logs

from k3_release import EXPERT, IGNORE, QUANTIZATION_CONFIG, rewrite, save_k3_release
from splitspec.models.config import ConfigError, ModelConfig
from target_service.engine import generate
from splitspec.models.loader import CheckpointError, load_model
from splitspec.models.fp4 import PackedLinear, dequantize_mxfp4, parse_quantization, quantize_mxfp4

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPTS = [[5, 6, 7, 8], [17, 3, 99, 42, 42, 1]]
N_NEW = 12
EXPERT_W1 = "language_model.model.layers.1.block_sparse_moe.experts.0.w1"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("k3-release")
    return save_k3_release(root / "release", root / "plain", seed=3)


@pytest.fixture(scope="module")
def plain_model(folders):
    return load_model(folders[1])


# ---- the codec -----------------------------------------------------------------------------------

def test_dequantize_hand_computed_bytes():
    packed = torch.zeros(3, 16, dtype=torch.uint8)
    packed[0, 0] = 0x2B     # low nibble 0xB = -1.5 is element 0, high nibble 0x2 = 1.0 is element 1
    packed[0, 1] = 0xF7     # 0x7 = 6, 0xF = -6
    packed[1, 0] = 0x91     # 0x1 = 0.5, 0x9 = -0.5
    packed[1, 15] = 0x80    # 0x0 = 0, 0x8 = -0 (elements 30, 31)
    packed[2, 0] = 0x54     # 0x4 = 2, 0x5 = 3
    scales = torch.tensor([[129], [125], [255]], dtype=torch.uint8)     # 2^2, 2^-2, NaN
    got = dequantize_mxfp4(packed, scales)
    assert got.shape == (3, 32) and got.dtype == torch.float32
    assert got[0, :4].tolist() == [-6.0, 4.0, 24.0, -24.0] and not got[0, 4:].any()
    assert got[1, :2].tolist() == [0.125, -0.125] and got[1, 30:].tolist() == [0.0, 0.0]
    assert got[2].isnan().all()
    assert dequantize_mxfp4(packed[:2], scales[:2], torch.bfloat16).float().equal(got[:2])
    # One scale per 32 elements along the last dim; leading dims (an expert stack) pass through.
    two = dequantize_mxfp4(torch.full((2, 1, 32), 0x22, dtype=torch.uint8),
                           torch.tensor([[[127, 128]], [[126, 0]]], dtype=torch.uint8))
    assert two[0, 0, :32].eq(1.0).all() and two[0, 0, 32:].eq(2.0).all()
    assert two[1, 0, :32].eq(0.5).all() and two[1, 0, 32:].eq(2.0 ** -127).all()


def test_quantize_hand_computed_bytes():
    row = torch.zeros(2, 32)
    row[0, :2] = torch.tensor([1.0, -0.5])          # amax 1: exponent floor(log2 1) - 2 = -2 (byte 125)
    row[1, :2] = torch.tensor([8.0, -12.0])         # amax 12: exponent 3 - 2 = 1 (byte 128)
    packed, scales = quantize_mxfp4(row)
    assert scales.tolist() == [[125], [128]]
    assert packed[0, 0].item() == 0xC6              # 1 / 2^-2 = 4 is code 6 (low), -0.5 / 2^-2 = -2 is 0xC (high)
    assert packed[1, 0].item() == 0xF6              # 8 / 2 = 4 is code 6, -12 / 2 = -6 is 0xF
    assert not packed[:, 1:].any()
    assert dequantize_mxfp4(packed, scales)[:, :2].tolist() == [[1.0, -0.5], [8.0, -12.0]]


def test_quantize_rounds_to_nearest_ties_to_even_and_saturates():
    # amax 7 -> exponent floor(log2 7) - 2 = 0 (scale byte 127): the values are rounded as they are.
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.1, -0.3, -6.0, 0.6, 2.9, -4.9] + [0.0] * 18)
    packed, scales = quantize_mxfp4(x[None])
    assert scales.item() == 127
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.0, -0.5, -6.0, 0.5, 3.0, -4.0]
    assert dequantize_mxfp4(packed, scales)[0, :14].tolist() == want


def test_round_trip_is_exact_on_representable_values_and_bounded_otherwise():
    w = torch.randn(6, 4, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 6)[:, None, None]
    packed, scales = quantize_mxfp4(w)
    assert packed.shape == (6, 4, 48) and scales.shape == (6, 4, 3)
    d = dequantize_mxfp4(packed, scales)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)     # 2^shared per element
    assert ((d - w).abs() <= 2 * step).all()            # half the widest gap, or the saturation 8 -> 6
    assert d.to(torch.bfloat16).float().equal(d)        # every value is a bfloat16
    again = quantize_mxfp4(d)
    assert again[0].equal(packed) and again[1].equal(scales)


def test_bad_shapes_and_dtypes_are_refused():
    with pytest.raises(ValueError, match=r"packed shape \(2, 16\) and scale shape \(2, 2\) disagree"):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(2, 24))


# ---- the quantization_config ----------------------------------------------------------------------

def test_quantization_config_targets_and_ignore():
    scheme = parse_quantization({"text_config": {"quantization_config": QUANTIZATION_CONFIG}})
    lin = torch.nn.Linear(2, 2)
    assert scheme.covers("language_model.model.layers.1.block_sparse_moe.experts.7.w2", lin)
    for ignored in ("language_model.model.layers.1.self_attn.q_proj", "language_model.lm_head",
                    "language_model.model.layers.1.block_sparse_moe.shared_experts.up_proj",
                    "language_model.model.layers.0.mlp.down_proj", "vision_tower.encoder.blocks.0.wqkv"):
        assert not scheme.covers(ignored, lin), ignored
    assert not scheme.covers("language_model.model.layers.1.block_sparse_moe.gate", torch.nn.Module())
    # Also read at the wrapper's top level; none at all is a plain folder.
    assert parse_quantization({"quantization_config": QUANTIZATION_CONFIG}) == scheme
    assert parse_quantization({"text_config": {}}) is None
    assert len(IGNORE) == 6


@pytest.mark.parametrize("change, message", [
    (lambda q: q.update(quant_method="fp8"), r"quantization_config.quant_method is 'fp8'"),
    (lambda q: q["config_groups"]["group_0"].update(format="int-quantized"),
     r"config_groups.group_0.format is 'int-quantized'; only 'mxfp4-pack-quantized' and 'nvfp4-pack-quantized'"),
    (lambda q: q["config_groups"]["group_0"].update(format="nvfp4-pack-quantized"),
     r"weights.group_size is 32; nvfp4-pack-quantized is group_size 16"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=16), r"weights.group_size is 16"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}), "quantizes activations"),
])
def test_unsupported_quantization_is_a_config_error_naming_the_field(folders, tmp_path, change, message):
    def config(raw):
        change(raw["text_config"]["quantization_config"])
        return raw
    bad = rewrite(folders[0], tmp_path / "bad", config=config)
    with pytest.raises(ConfigError, match=message):
        load_model(bad)


# ---- the released layout -------------------------------------------------------------------------

def test_release_folder_has_the_published_layout(folders):
    release, _ = folders
    raw = json.loads((release / "config.json").read_text())
    assert raw["architectures"] == ["KimiK3ForConditionalGeneration"] and raw["model_type"] == "kimi_k3"
    assert raw["text_config"]["model_type"] == "kimi_linear" and "vision_config" in raw
    index = json.loads((release / "model.safetensors.index.json").read_text())["weight_map"]
    assert f"{EXPERT_W1}.weight_packed" in index and f"{EXPERT_W1}.weight_scale" in index
    assert f"{EXPERT_W1}.weight" not in index
    assert "language_model.model.layers.1.block_sparse_moe.shared_experts.up_proj.weight" in index
    assert "language_model.lm_head.weight" in index and "vision_tower.patch_embed.proj.weight" in index
    experts = [n for n in index if n.startswith("language_model.") and EXPERT.fullmatch(
        n[len("language_model."):].replace("weight_packed", "weight"))]
    assert len(experts) == 7 * 8 * 3                # MoE layers x experts x (w1, w2, w3)


def test_release_loads_to_the_plain_twin_and_generates_the_same(folders, plain_model):
    release, _ = folders
    with capture_logs() as logs:
        model = load_model(release)
    skipped = [e for e in logs if e["event"] == "checkpoint_tensors_skipped"]
    assert len(skipped) == 1 and skipped[0]["tensors"] == {"vision_tower.": 3, "mm_projector.": 3}
    assert model.cfg.architecture == "KimiLinearForCausalLM" and model.cfg.hybrid.latent_dim == 32
    assert model.cfg == plain_model.cfg
    # The experts stay packed (the checkpoint's bytes); each decodes to the plain twin's weight,
    # and every other tensor equals the twin's.
    packed = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert len(packed) == 7 * 8 * 3 and all(m.weight_packed.dtype == torch.uint8 for m in packed.values())
    theirs = plain_model.state_dict()
    for name, m in packed.items():
        assert torch.equal(m.dequantized(), theirs[name + ".weight"]), name
    mine = model.state_dict()
    plain_names = {n for n in theirs if n.rpartition(".")[0] not in packed}
    assert {n for n in mine if n.rpartition(".")[0] not in packed} == plain_names
    for name in plain_names:
        assert torch.equal(mine[name], theirs[name]), name
    w1 = packed["model.layers.1.block_sparse_moe.experts.0.w1"].dequantized()
    assert len(w1.unique()) > 8                      # decoded values, several scales
    for prompt in PROMPTS:
        got = generate(model, prompt, N_NEW)
        assert got == generate(plain_model, prompt, N_NEW) and len(set(got)) > 1


def test_release_in_bfloat16_loads_the_same_values(folders, plain_model):
    model = load_model(folders[0], dtype="bfloat16")
    name = "model.layers.4.block_sparse_moe.experts.5.w2"
    expert = model.get_submodule(name)
    assert expert.weight_scale.dtype == torch.uint8          # model.to(bfloat16) moved it, never converted it
    got = expert.dequantized(torch.bfloat16)
    assert got.float().equal(dict(plain_model.named_parameters())[name + ".weight"])


def test_a_wrapper_config_reads_its_text_config():
    text = {"model_type": "kimi_linear", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 16, "num_experts": 4, "num_experts_per_token": 2,
            "linear_attn_config": {"head_dim": 16, "num_heads": 2, "kda_layers": [1], "full_attn_layers": [2]}}
    raw = {"architectures": ["KimiK3ForConditionalGeneration"], "eos_token_id": 7, "text_config": text}
    cfg = ModelConfig.from_dict(raw)                 # no text_config.architectures: model_type decides
    assert cfg.architecture == "KimiLinearForCausalLM" and cfg.eos_token_ids == (7,)
    assert cfg.hybrid.layer_types == ("kda", "mla")
    with pytest.raises(ConfigError, match="KimiK3ForConditionalGeneration needs a text_config object"):
        ModelConfig.from_dict({"architectures": ["KimiK3ForConditionalGeneration"]})
    with pytest.raises(ConfigError, match=r"text_config.model_type 'qwen3' of KimiK3ForConditionalGeneration"):
        ModelConfig.from_dict({**raw, "text_config": {**text, "model_type": "qwen3"}})
    with pytest.raises(ConfigError, match=r"architectures=\['KimiK25ForConditionalGeneration'\] is not supported.*"
                                          r"KimiK3ForConditionalGeneration"):
        ModelConfig.from_dict({**raw, "architectures": ["KimiK25ForConditionalGeneration"]})


def _drop(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


def _replace(name, value):
    return lambda t: {**t, name: value}


@pytest.mark.parametrize("edit, message", [
    (lambda t: _replace(f"{EXPERT_W1}.weight_packed", t[f"{EXPERT_W1}.weight_packed"][:, :-1])(t),
     rf"tensor '{EXPERT_W1}.weight_packed' has shape \(64, 15\), expected \(64, 16\)"),
    (lambda t: _replace(f"{EXPERT_W1}.weight_packed", t[f"{EXPERT_W1}.weight_packed"][:-1])(t),
     rf"tensor '{EXPERT_W1}.weight_packed' has shape \(63, 16\), expected \(64, 16\)"),
    (lambda t: _replace(f"{EXPERT_W1}.weight_packed", t[f"{EXPERT_W1}.weight_packed"][:, :8])(
        _replace(f"{EXPERT_W1}.weight_scale", t[f"{EXPERT_W1}.weight_scale"][:, :0].contiguous())(t)),
     rf"tensor '{EXPERT_W1}.weight_(packed|scale)' has shape"),
    (lambda t: _drop(f"{EXPERT_W1}.weight_scale")(t),
     rf"tensor '{EXPERT_W1}.weight_scale' is missing from the checkpoint: the mxfp4-pack-quantized tensor "
     rf"'{EXPERT_W1}.weight_packed' needs it"),
    (lambda t: _drop(f"{EXPERT_W1}.weight_packed")(t),
     rf"tensor '{EXPERT_W1}.weight' is missing from the checkpoint"),
    (lambda t: {**_drop("language_model.model.layers.2.block_sparse_moe.shared_experts.up_proj.weight")(t),
                **dict(zip(("language_model.model.layers.2.block_sparse_moe.shared_experts.up_proj.weight_packed",
                            "language_model.model.layers.2.block_sparse_moe.shared_experts.up_proj.weight_scale"),
                           quantize_mxfp4(t["language_model.model.layers.2.block_sparse_moe.shared_experts."
                                            "up_proj.weight"].float())))},
     r"'language_model.model.layers.2.block_sparse_moe.shared_experts.up_proj.weight_packed' is FP4-packed but "
     r"config.json's quantization_config does not quantize"),
    (lambda t: _replace("audio_tower.proj.weight", torch.zeros(2))(t),
     r"tensors \['audio_tower.proj.weight'\] are neither the text model's \(language_model.\*\) nor the vision "
     r"parts this target skips"),
    (lambda t: _replace("language_model.model.layers.1.block_sparse_moe.experts.0.w1.bias", torch.zeros(64))(t),
     r"unexpected tensors in the checkpoint: \['language_model.model.layers.1.block_sparse_moe.experts.0.w1.bias'\]"),
], ids=["packed-width", "packed-rows", "no-groups", "missing-scale", "missing-packed", "ignored-module-packed",
        "unknown-top-level", "unexpected-text-tensor"])
def test_broken_release_folders_name_the_tensor(folders, tmp_path, edit, message):
    bad = rewrite(folders[0], tmp_path / "bad", edit=edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(bad)


def test_packed_experts_without_a_quantization_config_are_refused(folders, tmp_path):
    def config(raw):
        del raw["text_config"]["quantization_config"]
        return raw
    bad = rewrite(folders[0], tmp_path / "bad", config=config)
    with pytest.raises(CheckpointError, match=r"weight_packed' is FP4-packed but config.json has no "
                                              r"quantization_config"):
        load_model(bad)


def test_release_at_tensor_parallel_size_2_generates_the_same(folders, plain_model):
    """Two gloo ranks (rank 1 spawned): each keeps its half of every expert packed (bytes and
    scales cut along the expert intermediate on 32-element groups); rank 0's greedy tokens equal
    the plain one-process model's."""
    from target_service import tp_worker
    drv = tp_worker.start(folders[0], 2, dtype=torch.float32, device=torch.device("cpu"), timeout_s=120,
                          torch_threads=1)
    try:
        assert "expert intermediate 32/rank" in drv.layout.describe(drv.cfg)
        assert isinstance(drv.inner.get_submodule("model.layers.1.block_sparse_moe.experts.0.w2"), PackedLinear)
        for prompt in PROMPTS:
            assert generate(drv, prompt, N_NEW) == generate(plain_model, prompt, N_NEW)
    finally:
        drv.close()
