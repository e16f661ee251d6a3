"""Fuzzing the gRPC surfaces (issue 54, item 9): messages generated from the proto descriptors
(tests/proto_strategies.py) sent to every method of the gateway, the target and the draft. No
call may end UNKNOWN or INTERNAL (an unhandled exception) or hang past its deadline; afterwards
every service is still SERVING (grpc.health.v1) and a greedy request through the gateway,
speculating, equals target-only.

Calls per service: SPLITSPEC_FUZZ_CALLS (CI's default keeps the file well under a minute on 2
cores; docs/reliability.md has the full run's command and result). A call sends one message,
or 1-3 to a streaming method, so a session is opened, stepped and closed in random orders."""
from __future__ import annotations

import collections
import os

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proto_strategies import messages
from service_helpers import collect, gateway_stub, running, running_gateway, tiny_target_dir

from splitspec_tools.client import build_request
from splitspec_tools.ops.launch import health_status
from splitspec.v1 import draft_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc

CALLS = int(os.environ.get("SPLITSPEC_FUZZ_CALLS", "150"))
SERVING = 1
CAP = 8
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED}
SERVICES = {"gateway": (gateway_pb2, gateway_pb2_grpc, "Generation"), "target": (target_pb2, target_pb2_grpc, "Target"),
            "draft": (draft_pb2, draft_pb2_grpc, "Draft")}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    model = tiny_target_dir(256)
    with running("target", ["--model-path", str(model)], logs) as target, \
            running("draft", ["--method", "ngram", "--target-model-path", str(model)], logs) as draft, \
            running_gateway(target, logs, "--draft", draft.address, "--speculative-algorithm", "NGRAM",
                            "--max-new-tokens-cap", str(CAP)) as gw:
        yield {"target": target, "draft": draft, "gateway": gw}


def methods(name: str):
    pb2, _, service = SERVICES[name]
    return list(pb2.DESCRIPTOR.services_by_name[service].methods)


def call(channel: grpc.Channel, service: str, method, requests: list) -> tuple[grpc.StatusCode, int]:
    """One call of `method` with `requests` (one for a unary request); its status and how many
    responses came back."""
    path = f"/{service}/{method.name}"
    encode = lambda m: m.SerializeToString()          # noqa: E731
    decode = method.output_type._concrete_class.FromString
    try:
        if method.client_streaming:
            responses = list(channel.stream_stream(path, encode, decode)(iter(requests), timeout=30))
        elif method.server_streaming:
            responses = list(channel.unary_stream(path, encode, decode)(requests[0], timeout=30))
        else:
            responses = [channel.unary_unary(path, encode, decode)(requests[0], timeout=30)]
        return grpc.StatusCode.OK, len(responses)
    except grpc.RpcError as err:
        return err.code(), 0


VOCAB = 512
prompts = st.lists(st.integers(min_value=0, max_value=VOCAB - 1), min_size=1, max_size=8)


@st.composite
def _tame_open(draw, name: str):
    """A session that opens on a prompt in the vocabulary (everything else random), then 0-2
    random steps: random bodies alone are nearly all refused at the first message."""
    if name == "gateway":
        req = draw(messages(gateway_pb2.GenerateRequest))
        req.token_ids.ids[:] = draw(prompts)
        req.sampling.max_new_tokens = 1 + req.sampling.max_new_tokens % CAP
        return [req]
    pb2, request, opener = (target_pb2, target_pb2.TargetRequest, target_pb2.TargetOpen) if name == "target" else \
        (draft_pb2, draft_pb2.DraftRequest, draft_pb2.DraftOpen)
    first = request(open=draw(messages(opener)))
    first.open.prompt_token_ids[:] = draw(prompts)
    return [first, *draw(st.lists(messages(request), max_size=2))]


def strategy(name: str):
    """(method, requests): random messages for any method, or a tamed session."""
    ops = methods(name)
    random = [st.tuples(st.just(m), st.lists(messages(m.input_type._concrete_class), min_size=1,
                                             max_size=3 if m.client_streaming else 1)) for m in ops]
    main = next(m for m in ops if m.name in ("Generate", "Session"))
    return st.one_of(*random, st.tuples(st.just(main), _tame_open(name)))


@pytest.mark.parametrize("name", list(SERVICES))
def test_no_unknown_or_internal_status(stack, name):
    pb2, _, service = SERVICES[name]
    full = pb2.DESCRIPTOR.services_by_name[service].full_name
    codes: dict[str, collections.Counter] = {m.name: collections.Counter() for m in methods(name)}
    sent = [0]
    strategies = strategy(name)

    with grpc.insecure_channel(stack[name].address) as channel:
        @settings(max_examples=CALLS, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(strategies)
        def fuzz(case):
            method, requests = case
            code, _ = call(channel, full, method, requests)
            codes[method.name][code.name] += 1
            sent[0] += len(requests)
            assert code not in FORBIDDEN, (method.name, code, [str(r)[:300] for r in requests])
        fuzz()
    print(f"{name}: {sent[0]} messages; " + "; ".join(f"{m}: {dict(c)}" for m, c in codes.items()))
    assert health_status(stack[name].address) == SERVING


def test_still_serving_and_greedy_equals_target_only(stack):
    """The canary, run after the fuzz (pytest keeps file order)."""
    for name in SERVICES:
        assert health_status(stack[name].address) == SERVING, name
    ch, stub = gateway_stub(stack["gateway"].address)
    with ch:
        ids, _, speculated = collect(stub.Generate(build_request("def fibonacci(n):", max_new_tokens=CAP,
                                                                 temperature=0), timeout=60))
        want, _, _ = collect(stub.Generate(build_request("def fibonacci(n):", max_new_tokens=CAP, temperature=0,
                                                         method="none"), timeout=60))
    assert speculated.stats.method == "ngram" and ids == want
