"""The tokenizer built from a GGUF file's metadata encodes as the reference implementations do,
on files written with gguf-py for each `tokenizer.ggml.pre` the loader serves:

* `llama-bpe`: transformers' own GGUF converter (`AutoTokenizer.from_pretrained(gguf_file=...)`),
  `<|begin_of_text|>` first as the file's `tokenizer.ggml.add_bos_token` asks (and as llama.cpp
  adds it for this group even without the flag);
* `qwen2`: transformers' `Qwen2Tokenizer` over the file's vocabulary and merges (as
  transformers' GGUF reader reads them), whose NFC normalizer the GGUF converter leaves out;
* `smollm`: transformers' GGUF converter with llama.cpp's SmolLM split (each digit apart, then
  GPT-2's pattern), which the converter has no entry for.

Each is compared on fixed strings (unicode, digits, whitespace runs, contractions, NFC / NFD
pairs) and on hypothesis-generated text from the same alphabet."""
from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gguf_models import save_tiny_gguf
from splitspec.models.loader import load_tokenizer
from tiny_models import build_tiny_hf_model, save_tiny_tokenizer

VOCAB = 512
BOS = "<|begin_of_text|>"
STRINGS = [
    "Hello world", "I'm sure they'll say we've done it, don't you THINK'S so", "12345 678 9 1234567890",
    "x=3.14159; y = 2**10", "naïve café", "cafe\u0301 nai\u0308ve", "e\u0301\u0301 \u212b \u00c5 A\u030a",
    "  leading spaces", "trailing spaces   ", "tabs\tand\nnewlines\r\n\n\nruns", "   \n   \t  ",
    "日本語のテキスト", "emoji 😀👍🏽 mixed", "ΑΒΓ αβγ Ωmega", "def f(x):\n    return x  # done\n",
    "<|endoftext|> between <|endoftext|>", "", "a",
]
ALPHABET = st.sampled_from(list("abcXYZ019 '\t\n\r.,;!?-_") + ["é", "e\u0301", "ñ", "日", "本", "😀", "ß", "İ",
                                                                  "\u00a0", "\u2003", "Å", "A\u030a", "'s", "'LL"])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf-tok")
    tok_dir = save_tiny_tokenizer(out / "tok", VOCAB)
    hf = build_tiny_hf_model("llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_layers=1,
                             num_heads=2, num_kv_heads=1)
    made = {}
    for pre in ("llama-bpe", "qwen2", "smollm"):
        folder = out / pre
        folder.mkdir()
        save_tiny_gguf(folder / "m.gguf", hf, tok_dir / "tokenizer.json", qtype="F32", pre=pre,
                       edit=_with_bos if pre == "llama-bpe" else None)
        made[pre] = folder / "m.gguf"
    return made


def _with_bos(w):
    """Llama 3's layout: `<|begin_of_text|>` a control token, the bos id, the flag set."""
    from gguf import GGUFValueType as T
    w.kv_data[0]["tokenizer.ggml.tokens"].value[1] = BOS
    w.add_key_value("tokenizer.ggml.bos_token_id", 1, T.UINT32)
    w.add_key_value("tokenizer.ggml.add_bos_token", True, T.BOOL)


def _converter(file: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)


def _qwen2_reference(file: Path):
    from transformers import Qwen2Tokenizer
    from transformers.integrations.gguf.gguf_tokenizer_mapping import get_gguf_tokenizer
    _, fields, _ = get_gguf_tokenizer(str(file))
    vocab = {tok: i for i, tok in enumerate(fields["tokens"])}
    merges = [tuple(m.split(" ")) for m in fields["merges"]]
    ref = Qwen2Tokenizer(vocab=vocab, merges=merges)
    ref.add_special_tokens({"additional_special_tokens": [t for t, ty in zip(fields["tokens"], fields["token_type"])
                                                          if ty == 3]})
    return ref


def _smollm_reference(file: Path):
    from tokenizers import Regex, pre_tokenizers
    ref = _converter(file)
    gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.Split(Regex(gpt2), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return ref


REFERENCES = {"llama-bpe": _converter, "qwen2": _qwen2_reference, "smollm": _smollm_reference}


@pytest.fixture(scope="module")
def pairs(files):
    return {pre: (load_tokenizer(file), REFERENCES[pre](file)) for pre, file in files.items()}


@pytest.mark.parametrize("pre", list(REFERENCES))
def test_ids_equal_the_reference_on_fixed_strings(pairs, pre):
    ours, ref = pairs[pre]
    for text in STRINGS:
        assert ours.encode(text).ids == ref(text)["input_ids"], (pre, text)
        assert ours.encode(text, add_special_tokens=False).ids == ref(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("pre", list(REFERENCES))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.lists(ALPHABET, max_size=40).map("".join))
def test_ids_equal_the_reference_on_generated_text(pairs, pre, text):
    ours, ref = pairs[pre]
    assert ours.encode(text).ids == ref(text)["input_ids"]


def test_bos_is_added_where_the_file_says_and_only_there(pairs):
    llama, _ = pairs["llama-bpe"]
    assert llama.encode("hi").ids[0] == 1 and llama.id_to_token(1) == BOS
    assert llama.encode("hi", add_special_tokens=False).ids[0] != 1     # a rendered chat template brings its own
    for pre in ("qwen2", "smollm"):
        ours, _ = pairs[pre]
        assert ours.encode("hi").ids == ours.encode("hi", add_special_tokens=False).ids


def test_qwen2_normalizes_nfd_to_nfc_and_the_others_do_not(pairs):
    nfd = "cafe\u0301"
    qwen, _ = pairs["qwen2"]
    assert qwen.encode(nfd).ids == qwen.encode(unicodedata.normalize("NFC", nfd)).ids
    llama, _ = pairs["llama-bpe"]
    assert llama.encode(nfd).ids != llama.encode(unicodedata.normalize("NFC", nfd)).ids


def test_smollm_splits_digits_one_by_one(pairs):
    smol, _ = pairs["smollm"]
    digits = smol.encode("2024", add_special_tokens=False)
    assert [smol.decode([i]) for i in digits.ids] == ["2", "0", "2", "4"]


def test_text_round_trips_through_decode(pairs):
    for pre, (ours, _) in pairs.items():
        for text in STRINGS:
            want = unicodedata.normalize("NFC", text) if pre == "qwen2" else text
            assert ours.decode(ours.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == want


def test_the_llama3_group_adds_bos_without_the_flag_and_eos_where_asked(tmp_path):
    """llama.cpp adds BOS for the `llama-bpe` group unless the file says false; EOS only where
    `tokenizer.ggml.add_eos_token` is true."""
    from gguf import GGUFValueType as T
    from splitspec.models.gguf_header import scan
    hf_tok = save_tiny_tokenizer(tmp_path / "tok", VOCAB) / "tokenizer.json"
    hf = build_tiny_hf_model("llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_layers=1,
                             num_heads=2, num_kv_heads=1)

    def no_flag_eos(w):
        _with_bos(w)
        del w.kv_data[0]["tokenizer.ggml.add_bos_token"]
        w.add_key_value("tokenizer.ggml.add_eos_token", True, T.BOOL)

    save_tiny_gguf(tmp_path / "m.gguf", hf, hf_tok, qtype="F32", pre="llama-bpe", edit=no_flag_eos)
    assert "tokenizer.ggml.add_bos_token" not in scan(tmp_path / "m.gguf").values
    tok = load_tokenizer(tmp_path / "m.gguf")
    ids = tok.encode("hi there").ids
    assert ids[0] == 1 and ids[-1] == 0 and tok.id_to_token(0) == "<|endoftext|>"      # eos id 0 in these files
    assert tok.encode("hi there", add_special_tokens=False).ids == ids[1:-1]
