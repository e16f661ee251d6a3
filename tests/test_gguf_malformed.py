"""Malformed GGUF files, written with gguf-py and corrupted by hypothesis, are refused with a
GGUFError naming the file and the field, never a traceback from deeper down:

* a count or length (tensor / KV counts, array and string lengths, tensor dimensions and
  offsets) past what the file holds is refused by the header scan, before gguf-py's reader is
  built (it would walk the count: 2^40 iterations, memory until the process is killed), and the
  scan holds no memory per declared element;
* any byte of the header flipped, or the file cut anywhere, is either still a servable file or a
  GGUFError;
* a field with the wrong type or a value the model cannot have (zero or per-layer-differing
  head counts, a KV head count that does not divide the heads, an id past the vocabulary, a
  malformed merge, token types of the wrong length, sizes the tensors contradict) is refused
  naming the field;
* a service given such a file exits non-zero naming the file."""
from __future__ import annotations

import struct
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gguf_models import save_tiny_gguf
from splitspec.models import gguf
from splitspec.models.gguf_header import GGUFError, scan
from splitspec.models.loader import CheckpointError, load_model
from tiny_models import build_tiny_hf_model, save_tiny_tokenizer

VOCAB = 512
LAYERS, HEADS, KV_HEADS = 2, 4, 2
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(tiny HF model, tokenizer.json) the files here are written from."""
    out = tmp_path_factory.mktemp("gguf-bad")
    tok = save_tiny_tokenizer(out / "tok", VOCAB) / "tokenizer.json"
    hf = build_tiny_hf_model("llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_layers=LAYERS,
                             num_heads=HEADS, num_kv_heads=KV_HEADS)
    return hf, tok


@pytest.fixture(scope="module")
def good(source, tmp_path_factory) -> bytes:
    file = tmp_path_factory.mktemp("gguf-good") / "m.gguf"
    save_tiny_gguf(file, *source, qtype="Q8_0")
    return file.read_bytes()


def _serve(file: Path, cache: Path) -> None:
    """Everything start-up does with a file: the folder from its metadata, the parse, every tensor."""
    gguf.release()
    gguf.model_folder(file, cache=cache)
    weights = gguf.GGUFWeights(file)
    for name in weights.keys():
        weights.get_tensor(name)
    gguf.release()


def _refused(file: Path, *needles: str) -> str:
    with tempfile.TemporaryDirectory() as cache, pytest.raises(GGUFError) as exc:
        _serve(file, Path(cache))
    message = str(exc.value)
    for needle in (str(file), *needles):
        assert needle in message, (needle, message)
    return message


# ------------------------------------------------------------------ counts and sizes (the scan)


def _targets(data: bytes) -> dict[str, tuple[int, str, str]]:
    """Where the counts and lengths of a written file lie: name -> (offset, struct code, what the
    refusal must name). Found by the bytes around them, so the test does not share the scan's walk."""
    def array_length(key):
        return data.index(key.encode()) + len(key) + 8        # type u32, item type u32, then the u64 count

    def string_length(key):
        return data.index(key.encode()) + len(key) + 4        # type u32, then the u64 length

    def tensor(name):
        return data.index(name.encode()) + len(name)           # dimension count u32, dimensions, type, offset

    embd = tensor("token_embd.weight")
    (n_dims,) = struct.unpack_from("<I", data, embd)
    return {
        "tensor count": (8, "Q", "GGUF.tensor_count"),
        "kv count": (16, "Q", "GGUF.kv_count"),
        "first key length": (24, "Q", "metadata key #0"),
        "tokens length": (array_length("tokenizer.ggml.tokens"), "Q", "tokenizer.ggml.tokens"),
        "first token length": (array_length("tokenizer.ggml.tokens") + 8, "Q", "tokenizer.ggml.tokens'[0]"),
        "merges length": (array_length("tokenizer.ggml.merges"), "Q", "tokenizer.ggml.merges"),
        "token types length": (array_length("tokenizer.ggml.token_type"), "Q", "tokenizer.ggml.token_type"),
        "chat template length": (string_length("tokenizer.chat_template"), "Q", "tokenizer.chat_template"),
        "dimension count": (embd, "I", "token_embd.weight"),
        "dimension": (embd + 4, "Q", "token_embd.weight"),
        "tensor offset": (embd + 4 + 8 * n_dims + 4, "Q", "token_embd.weight"),
    }


def _write(tmp: Path, data: bytes, name: str = "bad.gguf") -> Path:
    file = tmp / name
    file.write_bytes(data)
    return file


@FUZZ
@given(target=st.sampled_from(["tensor count", "kv count", "first key length", "tokens length", "first token length",
                               "merges length", "token types length", "chat template length", "dimension count",
                               "dimension", "tensor offset"]),
       big=st.integers(min_value=0, max_value=2 ** 64 - 1),
       choice=st.sampled_from([2 ** 40, 2 ** 63, 2 ** 64 - 1, None]))
def test_a_count_past_the_file_is_refused_by_the_scan_naming_it(good, tmp_path, target, big, choice):
    offset, code, needle = _targets(good)[target]
    limit = 2 ** (8 * struct.calcsize(code)) - 1
    value = max(choice if choice is not None else big, len(good)) if code == "Q" else max(big % (limit + 1), 5)
    data = bytearray(good)
    struct.pack_into("<" + code, data, offset, min(value, limit))
    file = _write(tmp_path, bytes(data))
    with pytest.raises(GGUFError) as exc:
        scan(file)
    assert str(file) in str(exc.value) and needle in str(exc.value), str(exc.value)


def test_a_corrupt_array_length_is_refused_before_gguf_py_reads_it_and_in_flat_memory(good, tmp_path, monkeypatch):
    offset, _, _ = _targets(good)["tokens length"]
    data = bytearray(good)
    struct.pack_into("<Q", data, offset, 2 ** 40)
    file = _write(tmp_path, bytes(data))

    def never(*args, **kwargs):
        raise AssertionError("gguf-py's reader was built over a file the scan should have refused")

    monkeypatch.setattr("gguf.GGUFReader", never)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match=r"tokenizer\.ggml\.tokens.*1099511627776 STRING items"):
            load_model(file)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 ** 20, peak         # nothing per declared element: 2^40 of anything would not fit


@FUZZ
@given(data=st.data())
def test_any_header_byte_flipped_is_served_or_refused(good, tmp_path, data):
    end = scan(_write(tmp_path, good, "good.gguf")).data_offset
    at = data.draw(st.integers(0, end - 1), label="offset")
    flip = data.draw(st.integers(1, 255), label="xor")
    bad = bytearray(good)
    bad[at] ^= flip
    file = _write(tmp_path, bytes(bad))
    try:
        with tempfile.TemporaryDirectory() as cache:
            _serve(file, Path(cache))
    except GGUFError as exc:
        assert str(file) in str(exc)


@FUZZ
@given(cut=st.integers(min_value=0))
def test_a_file_cut_anywhere_is_refused_or_still_whole(good, tmp_path, cut):
    header = scan(_write(tmp_path, good, "good.gguf"))
    cut %= len(good)
    file = _write(tmp_path, good[:cut])
    whole = max(header.data_offset + t.offset + t.n_bytes for t in header.tensors)
    if cut < whole:
        _refused(file)
    else:                              # only padding after the last tensor was cut
        with tempfile.TemporaryDirectory() as cache:
            _serve(file, Path(cache))


def test_header_level_refusals_name_the_field(good, tmp_path):
    _refused(_write(tmp_path, b"GGUF" + struct.pack("<I", 1) + bytes(16), "v1.gguf"), "GGUF version 1")
    _refused(_write(tmp_path, b"GGML" + good[4:], "magic.gguf"), "magic")
    _refused(_write(tmp_path, good[:20], "short.gguf"), "shorter than a GGUF header")


# ------------------------------------------------------------------ metadata values


def _set(key, value, vtype, sub_type=None):
    def edit(w):
        w.add_key_value(key, value, vtype, sub_type)
    return edit


def _merges(change):
    def edit(w):
        merges = list(w.kv_data[0]["tokenizer.ggml.merges"].value)
        change(merges)
        w.kv_data[0]["tokenizer.ggml.merges"].value = merges
    return edit


def _token_types(change):
    def edit(w):
        types = list(w.kv_data[0]["tokenizer.ggml.token_type"].value)
        change(types)
        w.kv_data[0]["tokenizer.ggml.token_type"].value = types
    return edit


def _bos_text(text):
    """BOS added to every sequence, spelled `text`."""
    def edit(w):
        from gguf import GGUFValueType as T
        w.kv_data[0]["tokenizer.ggml.tokens"].value[1] = text
        w.add_key_value("tokenizer.ggml.bos_token_id", 1, T.UINT32)
        w.add_key_value("tokenizer.ggml.add_bos_token", True, T.BOOL)
    return edit


def _malformed() -> dict[str, st.SearchStrategy]:
    """Kind of bad value -> strategy of (edit, the field the refusal must name)."""
    from gguf import GGUFValueType as T
    arr, ints = T.ARRAY, st.integers(min_value=0, max_value=2 ** 32 - 1)
    int_keys = st.sampled_from(["block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                                "context_length", "attention.head_count_kv"])
    no_space = st.text(st.sampled_from("abcdefgĠ"), min_size=1, max_size=6)

    def merge(index, text):
        return _merges(lambda ms: ms.__setitem__(index, text)), "tokenizer.ggml.merges"

    return {
        "zero heads": st.sampled_from([("llama.attention.head_count", 0), ("llama.attention.head_count_kv", 0)]).map(
            lambda kv: (_set(kv[0], kv[1], T.UINT32), kv[0])),
        "kv heads not dividing": st.integers(1, 64).filter(lambda k: HEADS % k).map(
            lambda k: (_set("llama.attention.head_count_kv", k, T.UINT32), "does not divide")),
        "per-layer heads differ": st.lists(st.integers(1, 8), min_size=LAYERS, max_size=LAYERS).filter(
            lambda v: len(set(v)) > 1).map(
            lambda v: (_set("llama.attention.head_count", v, arr, T.UINT32), "differs between layers")),
        "per-layer heads of another length": st.lists(st.just(HEADS), min_size=1, max_size=5).filter(
            lambda v: len(v) != LAYERS).map(
            lambda v: (_set("llama.attention.head_count", v, arr, T.UINT32), "per-layer values")),
        "id past the vocabulary": st.tuples(st.sampled_from(["bos", "eos", "eot"]),
                                            st.integers(VOCAB, 2 ** 32 - 1)).map(
            lambda kv: (_set(f"tokenizer.ggml.{kv[0]}_token_id", kv[1], T.UINT32), f"tokenizer.ggml.{kv[0]}_token_id")),
        "float for an integer": int_keys.map(lambda k: (_set(f"llama.{k}", 4.0, T.FLOAT32), f"llama.{k}")),
        "string for an integer": int_keys.map(lambda k: (_set(f"llama.{k}", "4", T.STRING), f"llama.{k}")),
        "huge block count": st.integers(LAYERS + 1, 2 ** 64 - 1).map(
            lambda n: (_set("llama.block_count", n, T.UINT64), "block_count")),
        "hidden size the tensors contradict": st.integers(33, 2 ** 63).map(
            lambda n: (_set("llama.embedding_length", n, T.UINT64), "token_embd.weight")),
        "feed-forward size the tensors contradict": st.integers(33, 2 ** 31).map(
            lambda n: (_set("llama.feed_forward_length", n, T.UINT32), "ffn_")),
        "bad norm epsilon": st.sampled_from([0.0, -1e-5, float("nan"), float("inf")]).map(
            lambda e: (_set("llama.attention.layer_norm_rms_epsilon", e, T.FLOAT32), "layer_norm_rms_epsilon")),
        "merge without a space": st.tuples(st.integers(0, 50), no_space).map(lambda m: merge(*m)),
        "merge of three": st.integers(0, 50).map(lambda i: merge(i, "a b c")),
        "merge of unknown tokens": st.integers(0, 50).map(lambda i: merge(i, "Ġzzq Ġqzz")),
        "merges of integers": st.just((_set("tokenizer.ggml.merges", [1, 2], arr, T.INT32), "tokenizer.ggml.merges")),
        "tokens of integers": st.just(
            (_set("tokenizer.ggml.tokens", list(range(VOCAB)), arr, T.INT32), "tokenizer.ggml.tokens")),
        "token types of another length": st.integers(1, 5).map(
            lambda n: (_token_types(lambda ts: ts.__delitem__(slice(0, n))), "tokenizer.ggml.token_type")),
        "token type out of range": st.tuples(st.integers(0, VOCAB - 1), st.integers(7, 2 ** 31 - 1)).map(
            lambda v: (_token_types(lambda ts: ts.__setitem__(v[0], v[1])), "tokenizer.ggml.token_type")),
        "bos no template can hold": st.sampled_from(["", "<|x:y|>", "$A"]).map(
            lambda text: (_bos_text(text), "tokenizer.ggml.bos_token_id")),
        "flag not a bool": st.sampled_from([(1, T.UINT8), ("yes", T.STRING)]).map(
            lambda v: (_set("tokenizer.ggml.add_bos_token", v[0], v[1]), "tokenizer.ggml.add_bos_token")),
        "template not a string": ints.map(
            lambda n: (_set("tokenizer.chat_template", n, T.UINT32), "tokenizer.chat_template")),
        "architecture not a string": ints.map(
            lambda n: (_set("general.architecture", n, T.UINT32), "general.architecture")),
        "alignment not a power of two": st.integers(0, 2 ** 32 - 1).filter(lambda a: a & (a - 1) or a == 0).map(
            lambda a: (_set("general.alignment", a, T.UINT32), "general.alignment")),
        "alignment not UINT32": st.just((_set("general.alignment", 32, T.UINT64), "general.alignment")),
        "unknown pre-tokenizer": st.just((_set("tokenizer.ggml.pre", "tekken", T.STRING), "tokenizer.ggml.pre")),
    }


MALFORMED = _malformed()


@pytest.mark.parametrize("kind", list(MALFORMED))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_malformed_field_is_refused_naming_it(source, tmp_path, kind, data):
    edit, needle = data.draw(MALFORMED[kind])
    save_tiny_gguf(tmp_path / "m.gguf", *source, qtype="F32", edit=edit)
    _refused(tmp_path / "m.gguf", needle)


def test_per_layer_counts_that_agree_are_served(source, tmp_path):
    from gguf import GGUFValueType as T
    per_layer = _set("llama.attention.head_count", [HEADS] * LAYERS, T.ARRAY, T.UINT32)
    save_tiny_gguf(tmp_path / "m.gguf", *source, qtype="F32", edit=per_layer)
    with tempfile.TemporaryDirectory() as cache:
        _serve(tmp_path / "m.gguf", Path(cache))
    assert gguf.parse(tmp_path / "m.gguf").config["num_attention_heads"] == HEADS
    gguf.release()


def test_big_endian_files_load_as_floats_and_are_refused_quantized(source, tmp_path):
    hf, tok = source
    expected = save_tiny_gguf(tmp_path / "be.gguf", hf, tok, qtype="F32", big_endian=True)
    model = load_model(tmp_path / "be.gguf")
    for name, want in expected.items():
        assert (model.state_dict()[name].float() == want).all(), name
    save_tiny_gguf(tmp_path / "beq.gguf", hf, tok, qtype="Q8_0", big_endian=True)
    _refused(tmp_path / "beq.gguf", "Q8_0 in a big-endian file")


# ------------------------------------------------------------------ services


@pytest.mark.parametrize("service, flag, extra", [
    ("target_service.server", "--model-path", ["--port", "0"]),
    ("draft_service.server", "--target-model-path", ["--method", "ngram", "--port", "0"]),
])
def test_a_service_given_a_corrupt_file_exits_naming_it(good, tmp_path, service, flag, extra):
    offset, _, _ = _targets(good)["merges length"]
    data = bytearray(good)
    struct.pack_into("<Q", data, offset, 2 ** 40)
    file = _write(tmp_path, bytes(data))
    out = subprocess.run([sys.executable, "-m", service, flag, str(file), *extra], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0, out.stderr[-2000:]
    assert str(file) in out.stderr and "tokenizer.ggml.merges" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
