"""HTTP bodies built to cost the gateway more than they are worth (issue 63), for the in-process
tests (tests/test_http_adversarial.py) and the real services (tests/test_fuzz_http.py):
hypothesis strategies of bounded size, and a few large bodies each refused with a 4xx."""
from __future__ import annotations

import json

from hypothesis import strategies as st

from splitspec.limits import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS

MESSAGES = [{"role": "user", "content": "hi"}]
# Strings made of what confuses a scan for strings: quotes, backslashes, brackets.
TRICKY = st.text(alphabet='"\\[]{}a', max_size=8)


def sized_list(item, most: int):
    return st.builds(lambda x, n: [x] * n, item, st.integers(0, most))


FIELDS = st.fixed_dictionaries({}, optional={
    "stop": st.one_of(st.text(max_size=300), sized_list(st.text(max_size=300), 8)),
    "stop_token_ids": sized_list(st.integers(0, 600), MAX_STOP_TOKEN_IDS + 50),
    "logit_bias": st.builds(lambda n, b: {str(i): b for i in range(n)}, st.integers(0, MAX_LOGIT_BIAS + 50),
                            st.floats(-100, 100)),
    "guided_json": st.builds(lambda n, inner: "[" * n + inner + "]" * n, st.integers(0, 2000), TRICKY),
    "structured_outputs": st.builds(lambda n: {"structural_tag": '{"a": ' * n + "1" + "}" * n}, st.integers(0, 2000)),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["bos_token", "enable_thinking", "suffix", "x"]),
                                            st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                                            max_size=3),
})
PROMPTS = st.one_of(st.text(min_size=1, max_size=50), sized_list(st.just("hi"), 300),
                    sized_list(st.integers(3, 500), 2000), sized_list(st.just([5, 6]), 300))
# (path, body): a dict is sent as JSON, bytes as they are (unterminated strings, escape runs).
BODIES = st.one_of(
    st.builds(lambda p, f: ("/v1/completions", {**f, "prompt": p, "max_tokens": 2}), PROMPTS, FIELDS),
    st.builds(lambda f: ("/v1/chat/completions", {**f, "messages": MESSAGES, "max_tokens": 2}), FIELDS),
    st.builds(lambda head, run, n: ("/v1/completions", head + b'"' + run * n),
              st.sampled_from([b"", b'{"prompt": ', b"[" * 70, b'{"messages": [{"role": "user", "content": ']),
              st.sampled_from([b'\\"', b"\\\\", b"\\", b"[", b'{"', b'"']), st.integers(0, 50_000)))

# Megabytes each, every one a 4xx: the unterminated string, a backslash run, a million flat
# arrays, JSON nested in a string, and lists far past their limits.
LARGE = {
    "unterminated-escapes": b'"' + b'\\"' * 1_000_000,
    "backslash-run": b'{"prompt": "' + b"\\\\" * 1_000_000,
    "flat-arrays": b'{"prompt": [' + b"[]," * 1_000_000 + b"[]]}",
    "nested-in-string": json.dumps({"prompt": "hi", "guided_json": "[" * 30_000 + "]" * 30_000}).encode(),
    "logit-bias": json.dumps({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(200_000)}}).encode(),
    "prompt-batch": json.dumps({"prompt": ["hi"] * 300_000}).encode(),
    "stop-strings": json.dumps({"prompt": "hi", "stop": ["x" * 1000] * 1000}).encode(),
}
