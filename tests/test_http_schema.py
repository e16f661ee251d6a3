"""The HTTP API's declared bodies and the checks around them, without services (issue 54 item 7):
schema errors name the field as a client wrote it, the API key is checked before anything
about the body, prompts are tokenized off the event loop, and a request's deadline is the
flag's or the client's shorter one."""
from __future__ import annotations

import asyncio
import json
import threading
import types

import pytest
from pydantic import ValidationError
from service_helpers import asgi_post

from gateway.http_api import OpenAIApi, create_app
from gateway.openai_errors import ApiError, field_name, from_validation
from gateway.openai_protocol import ChatCompletionRequest, CompletionRequest
from splitspec.security import ApiKeys


@pytest.mark.parametrize("loc, want", [
    (("body", "messages", 2, "content", "str"), "messages[2].content"),
    (("body", "messages", 0, "content", "list[TextPart]", 1, "type"), "messages[0].content[1].type"),
    (("body", "speculative", "num_steps"), "speculative.num_steps"),
    (("body", "logit_bias", "5"), "logit_bias"),
    (("body", "stop_token_ids", 3), "stop_token_ids[3]"),
    (("body", "top_k", "function-before[_whole(), constrained-int]"), "top_k"),
    (("body",), "body"),
])
def test_field_names_read_as_a_client_wrote_them(loc, want):
    assert field_name(loc) == want


def refusal(model, body: dict) -> ApiError:
    with pytest.raises(ValidationError) as err:
        model.model_validate(body)
    return from_validation(err.value.errors())


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "x", "top_k": 2 ** 31}, "top_k", "less than or equal to 2147483647"),
    ({"prompt": "x", "temperature": float("inf")}, "temperature", "finite"),
    ({"prompt": "x", "cache_salt": 7}, "cache_salt", "cache_salt must be a string"),
    ({"prompt": "x", "echo": "yes"}, "echo", "echo must be a boolean"),
    ({"prompt": ["ok", 5]}, "prompt[1]", "prompt[1] must be a non-empty string"),
    ({"prompt": [1, -2]}, "prompt", "token ids in [0, 2147483647]"),
    ({"prompt": "x", "speculative": {"widths": 2}}, "speculative.widths", "not a field of speculative"),
    ({}, "prompt", "prompt is required"),
])
def test_completion_refusals_name_the_field(body, param, words):
    err = refusal(CompletionRequest, body)
    assert (err.status, err.param) == (400, param) and words in err.message, err.message


def test_chat_refusals_name_the_field():
    err = refusal(ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]})
    assert err.param == "messages[0].content" and "must be" in err.message
    err = refusal(ChatCompletionRequest, {"messages": []})
    assert err.param == "messages"
    assert refusal(ChatCompletionRequest, {"messages": [{"content": "x"}]}).param == "messages[0].role"


def test_whole_floats_are_integers_and_nothing_else_is():
    assert CompletionRequest.model_validate({"prompt": [1.0, 2], "max_tokens": 4.0}).prompt == [1, 2]
    for bad in (2.5, "4", True):
        assert refusal(CompletionRequest, {"prompt": "x", "max_tokens": bad}).param == "max_tokens"


def servicer():
    info = types.SimpleNamespace(model_id="m", vocab_size=512, max_context=64, tokenizer_config_json="")
    calls = []

    class Tok:
        def encode_batch(self, texts, add_special_tokens=True):
            calls.append(threading.get_ident())
            return [types.SimpleNamespace(ids=[1, 2, 3]) for _ in texts]
    backends = types.SimpleNamespace(info=info, limits=None, tokenizer=Tok())
    return types.SimpleNamespace(backends=backends, server=types.SimpleNamespace(serving=True)), calls


def test_text_prompts_are_tokenized_off_the_event_loop():
    svc, calls = servicer()
    api = OpenAIApi(svc)

    async def main():
        return await api.tokenize(["a long prompt", [7, 8]]), threading.get_ident()
    ids, loop_thread = asyncio.run(main())
    assert ids == [[1, 2, 3], [7, 8]] and calls and loop_thread not in calls


def test_the_api_key_comes_before_the_body():
    svc, _ = servicer()
    app = create_app(svc, ApiKeys(("sk-1",)))
    status, raw = asyncio.run(asgi_post(app, "/v1/completions", "[" * 1000))
    assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error"


def test_the_deadline_is_the_shorter_of_flag_and_header():
    svc, _ = servicer()
    request = lambda headers: types.SimpleNamespace(headers=headers)     # noqa: E731
    assert OpenAIApi(svc, timeout_s=600).deadline(request({})) == 600
    assert OpenAIApi(svc, timeout_s=600).deadline(request({"x-request-timeout": "2.5"})) == 2.5
    assert OpenAIApi(svc, timeout_s=1).deadline(request({"x-request-timeout": "30"})) == 1
    assert OpenAIApi(svc, timeout_s=0).deadline(request({})) is None
    for bad in ("-1", "0", "inf", "nan", "soon"):
        with pytest.raises(ApiError) as err:
            OpenAIApi(svc).deadline(request({"x-request-timeout": bad}))
        assert err.value.param == "x-request-timeout"
