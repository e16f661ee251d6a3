"""Failover keeps a grammar's state (issue 54, item 2): a session re-opened with the tokens an
answer already generated (TargetOpen.generated_tokens, what the gateway sends after losing a
replica) masks the rest with the grammar's state after them, so a json_schema answer whose
replica is SIGKILLed mid-answer is still valid and equal to target-only greedy.

Two tiny target replicas and a gateway over both, target-only (method none)."""
from __future__ import annotations

import contextlib
import json
import signal

import grpc
import pytest

from service_helpers import collect, gateway_stub, running, running_gateway, target_info, target_stub, tiny_target_dir
from splitspec_tools.client import build_request
from splitspec.v1 import common_pb2, target_pb2

pytest.importorskip("xgrammar")

CONTEXT = 2048
# Long enough to kill a replica while the answer is still being written.
SCHEMA = {"type": "object", "properties": {"note": {"type": "string", "minLength": 400, "maxLength": 480}},
          "required": ["note"], "additionalProperties": False}
PROMPT = [5, 6, 7, 8, 9, 10]
EOS = 0


def constraint() -> common_pb2.Constraint:
    return common_pb2.Constraint(json_schema=json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    args = ["--model-path", str(tiny_target_dir(CONTEXT)), "--idle-timeout-s", "60"]
    with contextlib.ExitStack() as stack:
        targets = [stack.enter_context(running("target", args, logs)) for _ in range(2)]
        gw = stack.enter_context(running_gateway(",".join(t.address for t in targets), logs,
                                                 "--reconnect-max-s", "0.5"))
        yield targets, gw


def session(address: str, prompt: list[int], n: int, generated_tokens: int = 0) -> list[int]:
    """Open (greedy, under SCHEMA) and decode n tokens on one target; the tokens it produced."""
    ch, stub = target_stub(address)
    sampling = common_pb2.SamplingParams(constraint=constraint())
    msgs = [target_pb2.TargetRequest(open=target_pb2.TargetOpen(
        prompt_token_ids=prompt, max_new_tokens=n + 1, sampling=sampling, generated_tokens=generated_tokens))]
    if n:
        msgs.append(target_pb2.TargetRequest(decode=target_pb2.TargetDecode(n=n)))
    msgs.append(target_pb2.TargetRequest(close=target_pb2.TargetClose()))
    out = []
    with ch:
        for r in stub.Session(iter(msgs), timeout=120):
            if r.HasField("opened"):
                out.append(r.opened.first_token_id)
            elif r.HasField("token"):
                out += [r.token.token_id, *r.token.more_token_ids]
    return out


def answer(tokens: list[int]) -> list[int]:
    """Tokens up to and including the first eos (where the grammar ended the answer)."""
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens


def test_a_reopened_session_continues_the_grammar_where_the_answer_was(replicas):
    """The answer from one replica; then the other replica, opened on the prompt plus its first
    k tokens with generated_tokens = k, continues it token for token. A matcher that started
    from the grammar's beginning would mask the rest as a new JSON object."""
    targets, _ = replicas
    full = answer(session(targets[0].address, PROMPT, 700))
    assert full[-1] == EOS and len(full) > 40
    for k in (1, 10, len(full) // 2):
        rest = session(targets[1].address, PROMPT + full[:k], len(full) - k - 1, generated_tokens=k)
        assert rest == full[k:], k


def test_a_reopen_whose_tokens_the_grammar_refuses_is_invalid_argument(replicas):
    targets, _ = replicas
    with pytest.raises(grpc.RpcError) as err:
        session(targets[0].address, PROMPT + [ord("x")], 1, generated_tokens=1)    # JSON cannot start with x
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "open.generated_tokens" in err.value.details()


def test_a_json_schema_answer_survives_its_replica_killed(replicas, tmp_path):
    """SIGKILL the replica writing a json_schema answer: the gateway resumes it on the other
    replica, and the answer is valid and equal to target-only greedy (the same request run
    without a failure). Last in the module: a replica stays dead."""
    targets, gw = replicas
    req = build_request(PROMPT, max_new_tokens=700)
    req.sampling.constraint.CopyFrom(constraint())
    ch, stub = gateway_stub(gw.address)
    with ch:
        want, texts, complete = collect(stub.Generate(req, timeout=120))
        assert complete.finish_reason == "eos" and complete.stats.target_failovers == 0
        call = stub.Generate(req, timeout=120)
        first = next(call).chunk
        serving = [t for t in targets if target_info(t.address).active_sessions]
        assert len(serving) == 1
        serving[0].proc.send_signal(signal.SIGKILL)
        serving[0].proc.wait()
        ids, more, complete = collect(call)
    assert complete.stats.target_failovers == 1
    assert list(first.token_ids) + ids == want
    # xgrammar's JSON strings admit raw control bytes (a random model writes them), which only a
    # lenient parser takes; the shape is the schema's.
    got = json.loads(first.text + "".join(more), strict=False)
    assert list(got) == ["note"] and isinstance(got["note"], str) and first.text + "".join(more) == "".join(texts)
