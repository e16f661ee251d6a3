"""Incremental detokenization: the concatenated deltas equal decoding the whole sequence, for
any split of the tokens into chunks, and no delta ever ends in a broken character."""
from __future__ import annotations

import functools

from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer

from gateway.detok import IncrementalDetokenizer
from service_helpers import tiny_target_dir

TEXTS = [
    "naïve café façade",
    "日本語のテキスト、そして絵文字 🙂🚀 と € 記号",
    "def fibonacci(n):\n    a, b = 0, 1\n    return a  # ünïcödé comment",
    "mixed ascii and 中文 and emoji 👩‍💻 sequences",
]


@functools.lru_cache(maxsize=None)
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(tiny_target_dir() / "tokenizer.json"))


def stream(ids, sizes, prompt=()):
    d = IncrementalDetokenizer(tokenizer(), prompt)
    deltas, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)] if sizes else 1
        deltas.append(d.add(ids[i:i + n]))
        i, k = i + n, k + 1
    deltas.append(d.flush())
    return deltas


def test_multibyte_characters_span_several_tokens():
    # The premise of the other tests: the byte-level tokenizer splits these characters.
    tok = tokenizer()
    ids = tok.encode("🙂").ids
    assert len(ids) > 1 and "\ufffd" in tok.decode(ids[:1])


def test_one_token_at_a_time_never_emits_a_broken_character():
    for text in TEXTS:
        ids = tokenizer().encode(text).ids
        deltas = stream(ids, [1])
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=60, deadline=None)
@given(text=st.sampled_from(TEXTS) | st.text(min_size=1, max_size=40),
       sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6),
       prompt_len=st.integers(0, 8))
def test_any_chunking_concatenates_to_the_full_decode(text, sizes, prompt_len):
    ids = tokenizer().encode(text).ids
    prompt, gen = ids[:prompt_len], ids[prompt_len:]
    deltas = stream(gen, sizes, prompt)
    assert "".join(deltas) == tokenizer().decode(gen)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(3, 511), min_size=1, max_size=40),
       sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_arbitrary_token_sequences_including_invalid_utf8(ids, sizes):
    # What a random model emits: byte tokens that may never form valid UTF-8.
    assert "".join(stream(ids, sizes)) == tokenizer().decode(ids)


def test_special_tokens_are_skipped():
    tok = tokenizer()
    ids = tok.encode("hello").ids + [0] + tok.encode(" world").ids     # 0 = <|endoftext|>
    assert "".join(stream(ids, [1])) == "hello world"
