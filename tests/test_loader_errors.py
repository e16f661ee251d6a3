"""Bad input is refused with an error that names the field or tensor: unsupported
architecture / rope type, missing or misshapen tensors, token ids outside the vocabulary,
malformed trees, sequences over the max length, bad dtype / device."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitspec.models.config import ConfigError, ModelConfig
from target_service.engine import TargetSequence, forward_sequences
from splitspec.models.loader import (CheckpointError, load_checkpoint, load_model, load_tokenizer,
                                   parse_dtype, resolve_device, tokenizer_hash)
from splitspec.engine.sample import SamplingParams
from splitspec.engine.tree import Tree, TreeError
from tiny_models import edit_config, save_tiny_model


@pytest.fixture
def ckpt(tiny_qwen3, tmp_path):
    """A writable copy of the tiny Qwen3 checkpoint (single model.safetensors)."""
    return shutil.copytree(tiny_qwen3, tmp_path / "ckpt")


@pytest.fixture
def sharded(tiny_model_factory, tmp_path):
    src = tiny_model_factory("llama", max_shard_size="20KB", seed=11)
    return shutil.copytree(src, tmp_path / "sharded")


# ------------------------------------------------------------------ config.json


@pytest.mark.parametrize("changes, message", [
    (dict(architectures=["MistralForCausalLM"]),
     r"architectures=\['MistralForCausalLM'\] is not supported; expected one of LlamaForCausalLM"),
    (dict(architectures=None), r"architectures=\[\] is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
     r"rope type 'yarn' is not supported; expected one of default, llama3"),
    (dict(rope_parameters=None, rope_scaling={"type": "dynamic", "factor": 2.0}),
     r"rope type 'dynamic' is not supported"),
    (dict(hidden_size=None), r"hidden_size must be a positive integer, got None"),
    (dict(num_hidden_layers=0), r"num_hidden_layers must be a positive integer, got 0"),
    (dict(vocab_size="128"), r"vocab_size must be a positive integer"),
    (dict(num_key_value_heads=3), r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
])
def test_bad_config_names_the_field(ckpt, changes, message):
    edit_config(ckpt, **changes)
    with pytest.raises(ConfigError, match=message):
        load_model(ckpt)


def test_llama3_rope_needs_its_parameters():
    raw = dict(architectures=["LlamaForCausalLM"], vocab_size=8, hidden_size=8, intermediate_size=8,
               num_hidden_layers=1, num_attention_heads=2,
               rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0})
    with pytest.raises(ConfigError, match="llama3 rope scaling needs 'original_max_position_embeddings'"):
        ModelConfig.from_dict(raw)


def test_qwen2_sliding_window_refused(tiny_model_factory, tmp_path):
    path = shutil.copytree(tiny_model_factory("qwen2", seed=13), tmp_path / "q2")
    edit_config(path, use_sliding_window=True, sliding_window=16)
    with pytest.raises(ConfigError, match="use_sliding_window=true is not supported"):
        load_model(path)


def test_missing_config_and_weights(tmp_path, ckpt):
    with pytest.raises(ConfigError, match=r"config\.json: not found"):
        load_model(tmp_path / "nowhere")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"neither model\.safetensors nor model\.safetensors\.index\.json"):
        load_model(ckpt)


def test_old_style_rope_fields_are_read(ckpt):
    """transformers < 5 files: top-level rope_theta and rope_scaling."""
    raw = json.loads((ckpt / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    edit_config(ckpt, rope_parameters=None, rope_theta=rope["rope_theta"] * 2)
    assert load_model(ckpt).cfg.rope_theta == rope["rope_theta"] * 2


# ------------------------------------------------------------------ tensors


def test_missing_tensor_is_named(ckpt):
    file = ckpt / "model.safetensors"
    state = load_file(str(file))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(file), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        load_model(ckpt)


def test_misshapen_tensor_is_named_with_both_shapes(ckpt):
    file = ckpt / "model.safetensors"
    state = load_file(str(file))
    name = "model.layers.0.self_attn.k_proj.weight"
    state[name] = torch.zeros(state[name].shape[0] + 1, state[name].shape[1])
    save_file(state, str(file), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' has shape "
                                              r"\(65, 64\), expected \(64, 64\) from config\.json"):
        load_model(ckpt)


def test_unexpected_tensor_is_named(ckpt):
    file = ckpt / "model.safetensors"
    state = load_file(str(file))
    state["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(state, str(file), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*model\.layers\.0\.self_attn\.extra\.weight"):
        load_model(ckpt)


def test_sharded_index_missing_entry_is_named(sharded):
    index = sharded / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    del raw["weight_map"]["model.layers.0.mlp.gate_proj.weight"]
    index.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' is missing"):
        load_model(sharded)


def test_tied_checkpoint_that_also_stores_lm_head_loads(tmp_path):
    """Some exports keep lm_head.weight although tie_word_embeddings is true; the tie wins."""
    path = save_tiny_model(tmp_path / "tied", "llama", tie_word_embeddings=True, seed=4)
    file = path / "model.safetensors"
    state = load_file(str(file))
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(file), metadata={"format": "pt"})
    model = load_model(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


# ------------------------------------------------------------------ dtype / device / tokenizer


def test_bad_dtype_and_device():
    with pytest.raises(ValueError, match=r"dtype 'int8' is not supported; expected one of float32, bfloat16, float16"):
        parse_dtype("int8")
    assert parse_dtype("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match=r"device 'mps' is not supported"):
        resolve_device("mps")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device 'cuda' requested but CUDA is not available"):
            resolve_device("cuda")


def test_tokenizer_loading(tmp_path, ckpt):
    assert load_checkpoint(ckpt).tokenizer is None and tokenizer_hash(ckpt) == ""
    with pytest.raises(ConfigError, match=r"tokenizer\.json: not found"):
        load_tokenizer(ckpt)
    path = save_tiny_model(tmp_path / "with_tok", "qwen3", vocab_size=320, tokenizer=True, seed=2)
    ck = load_checkpoint(path)
    assert ck.tokenizer.get_vocab_size() == ck.cfg.vocab_size == 320
    assert len(tokenizer_hash(path)) == 16
    text = "def café(): return '🙂'\n"
    assert ck.tokenizer.decode(ck.tokenizer.encode(text).ids) == text


# ------------------------------------------------------------------ token ids, trees, lengths


def test_token_id_outside_vocab(tiny_qwen3_model):
    model = tiny_qwen3_model
    V = model.cfg.vocab_size
    with pytest.raises(ValueError, match=rf"token id {V} is outside the vocabulary \[0, {V}\)"):
        forward_sequences(model, torch.tensor([1, V, 2]))
    with pytest.raises(ValueError, match=r"token id -1 is outside the vocabulary"):
        forward_sequences(model, torch.tensor([-1]))
    with pytest.raises(ValueError, match=rf"prompt token_ids\[2\] = {V + 5} is outside the vocabulary"):
        TargetSequence(model, [1, 2, V + 5])
    seq = TargetSequence(model, [1, 2, 3], max_len=32)
    seq.prefill()
    with pytest.raises(TreeError, match=rf"tree\.token_ids\[1\] = {V} is outside the vocabulary"):
        seq.verify(Tree((4, V), (-1, 0)))
    with pytest.raises(ValueError, match="prompt is empty"):
        TargetSequence(model, [])
    with pytest.raises(ValueError, match=r"hidden layer id 2 is outside 0\.\.1"):
        forward_sequences(model, torch.tensor([1]), hidden_layers=[2])


@pytest.mark.parametrize("parents, bad", [
    ((-1, 1), r"tree\.parents\[1\] = 1"),            # self-loop / not topological
    ((-1, 0, 3, 1), r"tree\.parents\[2\] = 3"),       # points forward
    ((-1, -2), r"tree\.parents\[1\] = -2"),           # out of range
    ((0,), r"tree\.parents\[0\] = 0"),
])
def test_malformed_tree_refused_before_touching_the_cache(tiny_qwen3_model, parents, bad):
    seq = TargetSequence(tiny_qwen3_model, [1, 2, 3], max_len=32)
    seq.prefill()
    before = (seq.cache.length, list(seq.tokens))
    with pytest.raises(TreeError, match=bad + r": must be -1 or the index of an earlier node"):
        seq.verify(Tree(tuple([5] * len(parents)), parents))
    assert (seq.cache.length, seq.tokens) == before


def test_sequence_over_max_length(tiny_qwen3_model):
    model = tiny_qwen3_model
    with pytest.raises(ValueError, match="prompt has 8 tokens; the max context is 8"):
        TargetSequence(model, list(range(8)), max_len=8)
    seq = TargetSequence(model, list(range(5)), max_len=8)
    seq.prefill()                       # 6 tokens, 5 cached
    with pytest.raises(ValueError, match="sequence would reach 9 tokens; the max context is 8"):
        seq.verify(Tree.chain([1, 2, 3]))
    assert seq.cache.length == 5
    seq.decode()
    seq.decode()
    seq.decode()                        # 8 cached: the cache is full
    with pytest.raises(ValueError, match="the max context is 8"):
        seq.decode()
    assert seq.cache.length == 8 and len(seq.tokens) == 9
    with pytest.raises(ValueError, match="the max context is 8"):
        seq.decode()


def test_invalid_sampling_params_refused_by_sequence(tiny_qwen3_model):
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        TargetSequence(tiny_qwen3_model, [1, 2], SamplingParams(temperature=1.0, top_p=0.0))
