"""The prefix cache as clients see it (issue 40, "Visible" and "Bad input"): `cache_salt` on
gRPC's GenerateRequest and on /v1/completions and /v1/chat/completions reaches every TargetOpen
of the request (n > 1 choices and a failover's reopen included), bad salts are refused naming the
field, and TargetOpened.cached_tokens comes back as Usage.cached_tokens and OpenAI's
usage.prompt_tokens_details.cached_tokens.

The gateway runs in process against fake targets (grpc.aio servers that record every TargetOpen
and answer cached_tokens = len(prompt) - 1): no model, a few seconds for the whole file."""
from __future__ import annotations

import asyncio
import contextlib
import json
import types

import grpc
import pytest
from service_helpers import VOCAB, FakeTargetServicer
from service_helpers import asgi_post as post

from gateway.config import GatewayConfig
from gateway.http_api import create_app
from gateway.openai_answer import usage
from gateway.server import Backends, GenerationServicer, add_servicer
from splitspec import logs
from splitspec_tools.client import build_request
from splitspec.security import ApiKeys
from splitspec.v1 import gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc

TOKEN = 100          # what the fake target emits: never its eos (0)
PROMPT = [5, 6, 7, 8, 9, 10, 11]
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"


class FakeTarget(FakeTargetServicer):
    """Answers cached_tokens = len(prompt) - 1 (all but the last token, as a warm prefix cache
    would); `fail_after` (shared between replicas: a one-element list) makes the first session
    that decodes that many tokens die with UNAVAILABLE."""

    def __init__(self, tokenizer_json: bytes, opens: list, fail_after: list):
        super().__init__(tokenizer_json, TEMPLATE, opens)
        self.fail_after = fail_after

    async def open(self, request, context):
        async def token(i):
            if self.fail_after[0] is not None and i == self.fail_after[0]:
                self.fail_after[0] = None
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica went away")
            return TOKEN
        length = len(request.prompt_token_ids)
        return target_pb2.TargetOpened(session_id=request.session_id, first_token_id=TOKEN, length=length,
                                       cached_tokens=length - 1), token


@contextlib.asynccontextmanager
async def stack(tokenizer_json: bytes, replicas: int = 1, fail_after: int | None = None):
    """Fake target replicas, the gateway's Generate servicer over them (also on a gRPC port),
    and its HTTP app. Yields (servicer, app, gRPC address, the TargetOpens received)."""
    opens: list[target_pb2.TargetOpen] = []
    fail = [fail_after]
    servers, addresses = [], []
    for _ in range(replicas):
        srv = grpc.aio.server()
        target_pb2_grpc.add_TargetServicer_to_server(FakeTarget(tokenizer_json, opens, fail), srv)
        addresses.append(f"127.0.0.1:{srv.add_insecure_port('127.0.0.1:0')}")
        await srv.start()
        servers.append(srv)
    cfg = GatewayConfig(targets=tuple(addresses), target_wait_s=10, max_new_tokens_cap=64)
    backends = Backends(cfg)
    await backends.connect(logs.get_logger())
    servicer = GenerationServicer(backends, types.SimpleNamespace(serving=True))
    gw = grpc.aio.server()
    add_servicer(servicer, gw)
    address = f"127.0.0.1:{gw.add_insecure_port('127.0.0.1:0')}"
    await gw.start()
    try:
        yield servicer, create_app(servicer, ApiKeys([])), address, opens
    finally:
        await gw.stop(None)
        await backends.close()
        for srv in servers:
            await srv.stop(None)


def events(body: bytes) -> list:
    out = []
    for line in body.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


ENDPOINTS = [("/v1/completions", {"prompt": PROMPT}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]


def test_http_refuses_a_salt_that_is_not_a_string(tokenizer_json):
    async def main():
        async with stack(tokenizer_json) as (_, app, _, opens):
            for path, base in ENDPOINTS:
                for salt in (7, ["a"], {"tenant": "a"}, True, 1.5):
                    status, raw = await post(app, path, {**base, "max_tokens": 2, "cache_salt": salt})
                    err = json.loads(raw)["error"]
                    assert status == 400, (path, salt, raw)
                    assert err["param"] == "cache_salt" and err["type"] == "invalid_request_error"
                    assert "cache_salt must be a string" in err["message"]
                # Too long: the same limit as gRPC's (256 characters), naming the field.
                status, raw = await post(app, path, {**base, "max_tokens": 2, "cache_salt": "x" * 257})
                err = json.loads(raw)["error"]
                assert status == 400 and err["param"] == "cache_salt" and "256" in err["message"]
            assert opens == []          # nothing refused reached a target
    asyncio.run(main())


def test_grpc_refuses_a_salt_over_256_characters(tokenizer_json):
    async def main():
        async with stack(tokenizer_json) as (_, _, address, opens):
            async with grpc.aio.insecure_channel(address) as ch:
                stub = gateway_pb2_grpc.GenerationStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(build_request(PROMPT, max_new_tokens=2, cache_salt="s" * 257)):
                        pass
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "cache_salt" in err.value.details() and "256" in err.value.details()
                assert opens == []
                # 256 characters (not bytes: a multi-byte salt is fine) are accepted.
                salt = "é" * 256
                got = [r async for r in stub.Generate(build_request(PROMPT, max_new_tokens=3, cache_salt=salt))]
                assert [o.cache_salt for o in opens] == [salt]
                usage_pb = got[-1].complete.usage
                assert usage_pb.prompt_tokens == len(PROMPT) and usage_pb.cached_tokens == len(PROMPT) - 1
    asyncio.run(main())


def test_http_salt_reaches_every_open_and_usage_has_cached_tokens(tokenizer_json):
    async def main():
        async with stack(tokenizer_json) as (_, app, _, opens):
            # Non-streaming, n = 3: every choice opens with the same salt; the prompt (and its
            # cached tokens) are counted once.
            status, raw = await post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "n": 3,
                                                              "cache_salt": "tenant-a", "ignore_eos": True})
            assert status == 200, raw
            body = json.loads(raw)
            assert [o.cache_salt for o in opens] == ["tenant-a"] * 3
            assert body["usage"]["prompt_tokens"] == len(PROMPT)
            details = body["usage"]["prompt_tokens_details"]
            assert isinstance(details["cached_tokens"], int) and details["cached_tokens"] == len(PROMPT) - 1

            # Streaming chat with include_usage: the final usage chunk has the same shape.
            opens.clear()
            status, raw = await post(app, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}, "cache_salt": "tenant-b"})
            assert status == 200, raw
            last = events(raw)[-1]
            assert last["choices"] == [] and isinstance(last["usage"]["prompt_tokens_details"]["cached_tokens"], int)
            assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == last["usage"]["prompt_tokens"] - 1
            assert [o.cache_salt for o in opens] == ["tenant-b"]

            # No salt (or an empty one): the shared namespace; the usage key is there all the same.
            opens.clear()
            for extra in ({}, {"cache_salt": ""}, {"cache_salt": None}):
                status, raw = await post(app, "/v1/chat/completions", {
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra})
                assert status == 200, raw
                assert isinstance(json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"], int)
            assert [o.cache_salt for o in opens] == ["", "", ""]
    asyncio.run(main())


def test_failover_reopens_with_the_salt_and_counts_the_prompt_once(tokenizer_json):
    async def main():
        async with stack(tokenizer_json, replicas=2, fail_after=2) as (_, _, address, opens):
            async with grpc.aio.insecure_channel(address) as ch:
                stub = gateway_pb2_grpc.GenerationStub(ch)
                got = [r async for r in stub.Generate(build_request(PROMPT, max_new_tokens=8, ignore_eos=True,
                                                                   cache_salt="tenant-c"))]
            complete = got[-1].complete
            assert complete.stats.target_failovers == 1 and complete.usage.completion_tokens == 8
            assert len(opens) == 2 and {o.cache_salt for o in opens} == {"tenant-c"}
            assert len(opens[1].prompt_token_ids) > len(PROMPT)       # the reopen: prompt + tokens so far
            # The reopen's cache hits (prompt + streamed tokens) are not the prompt's: not counted.
            assert complete.usage.cached_tokens == len(PROMPT) - 1
    asyncio.run(main())


def test_usage_counts_each_prompts_cached_tokens_once():
    def choice(index, prompt_index, prompt, cached, completion):
        from gateway.openai_answer import Choice
        c = Choice(index, prompt_index)
        c.complete = gateway_pb2.Complete(usage=gateway_pb2.Usage(
            prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached))
        return c
    # Two prompts x n = 2: prompt 0's second choice hit the blocks its first one had just
    # computed; the fewest per prompt is reported, once.
    got = usage([choice(0, 0, 10, 0, 3), choice(1, 0, 10, 8, 3), choice(2, 1, 6, 4, 2), choice(3, 1, 6, 5, 2)], 2)
    assert got == {"prompt_tokens": 16, "completion_tokens": 10, "total_tokens": 26,
                   "prompt_tokens_details": {"cached_tokens": 4}}


def test_target_open_passes_the_salt_and_reports_cached_tokens():
    """target_service/server.py `_open`: a salt over 256 characters is refused naming
    open.cache_salt; a good one goes to Scheduler.open; the Step's cached_tokens comes back."""
    from splitspec.wire import WireError
    from target_service.server import TargetServicer

    calls = []

    async def open_(session_id, prompt, params, **kw):
        calls.append(kw)
        seq = types.SimpleNamespace(prompt_logprobs=[])
        session = types.SimpleNamespace(session_id=session_id, length=len(prompt), seq=seq)
        out = types.SimpleNamespace(committed=[TOKEN], hidden=None, logprobs=[])
        step = types.SimpleNamespace(out=out, forward_ms=1.0, queue_ms=0.0, batch_size=1, batch_tokens=len(prompt),
                                     cached_tokens=4)
        return session, step

    sched = types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=VOCAB), dtype=None, open=open_)
    servicer = TargetServicer.__new__(TargetServicer)     # _open uses only its arguments

    async def main():
        msg = target_pb2.TargetOpen(session_id="s", prompt_token_ids=PROMPT, cache_salt="x" * 257)
        with pytest.raises(WireError, match="open.cache_salt"):
            await servicer._open(sched, msg)
        assert calls == []
        msg.cache_salt = "tenant-d"
        _, resp = await servicer._open(sched, msg)
        assert calls[0]["cache_salt"] == "tenant-d"
        assert resp.opened.cached_tokens == 4 and resp.opened.first_token_id == TOKEN
    asyncio.run(main())
