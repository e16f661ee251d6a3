"""Hidden states between the services (issue 25): raw little-endian bytes in each dtype round-trip
bit for bit; the dtype is negotiated (the draft names the one it takes, the gateway asks the target
for it) and any other is refused by name; greedy speculation with bfloat16 on the wire still equals
target-only decoding, with half the bytes. Also the per-host core share (splitspec/colocation.py)."""
from __future__ import annotations

import json
import os
import queue

import grpc
import pytest
import torch

from service_helpers import collect, running_stack
from splitspec_tools.client import build_request
from splitspec.colocation import HostShare, divide
from splitspec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2
from splitspec.wire import WireError, tensor_from_pb, tensor_to_pb
from target_service.engine import generate

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
N_NEW = 24


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_hidden_states_round_trip_exactly(dtype):
    t = torch.randn(5, 12).to(dtype)
    t[0, :4] = torch.tensor([float("inf"), -0.0, float("nan"), 1e-30]).to(dtype)    # edge values keep their bits
    msg = tensor_to_pb(t)
    assert msg.dtype == {torch.float32: common_pb2.DTYPE_F32, torch.bfloat16: common_pb2.DTYPE_BF16,
                         torch.float16: common_pb2.DTYPE_F16}[dtype]
    assert list(msg.shape) == [5, 12] and len(msg.data) == t.numel() * t.element_size()
    assert msg.data == bits(t).numpy().astype(bits(t).numpy().dtype.newbyteorder("<")).tobytes()   # little-endian
    # Through a serialized message and back, built in place in the response.
    resp = target_pb2.TargetResponse()
    tensor_to_pb(t, out=resp.verified.hidden)
    got = tensor_from_pb(target_pb2.TargetResponse.FromString(resp.SerializeToString()).verified.hidden)
    assert got.dtype == dtype and got.shape == t.shape
    assert torch.equal(bits(got), bits(t))
    # A cast on the way (the target's rows to the draft's dtype) is the cast torch makes, no more.
    f32 = torch.randn(3, 8)
    assert torch.equal(bits(tensor_from_pb(tensor_to_pb(f32, dtype))), bits(f32.to(dtype)))
    # Non-contiguous rows (a slice of a batch's hidden states) and empty tensors.
    assert torch.equal(bits(tensor_from_pb(tensor_to_pb(t.t()))), bits(t.t().contiguous()))
    assert tensor_from_pb(tensor_to_pb(torch.empty(0, 12, dtype=dtype))).shape == (0, 12)


def test_decoded_tensor_is_a_view_unless_asked_for_a_copy():
    msg = tensor_to_pb(torch.arange(6, dtype=torch.float32).view(2, 3))
    a, b = tensor_from_pb(msg, writable=True), tensor_from_pb(msg, writable=True)
    a.zero_()                                   # a writable copy is the caller's own
    assert torch.equal(b, torch.arange(6, dtype=torch.float32).view(2, 3))


def test_dtype_mismatch_is_refused_by_name():
    msg = tensor_to_pb(torch.randn(2, 4), torch.bfloat16)
    with pytest.raises(WireError, match=r"propose\.new_hidden\.dtype is bf16, expected f32 \(this draft takes f32"):
        tensor_from_pb(msg, field="propose.new_hidden", allowed=(torch.float32,),
                       expected="this draft takes f32 hidden states")
    with pytest.raises(WireError, match=r"x\.dtype is 9, expected one of f32, f16, bf16"):
        tensor_from_pb(common_pb2.Tensor(dtype=9, shape=[1]), field="x")


# --- through the services ------------------------------------------------------------------------

TARGET_CONTEXT = 1024


@pytest.fixture(scope="module")
def stack(target_dir, draft_dir, tmp_path_factory):
    """A float32 target, a float32 draft taking its default (float32) hidden states, a gateway."""
    logs = tmp_path_factory.mktemp("logs")
    with running_stack(target_dir, logs, draft_dir, "--speculative-algorithm", "DFLASH", "--draft-timeout-ms", "60000",
                       service_args=("--torch-threads", "1")) as stack:
        yield stack


def draft_info(address):
    with grpc.insecure_channel(address) as ch:
        return draft_pb2_grpc.DraftStub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=10)


@pytest.fixture(scope="module")
def draft_bf16(target_dir, draft_dir, tmp_path_factory):
    """A second draft service on the same weights that takes bfloat16 hidden states."""
    from service_helpers import running_draft
    with running_draft(target_dir, tmp_path_factory.mktemp("logs"), "--hidden-dtype", "bfloat16",
                       "--torch-threads", "1", draft_dir=draft_dir) as svc:
        yield svc


def open_draft(address, feat, dtype):
    """Open a Draft.Session with 3 prompt tokens' hidden states in `dtype`: the first answer,
    or the error the stream ended with."""
    ch = grpc.insecure_channel(address)
    q: queue.Queue = queue.Queue()
    responses = draft_pb2_grpc.DraftStub(ch).Session(iter(q.get, None), timeout=60)
    q.put(draft_pb2.DraftRequest(open=draft_pb2.DraftOpen(
        session_id="w", prompt_token_ids=[5, 6, 7], prompt_hidden=tensor_to_pb(torch.randn(3, feat), dtype))))
    try:
        return next(responses)
    except grpc.RpcError as err:
        return err
    finally:
        q.put(None)
        responses.cancel()
        ch.close()


def test_draft_names_its_dtype_and_refuses_others(draft_bf16, stack):
    info = draft_info(draft_bf16.address)
    assert info.hidden_dtype == common_pb2.DTYPE_BF16 and info.dtype == "float32"
    feat = len(info.target_layer_ids) * info.target_hidden_size
    assert open_draft(draft_bf16.address, feat, torch.bfloat16).HasField("opened")
    err = open_draft(draft_bf16.address, feat, torch.float32)
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "open.prompt_hidden.dtype is f32, expected bf16" in err.details()
    assert "hidden_dtype" in err.details()
    # The default draft takes its weights' dtype and refuses bfloat16 the same way.
    default = stack[1]
    assert draft_info(default.address).hidden_dtype == common_pb2.DTYPE_F32
    err = open_draft(default.address, feat, torch.bfloat16)
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "open.prompt_hidden.dtype is bf16, expected f32" in err.details()


def test_target_refuses_an_unknown_hidden_dtype_by_name(stack):
    target = stack[0]
    with grpc.insecure_channel(target.address) as ch:
        from splitspec.v1 import target_pb2_grpc
        call = target_pb2_grpc.TargetStub(ch).Session(iter([target_pb2.TargetRequest(open=target_pb2.TargetOpen(
            prompt_token_ids=[5, 6], hidden_layer_ids=[0], hidden_dtype=9))]), timeout=60)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "open.hidden_dtype = 9" in err.value.details()


@pytest.mark.parametrize("draft", ["f32", "bf16"])
def test_greedy_speculation_equals_target_only_in_each_wire_dtype(model, target_dir, stack, draft_bf16, tmp_path,
                                                                    draft):
    from service_helpers import gateway_stub, running_gateway
    drafter = stack[1] if draft == "f32" else draft_bf16
    feat = len(draft_info(drafter.address).target_layer_ids) * model.cfg.hidden_size
    prompts = [[5, 6, 7, 8, 9, 10, 11] * 3, [40, 41, 42, 43] * 4, [100 + i for i in range(15)]]
    with running_gateway(stack[0], tmp_path, "--draft", drafter.address, "--speculative-algorithm", "DFLASH",
                         "--draft-timeout-ms", "60000") as gw:
        ch, stub = gateway_stub(gw.address)
        with ch:
            for p in prompts:
                req = build_request(p, max_new_tokens=N_NEW, ignore_eos=True, method="dflash")
                ids, _, complete = collect(stub.Generate(req, timeout=300))
                st = complete.stats
                assert ids == generate(model, p, N_NEW)
                assert st.draft_fallbacks == 0 and st.draft_tokens > 0
                # Every step's features crossed in the draft's dtype: 2 or 4 bytes per feature.
                per = {"f32": 4, "bf16": 2}[draft] * feat
                assert st.hidden_state_bytes % per == 0 and st.hidden_state_bytes >= per * len(p)


# --- the per-host core share --------------------------------------------------------------------

def test_cores_are_divided_among_the_services_on_a_host():
    alone = divide("target", 2, 1, 0)
    assert (alone.threads, alone.verify_threads) == (2, 2)
    # splitspec up's measured setting on 2 cores: target 2, 1 while several sessions verify; draft 1.
    t, d = divide("target", 2, 1, 1), divide("draft", 2, 1, 1)
    assert (t.threads, t.verify_threads, d.threads) == (2, 1, 1)
    t, d = divide("target", 16, 1, 1), divide("draft", 16, 1, 1)
    assert (t.threads, t.verify_threads, d.threads) == (16, 8, 8)
    assert divide("draft", 8, 0, 1).threads == 8                      # a draft alone takes the host
    assert divide("target", 2, 2, 0).threads == 1                     # two targets never oversubscribe
    # Explicit flags win.
    t = divide("target", 2, 1, 1, threads=2, verify_threads=2)
    assert (t.threads, t.verify_threads) == (2, 2)
    assert divide("draft", 2, 1, 1, threads=2).threads == 2


def test_services_on_a_host_see_each_other_and_forget_the_dead(tmp_path):
    target = HostShare("target", directory=tmp_path, cpus=frozenset({0, 1}), refresh_s=0).join()
    assert target.plan().threads == 2 and target.plan().drafts == 0
    draft = HostShare("draft", directory=tmp_path, cpus=frozenset({0, 1}), refresh_s=0).join()
    assert (target.plan().threads, target.plan().verify_threads, target.plan().drafts) == (2, 1, 1)
    assert draft.plan().threads == 1
    # A service pinned to other CPUs does not share ours.
    other = HostShare("draft", directory=tmp_path, cpus=frozenset({2, 3}), refresh_s=0).join()
    assert target.plan().drafts == 1
    other.leave()
    # An entry nobody holds (its process died) is stale: removed, not counted.
    stale = tmp_path / f"draft-{os.getpid() + 100000}-dead.json"
    stale.write_text(json.dumps({"role": "draft", "pid": 1, "cpus": [0, 1]}))
    assert target.plan().drafts == 1
    assert not stale.exists()
    draft.leave()
    assert target.plan().drafts == 0 and target.plan().verify_threads == 2
    target.leave()
    assert list(tmp_path.glob("*.json")) == []


def test_an_unwritable_registry_never_stops_a_service(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    share = HostShare("draft", directory=blocker / "sub", cpus=frozenset({0, 1}), refresh_s=0).join()
    assert share.plan().threads == 2          # counts only itself
    share.leave()
