"""Bad input never crashes a service: each case gets INVALID_ARGUMENT / OUT_OF_RANGE (or the
documented status for protocol and capacity errors) with a message naming the field, and both
services stay healthy and keep serving afterwards."""
from __future__ import annotations

import math
import time

import grpc
import pytest

from service_helpers import (SessionStream, collect, garbage_error, gateway_stub, running_gateway, running_target,
                             target_info, tiny_target_dir)
from splitspec_tools.client import build_request
from splitspec_tools.ops.launch import health_status
from splitspec.limits import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from splitspec.v1 import common_pb2, gateway_pb2, target_pb2, target_pb2_grpc
from splitspec.wire import tensor_to_pb

import torch

INVALID = grpc.StatusCode.INVALID_ARGUMENT
CAP = 100
CONTEXT = 2048
IDLE_S = 2


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    model = tiny_target_dir(CONTEXT)
    with running_target(model, logs, "--max-running-requests", "3", "--max-queued-requests", "1",
                        "--kv-cache-budget-mb", "1",
                        "--idle-timeout-s", str(IDLE_S), "--max-message-mb", "1") as target, \
            running_gateway(target, logs, "--max-new-tokens-cap", str(CAP)) as gateway:
        yield target, gateway


def req(prompt=(5, 6, 7), **sampling):
    spec = sampling.pop("speculative", None)
    r = build_request(list(prompt), **sampling) if prompt is not None else gateway_pb2.GenerateRequest()
    if spec:
        r.speculative.CopyFrom(common_pb2.SpeculativeParams(**spec))
    return r


def text_req(text):
    return gateway_pb2.GenerateRequest(text=text)


GATEWAY_CASES = [
    ("temperature < 0", req(temperature=-0.5), INVALID, "sampling.temperature"),
    ("temperature nan", req(temperature=math.nan), INVALID, "sampling.temperature"),
    ("top_p = 0", req(top_p=0.0), INVALID, "sampling.top_p"),
    ("top_p > 1", req(top_p=1.5), INVALID, "sampling.top_p"),
    ("top_k < 0", req(top_k=-1), INVALID, "sampling.top_k"),
    ("max_new_tokens = 0", req(max_new_tokens=0), INVALID, "sampling.max_new_tokens"),
    ("max_new_tokens < 0", req(max_new_tokens=-3), INVALID, "sampling.max_new_tokens"),
    ("max_new_tokens above cap", req(max_new_tokens=CAP + 1), INVALID, "sampling.max_new_tokens"),
    ("no input", req(prompt=None), INVALID, "input"),
    ("empty text", text_req(""), INVALID, "text"),
    ("empty token ids", gateway_pb2.GenerateRequest(token_ids=common_pb2.TokenIds()), INVALID, "token_ids"),
    ("token id above vocab", req(prompt=(5, 512)), INVALID, "token_ids.ids[1]"),
    ("negative token id", req(prompt=(-1,)), INVALID, "token_ids.ids[0]"),
    ("prompt over context", req(prompt=[5] * CONTEXT), grpc.StatusCode.OUT_OF_RANGE, "prompt"),
    ("unknown method", req(speculative={"method": "medusa"}), INVALID, "speculative.method"),
    ("unknown draft sampling", req(speculative={"draft_sampling": "beam"}), INVALID, "speculative.draft_sampling"),
    ("num_draft_tokens < 2", req(speculative={"num_draft_tokens": 1}), INVALID, "speculative.num_draft_tokens"),
    ("empty stop string", req(stop=[""]), INVALID, "sampling.stop[0]"),
    ("stop token id out of range", req(stop_token_ids=[9999]), INVALID, "sampling.stop_token_ids[0]"),
    ("5 stop strings", req(stop=list("abcde")), INVALID, "sampling.stop has 5 entries; at most 4"),
    ("a long stop string", req(stop=["x" * 257]), INVALID, "sampling.stop[0] has 257 characters; at most 256"),
    ("too many stop token ids", req(stop_token_ids=[5] * 1025), INVALID, "sampling.stop_token_ids has 1025 entries"),
]


def sampled(**fields):
    r = req()
    for name, value in fields.items():
        if name == "logit_bias":
            r.sampling.logit_bias.update(value)
        elif name == "constraint":
            r.sampling.constraint.CopyFrom(value)
        else:
            setattr(r.sampling, name, value)
    return r


GATEWAY_CASES += [
    ("presence_penalty > 2", sampled(presence_penalty=2.5), INVALID, "sampling.presence_penalty"),
    ("frequency_penalty nan", sampled(frequency_penalty=math.nan), INVALID, "sampling.frequency_penalty"),
    ("repetition_penalty = 0", sampled(repetition_penalty=0.0), INVALID, "sampling.repetition_penalty"),
    ("logit_bias outside the vocab", sampled(logit_bias={9999: 1.0}), INVALID, "sampling.logit_bias"),
    ("logit_bias > 100", sampled(logit_bias={5: 150.0}), INVALID, "sampling.logit_bias[5]"),
    ("logit_bias over 300 entries", sampled(logit_bias={i: 1.0 for i in range(301)}), INVALID,
     "sampling.logit_bias has 301 entries; at most 300"),
    ("json_schema nested in its text", sampled(constraint=common_pb2.Constraint(json_schema="[" * 30_000 + "]" * 30_000)),
     INVALID, "sampling.constraint.json_schema nests deeper than 64"),
    ("min_tokens > max_new_tokens", sampled(min_tokens=20, max_new_tokens=4), INVALID, "sampling.min_tokens"),
    ("logprobs > 20", sampled(logprobs=21), INVALID, "sampling.logprobs"),
    ("prompt_logprobs < 0", sampled(prompt_logprobs=-1), INVALID, "sampling.prompt_logprobs"),
]


@pytest.mark.parametrize("request_msg,code,field", [c[1:] for c in GATEWAY_CASES],
                         ids=[c[0] for c in GATEWAY_CASES])
def test_gateway_refuses_bad_input(services, request_msg, code, field):
    ch, stub = gateway_stub(services[1].address)
    with ch, pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request_msg, timeout=30))
    assert err.value.code() == code
    assert field in err.value.details()


def Stream(address) -> SessionStream:
    """A Target.Session stream driven one message at a time."""
    return SessionStream(address, target_pb2_grpc.TargetStub, target_pb2.TargetRequest)


def open_msg(prompt=(5, 6, 7), **kw):
    kw.setdefault("max_new_tokens", 16)
    return target_pb2.TargetOpen(session_id="t", prompt_token_ids=list(prompt), **kw)


CHAIN = common_pb2.TokenTree(token_ids=[5, 6], parents=[-1, 0])


def chain_q(node: int, row) -> common_pb2.Tensor:
    """draft_probs for CHAIN: node 0 sampled from a fair q over tokens 5 and 6, node 1
    deterministic (a zero row), with `row` (a function of a good row) put at `node`."""
    q = torch.zeros(2, 512)
    q[0, 5] = q[0, 6] = 0.5
    q[node] = row(q[0].clone())
    return tensor_to_pb(q)


def nan_row(r):
    r[7] = math.nan
    return r


def negative_row(r):
    r[5], r[7] = 0.75, -0.25
    return r


def q_zero_at_its_token(r):
    r[5], r[7] = 0.0, 0.5
    return r


def bf16_q(total: float) -> common_pb2.Tensor:
    """CHAIN's q at bf16, node 0's row summing to `total` (past bf16's rounding of a true q)."""
    q = torch.zeros(2, 512)
    q[0, 5], q[0, 6] = 0.5, total - 0.5
    return tensor_to_pb(q, torch.bfloat16)


def test_q_is_renormalised_within_its_dtypes_rounding_and_refused_past_it():
    """A q rounded to bf16 sums to 1 within 2^-8, a float32 one within float32 rounding: within
    that (plus 1e-4) the row is renormalised, past it (0.991, or 1.001 at float32) refused."""
    from splitspec.engine.tree import Tree
    from target_service.verify import DraftProbsError, check_draft_probs
    tree = Tree((5, 6), (-1, 0))
    for dtype, total in ((torch.bfloat16, 1 - 2 ** -9), (torch.float16, 1 + 2 ** -12), (torch.float32, 1 + 5e-5)):
        q = torch.zeros(2, 512)
        q[0, 5], q[0, 6] = 0.5, total - 0.5
        got = check_draft_probs(q.to(dtype), tree)
        assert got.dtype == torch.float32 and abs(float(got[0].sum()) - 1) < 1e-6 and not got[1].any()
    for dtype, total in ((torch.bfloat16, 0.991), (torch.float16, 0.995), (torch.float32, 1.001)):
        q = torch.zeros(2, 512)
        q[0, 5], q[0, 6] = 0.5, total - 0.5
        with pytest.raises(DraftProbsError, match=r"draft_probs\[0\] \(tree node 0\) sums to"):
            check_draft_probs(q.to(dtype), tree)


def bad_q(q):
    return [dict(open=open_msg()), dict(verify=target_pb2.TargetVerify(base_len=4, tree=CHAIN, draft_probs=q))]

TARGET_CASES = [
    ("decode before open", [dict(decode=target_pb2.TargetDecode(n=2))],
     grpc.StatusCode.FAILED_PRECONDITION, "before open"),
    ("second open", [dict(open=open_msg()), dict(open=open_msg())],
     grpc.StatusCode.FAILED_PRECONDITION, "second Open"),
    ("kind not set", [dict()], INVALID, "TargetRequest.kind"),
    ("empty prompt", [dict(open=open_msg(prompt=()))], INVALID, "open.prompt_token_ids"),
    ("prompt token out of vocab", [dict(open=open_msg(prompt=(600,)))], INVALID, "open.prompt_token_ids[0]"),
    ("hidden layer out of range", [dict(open=open_msg(hidden_layer_ids=[7]))], INVALID, "open.hidden_layer_ids[0]"),
    ("bad sampling", [dict(open=open_msg(sampling=common_pb2.SamplingParams(top_p=2.0)))], INVALID, "sampling.top_p"),
    ("too many logit_bias entries", [dict(open=open_msg(sampling=common_pb2.SamplingParams(
        logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)})))], INVALID, "sampling.logit_bias has 301 entries"),
    ("too many stop_token_ids", [dict(open=open_msg(sampling=common_pb2.SamplingParams(
        stop_token_ids=[5] * (MAX_STOP_TOKEN_IDS + 1))))], INVALID, "sampling.stop_token_ids has 1025 entries"),
    ("prompt over context", [dict(open=open_msg(prompt=[5] * CONTEXT))], grpc.StatusCode.OUT_OF_RANGE,
     "open.prompt_token_ids"),
    ("decode n = 0", [dict(open=open_msg()), dict(decode=target_pb2.TargetDecode(n=0))], INVALID, "decode.n"),
    ("decode past the session's room", [dict(open=open_msg(max_new_tokens=4)), dict(decode=target_pb2.TargetDecode(n=50))],
     grpc.StatusCode.OUT_OF_RANGE, "decode.n"),
    ("extension past the session's room", [dict(open=open_msg(max_new_tokens=4)), dict(decode=target_pb2.TargetDecode(n=2)),
                                            dict(decode=target_pb2.TargetDecode(n=50))],
     grpc.StatusCode.OUT_OF_RANGE, "decode.n = 50"),
    ("extension with another return_hidden", [
        dict(open=open_msg(hidden_layer_ids=[0], max_new_tokens=200)),
        dict(decode=target_pb2.TargetDecode(n=150, return_hidden=True)),
        dict(decode=target_pb2.TargetDecode(n=1))], grpc.StatusCode.FAILED_PRECONDITION, "return_hidden"),
    ("stale verify", [dict(open=open_msg()), dict(verify=target_pb2.TargetVerify(base_len=2, tree=CHAIN))],
     grpc.StatusCode.ABORTED, "verify.base_len"),
    ("malformed tree", [dict(open=open_msg()), dict(verify=target_pb2.TargetVerify(
        base_len=4, tree=common_pb2.TokenTree(token_ids=[5], parents=[3])))], INVALID, "tree.parents[0]"),
    ("tree token out of vocab", [dict(open=open_msg()), dict(verify=target_pb2.TargetVerify(
        base_len=4, tree=common_pb2.TokenTree(token_ids=[5, 900], parents=[-1, 0])))], INVALID, "tree.token_ids[1]"),
    ("draft probs misshapen", [dict(open=open_msg()), dict(verify=target_pb2.TargetVerify(
        base_len=4, tree=CHAIN, draft_probs=tensor_to_pb(torch.full((2, 7), 0.1))))], INVALID, "verify.draft_probs"),
    ("draft probs NaN", bad_q(chain_q(0, nan_row)), INVALID, "verify.draft_probs[0] (tree node 0) has a NaN"),
    ("draft probs negative", bad_q(chain_q(1, negative_row)), INVALID,
     "verify.draft_probs[1] (tree node 1) has a negative"),
    ("draft probs unnormalised", bad_q(chain_q(1, lambda r: r * 0.5)), INVALID,
     "verify.draft_probs[1] (tree node 1) sums to 0.5"),
    ("draft probs summing to 0.991", bad_q(chain_q(0, lambda r: r * 0.991)), INVALID,
     "verify.draft_probs[0] (tree node 0) sums to 0.991"),
    ("draft probs summing to 0.991 at bf16", bad_q(bf16_q(0.991)), INVALID,
     "verify.draft_probs[0] (tree node 0) sums to 0.99"),
    ("draft probs zero at a sampled token", bad_q(chain_q(0, q_zero_at_its_token)), INVALID,
     "verify.draft_probs[0] (tree node 0) gives its own token 5 probability 0"),
    ("tree with a cycle", [dict(open=open_msg()), dict(verify=target_pb2.TargetVerify(
        base_len=4, tree=common_pb2.TokenTree(token_ids=[5, 6], parents=[1, 0])))], INVALID, "tree.parents[0]"),
    ("non-topological parent", [dict(open=open_msg()), dict(verify=target_pb2.TargetVerify(
        base_len=4, tree=common_pb2.TokenTree(token_ids=[5, 6, 7], parents=[-1, 2, 0])))], INVALID, "tree.parents[1]"),
    ("self parent", [dict(open=open_msg()), dict(verify=target_pb2.TargetVerify(
        base_len=4, tree=common_pb2.TokenTree(token_ids=[5, 6], parents=[-1, 1])))], INVALID, "tree.parents[1]"),
    ("parent below -1", [dict(open=open_msg()), dict(verify=target_pb2.TargetVerify(
        base_len=4, tree=common_pb2.TokenTree(token_ids=[5], parents=[-2])))], INVALID, "tree.parents[0]"),
    ("parents and tokens differ in length", [dict(open=open_msg()), dict(verify=target_pb2.TargetVerify(
        base_len=4, tree=common_pb2.TokenTree(token_ids=[5, 6], parents=[-1])))], INVALID, "tree.parents"),
    ("oversized tree", [dict(open=open_msg()), dict(verify=target_pb2.TargetVerify(
        base_len=4, tree=common_pb2.TokenTree(token_ids=[5] * 300, parents=list(range(-1, 299)))))],
     INVALID, "limit"),
    ("bad hidden dtype", [dict(open=open_msg(hidden_dtype=9))], INVALID, "dtype"),
    ("negative hidden_last", [dict(open=open_msg(hidden_layer_ids=[0], hidden_last=-1))], INVALID,
     "open.hidden_last = -1"),
    ("oversized message", [dict(open=open_msg(prompt=[300] * 600_000))], grpc.StatusCode.RESOURCE_EXHAUSTED,
     "larger than max"),
    ("kv budget", [dict(open=open_msg(max_new_tokens=0))], grpc.StatusCode.RESOURCE_EXHAUSTED, "--kv-cache-budget-mb"),
]


@pytest.mark.parametrize("messages,code,text", [c[1:] for c in TARGET_CASES], ids=[c[0] for c in TARGET_CASES])
def test_target_refuses_bad_messages(services, messages, code, text):
    # A healthy session on another stream runs across the bad one, unaffected.
    good = Stream(services[0].address).send(open=open_msg(max_new_tokens=4))
    s = Stream(services[0].address)
    try:
        assert good.recv().HasField("opened")
        err = s.refused(messages)
        assert err.code() == code
        assert text in err.details()
        good.send(decode=target_pb2.TargetDecode(n=1))
        assert good.recv().token.length == 5
    finally:
        s.close()
        good.close()


def test_a_decode_sent_mid_run_extends_it_in_order(services):
    """A Decode sent before a run's last token extends the run: the tokens go on in order, the
    same as one longer run, and the stream then takes a Verify as usual."""
    def tokens(stream, n):
        return [stream.recv().token for _ in range(n)]

    plain = Stream(services[0].address).send(open=open_msg(max_new_tokens=40))
    split = Stream(services[0].address).send(open=open_msg(max_new_tokens=40))
    try:
        assert plain.recv().HasField("opened") and split.recv().HasField("opened")
        want = tokens(plain.send(decode=target_pb2.TargetDecode(n=21)), 21)
        got = tokens(split.send(decode=target_pb2.TargetDecode(n=3)), 1)
        got += tokens(split.send(decode=target_pb2.TargetDecode(n=12)), 14)   # 2 + 12 more on this run
        got += tokens(split.send(decode=target_pb2.TargetDecode(n=6)), 6)     # a new run
        assert [t.token_id for t in got] == [t.token_id for t in want]
        assert [t.length for t in got] == list(range(5, 26))
        split.send(verify=target_pb2.TargetVerify(base_len=25, tree=common_pb2.TokenTree(token_ids=[5], parents=[-1])))
        assert split.recv().verified.length in (26, 27)
    finally:
        plain.close()
        split.close()


def test_target_open_sends_only_the_last_hidden_last_rows(services):
    """hidden_last = n: TargetOpened.hidden is the last n rows of what hidden_last = 0 sends
    (all of them when n is past the prompt)."""
    from splitspec.wire import tensor_from_pb
    prompt = (5, 6, 7, 8, 9)
    got = {}
    for last in (0, 2, 9):
        s = Stream(services[0].address).send(open=open_msg(prompt=prompt, hidden_layer_ids=[0, 1], hidden_last=last))
        try:
            got[last] = tensor_from_pb(s.recv().opened.hidden)
        finally:
            s.close()
    assert got[0].shape[0] == len(prompt) and got[2].shape[0] == 2
    assert torch.equal(got[2], got[0][-2:]) and torch.equal(got[9], got[0])


def test_target_refuses_garbage_bytes(services):
    err = garbage_error(services[0].address, "/splitspec.v1.Target/Session", streaming=True)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid splitspec.v1.TargetRequest" in err.details()
    err = garbage_error(services[0].address, "/splitspec.v1.Target/GetInfo", streaming=False)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid splitspec.v1.GetInfoRequest" in err.details()


def test_target_queues_past_max_running_and_refuses_past_the_queue(services):
    address = services[0].address
    streams = [Stream(address).send(open=open_msg()) for _ in range(3)]
    try:
        for s in streams:
            assert s.recv().HasField("opened")
        queued = Stream(address).send(open=open_msg())           # 4th: waits for a running slot
        streams.append(queued)
        deadline = time.monotonic() + 10
        while target_info(address).waiting_sessions != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        info = target_info(address)
        assert (info.running_sessions, info.waiting_sessions, info.max_queued_requests) == (3, 1, 1)
        extra = Stream(address).send(open=open_msg())            # 5th: the queue is full
        streams.append(extra)
        with pytest.raises(grpc.RpcError) as err:
            extra.recv()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-queued-requests 1" in err.value.details()
        streams[0].close()                                       # frees a slot: the queued one runs
        opened = queued.recv()
        assert opened.HasField("opened") and opened.opened.queue_ms > 0
    finally:
        for s in streams:
            s.close()


def test_idle_session_is_closed(services):
    s = Stream(services[0].address).send(open=open_msg())
    try:
        assert s.recv().HasField("opened")
        with pytest.raises(grpc.RpcError) as err:
            s.recv()                     # nothing sent: the server gives up after --idle-timeout-s
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "--idle-timeout-s" in err.value.details()
    finally:
        s.close()


def test_services_stay_healthy_and_serve(services):
    target, gateway = services
    assert health_status(target.address) == health_status(gateway.address) == 1   # SERVING
    deadline = time.monotonic() + 5
    while target_info(target.address).active_sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert target_info(target.address).active_sessions == 0
    assert target_info(target.address).kv_cache_bytes == 0
    ch, stub = gateway_stub(gateway.address)
    with ch:
        ids, _, complete = collect(stub.Generate(req(max_new_tokens=8, ignore_eos=True), timeout=60))
    assert len(ids) == 8 and complete.finish_reason == "length"
