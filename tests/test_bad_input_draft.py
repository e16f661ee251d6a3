"""Bad input at the draft service: every case gets its status code and a message naming the
field; the service stays SERVING, keeps no session open, and a session running meanwhile on
another stream is unaffected. Also: the max-running-requests and message-size limits, idle reaping,
and garbage bytes on the wire."""
from __future__ import annotations

import time

import grpc
import pytest
import torch

from draft_service.architectures import load_draft
from draft_service.dflash import new_draft, save_draft
from service_helpers import SessionStream, garbage_error, running_draft, tiny_target_dir
from splitspec_tools.ops.launch import health_status
from splitspec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from splitspec.wire import tensor_to_pb
from splitspec.models.loader import load_model

INVALID = grpc.StatusCode.INVALID_ARGUMENT
IDLE_S = 2


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target = tiny_target_dir(1024)
    d = new_draft(load_model(target).cfg, num_layers=1, block_size=8, mask_token_id=2, seed=3)
    path = tmp_path_factory.mktemp("draft") / "tiny-dflash"
    save_draft(d, path)
    return target, path


@pytest.fixture(scope="module")
def feat(dirs):
    return load_draft(dirs[1], dirs[0]).cfg.target_feature_size


@pytest.fixture(scope="module")
def draft(dirs, tmp_path_factory):
    with running_draft(dirs[0], tmp_path_factory.mktemp("logs"), "--max-running-requests", "3", "--max-message-mb", "1",
                       "--idle-timeout-s", str(IDLE_S), draft_dir=dirs[1]) as svc:
        yield svc


def Stream(address) -> SessionStream:
    """A Draft.Session stream driven one message at a time."""
    return SessionStream(address, draft_pb2_grpc.DraftStub, draft_pb2.DraftRequest)


def hidden(n, f, dtype=torch.float32):
    return tensor_to_pb(torch.randn(n, f), dtype)


def open_msg(feat, prompt=(5, 6, 7), h=None, **kw):
    h = hidden(len(prompt), feat) if h is None else h
    return draft_pb2.DraftOpen(session_id="d", prompt_token_ids=list(prompt), prompt_hidden=h, **kw)


def spec(**kw):
    return common_pb2.SpeculativeParams(**kw)


def cases(feat):
    ok = dict(open=open_msg(feat))
    return [
        ("propose before open", [dict(propose=draft_pb2.DraftPropose(base_len=4, new_token_ids=[1]))],
         grpc.StatusCode.FAILED_PRECONDITION, "before open"),
        ("second open", [ok, ok], grpc.StatusCode.FAILED_PRECONDITION, "second Open"),
        ("kind not set", [dict()], INVALID, "DraftRequest.kind"),
        ("empty prompt", [dict(open=open_msg(feat, prompt=(), h=hidden(0, feat)))], INVALID, "open.prompt_token_ids"),
        ("prompt token out of vocab", [dict(open=open_msg(feat, prompt=(5, 600)))], INVALID,
         "open.prompt_token_ids[1]"),
        ("negative prompt token", [dict(open=open_msg(feat, prompt=(-1,)))], INVALID, "open.prompt_token_ids[0]"),
        ("prompt over context", [dict(open=open_msg(feat, prompt=[5] * 5000, h=common_pb2.Tensor()))], INVALID,
         "max context"),
        ("hidden of the wrong width", [dict(open=open_msg(feat, h=hidden(3, feat + 1)))], INVALID,
         "open.prompt_hidden.shape"),
        ("hidden of the wrong length", [dict(open=open_msg(feat, h=hidden(2, feat)))], INVALID,
         "open.prompt_hidden.shape"),
        ("hidden dtype unset", [dict(open=open_msg(feat, h=common_pb2.Tensor(data=b"\0" * 12, shape=[3, 1])))],
         INVALID, "open.prompt_hidden.dtype"),
        ("hidden dtype unknown", [dict(open=open_msg(feat, h=common_pb2.Tensor(data=b"", dtype=9, shape=[3, feat])))],
         INVALID, "dtype"),
        ("hidden bytes do not match shape", [dict(open=open_msg(feat, h=common_pb2.Tensor(
            data=b"\0" * 8, dtype=common_pb2.DTYPE_F32, shape=[3, feat])))], INVALID, "open.prompt_hidden"),
        ("unknown method", [dict(open=open_msg(feat, speculative=spec(method="medusa")))], INVALID,
         "open.speculative.method"),
        ("topk above the draft's candidates", [dict(open=open_msg(feat, speculative=spec(topk=17)))], INVALID,
         "open.speculative.topk = 17"),
        ("tree past the verify cap", [dict(open=open_msg(feat, speculative=spec(topk=2, num_draft_tokens=70)))],
         INVALID, "open.speculative.num_draft_tokens = 70"),
        ("tree deeper than the block", [dict(open=open_msg(feat, speculative=spec(topk=2, num_steps=9)))],
         INVALID, "open.speculative.num_steps = 9"),
        ("bad draft sampling", [dict(open=open_msg(feat, speculative=spec(draft_sampling="beam")))], INVALID,
         "open.speculative.draft_sampling"),
        ("width over block size", [dict(open=open_msg(feat, speculative=spec(num_draft_tokens=9)))], INVALID,
         "open.speculative.num_draft_tokens"),
        ("bad sampling params", [dict(open=open_msg(feat, sampling=common_pb2.SamplingParams(top_p=1.5)))],
         INVALID, "top_p"),
        ("tokenizer of another target", [dict(open=open_msg(feat, target_tokenizer_hash="not-this-one"))],
         grpc.StatusCode.FAILED_PRECONDITION, "open.target_tokenizer_hash"),
        ("stale base_len", [ok, dict(propose=draft_pb2.DraftPropose(base_len=9, new_token_ids=[1]))],
         grpc.StatusCode.ABORTED, "base_len"),
        ("propose token out of vocab", [ok, dict(propose=draft_pb2.DraftPropose(base_len=4, new_token_ids=[700]))],
         INVALID, "propose.new_token_ids[0]"),
        ("propose hidden misshapen", [ok, dict(propose=draft_pb2.DraftPropose(
            base_len=4, new_token_ids=[1], new_hidden=hidden(1, feat - 1)))], INVALID, "propose.new_hidden"),
        ("tail to a full-attention draft", [dict(open=open_msg(feat, h=hidden(2, feat), prompt_hidden_start=1))],
         INVALID, "open.prompt_hidden_start = 1, but this draft attends to the whole context"),
        ("negative prompt_hidden_start", [dict(open=open_msg(feat, prompt_hidden_start=-1))], INVALID,
         "open.prompt_hidden_start = -1"),
        ("oversized message", [dict(open=open_msg(feat, prompt=[5] * 300, h=hidden(300, 1024)))],
         grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
    ]


def _names():
    return [c[0] for c in cases(1)]


@pytest.mark.parametrize("index", range(len(_names())), ids=_names())
def test_draft_refuses_bad_messages(draft, feat, index):
    _, messages, code, text = cases(feat)[index]
    # A healthy session on another stream runs across the bad one, unaffected.
    good = Stream(draft.address).send(open=open_msg(feat))
    s = Stream(draft.address)
    try:
        assert good.recv().HasField("opened")
        err = s.refused(messages)
        assert err.code() == code, err.details()
        assert text in (err.details() or ""), err.details()
        good.send(propose=draft_pb2.DraftPropose(base_len=4, new_token_ids=[9]))
        assert len(good.recv().proposal.tree.token_ids) == 7
    finally:
        s.close()
        good.close()


WINDOW = 16       # the windowed draft's sliding window: a Propose reads the last 15 positions


@pytest.fixture(scope="module")
def windowed_draft(dirs, tmp_path_factory):
    import dataclasses
    target = dirs[0]
    d = new_draft(load_model(target).cfg, num_layers=1, block_size=8, mask_token_id=2, seed=3)
    d.cfg = dataclasses.replace(d.cfg, layer_types=("sliding_attention",), sliding_window=WINDOW, is_causal=False)
    path = tmp_path_factory.mktemp("windowed") / "tiny-dflash-windowed"
    save_draft(d, path)
    with running_draft(target, tmp_path_factory.mktemp("logs"), draft_dir=path) as svc:
        yield svc


def test_windowed_draft_takes_the_tail_and_refuses_too_little(windowed_draft, draft, feat):
    """A windowed draft reports context_window = W - 1 (a full-attention one 0) and opens with
    only the prompt's last W - 1 rows; rows that do not match prompt_hidden_start, or a start that
    leaves fewer than the window, are refused naming the fields and what to send."""
    cw = WINDOW - 1
    assert _info(windowed_draft.address).context_window == cw
    assert _info(draft.address).context_window == 0
    prompt = [5 + i % 40 for i in range(40)]
    start = len(prompt) - cw
    s = Stream(windowed_draft.address).send(open=open_msg(feat, prompt=prompt, h=hidden(cw, feat),
                                                          prompt_hidden_start=start))
    try:
        assert s.recv().HasField("opened")
        s.send(propose=draft_pb2.DraftPropose(base_len=len(prompt) + 1, new_token_ids=[9]))
        assert len(s.recv().proposal.tree.token_ids) == 7
        s.send(propose=draft_pb2.DraftPropose(base_len=len(prompt) + 3, new_token_ids=[9, 10],
                                              new_hidden=hidden(2, feat)))
        assert len(s.recv().proposal.tree.token_ids) == 7
    finally:
        s.close()
    short = Stream(windowed_draft.address).send(open=open_msg(feat, prompt=prompt[:5], h=hidden(5, feat)))
    try:
        assert short.recv().HasField("opened")      # shorter than the window: the whole prompt, start 0
    finally:
        short.close()
    bad = [
        (hidden(cw + 1, feat), start, ["open.prompt_hidden.shape is [16,", f"open.prompt_hidden_start = {start}",
                                       f"needs {cw} rows", f"prompt_hidden_start = {start - 1}"]),
        (hidden(cw - 1, feat), start + 1, [f"open.prompt_hidden_start = {start + 1} leaves {cw - 1}",
                                           f"reads the last {cw}", f"prompt_hidden_start <= {start}"]),
        (hidden(0, feat), len(prompt) + 1, [f"open.prompt_hidden_start = {len(prompt) + 1} is outside"]),
    ]
    for h, st, texts in bad:
        s = Stream(windowed_draft.address).send(open=open_msg(feat, prompt=prompt, h=h, prompt_hidden_start=st))
        try:
            with pytest.raises(grpc.RpcError) as err:
                s.recv()
            assert err.value.code() == INVALID, err.value.details()
            for t in texts:
                assert t in err.value.details(), err.value.details()
        finally:
            s.close()
    assert health_status(windowed_draft.address) == 1


def _info(address):
    with grpc.insecure_channel(address) as ch:
        return draft_pb2_grpc.DraftStub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=10)


def test_garbage_bytes_on_the_wire(draft):
    err = garbage_error(draft.address, "/splitspec.v1.Draft/Session", streaming=True)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid splitspec.v1.DraftRequest" in err.details()
    assert health_status(draft.address) == 1


def test_draft_max_sessions(draft, feat):
    streams = [Stream(draft.address).send(open=open_msg(feat)) for _ in range(3)]
    try:
        for s in streams:
            assert s.recv().HasField("opened")
        extra = Stream(draft.address).send(open=open_msg(feat))
        streams.append(extra)
        with pytest.raises(grpc.RpcError) as err:
            extra.recv()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-running-requests" in err.value.details()
    finally:
        for s in streams:
            s.close()


def test_idle_draft_session_is_reaped(draft, feat):
    s = Stream(draft.address).send(open=open_msg(feat))
    try:
        assert s.recv().HasField("opened")
        with pytest.raises(grpc.RpcError) as err:
            s.recv()
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "--idle-timeout-s" in err.value.details()
    finally:
        s.close()


def test_draft_stays_healthy_with_no_session_left(draft, feat):
    assert health_status(draft.address) == 1                        # SERVING
    deadline = time.monotonic() + 5
    while _info(draft.address).active_sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _info(draft.address).active_sessions == 0
    s = Stream(draft.address).send(open=open_msg(feat))
    try:
        assert s.recv().HasField("opened")
    finally:
        s.close()
