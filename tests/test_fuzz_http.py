"""Fuzzing the HTTP API from its own /openapi.json (issue 54, item 9): schemathesis generates
valid and invalid bodies for every operation and checks that none is answered with a 5xx and
that every answer matches the declared response schema. Bodies built to be costly (issue 63,
tests/adversarial_bodies.py) are fuzzed too, and sent by the megabyte while /health, gRPC health
and a completion must still answer. Afterwards the services are still SERVING and a greedy
request through the gateway (speculating) equals target-only.

The stack is real: the tiny target, the n-gram draft and a gateway with --http-port, as
separate processes. Examples per operation: SPLITSPEC_FUZZ_EXAMPLES (CI's default keeps the
file to about a minute on 2 cores; docs/reliability.md has the full run's command and result)."""
from __future__ import annotations

import asyncio
import collections
import http.client
import json
import os
import threading
import types
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import adversarial_bodies
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, response_schema_conformance
from service_helpers import collect, gateway_stub, running, running_gateway, tiny_target_dir

from gateway.http_api import create_app
from gateway.http_guard import MAX_BODY_BYTES, Guard, json_depth
from splitspec_tools.client import build_request
from splitspec_tools.ops.launch import free_port, health_status
from splitspec.security import ApiKeys

EXAMPLES = int(os.environ.get("SPLITSPEC_FUZZ_EXAMPLES", "25"))
SERVING = 1
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CAP = 8      # --max-new-tokens-cap: generated requests stay short, larger ones are refused (400)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    model = tiny_target_dir(256)
    port = free_port()
    with running("target", ["--model-path", str(model)], logs) as target, \
            running("draft", ["--method", "ngram", "--target-model-path", str(model)], logs) as draft, \
            running_gateway(target, logs, "--draft", draft.address, "--speculative-algorithm", "NGRAM",
                            "--http-port", str(port), "--max-new-tokens-cap", str(CAP),
                            "--chat-template", TEMPLATE) as gw:
        yield {"target": target, "draft": draft, "gateway": gw, "url": f"http://127.0.0.1:{port}"}


def api_schema():
    """The schema the gateway serves at /openapi.json, built here without a server so that each
    operation can be a test of its own (the running gateway serves the same dict: checked below)."""
    app = create_app(types.SimpleNamespace(), ApiKeys([]))
    return app.openapi()


SCHEMA = schemathesis.openapi.from_dict(api_schema())
# (path, method, mode): negative examples only where there is something to break (a body);
# "tame" ones are positive bodies cut down to what must be accepted (below).
MODES = ("positive", "negative", "tame")
OPERATIONS = [(path, method.upper(), mode) for path, ops in api_schema()["paths"].items() for method in ops
              for mode in MODES if method == "post" or mode == "positive"]
STATUSES: dict[str, collections.Counter] = {}      # "mode METHOD path" -> HTTP statuses seen

# The fields a tame body keeps: the sampling knobs whose every value in the schema's range must
# be served. Random positive bodies are nearly all refused by a rule the schema cannot state
# (max_tokens over the gateway's cap, a model name, a token outside the vocabulary); tame ones
# reach the target with random temperatures, penalties and seeds.
TAME = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "ignore_eos", "stream", "stream_options", "logprobs", "top_logprobs", "echo", "user", "cache_salt",
        "prompt", "messages")
VOCAB = 512


def in_vocab(p):
    """A token id (2.0 is one too) or a list of them, moved into the vocabulary."""
    if isinstance(p, (int, float)):
        return int(p) % VOCAB
    return [int(t) % VOCAB for t in p] if isinstance(p, list) else p


def tame(body: dict) -> dict:
    out = {k: v for k, v in body.items() if k in TAME}
    out["max_tokens"] = 1 + (body.get("max_tokens") or 0) % CAP
    out["n"] = 1 + (body.get("n") or 1) % 2
    if "prompt" in out:
        prompt = out["prompt"]
        if isinstance(prompt, list):      # token ids into the vocabulary, a batch of 2 at most
            prompt = [in_vocab(p) for p in prompt[:2]]
        out["prompt"] = prompt
    if "messages" in out:
        out["messages"] = [{"role": m["role"], "content": m["content"] if isinstance(m.get("content"), str) else "hi"}
                           for m in out["messages"][:3]]
    if not isinstance(out.get("logprobs"), bool) and "messages" in out:
        out.pop("logprobs", None)
    if out.get("top_logprobs") is not None and out.get("logprobs") is not True:
        out.pop("top_logprobs")
    if "messages" in out:
        out.pop("echo", None)
    return out


@pytest.mark.parametrize("path, method, mode", OPERATIONS, ids=[f"{m} {p} {g}" for p, m, g in OPERATIONS])
def test_no_server_errors(stack, path, method, mode):
    """Positive examples follow the schema, negative ones break it somewhere, tame ones are
    positive ones the gateway must serve; none gets a 5xx or an answer off its declared schema."""
    operation = SCHEMA[path][method]
    seen = STATUSES.setdefault(f"{mode} {method} {path}", collections.Counter())
    strategy = operation.as_strategy(GenerationMode.NEGATIVE if mode == "negative" else GenerationMode.POSITIVE)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def fuzz(case):
        if mode == "tame":
            case.body = tame(case.body)
        response = case.call_and_validate(base_url=stack["url"], timeout=60,
                                          checks=[not_a_server_error, response_schema_conformance])
        seen[response.status_code] += 1
        if mode == "tame":
            assert response.status_code == 200, (case.body, response.text[:500])
    fuzz()
    print(f"{mode} {method} {path}: {dict(sorted(seen.items()))}")


def test_the_served_schema_is_the_fuzzed_one(stack):
    with urllib.request.urlopen(f"{stack['url']}/openapi.json", timeout=10) as resp:
        assert json.loads(resp.read()) == json.loads(json.dumps(api_schema()))


BIG = 2 ** 31
# The malformed requests (seven answered 500, one was accepted) and their neighbours:
# each a 4xx naming the field.
MALFORMED = [
    ({"top_k": BIG}, 400, "top_k"),
    ({"max_tokens": BIG}, 400, "max_tokens"),
    ({"stop_token_ids": [BIG]}, 400, "stop_token_ids[0]"),
    ({"prompt": [1, BIG]}, 400, "prompt"),
    ({"prompt": ["a", [1, BIG]]}, 400, "prompt[1]"),
    ({"stream_options": ["include_usage"]}, 400, "stream_options"),
    ({"echo": True, "prompt": [5, -1]}, 400, "prompt"),
    ({"echo": True, "prompt": [5, 100000]}, 400, "prompt"),
    ({"temperature": float("inf")}, 400, "temperature"),
    ({"temperature": float("nan")}, 400, "temperature"),
    ({"repetition_penalty": 1e39}, 400, "repetition_penalty"),
    ({"seed": 2 ** 64}, 400, "seed"),
    ({"speculative": {"num_steps": BIG}}, 400, "speculative.num_steps"),
    ({"speculative": {"widths": 3}}, 400, "speculative.widths"),
    ({"logit_bias": {"5": float("inf")}}, 400, "logit_bias"),
    ({"n": 2.5}, 400, "n"),
    ({"stream": "yes"}, 400, "stream"),
    ({"prompt": ""}, 400, "prompt"),
    ({"cache_salt": 7}, 400, "cache_salt"),
]


def post(url: str, raw: bytes, headers: dict | None = None, path: str = "/v1/completions") -> tuple[int, dict]:
    req = urllib.request.Request(f"{url}{path}", data=raw,
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize("extra, status, param", MALFORMED, ids=[p for _, _, p in MALFORMED])
def test_malformed_fields_get_a_4xx_naming_them(stack, extra, status, param):
    # json.dumps writes Infinity and NaN, as a client that sends them does.
    got, body = post(stack["url"], json.dumps({"prompt": "hi", "max_tokens": 2, **extra}).encode())
    assert got == status and body["error"]["param"] == param, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]


def test_malformed_bodies(stack):
    url = stack["url"]
    status, body = post(url, b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and "nests deeper" in body["error"]["message"]
    # Refused on its Content-Length, before a byte of it is read.
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("content-type", "application/json")
    conn.putheader("content-length", str(MAX_BODY_BYTES + 1))
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "request_too_large"
    conn.close()
    for raw in (b"{not json", b"null", b"[]", b"\xff\xfe"):
        status, body = post(url, raw)
        assert status == 400 and body["error"]["message"], (raw, body)
    # a form content type (curl -d without -H) is read as the JSON it holds
    status, body = post(url, json.dumps({"prompt": "hi", "max_tokens": 2}).encode(),
                        {"content-type": "application/x-www-form-urlencoded"})
    assert status == 200, body


def test_a_request_past_its_deadline_is_a_504(stack):
    status, body = post(stack["url"], json.dumps({"prompt": "hi", "max_tokens": 2}).encode(),
                        {"x-request-timeout": "0.000001"})
    assert status == 504 and body["error"]["type"] == "timeout_error", body
    status, body = post(stack["url"], json.dumps({"prompt": "hi", "max_tokens": 2}).encode(),
                        {"x-request-timeout": "soon"})
    assert status == 400 and body["error"]["param"] == "x-request-timeout"
    status, _ = post(stack["url"], json.dumps({"prompt": "hi", "max_tokens": 2}).encode(), {"x-request-timeout": "60"})
    assert status == 200


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_adversarial_bodies_leave_health_and_generation_answering(stack):
    """Senders post megabyte bodies built to be costly (adversarial_bodies.LARGE), each over and
    over, while this test probes /health and the gateway's gRPC health and runs a short
    completion: all answer, every adversarial body gets a 4xx, nothing a 5xx. The probes start
    once every sender has had an answer, so they run while the senders send their next ones."""
    url, stop, lock = stack["url"], threading.Event(), threading.Lock()
    statuses: dict[str, collections.Counter] = {name: collections.Counter() for name in adversarial_bodies.LARGE}
    answered = threading.Barrier(len(adversarial_bodies.LARGE) + 1)

    def send(name: str, raw: bytes) -> None:
        first = True
        while first or not stop.is_set():
            status, body = post(url, raw)
            with lock:
                statuses[name][status] += 1
            assert 400 <= status < 500 and body["error"]["message"], (name, status, body)
            if first:
                answered.wait(120)
                first = False

    with ThreadPoolExecutor(len(adversarial_bodies.LARGE)) as pool:
        senders = [pool.submit(send, name, raw) for name, raw in adversarial_bodies.LARGE.items()]
        try:
            answered.wait(120)
            health = [get(f"{url}/health") for _ in range(3)]
            serving = health_status(stack["gateway"].address)
            status, got = post(url, json.dumps({"prompt": "def f(x):", "max_tokens": 4, "temperature": 0}).encode())
        finally:
            stop.set()
        for s in senders:
            s.result(120)
    assert health == [200] * 3 and serving == SERVING
    assert status == 200 and got["usage"]["completion_tokens"] == 4, got
    print({name: dict(c) for name, c in statuses.items()})


def test_fuzzed_adversarial_bodies_get_no_5xx(stack):
    """The in-process fuzz's shapes (tests/test_http_adversarial.py) against the real services."""
    seen = collections.Counter()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(adversarial_bodies.BODIES)
    def fuzz(case):
        path, body = case
        status, answer = post(stack["url"], body if isinstance(body, bytes) else json.dumps(body).encode(),
                              path=path)
        seen[status] += 1
        assert status < 500, answer
    fuzz()
    print(f"adversarial: {dict(sorted(seen.items()))}")
    assert seen[400]


def test_still_serving_and_greedy_equals_target_only(stack):
    """The canary, run after the fuzz (pytest keeps file order)."""
    for name in ("target", "draft", "gateway"):
        assert health_status(stack[name].address) == SERVING, name
    prompt = "def fibonacci(n):"
    req = urllib.request.Request(f"{stack['url']}/v1/completions", headers={"content-type": "application/json"},
                                 data=json.dumps({"prompt": prompt, "max_tokens": CAP, "temperature": 0}).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        got = json.loads(resp.read())
    assert got["speculative_stats"]["method"] == "ngram"
    ch, stub = gateway_stub(stack["gateway"].address)
    with ch:
        _, texts, _ = collect(stub.Generate(build_request(prompt, max_new_tokens=CAP, temperature=0, method="none"),
                                            timeout=60))
    assert got["choices"][0]["text"] == "".join(texts)



def test_json_depth_counts_brackets_outside_strings():
    assert json_depth(b'{"a": "[[[[{{", "b": [[1]]}', 64) == 3
    assert json_depth(b'{"a": "\\"[[[[", "b": [{"c": []}]}', 64) == 4
    assert json_depth(b"[" * 100_000 + b"]" * 100_000, 64) == 65       # stops once past the limit


def test_a_body_without_a_length_is_cut_at_the_limit():
    """A chunked body is counted as it arrives: 413 once past the limit, the route never runs."""
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def main():
        chunks = [{"type": "http.request", "body": b"x" * 6, "more_body": True} for _ in range(3)]
        sent = []

        async def receive():
            return chunks.pop(0)

        async def send(message):
            sent.append(message)
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
        await Guard(app, ApiKeys([]), max_bytes=10)(scope, receive, send)
        return sent[0]["status"]
    assert asyncio.run(main()) == 413 and reached == []
