"""Bodies built to cost the gateway more than they are worth (issue 63): unterminated strings and
long escape runs for the pre-parse guard, lists past their limits (stop, stop_token_ids,
logit_bias, a batch of prompts), JSON nested deep inside strings (guided_json, structural tags,
gRPC's constraint), chat_template_kwargs of the wrong type and templates that fail on them. Each
is a 4xx (or INVALID_ARGUMENT) naming the field and its limit, and none reaches a target. Chat over
HTTP opens with the token ids gRPC chat opens with: the template's own BOS, not a second one.

The gateway runs in process against a fake target (service_helpers.FakeTargetServicer): no
model, a few seconds for the file. tests/test_fuzz_http.py sends the same shapes to the real
services, with a health probe and a generation running meanwhile."""
from __future__ import annotations

import asyncio
import contextlib
import json
import types

import grpc
import pytest
import adversarial_bodies
from adversarial_bodies import MESSAGES, TRICKY
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_helpers import FakeTargetServicer
from service_helpers import asgi_post as post
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from gateway.config import GatewayConfig
from gateway.http_api import create_app
from gateway.http_guard import MAX_JSON_DEPTH, json_depth
from gateway.server import Backends, GenerationServicer, add_servicer
from splitspec import logs
from splitspec.limits import MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from splitspec.security import ApiKeys
from splitspec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc
from splitspec_tools.client import build_request

TOKEN = 100
BOS = 0              # <|endoftext|>: the tokenizer below adds it in front of every plain text
# The template writes the BOS itself, as Llama's and Gemma's do, and adds what a kwarg holds to a
# string (a number there is a TypeError inside the render).
TEMPLATE = ("<|endoftext|>{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if suffix is defined %}{{ 'suffix: ' + suffix }}{% endif %}<|assistant|>")


class FakeTarget(FakeTargetServicer):
    async def open(self, request, context):
        async def token(i):
            return TOKEN
        return target_pb2.TargetOpened(session_id=request.session_id, first_token_id=TOKEN,
                                       length=len(request.prompt_token_ids)), token


def with_bos(tokenizer_json: bytes) -> bytes:
    """The tiny tokenizer, adding a BOS in front of a text encoded with special tokens."""
    tok = Tokenizer.from_str(tokenizer_json.decode())
    tok.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", BOS)])
    return tok.to_str().encode()


@contextlib.asynccontextmanager
async def stack(tokenizer_json: bytes):
    """A fake target, the gateway's servicer over it (on a gRPC port too) and its HTTP app:
    yields (app, gRPC address, the TargetOpens received)."""
    opens: list[target_pb2.TargetOpen] = []
    srv = grpc.aio.server()
    target_pb2_grpc.add_TargetServicer_to_server(FakeTarget(with_bos(tokenizer_json), TEMPLATE, opens), srv)
    target = f"127.0.0.1:{srv.add_insecure_port('127.0.0.1:0')}"
    await srv.start()
    backends = Backends(GatewayConfig(targets=(target,), target_wait_s=10, max_new_tokens_cap=8))
    await backends.connect(logs.get_logger())
    servicer = GenerationServicer(backends, types.SimpleNamespace(serving=True))
    gw = grpc.aio.server()
    add_servicer(servicer, gw)
    address = f"127.0.0.1:{gw.add_insecure_port('127.0.0.1:0')}"
    await gw.start()
    try:
        yield create_app(servicer, ApiKeys([])), address, opens
    finally:
        await gw.stop(None)
        await backends.close()
        await srv.stop(None)


def deep(n: int) -> str:
    return "[" * n + "]" * n


COMPLETION = {"prompt": "hi", "max_tokens": 2}
CHAT = {"messages": MESSAGES, "max_tokens": 2}
# (id, path, body, the refusal's param, words its message must hold)
REFUSED = [
    ("5 stop strings", "/v1/completions", {**COMPLETION, "stop": list("abcde")}, "stop", f"at most {MAX_STOP_STRINGS}"),
    ("a long stop string", "/v1/completions", {**COMPLETION, "stop": "x" * (MAX_STOP_CHARS + 1)}, "stop",
     f"at most {MAX_STOP_CHARS}"),
    ("a long stop in a list", "/v1/chat/completions", {**CHAT, "stop": ["a", "x" * (MAX_STOP_CHARS + 1)]}, "stop[1]",
     f"at most {MAX_STOP_CHARS}"),
    ("a million stop strings", "/v1/completions", {**COMPLETION, "stop": ["x"] * 1_000_000}, "stop", "1000000"),
    ("too many stop_token_ids", "/v1/completions", {**COMPLETION, "stop_token_ids": [5] * (MAX_STOP_TOKEN_IDS + 1)},
     "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS}"),
    ("a huge logit_bias", "/v1/chat/completions",
     {**CHAT, "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias", f"at most {MAX_LOGIT_BIAS}"),
    ("257 prompts", "/v1/completions", {"prompt": ["hi"] * 257, "max_tokens": 2}, "prompt", "at most 256"),
    ("100,000 prompts", "/v1/completions", {"prompt": [[5]] * 100_000, "max_tokens": 2}, "prompt", "at most 256"),
    ("prompts x n", "/v1/completions", {"prompt": ["a", "b", "c"], "n": 128, "max_tokens": 2}, "n", "at most 256"),
    ("guided_json nested in its string", "/v1/completions", {**COMPLETION, "guided_json": deep(30_000)},
     "guided_json", "nests deeper"),
    ("a schema's enum nested in its string", "/v1/completions",
     {**COMPLETION, "guided_json": '{"enum": [' + deep(MAX_JSON_DEPTH) + "]}"}, "guided_json", "nests deeper"),
    ("a structural tag nested in its string", "/v1/chat/completions",
     {**CHAT, "structured_outputs": {"structural_tag": '{"a": ' * 5000 + "1" + "}" * 5000}}, "structured_outputs",
     "nests deeper"),
    ("bos_token a number", "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"bos_token": 5}},
     "chat_template_kwargs.bos_token", "must be a string"),
    ("enable_thinking a string", "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"enable_thinking": "no"}},
     "chat_template_kwargs.enable_thinking", "must be a boolean"),
    ("a kwarg the template adds to a string", "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"suffix": 5}},
     "messages", "TypeError"),
    ("raise_exception overridden", "/v1/chat/completions",
     {**CHAT, "chat_template_kwargs": {"raise_exception": "x"}}, "chat_template_kwargs", "raise_exception"),
]


@pytest.mark.parametrize("path, body, param, words", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_a_body_past_a_limit_is_a_400_naming_the_field(tokenizer_json, path, body, param, words):
    async def main():
        async with stack(tokenizer_json) as (app, _, opens):
            status, raw = await post(app, path, body)
            err = json.loads(raw)["error"]
            assert status == 400 and err["param"] == param and words in err["message"], err
            assert opens == []
            status, _ = await post(app, "/v1/completions", COMPLETION)      # and the next request is served
            assert status == 200 and len(opens) == 1
    asyncio.run(main())


UNTERMINATED = [b'"' + b'\\"' * 200_000, b'{"prompt": "' + b'\\"' * 200_000, b'{"prompt": "' + b"\\\\" * 200_000,
                b'{"prompt": "' + b"\\" * 400_001, b"[" * 60 + b'"' + b"[" * 200_000,
                json.dumps(COMPLETION).encode("utf-16")]


@pytest.mark.parametrize("raw", UNTERMINATED, ids=["quote-escapes", "prompt-escapes", "backslashes",
                                                   "odd-backslashes", "brackets-in-string", "utf-16"])
def test_unterminated_strings_and_escape_runs_are_a_400(tokenizer_json, raw):
    async def main():
        async with stack(tokenizer_json) as (app, _, opens):
            status, body = await post(app, "/v1/completions", raw)
            assert status == 400 and json.loads(body)["error"]["message"]
            assert opens == []
    asyncio.run(main())


def grpc_request(**sampling) -> gateway_pb2.GenerateRequest:
    req = build_request([5, 6, 7], max_new_tokens=2)
    for name, value in sampling.items():
        field = getattr(req.sampling, name)
        if name == "logit_bias":
            field.update(value)
        elif name == "constraint":
            field.CopyFrom(value)
        else:
            field.extend(value)
    return req


GRPC_REFUSED = [
    ("5 stop strings", grpc_request(stop=list("abcde")), "sampling.stop has 5 entries"),
    ("a long stop string", grpc_request(stop=["x" * (MAX_STOP_CHARS + 1)]), "sampling.stop[0] has"),
    ("too many stop_token_ids", grpc_request(stop_token_ids=[5] * (MAX_STOP_TOKEN_IDS + 1)),
     "sampling.stop_token_ids has"),
    ("a huge logit_bias", grpc_request(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}),
     "sampling.logit_bias has"),
    ("a json_schema nested", grpc_request(constraint=common_pb2.Constraint(json_schema=deep(30_000))),
     "sampling.constraint.json_schema nests deeper"),
    ("an enum nested", grpc_request(constraint=common_pb2.Constraint(json_schema='{"enum": [' + deep(900) + "]}")),
     "sampling.constraint.json_schema nests deeper"),
    ("a structural tag nested", grpc_request(constraint=common_pb2.Constraint(structural_tag=deep(30_000))),
     "sampling.constraint.structural_tag nests deeper"),
]


@pytest.mark.parametrize("request_msg, words", [c[1:] for c in GRPC_REFUSED], ids=[c[0] for c in GRPC_REFUSED])
def test_grpc_refuses_the_same_with_invalid_argument(tokenizer_json, request_msg, words):
    async def main():
        async with stack(tokenizer_json) as (_, address, opens):
            async with grpc.aio.insecure_channel(address) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in gateway_pb2_grpc.GenerationStub(ch).Generate(request_msg, timeout=30):
                        pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
            assert opens == []
    asyncio.run(main())


def test_chat_over_http_opens_with_the_ids_grpc_chat_opens_with(tokenizer_json):
    """One BOS, the template's: the rendered text is encoded without the tokenizer's own special
    tokens, on both surfaces (a plain text prompt does get them)."""
    async def main():
        async with stack(tokenizer_json) as (app, address, opens):
            status, raw = await post(app, "/v1/chat/completions", CHAT)
            assert status == 200, raw
            chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**m) for m in MESSAGES])
            req = gateway_pb2.GenerateRequest(chat=chat, sampling=common_pb2.SamplingParams(max_new_tokens=2))
            async with grpc.aio.insecure_channel(address) as ch:
                [r async for r in gateway_pb2_grpc.GenerationStub(ch).Generate(req, timeout=30)]
            text = "<|endoftext|><|user|>hi\n<|assistant|>"
            status, _ = await post(app, "/v1/completions", {"prompt": text, "max_tokens": 2})
            assert status == 200
            http_ids, grpc_ids, text_ids = (list(o.prompt_token_ids) for o in opens)
            assert http_ids == grpc_ids and http_ids[0] == BOS and http_ids[1] != BOS
            assert text_ids == [BOS, *http_ids]
    asyncio.run(main())


# --- the guard's depth, against the parser's ------------------------------------------------------

def parsed_depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(parsed_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(parsed_depth, value.values()), default=0)
    return 0


JSON_VALUES = st.recursive(st.none() | st.integers() | TRICKY,
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TRICKY, inner, max_size=4),
                           max_leaves=40)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(JSON_VALUES)
def test_the_guard_counts_the_depth_json_loads_recurses_to(value):
    raw = json.dumps(value).encode()
    assert json_depth(raw, MAX_JSON_DEPTH) == min(parsed_depth(value), MAX_JSON_DEPTH + 1)


def test_the_guard_depth_on_bodies_json_refuses():
    assert json_depth(b'"' + b'\\"' * 100_000, 64) == 0                   # one unterminated string
    assert json_depth(b"[[" + b'"' + b"\\" * 7 + b'"[[[', 64) == 2        # the odd backslash escapes the quote
    assert json_depth(b"[" * 100_000 + b"]" * 100_000, 64) == 65
    assert json_depth(b'["' + b"]" * 10 + b'"' + b"[" * 70, 64) == 65     # brackets after a closed string count


# --- a bounded fuzz of the same shapes -------------------------------------------------------------

def test_fuzzed_adversarial_bodies_get_no_5xx(tokenizer_json):
    async def main():
        async with stack(tokenizer_json) as (app, _, opens):
            statuses = []

            @settings(max_examples=80, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(adversarial_bodies.BODIES)
            def fuzz(case):
                path, body = case
                status, raw = asyncio.run_coroutine_threadsafe(post(app, path, body), loop).result(60)
                statuses.append(status)
                assert status < 500, raw[:500]
            loop = asyncio.get_running_loop()
            await asyncio.to_thread(fuzz)
            status, _ = await post(app, "/v1/completions", COMPLETION)
            assert status == 200 and 400 in statuses
    asyncio.run(main())
