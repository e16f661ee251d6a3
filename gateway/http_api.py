"""The OpenAI-compatible HTTP API of the gateway (Starlette; served by uvicorn in the gateway's
own event loop, gateway/http_server.py):

    POST /v1/completions        POST /v1/chat/completions    (stream and non-stream)
    GET  /v1/models             GET  /health

Every generation runs through the gateway's gRPC `Generate` handler in process
(gateway/inproc.py), so HTTP and gRPC clients get the same validation, limits, speculation,
failover and metrics. Sampling fields map to the gRPC request: temperature (OpenAI's default
1.0 when absent), top_p, top_k, max_tokens, stop, seed, plus vLLM's extensions stop_token_ids
and ignore_eos; speculation through the extension object `speculative` ({"method", "num_steps",
"topk", "num_draft_tokens", "draft_sampling"}, like SpeculativeParams). gRPC statuses become
OpenAI-style error bodies with the matching HTTP status (`http_status`)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from splitspec import logs
from splitspec.security import UNAUTHENTICATED_MESSAGE, ApiKeys
from splitspec.v1 import common_pb2, gateway_pb2

from . import inproc
from .chat import ChatTemplate, ChatTemplateError

# gRPC status -> (HTTP status, OpenAI error type).
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
SPECULATIVE_FIELDS = {"method": str, "num_steps": int, "topk": int, "num_draft_tokens": int, "draft_sampling": str}


def http_status(code: grpc.StatusCode) -> tuple[int, str]:
    return HTTP_STATUS.get(code, (500, "server_error"))


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, details: str) -> ApiError:
        status, kind = http_status(code)
        return cls(status, details or code.name, kind, code=code.name.lower())

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


# --- request body -> GenerateRequest ---------------------------------------------------------

def _number(body: dict, name: str, kind, *, minimum=None):
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok:
        raise bad(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}", name)
    if minimum is not None and value < minimum:
        raise bad(f"{name} must be >= {minimum}, got {value}", name)
    return kind(value)


def _unsupported(body: dict) -> None:
    """Refuse fields we cannot honour rather than silently ignoring them."""
    if body.get("n") not in (None, 1):
        raise bad("only n = 1 is supported", "n")
    if body.get("best_of") not in (None, 1):
        raise bad("only best_of = 1 is supported", "best_of")
    if body.get("echo"):
        raise bad("echo is not supported", "echo")
    if body.get("suffix"):
        raise bad("suffix is not supported", "suffix")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs"):
        raise bad("logprobs are not supported", "logprobs")
    if body.get("logit_bias"):
        raise bad("logit_bias is not supported", "logit_bias")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise bad(f"{name} is not supported (only 0)", name)
    if body.get("tools") or body.get("functions"):
        raise bad("tools / function calling are not supported", "tools")


def build_request(body: dict, prompt, request_id: str, *, max_tokens_field: str = "max_tokens") -> gateway_pb2.GenerateRequest:
    _unsupported(body)
    s = common_pb2.SamplingParams()
    temperature = _number(body, "temperature", float, minimum=0)
    s.temperature = 1.0 if temperature is None else temperature     # OpenAI's default
    top_p = _number(body, "top_p", float)
    if top_p is not None:
        s.top_p = top_p
    top_k = _number(body, "top_k", int)
    if top_k is not None:
        s.top_k = max(top_k, 0)                                    # vLLM: -1 = off
    seed = _number(body, "seed", int, minimum=0)
    if seed is not None:
        s.seed = seed
    max_tokens = _number(body, max_tokens_field, int)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens = _number(body, "max_tokens", int)
    if max_tokens is not None:
        s.max_new_tokens = max_tokens
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise bad("stop must be a string or a list of strings", "stop")
        s.stop.extend(stops)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
            raise bad("stop_token_ids must be a list of integers", "stop_token_ids")
        s.stop_token_ids.extend(ids)
    if body.get("ignore_eos") is not None:
        s.ignore_eos = bool(body["ignore_eos"])
    req = gateway_pb2.GenerateRequest(request_id=request_id, sampling=s, speculative=_speculative(body))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def _speculative(body: dict) -> common_pb2.SpeculativeParams:
    spec = body.get("speculative")
    out = common_pb2.SpeculativeParams()
    if spec is None:
        return out
    if not isinstance(spec, dict):
        raise bad("speculative must be an object: {method, num_steps, topk, num_draft_tokens, draft_sampling}",
                  "speculative")
    for name, value in spec.items():
        kind = SPECULATIVE_FIELDS.get(name)
        if kind is None:
            raise bad(f"speculative.{name} is not a field; expected one of {', '.join(SPECULATIVE_FIELDS)}",
                      f"speculative.{name}")
        if value is None:
            continue
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise bad(f"speculative.{name} must be an integer", f"speculative.{name}")
        if kind is str and not isinstance(value, str):
            raise bad(f"speculative.{name} must be a string", f"speculative.{name}")
        setattr(out, name, value)
    return out


def completion_prompt(body: dict):
    """A completions prompt: text or token ids, one per request."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]              # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad("one prompt per request: batched prompts are not supported", "prompt")
    raise bad("prompt must be a string or a non-empty list of token ids", "prompt")


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a role", f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):   # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            content = "".join(p.get("text", "") for p in content)
        if content is not None and not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string", f"messages[{i}].content")
        out.append({**m, "content": content or ""})
    return out


# --- responses ---------------------------------------------------------------------------------

def usage(complete: gateway_pb2.Complete) -> dict:
    u = complete.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def spec_stats(complete: gateway_pb2.Complete) -> dict:
    """The request's speculation stats (an extension field, like gRPC's SpeculativeStats)."""
    s = complete.stats
    return {"method": s.method, "verify_steps": s.verify_steps, "accept_length": round(s.accept_length, 4),
            "draft_tokens": s.draft_tokens, "accepted_per_position": list(s.accepted_per_position),
            "draft_fallbacks": s.draft_fallbacks, "target_failovers": s.target_failovers}


def sse(data) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"


class EventStream(StreamingResponse):
    """Server-sent events that always close their source: when the client disconnects (any
    ASGI spec version), the body iterator is closed at once, which cancels the generation and
    frees its backend sessions."""

    def __init__(self, content):
        super().__init__(content, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, gone):
                task.cancel()
            with contextlib.suppress(BaseException):
                await streaming
            with contextlib.suppress(BaseException):
                await self.body_iterator.aclose()


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIApi:
    def __init__(self, servicer, keys: ApiKeys):
        self.servicer = servicer
        self.keys = keys
        self._template: ChatTemplate | None = None

    # --- plumbing --------------------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        if self.keys and not self.keys.check(request.headers.get("authorization")):
            raise ApiError(401, UNAUTHENTICATED_MESSAGE, "authentication_error", code="invalid_api_key")

    def _info(self):
        info = self.servicer.backends.info
        if info is None or not self.servicer.server.serving:
            raise ApiError(503, "the gateway is not connected to a target yet", "service_unavailable_error")
        return info

    async def _body(self, request: Request) -> dict:
        try:
            body = json.loads(await request.body() or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad(f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise bad("the body must be a JSON object")
        info = self._info()
        model = body.get("model")
        if model not in (None, "", info.model_id):
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {info.model_id!r}",
                           "not_found_error", "model", "model_not_found")
        if not isinstance(body.get("stream", False), bool):
            raise bad("stream must be a boolean", "stream")
        return body

    def template(self) -> ChatTemplate:
        info = self._info()
        if self._template is None or self._template.model_id != info.model_id:
            self._template = ChatTemplate(info.tokenizer_config_json, info.model_id)
        return self._template

    async def handle(self, request: Request, endpoint) -> Response:
        try:
            self._auth(request)
            return await endpoint(request)
        except ApiError as exc:
            return exc.response()
        except ChatTemplateError as exc:
            return bad(str(exc), "messages").response()

    # --- endpoints -------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        ok = self.servicer.backends.limits is not None and self.servicer.server.serving
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    async def models(self, request: Request) -> Response:
        info = self._info()
        return JSONResponse({"object": "list", "data": [{
            "id": info.model_id, "object": "model", "created": 0, "owned_by": "splitspec",
            "max_model_len": info.max_context}]})

    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        rid = request.headers.get("x-request-id") or f"cmpl-{uuid.uuid4().hex}"
        req = build_request(body, completion_prompt(body), rid)
        return await self._respond(request, body, req, chat=False)

    async def chat(self, request: Request) -> Response:
        body = await self._body(request)
        rid = request.headers.get("x-request-id") or f"chatcmpl-{uuid.uuid4().hex}"
        messages = chat_messages(body)
        prompt = self.template().render(messages, add_generation_prompt=body.get("add_generation_prompt", True))
        req = build_request(body, prompt, rid, max_tokens_field="max_completion_tokens")
        return await self._respond(request, body, req, chat=True)

    # --- generation ------------------------------------------------------------------------
    async def _respond(self, request: Request, body: dict, req, *, chat: bool) -> Response:
        head = {"id": req.request_id, "created": int(time.time()), "model": self._info().model_id}
        stream = inproc.generate(self.servicer, req)
        if body.get("stream"):
            # Wait for the first message, so a refused request gets its HTTP status, not a 200
            # with an error event.
            try:
                first = await stream.__anext__()
            except inproc.LocalRpcError as exc:
                await stream.aclose()
                raise ApiError.from_grpc(exc.code, exc.details) from None
            except StopAsyncIteration:
                first = None
            opts = body.get("stream_options") or {}
            return EventStream(self._events(first, stream, head, chat, bool(opts.get("include_usage"))))
        collect = asyncio.ensure_future(self._collect(stream))
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():          # the client left: cancel the generation, free its sessions
                collect.cancel()
                with contextlib.suppress(BaseException):
                    await collect
                logs.get_logger(request_id=req.request_id).info("http_client_disconnected")
        if collect.cancelled():
            return Response(status_code=499)
        text, complete = collect.result()
        choice = {"index": 0, "finish_reason": FINISH.get(complete.finish_reason, complete.finish_reason),
                  "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                             "choices": [choice], "usage": usage(complete), "speculative_stats": spec_stats(complete)})

    @staticmethod
    async def _collect(stream) -> tuple[str, gateway_pb2.Complete]:
        text, complete = [], None
        async with contextlib.aclosing(stream):
            try:
                async for resp in stream:
                    if resp.HasField("chunk"):
                        text.append(resp.chunk.text)
                    else:
                        complete = resp.complete
            except inproc.LocalRpcError as exc:
                raise ApiError.from_grpc(exc.code, exc.details) from None
        return "".join(text), complete

    async def _events(self, first, stream, head: dict, chat: bool, include_usage: bool):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(delta_text: str | None, finish=None, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else \
                    ({} if delta_text is None else {"content": delta_text})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
            return {**head, "object": kind, "choices": [choice]}

        async with contextlib.aclosing(stream):
            try:
                if chat:
                    yield sse(event(None, role=True))
                async for resp in _chain(first, stream):
                    if resp.HasField("chunk"):
                        if resp.chunk.text:
                            yield sse(event(resp.chunk.text))
                        continue
                    complete = resp.complete
                    yield sse(event("" if not chat else None, FINISH.get(complete.finish_reason,
                                                                       complete.finish_reason)) |
                              {"speculative_stats": spec_stats(complete)})
                    if include_usage:
                        yield sse({**head, "object": kind, "choices": [], "usage": usage(complete)})
            except inproc.LocalRpcError as exc:
                # Headers are sent: the error travels as an event (as vLLM does), then [DONE].
                yield sse(ApiError.from_grpc(exc.code, exc.details).body())
            yield sse(b"[DONE]")


async def _chain(first, stream):
    if first is not None:
        yield first
    async for item in stream:
        yield item


def create_app(servicer, keys: ApiKeys) -> Starlette:
    api = OpenAIApi(servicer, keys)

    def route(path, endpoint, methods, auth=True):
        async def call(request: Request) -> Response:
            if not auth:
                return await endpoint(request)
            return await api.handle(request, endpoint)
        return Route(path, call, methods=methods)

    return Starlette(routes=[
        route("/health", api.health, ["GET"], auth=False),
        route("/v1/models", api.models, ["GET"]),
        route("/v1/completions", api.completions, ["POST"]),
        route("/v1/chat/completions", api.chat, ["POST"]),
    ])
