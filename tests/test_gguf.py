"""GGUF checkpoints (splitspec/models/gguf.py): tiny files written the way llama.cpp's converter
writes them load to the same weights and logits as the model they came from, for llama (Q/K
rows un-permuted), qwen2 (biases) and qwen3 (q/k norms), in every quant type gguf-py can
write; the tokenizer built from the metadata encodes as the original; bad files are refused
at start-up naming the file and the field."""
from __future__ import annotations

import json

import pytest
import torch

from gguf_models import save_tiny_gguf
from target_service.engine import forward_sequences
from splitspec.models.gguf import end_ids, find_gguf, open_reader
from splitspec.models.loader import CheckpointError, load_model, load_tokenizer, model_folder, tokenizer_hash
from tiny_models import build_tiny_hf_model, save_tiny_tokenizer

VOCAB = 512
TEXT = "def fibonacci(n):\n    return naïve 日本語 <|endoftext|> 12345  spaces\t\n"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return save_tiny_tokenizer(tmp_path_factory.mktemp("tok"), VOCAB)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"])
def test_weights_and_logits_match_the_source_model(tmp_path, tok_dir, arch, qtype):
    hf = build_tiny_hf_model(arch, vocab_size=VOCAB, seed=3)
    expected = save_tiny_gguf(tmp_path / "m.gguf", hf, tok_dir / "tokenizer.json", qtype=qtype)
    ours = load_model(tmp_path / "m.gguf", gguf_weights="dequantized")    # the reference path (packed: test_gguf_packed)
    state = ours.state_dict()
    for name, want in expected.items():
        assert torch.equal(state[name].float(), want), name
    hf.load_state_dict(expected, strict=False)      # the reference runs the dequantized weights too
    ids = torch.tensor([[5, 17, 300, 42, 9, 100, 7]])
    with torch.no_grad():
        torch.testing.assert_close(forward_sequences(ours, ids).logits, hf(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_folder_holding_one_gguf_file_and_tied_embeddings(tmp_path, tok_dir):
    hf = build_tiny_hf_model("llama", vocab_size=VOCAB, tie_word_embeddings=True, seed=4)
    (tmp_path / "folder").mkdir()
    save_tiny_gguf(tmp_path / "folder" / "m.gguf", hf, tok_dir / "tokenizer.json", qtype="Q8_0")
    assert find_gguf(tmp_path / "folder") == tmp_path / "folder" / "m.gguf"
    model = load_model(tmp_path / "folder", gguf_weights="dequantized")
    assert model.cfg.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight


def test_tokenizer_and_chat_template_from_the_metadata(tmp_path, tok_dir):
    from tokenizers import Tokenizer
    save_tiny_gguf(tmp_path / "m.gguf", build_tiny_hf_model("qwen3", vocab_size=VOCAB), tok_dir / "tokenizer.json")
    ours, ref = load_tokenizer(tmp_path / "m.gguf"), Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert ours.encode(TEXT).ids == ref.encode(TEXT).ids
    assert ours.decode(ours.encode(TEXT).ids, skip_special_tokens=False) == TEXT
    folder = model_folder(tmp_path / "m.gguf")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in cfg["chat_template"]
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"][0] == 0
    # The hash the gateway and the draft compare is stable across rebuilds of the folder.
    assert tokenizer_hash(tmp_path / "m.gguf") == tokenizer_hash(folder) != ""


def test_end_of_generation_ids_include_the_turn_end():
    """SmolLM2's file says eos = 2 and ends turns with <|im_end|>; a file whose eos is
    <|im_start|> still stops at <|im_end|> (llama.cpp's end-of-generation set)."""
    from gguf import GGUFValueType as T

    class Field:
        def __init__(self, v, *types):
            self.v, self.types = v, list(types)

        def contents(self):
            return self.v

    class Reader:
        fields = {"tokenizer.ggml.tokens": Field(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a"], T.ARRAY,
                                                 T.STRING),
                  "tokenizer.ggml.token_type": Field([3, 3, 3, 1], T.ARRAY, T.INT32),
                  "tokenizer.ggml.eos_token_id": Field(1, T.UINT32)}
    assert end_ids(Reader(), "f.gguf") == [0, 2, 1]


def _refused(path, *needles):
    with pytest.raises(CheckpointError) as exc:
        load_model(path)
    for needle in (str(path), *needles):
        assert needle in str(exc.value), (needle, str(exc.value))


def test_a_truncated_file_is_refused_naming_it(tmp_path, tok_dir):
    save_tiny_gguf(tmp_path / "m.gguf", build_tiny_hf_model("llama", vocab_size=VOCAB), tok_dir / "tokenizer.json")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    _refused(tmp_path / "cut.gguf", "truncated")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
    _refused(tmp_path / "junk.gguf")


def test_an_unknown_architecture_is_refused_naming_the_field(tmp_path, tok_dir):
    save_tiny_gguf(tmp_path / "m.gguf", build_tiny_hf_model("llama", vocab_size=VOCAB), tok_dir / "tokenizer.json",
                   arch="gpt2")
    _refused(tmp_path / "m.gguf", "general.architecture", "'gpt2'")


def test_an_unknown_quant_type_is_refused_naming_the_tensor(tmp_path, tok_dir):
    import gguf
    import numpy as np
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    for key, value in (("block_count", 1), ("embedding_length", 256), ("feed_forward_length", 256)):
        getattr(w, f"add_{key}")(value)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-5)
    # IQ2_XXS: 66 bytes per 256 values; the bytes need not mean anything to be refused.
    w.add_tensor("token_embd.weight", np.zeros((8, 66), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _refused(tmp_path / "m.gguf", "token_embd.weight", "IQ2_XXS")


def test_a_tokenizer_without_merges_is_refused(tmp_path, tok_dir):
    save_tiny_gguf(tmp_path / "m.gguf", build_tiny_hf_model("llama", vocab_size=VOCAB), tok_dir / "tokenizer.json",
                   merges=False)
    with pytest.raises(CheckpointError, match="tokenizer.ggml.merges"):
        model_folder(tmp_path / "m.gguf")


def test_the_target_service_refuses_a_bad_file_at_start_up(tmp_path):
    import subprocess
    import sys
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    out = subprocess.run([sys.executable, "-m", "target_service.server", "--model-path", str(tmp_path / "bad.gguf"),
                          "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "bad.gguf" in out.stderr and "GGUF" in out.stderr, out.stderr[-2000:]


def test_a_draft_loads_against_a_gguf_target_and_a_mismatched_one_is_refused(tmp_path, tok_dir):
    """The draft service reads the target's embedding and head from the GGUF file (dequantized,
    tied here); a draft built for another target is refused naming what differs."""
    from draft_service.architectures import load_draft
    from draft_service.dflash import new_draft, save_draft
    from splitspec.models.config import ConfigError
    hf = build_tiny_hf_model("llama", vocab_size=VOCAB, tie_word_embeddings=True, seed=6)
    expected = save_tiny_gguf(tmp_path / "t.gguf", hf, tok_dir / "tokenizer.json", qtype="Q8_0")
    target = load_model(tmp_path / "t.gguf")
    save_draft(new_draft(target.cfg, num_layers=1, mask_token_id=1, target_layer_ids=[0, 1]), tmp_path / "draft")
    draft = load_draft(tmp_path / "draft", tmp_path / "t.gguf")
    for part in ("embed", "lm_head"):      # tied: the head is the embedding
        assert torch.equal(draft._target[part].float(), expected["model.embed_tokens.weight"])
    other = build_tiny_hf_model("llama", vocab_size=VOCAB, hidden_size=128, seed=7)
    save_tiny_gguf(tmp_path / "other.gguf", other, tok_dir / "tokenizer.json", qtype="Q8_0")
    with pytest.raises(ConfigError, match="hidden"):
        load_draft(tmp_path / "draft", tmp_path / "other.gguf")


def test_start_up_parses_the_file_once_and_lets_it_go(tmp_path, tok_dir, monkeypatch):
    """The target's start-up (the folder, the memory preflight, the model) builds gguf-py's
    reader once, cold or warm, and holds none of it once the model is loaded."""
    import gguf as gguf_py
    from splitspec.models import gguf
    from target_service import preflight
    built = []

    class Counting(gguf_py.GGUFReader):
        def __init__(self, *args, **kwargs):
            built.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf_py, "GGUFReader", Counting)
    monkeypatch.setenv("SPLITSPEC_CACHE", str(tmp_path / "cache"))
    save_tiny_gguf(tmp_path / "m.gguf", build_tiny_hf_model("qwen2", vocab_size=VOCAB), tok_dir / "tokenizer.json")
    for start in ("cold", "warm"):
        gguf.release()
        built.clear()
        folder = model_folder(tmp_path / "m.gguf")
        preflight.estimate(folder)
        load_model(folder)
        assert len(built) == 1, (start, built)
        assert not gguf._parsed, start


def test_a_tied_embedding_is_dequantized_once_for_the_draft(tmp_path, tok_dir, monkeypatch):
    from draft_service.architectures import load_draft
    from draft_service.dflash import new_draft, save_draft
    from splitspec.models import gguf
    hf = build_tiny_hf_model("llama", vocab_size=VOCAB, tie_word_embeddings=True, seed=6)
    save_tiny_gguf(tmp_path / "t.gguf", hf, tok_dir / "tokenizer.json", qtype="Q8_0")
    target = load_model(tmp_path / "t.gguf")
    save_draft(new_draft(target.cfg, num_layers=1, mask_token_id=1, target_layer_ids=[0, 1]), tmp_path / "draft")
    read = []
    real = gguf.GGUFWeights.get_tensor
    monkeypatch.setattr(gguf.GGUFWeights, "get_tensor", lambda self, name: read.append(name) or real(self, name))
    draft = load_draft(tmp_path / "draft", tmp_path / "t.gguf")
    assert read == ["model.embed_tokens.weight"]
    assert draft._target["embed"].data_ptr() == draft._target["lm_head"].data_ptr()     # one copy in memory


def test_a_cached_folder_is_rebuilt_when_the_file_no_longer_matches_its_pointer(tmp_path, tok_dir, monkeypatch):
    """Same path, size and modification time but other metadata (a file rewritten in place,
    its time put back): the pointer's header digest differs and the folder is rebuilt; a
    pointer edited by hand is not trusted either."""
    import os
    from splitspec.models.gguf import POINTER
    monkeypatch.setenv("SPLITSPEC_CACHE", str(tmp_path / "cache"))
    file = tmp_path / "m.gguf"
    save_tiny_gguf(file, build_tiny_hf_model("qwen3", vocab_size=VOCAB), tok_dir / "tokenizer.json")
    folder = model_folder(file)
    assert "<|im_start|>" in json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    st = file.stat()
    data = file.read_bytes()
    file.write_bytes(data.replace(b"<|im_start|>{{", b"<|im_begin|>{{", 1))
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file.stat().st_size == st.st_size and file.stat().st_mtime_ns == st.st_mtime_ns
    assert model_folder(file) == folder
    assert "<|im_begin|>{{" in json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    pointer = json.loads((folder / POINTER).read_text())
    (folder / POINTER).write_text(json.dumps({**pointer, "size": 1}))
    assert model_folder(file) == folder
    assert json.loads((folder / POINTER).read_text()) == pointer
    assert not list(folder.parent.glob("*.tmp*")) and not list(folder.parent.glob("*.stale*"))
