"""Fuzzing the HTTP API from its own /openapi.json (issue 54, item 9): schemathesis generates
valid and invalid bodies for every operation and checks that none is answered with a 5xx and
that every answer matches the declared response schema. Afterwards the services are still
SERVING and a greedy request through the gateway (speculating) equals target-only.

The stack is real: the tiny target, the n-gram draft and a gateway with --http-port, as
separate processes. Examples per operation: SPLITSPEC_FUZZ_EXAMPLES (CI's default keeps the
file to about a minute on 2 cores; docs/reliability.md has the full run's command and result)."""
from __future__ import annotations

import collections
import json
import os
import types
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, response_schema_conformance
from service_helpers import collect, gateway_stub, running, running_gateway, tiny_target_dir

from gateway.http_api import create_app
from splitspec.client import build_request
from splitspec.ops.launch import free_port, health_status
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
    if isinstance(p, int):
        return p % VOCAB
    return [t % VOCAB for t in p] if isinstance(p, list) else p


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
