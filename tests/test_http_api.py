"""The gateway's OpenAI-compatible HTTP front (issue 18), driven by the official `openai`
client: completions and chat, streaming and not, equal the gRPC output of the same greedy
request; gRPC errors map to HTTP statuses; a client that goes away cancels the backend
sessions."""
from __future__ import annotations

import json
import shutil
import socket
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from service_helpers import (
    ROOT,
    collect,
    gateway_stub,
    running,
    running_gateway,
    target_info,
    tiny_target_dir,
)

from gateway.chat import ChatTemplate, ChatTemplateError
from gateway.openai_errors import HTTP_STATUS, http_status
from splitspec_tools.client import build_request
from splitspec_tools.ops.launch import free_port

KEY = "sk-test-0123456789"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The tiny target with a chat template in its tokenizer_config.json."""
    path = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(tiny_target_dir(1024), path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}))
    return path


@pytest.fixture(scope="module")
def stack(chat_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    http_port = free_port()
    with running("target", ["--model-path", str(chat_model)], logs) as target, \
            running("draft", ["--method", "ngram", "--target-model-path", str(chat_model)], logs) as draft, \
            running_gateway(target, logs, "--draft", draft.address, "--speculative-algorithm", "NGRAM",
                            "--http-port", str(http_port), "--api-key", KEY, "--max-new-tokens-cap", "1000") as gw:
        yield target, gw, http_port


@pytest.fixture(scope="module")
def client(stack):
    _, _, port = stack
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client):
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


def grpc_text(stack, prompt, n: int, **kw) -> tuple[str, object]:
    _, gw, _ = stack
    ch, stub = gateway_stub(gw.address)
    with ch:
        _, texts, complete = collect(stub.Generate(build_request(prompt, max_new_tokens=n, temperature=0, **kw),
                                                   metadata=[("authorization", f"Bearer {KEY}")], timeout=120))
    return "".join(texts), complete


PROMPT = "def fibonacci(n):"


def test_completions_equal_grpc_greedy(stack, client, model_id):
    want, complete = grpc_text(stack, PROMPT, 40, ignore_eos=True)
    got = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=40, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == want and want
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 40 and got.usage.prompt_tokens == complete.usage.prompt_tokens
    assert got.usage.total_tokens == got.usage.prompt_tokens + 40
    extra = got.model_extra["speculative_stats"]
    assert extra["method"] == "ngram"

    # Token ids as the prompt, and speculation switched off through the extension field.
    ids = [5, 6, 7, 8, 9, 5, 6, 7]
    want, _ = grpc_text(stack, ids, 20, ignore_eos=True)
    got = client.completions.create(model=model_id, prompt=ids, max_tokens=20, temperature=0,
                                    extra_body={"ignore_eos": True, "speculative": {"method": "none"}})
    assert got.choices[0].text == want and got.model_extra["speculative_stats"]["method"] == "none"


def test_streamed_completions_equal_grpc_greedy(stack, client, model_id):
    want, _ = grpc_text(stack, PROMPT, 40, ignore_eos=True, stop=["\n\n\n"])
    events = list(client.completions.create(model=model_id, prompt=PROMPT, max_tokens=40, temperature=0,
                                            stop=["\n\n\n"], stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(e.choices[0].text for e in events if e.choices)
    assert text == want
    finishes = [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0] in ("stop", "length")
    assert events[-1].choices == [] and events[-1].usage.completion_tokens > 0


def test_chat_applies_the_template_and_equals_grpc(stack, client, model_id):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    prompt = ChatTemplate(json.dumps({"chat_template": TEMPLATE}), "m").render(messages)
    assert prompt == "<|system|>You write Python.\n<|user|>Sort a list.\n<|assistant|>"
    want, _ = grpc_text(stack, prompt, 32, ignore_eos=True)
    got = client.chat.completions.create(model=model_id, messages=messages, max_tokens=32, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want and want
    assert got.object == "chat.completion" and got.usage.completion_tokens == 32

    chunks = list(client.chat.completions.create(model=model_id, messages=messages, max_completion_tokens=32,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sampling_fields_reach_the_request(stack, client, model_id):
    """Seeded sampling through HTTP equals the same seeded gRPC request."""
    _, gw, _ = stack
    ch, stub = gateway_stub(gw.address)
    with ch:
        _, texts, _ = collect(stub.Generate(build_request(PROMPT, max_new_tokens=24, temperature=0.9, top_p=0.9,
                                                          top_k=50, seed=7, ignore_eos=True),
                                            metadata=[("authorization", f"Bearer {KEY}")], timeout=120))
    got = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0.9, top_p=0.9,
                                    seed=7, extra_body={"top_k": 50, "ignore_eos": True})
    assert got.choices[0].text == "".join(texts)


def test_errors_map_to_http_statuses(stack, client, model_id):
    with pytest.raises(openai.BadRequestError) as err:          # INVALID_ARGUMENT from the gateway
        client.completions.create(model=model_id, prompt=PROMPT, max_tokens=4, top_p=1.5)
    assert "top_p" in err.value.message and err.value.body["code"] == "invalid_argument"
    with pytest.raises(openai.BadRequestError):                 # refused before the first chunk of a stream
        client.completions.create(model=model_id, prompt=PROMPT, max_tokens=5000, stream=True)
    with pytest.raises(openai.BadRequestError) as err:          # OUT_OF_RANGE: prompt over the context
        client.completions.create(model=model_id, prompt=list(range(3, 300)) * 4, max_tokens=4)
    assert err.value.body["code"] == "out_of_range"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_id, prompt=PROMPT, n=0)
    assert err.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT)
    _, _, port = stack
    bad_key = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.completions.create(model=model_id, prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as resp:   # no key needed
        assert resp.status == 200
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=b"{not json",
                                 headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400 and "error" in json.loads(err.value.read())


# The HTTP mapping google/rpc/code.proto gives each canonical code, copied from that file (not
# from HTTP_STATUS), so a code left to http_status's default or mapped by a typo shows up.
CODE_PROTO_HTTP = {"OK": 200, "CANCELLED": 499, "UNKNOWN": 500, "INVALID_ARGUMENT": 400, "DEADLINE_EXCEEDED": 504,
                   "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "PERMISSION_DENIED": 403, "UNAUTHENTICATED": 401,
                   "RESOURCE_EXHAUSTED": 429, "FAILED_PRECONDITION": 400, "ABORTED": 409, "OUT_OF_RANGE": 400,
                   "UNIMPLEMENTED": 501, "INTERNAL": 500, "UNAVAILABLE": 503, "DATA_LOSS": 500}


def test_every_grpc_code_has_an_http_status():
    # Every code grpcio knows, so one added in a later release must be placed here on purpose.
    assert {c.name for c in grpc.StatusCode} == set(CODE_PROTO_HTTP)
    for code in grpc.StatusCode:
        status, kind = http_status(code)
        if code is grpc.StatusCode.OK:
            # Only failures reach http_status; an "error" that says OK is the server's own bug,
            # so a 500, never a 2xx that would pass a failed request off as a success.
            assert status == 500, status
            continue
        assert status == CODE_PROTO_HTTP[code.name], code
        assert (kind == "invalid_request_error") == (status == 400), (code, kind)
    assert all(400 <= s < 600 for s, _ in HTTP_STATUS.values())


def _raw_request(port: int, path: str, body: dict, request_id: str) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {KEY}\r\nX-Request-Id: {request_id}\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _wait_sessions(address: str, want: int, timeout_s: float = 20.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (n := target_info(address).active_sessions) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return n


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_client_disconnect_cancels_the_backend_sessions(stack, model_id, stream):
    target, gw, port = stack
    rid = f"disconnect-{'stream' if stream else 'plain'}"
    sock = _raw_request(port, "/v1/completions", {"model": model_id, "prompt": PROMPT, "max_tokens": 1000,
                                                  "temperature": 0, "ignore_eos": True, "stream": stream}, rid)
    try:
        if stream:                                    # the first event arrived: it is generating
            sock.settimeout(60)
            got = b""
            while b"data: " not in got:
                chunk = sock.recv(65536)
                assert chunk, got
                got += chunk
        assert _wait_sessions(target.address, 1) == 1
    finally:
        sock.close()
    assert _wait_sessions(target.address, 0) == 0
    deadline = time.monotonic() + 10
    while True:
        events = [json.loads(line) for line in gw.log_path.read_text().splitlines() if rid in line]
        if any(e["event"] == "request_cancelled" for e in events):
            break
        assert time.monotonic() < deadline, events
        time.sleep(0.05)
    assert not any(e["event"] == "request_finished" for e in events)


def test_chat_without_a_template_is_refused_clearly(tmp_path):
    bundled = ROOT / "models" / "splitspec-code-target" / "tokenizer_config.json"
    if bundled.is_file():
        assert not ChatTemplate(bundled.read_text(), "splitspec-code-target").available
    port = free_port()
    with running("target", ["--model-path", str(tiny_target_dir(1024))], tmp_path) as target, \
            running_gateway(target, tmp_path, "--http-port", str(port)):
        plain = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        model = plain.models.list().data[0].id
        with pytest.raises(openai.BadRequestError) as err:
            plain.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
        assert "has no chat template" in err.value.message
        # Without --api-key the gateway needs none.
        assert plain.completions.create(model=model, prompt="x", max_tokens=3, temperature=0).usage.completion_tokens


def test_template_errors_are_clear():
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate("{}", "m").render([{"role": "user", "content": "x"}])
    strict = ChatTemplate(json.dumps({"chat_template": "{{ raise_exception('roles must alternate') }}"}), "m")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        strict.render([{"role": "user", "content": "x"}])
