"""Limits through the gateway (issue 9, item 4): concurrent requests per gateway and sessions
per target (RESOURCE_EXHAUSTED naming the limit once its waiting queue is full), the KV pool checked at Open, the
prompt length, the max_new_tokens cap and the message size. None of them crashes a service:
both stay SERVING and serve the next request."""
from __future__ import annotations

import queue

import grpc
import pytest

from service_helpers import collect, gateway_stub, running_gateway, running_target, target_stub, tiny_target_dir
from splitspec_tools.client import build_request
from splitspec_tools.ops.launch import health_status
from splitspec.v1 import gateway_pb2, target_pb2

CONTEXT = 2048
CAP = 1500


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    # The tiny model's KV cache takes 1 KiB per token: 1 MiB holds ~1000 tokens.
    with running_target(tiny_target_dir(CONTEXT), logs, "--max-running-requests", "2",
                        "--max-queued-requests", "0", "--kv-cache-budget-mb", "1") as target, \
            running_gateway(target, logs, "--max-sessions", "1", "--max-prompt-tokens", "64",
                            "--max-new-tokens-cap", str(CAP), "--max-message-mb", "1") as gateway:
        yield target, gateway


@pytest.fixture
def stub(services):
    ch, stub = gateway_stub(services[1].address)
    yield stub
    ch.close()


def refused(stub, req) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.Generate(req, timeout=60))
    return err.value


def test_gateway_max_sessions(stub):
    hold = stub.Generate(build_request([5, 6, 7], max_new_tokens=900, ignore_eos=True), timeout=120)
    try:
        next(hold)
        err = refused(stub, build_request([5, 6, 7], max_new_tokens=4))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "gateway --max-sessions 1" in err.details()
    finally:
        hold.cancel()


def test_target_max_sessions_through_the_gateway(services, stub):
    ch, tstub = target_stub(services[0].address)
    qs = [queue.Queue() for _ in range(2)]
    streams = [tstub.Session(iter(q.get, None), timeout=60) for q in qs]
    try:
        for q, s in zip(qs, streams):
            q.put(target_pb2.TargetRequest(open=target_pb2.TargetOpen(prompt_token_ids=[5], max_new_tokens=4)))
            assert next(s).HasField("opened")
        err = refused(stub, build_request([5, 6, 7], max_new_tokens=4))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "target" in err.details() and "--max-queued-requests 0" in err.details()
    finally:
        for q, s in zip(qs, streams):
            q.put(None)
            s.cancel()
        ch.close()


def test_kv_budget_checked_at_open(stub):
    err = refused(stub, build_request([5] * 10, max_new_tokens=CAP, ignore_eos=True))   # ~1.5 MiB of KV
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV blocks" in err.details() and "--kv-cache-budget-mb" in err.details()


def test_prompt_length_limit(stub):
    err = refused(stub, build_request([5] * 65, max_new_tokens=4))
    assert err.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "--max-prompt-tokens" in err.details()


def test_max_new_tokens_cap(stub):
    err = refused(stub, build_request([5, 6], max_new_tokens=CAP + 1))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-new-tokens-cap" in err.details()


def test_oversized_message(stub):
    err = refused(stub, build_request("x" * 1_200_000, max_new_tokens=4))    # --max-message-mb 1
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in err.details()


def test_garbage_bytes_to_the_gateway(services):
    with grpc.insecure_channel(services[1].address) as ch:
        raw = ch.unary_stream("/splitspec.v1.Generation/Generate", request_serializer=lambda b: b,
                              response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            list(raw(b"\xff\xfe garbage \x00\x01", timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid splitspec.v1.GenerateRequest" in err.value.details()


def test_services_survive_every_limit(services, stub):
    target, gateway = services
    assert health_status(target.address) == health_status(gateway.address) == 1
    ids, _, complete = collect(stub.Generate(build_request([5, 6, 7], max_new_tokens=8, ignore_eos=True),
                                             timeout=60))
    assert len(ids) == 8 and complete.finish_reason == "length"
