"""The OpenAI-compatible HTTP API of the gateway (Starlette; served by uvicorn in the gateway's
own event loop, gateway/http_server.py):

    POST /v1/completions        POST /v1/chat/completions    (stream and non-stream)
    GET  /v1/models             GET  /health

Every generation runs through the gateway's gRPC `Generate` handler in process
(gateway/inproc.py), so HTTP and gRPC clients get the same validation, limits, speculation,
failover and metrics. One HTTP request is one Generate call per choice: a list of prompts and
`n` fan out into prompts x n calls run concurrently (choice index = prompt index * n + i, as
OpenAI numbers them), each through the batched services like any other request.

Sampling fields map to the gRPC request: temperature (OpenAI's default 1.0 when absent), top_p,
top_k, max_tokens, stop, seed, presence_penalty, frequency_penalty, logit_bias, logprobs /
top_logprobs, echo, plus vLLM's extensions repetition_penalty, min_tokens, stop_token_ids,
ignore_eos, chat_template_kwargs, cache_salt (the prefix-cache namespace: a string of at most 256
characters; every choice of the request gets it, so n > 1 choices share the prompt's cached blocks);
speculation through the extension object `speculative`
({"method", "num_steps", "topk", "num_draft_tokens", "draft_sampling"}, like SpeculativeParams).
`usage.prompt_tokens_details.cached_tokens` says how many prompt tokens came from the target's
prefix cache (see `usage`).
Structured outputs (gateway/structured.py): response_format (json_object, json_schema),
vLLM's structured_outputs and its legacy guided_* fields, and on chat tools / tool_choice /
parallel_tool_calls become one GenerateRequest.sampling.constraint per choice, which the target
enforces exactly under speculation; the tools go to the chat template, and the answer's
`<tool_call>` blocks come back as OpenAI tool_calls (message.tool_calls, or deltas when
streaming, finish_reason "tool_calls"). A constraint the target cannot compile is a 400 whose
`param` is the field it came from.
Fields this server does not know are ignored and logged (`http_unknown_fields`), as vLLM does;
known fields it cannot honour (best_of > 1, suffix, functions) are refused with a 400 naming them.
gRPC statuses become OpenAI-style error bodies with the matching HTTP status (`http_status`)."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from splitspec import logs
from splitspec.security import UNAUTHENTICATED_MESSAGE, ApiKeys
from splitspec.v1 import common_pb2, gateway_pb2

from . import inproc, structured
from .chat import ChatTemplate, ChatTemplateError
from .request import MAX_CACHE_SALT

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
# A refusal of the request itself: the same parameters go to every choice, so the whole
# request gets the 400 (as vLLM answers a batch); other failures end one choice only.
CLIENT_ERRORS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                           grpc.StatusCode.FAILED_PRECONDITION})
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
SPECULATIVE_FIELDS = {"method": str, "num_steps": int, "topk": int, "num_draft_tokens": int, "draft_sampling": str}
MAX_LOGPROBS = 20          # vLLM's default --max-logprobs
MAX_N = 128                # choices per prompt
MAX_CHOICES = 256          # prompts x n in one request
# gRPC SamplingParams field -> the HTTP field a client set.
HTTP_NAMES = {"max_new_tokens": "max_tokens", "prompt_logprobs": "logprobs"}
MIN_LOGPROB = -9999.0      # what -inf becomes in JSON (vLLM's choice): JSON has no infinity
# A refusal of the request's grammar, as the gateway or the target (through the gateway, whose
# message names the backend) words it.
CONSTRAINT_ERROR = re.compile(r"^(?:(?:target|draft): )?(?:open\.)?sampling\.constraint\b")

# Constrained decoding (gateway/structured.py): response_format, vLLM's structured_outputs and its
# legacy guided_* aliases (honoured, never ignored); tools on chat (named, so refused on completions).
COMMON_FIELDS = {"model", "stream", "stream_options", "temperature", "top_p", "top_k", "seed", "max_tokens", "stop",
                 "stop_token_ids", "ignore_eos", "speculative", "n", "best_of", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "logprobs", "user",
                 "tools", "functions", "tool_choice", "function_call", "response_format", "cache_salt",
                 "structured_outputs", *structured.GUIDED}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt",
                               "chat_template_kwargs", "parallel_tool_calls"}


def http_status(code: grpc.StatusCode) -> tuple[int, str]:
    return HTTP_STATUS.get(code, (500, "server_error"))


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, details: str, param: str | None = None) -> ApiError:
        status, kind = http_status(code)
        named = re.match(r"sampling\.(\w+)", details or "")
        if param is None and named and status == 400:      # the gateway names the field it refused
            param = HTTP_NAMES.get(named.group(1), named.group(1))
        return cls(status, details or code.name, kind, param=param, code=code.name.lower())

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_argument")


# --- request body -> GenerateRequest ---------------------------------------------------------

def _number(body: dict, name: str, kind, *, minimum=None, maximum=None, above=None):
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok:
        raise bad(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}", name)
    if minimum is not None and value < minimum:
        raise bad(f"{name} must be >= {minimum}, got {value}", name)
    if maximum is not None and value > maximum:
        raise bad(f"{name} must be <= {maximum}, got {value}", name)
    if above is not None and not value > above:
        raise bad(f"{name} must be > {above}, got {value}", name)
    return kind(value)


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"{name} must be a boolean, got {value!r}", name)
    return value


def _unsupported(body: dict) -> None:
    """Refuse known fields we cannot honour rather than silently ignoring them."""
    best_of = body.get("best_of")
    if best_of not in (None, 1) and best_of != body.get("n", 1):
        # best_of ranks extra samples by cumulative log-prob and returns the best n: a choice the
        # target's exact distribution does not make; vLLM's V1 engine dropped it too.
        raise bad("best_of is not supported (only best_of = n); use n to get several samples", "best_of")
    if body.get("suffix"):
        raise bad("suffix is not supported", "suffix")


@dataclass
class Wanted:
    """What the response needs beyond the text (not part of the gRPC request)."""
    n: int = 1
    logprobs: int | None = None          # alternatives per token; None: no logprobs in the answer
    echo: bool = False
    structured: structured.Structured = field(default_factory=structured.Structured)


def parse_options(body: dict, *, chat: bool) -> Wanted:
    _unsupported(body)
    _cache_salt(body)       # refused before the prompt is rendered or tokenized
    w = Wanted(n=_number(body, "n", int, minimum=1, maximum=MAX_N) or 1)
    try:
        w.structured = structured.from_request(body, chat=chat)
    except structured.StructuredError as exc:
        raise bad(exc.message, exc.param) from None
    if w.structured.constraint is not None and _flag(body, "ignore_eos"):
        raise bad(f"ignore_eos cannot be combined with {w.structured.source}: a constrained answer ends (eos) "
                  f"where its grammar is complete", "ignore_eos")
    if chat:
        if body.get("echo"):
            raise bad("echo is a /v1/completions field", "echo")
        if _flag(body, "logprobs"):
            w.logprobs = _number(body, "top_logprobs", int, minimum=0, maximum=MAX_LOGPROBS) or 0
        elif body.get("top_logprobs"):
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    else:
        if body.get("logprobs") is not None and body.get("logprobs") is not False:
            w.logprobs = _number(body, "logprobs", int, minimum=0, maximum=MAX_LOGPROBS)
        w.echo = _flag(body, "echo")
    return w


def build_request(body: dict, prompt, request_id: str, *, max_tokens_field: str = "max_tokens",
                  wanted: Wanted | None = None, vocab_size: int | None = None) -> gateway_pb2.GenerateRequest:
    wanted = wanted or Wanted()
    s = common_pb2.SamplingParams()
    temperature = _number(body, "temperature", float, minimum=0)
    s.temperature = 1.0 if temperature is None else temperature     # OpenAI's default
    top_p = _number(body, "top_p", float, minimum=0, maximum=1)
    if top_p is not None:
        s.top_p = top_p
    top_k = _number(body, "top_k", int, minimum=-1)
    if top_k is not None:
        s.top_k = max(top_k, 0)                                    # vLLM: -1 = off
    seed = _number(body, "seed", int, minimum=0, maximum=2 ** 64 - 1)
    if seed is not None:
        s.seed = seed
    max_tokens = _number(body, max_tokens_field, int, minimum=0)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens = _number(body, "max_tokens", int, minimum=0)
    if max_tokens == 0 and not wanted.echo:
        raise bad(f"{max_tokens_field} must be >= 1 (0 only with echo, to score the prompt)", max_tokens_field)
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
        s.ignore_eos = _flag(body, "ignore_eos")
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name, float, minimum=-2, maximum=2)
        if value is not None:
            setattr(s, name, value)
    repetition = _number(body, "repetition_penalty", float, above=0)
    if repetition is not None:
        s.repetition_penalty = repetition
    min_tokens = _number(body, "min_tokens", int, minimum=0)
    if min_tokens:
        if max_tokens is not None and min_tokens > max_tokens:
            raise bad(f"min_tokens ({min_tokens}) must be <= {max_tokens_field} ({max_tokens})", "min_tokens")
        s.min_tokens = min_tokens
    _logit_bias(body.get("logit_bias"), s, vocab_size)
    if wanted.logprobs is not None:
        s.logprobs = wanted.logprobs
    if wanted.echo and (wanted.logprobs is not None or max_tokens == 0):
        s.prompt_logprobs = wanted.logprobs or 0
    if wanted.structured.constraint is not None:
        s.constraint.CopyFrom(wanted.structured.constraint)
    req = gateway_pb2.GenerateRequest(request_id=request_id, sampling=s, speculative=_speculative(body),
                                      cache_salt=_cache_salt(body))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def _cache_salt(body: dict) -> str:
    """vLLM's cache_salt: a string of at most MAX_CACHE_SALT characters, the same limit as
    GenerateRequest.cache_salt's (empty or absent: the shared prefix cache)."""
    salt = body.get("cache_salt")
    if salt is None:
        return ""
    if not isinstance(salt, str):
        raise bad(f"cache_salt must be a string (e.g. a tenant id or a hash of one; \"\" or absent: the shared "
                  f"prefix cache), got {type(salt).__name__} {salt!r}"[:300], "cache_salt")
    if len(salt) > MAX_CACHE_SALT:
        raise bad(f"cache_salt has {len(salt)} characters; at most {MAX_CACHE_SALT} are accepted (a tenant or "
                  f"user id, or a hash of one)", "cache_salt")
    return salt


def _logit_bias(bias, s: common_pb2.SamplingParams, vocab_size: int | None) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise bad("logit_bias must be an object mapping token ids to biases in [-100, 100]", "logit_bias")
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad(f"logit_bias: key {key!r} is not a token id", "logit_bias") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise bad(f"logit_bias: token id {token} is outside the vocabulary [0, {vocab_size})", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
                or not -100 <= value <= 100:
            raise bad(f"logit_bias[{key}] must be a number in [-100, 100], got {value!r}", "logit_bias")
        s.logit_bias[token] = float(value)


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


def _token_list(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def completion_prompts(body: dict) -> list:
    """A completions prompt: text, token ids, or a list of either (a batch)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _token_list(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        for i, p in enumerate(prompt):
            if not (isinstance(p, str) or _token_list(p)):
                raise bad(f"prompt[{i}] must be a string or a non-empty list of token ids", f"prompt[{i}]")
        return list(prompt)
    raise bad("prompt must be a string, a non-empty list of token ids, or a list of those", "prompt")


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
        m = {**m, "content": content or ""}
        if isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = [_template_call(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _template_call(call):
    """An assistant message's tool call as chat templates read it (as vLLM passes it): the
    arguments JSON string parsed into an object, at `function.arguments`."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    args = call["function"].get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            return call
        if isinstance(parsed, dict):
            return {**call, "function": {**call["function"], "arguments": parsed}}
    return call


def choice_seed(seed: int, i: int) -> int:
    """The seed of choice i of a seeded request: the request's own for the first (so n = 1 is
    unchanged and a prompt samples the same alone or in a batch), then a hash of (seed, i), which
    unlike seed + i never collides with another request's seed."""
    if i == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1      # 63 bits: every generator takes it


# --- token strings for log-probs -----------------------------------------------------------------

def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE spells each byte as one printable character: the printable Latin-1 bytes as
    themselves, the others shifted past 255 in order. Inverting that recovers a token's bytes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in keep]
    table = {chr(b): b for b in keep}
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


class TokenText:
    """Token id -> (text, bytes) for log-probs, cached per id."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.bytes_level = "ByteLevel" in type(tokenizer.decoder).__name__ or "ByteLevel" in str(tokenizer.decoder)
        self.alphabet = _byte_alphabet()
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token_id)
        if hit is None:
            piece = self.tok.id_to_token(token_id) or ""
            if self.bytes_level and all(c in self.alphabet for c in piece):
                raw = bytes(self.alphabet[c] for c in piece)
            else:
                raw = self.tok.decode([token_id], skip_special_tokens=False).encode()
            hit = self.cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return hit


def _lp(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB


# --- one choice --------------------------------------------------------------------------------

@dataclass
class Choice:
    index: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)           # common_pb2.TokenLogprob per token
    prompt_logprobs: list = field(default_factory=list)
    complete: gateway_pb2.Complete | None = None
    error: ApiError | None = None

    def add(self, resp: gateway_pb2.GenerateResponse) -> None:
        if resp.HasField("chunk"):
            c = resp.chunk
            self.text.append(c.text)
            self.token_ids.extend(c.token_ids)
            self.logprobs.extend(c.logprobs)
            self.prompt_logprobs.extend(c.prompt_logprobs)
        else:
            self.complete = resp.complete


def usage(choices: list[Choice], prompts: int) -> dict:
    """OpenAI counts each prompt once however many choices it has, and every choice's tokens.
    prompt_tokens_details.cached_tokens follows: per prompt, once, the fewest cached tokens among
    its choices (so at most its prompt_tokens). With n > 1 the choices run concurrently and the
    later ones may reuse the blocks the first one just computed; the minimum reports what the
    cache held for the prompt, not the request's reuse of itself."""
    prompt_tokens, completion = 0, 0
    cached: dict[int, int] = {}
    for c in choices:
        if c.complete is None:
            continue
        u = c.complete.usage
        if c.prompt_index not in cached:
            prompt_tokens += u.prompt_tokens
            cached[c.prompt_index] = u.cached_tokens
        else:
            cached[c.prompt_index] = min(cached[c.prompt_index], u.cached_tokens)
        completion += u.completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


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


@dataclass
class Job:
    """One HTTP request's choices and what the answer must carry."""
    requests: list[gateway_pb2.GenerateRequest]
    choices: list[Choice]
    prompts: int
    wanted: Wanted
    chat: bool
    echo_text: list[str]          # per prompt, with echo
    head: dict = field(default_factory=dict)


class OpenAIApi:
    def __init__(self, servicer, keys: ApiKeys, chat_template: str | None = None):
        self.servicer = servicer
        self.keys = keys
        self.chat_template = chat_template      # --chat-template: wins over the model's own
        self._template: ChatTemplate | None = None
        self._token_text: TokenText | None = None

    # --- plumbing --------------------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        if self.keys and not self.keys.check(request.headers.get("authorization")):
            raise ApiError(401, UNAUTHENTICATED_MESSAGE, "authentication_error", code="invalid_api_key")

    def _info(self):
        info = self.servicer.backends.info
        if info is None or not self.servicer.server.serving:
            raise ApiError(503, "the gateway is not connected to a target yet", "service_unavailable_error")
        return info

    async def _body(self, request: Request, known: set[str]) -> dict:
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
        unknown = sorted(set(body) - known)
        if unknown:     # ignored, as vLLM does; the log says so
            logs.get_logger().info("http_unknown_fields", fields=unknown, path=request.url.path)
        return body

    def template(self) -> ChatTemplate:
        info = self._info()
        if self._template is None or self._template.model_id != info.model_id:
            config = info.tokenizer_config_json
            if self.chat_template is not None:
                try:
                    cfg = json.loads(config) if config else {}
                except json.JSONDecodeError:
                    cfg = {}
                config = json.dumps({**cfg, "chat_template": self.chat_template})
            self._template = ChatTemplate(config, info.model_id)
        return self._template

    def token_text(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self.servicer.backends.tokenizer)
        return self._token_text

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
        body = await self._body(request, COMPLETION_FIELDS)
        rid = request.headers.get("x-request-id") or f"cmpl-{uuid.uuid4().hex}"
        wanted = parse_options(body, chat=False)
        prompts = completion_prompts(body)
        echo = []
        if wanted.echo:
            tok = self.servicer.backends.tokenizer
            # The prompt as the gateway would tokenize it, so the echoed tokens are the scored ones.
            prompts = [tok.encode(p, add_special_tokens=True).ids if isinstance(p, str) else p for p in prompts]
            echo = [tok.decode(p, skip_special_tokens=False) for p in prompts]
        job = self._job(body, prompts, rid, wanted, chat=False, max_tokens_field="max_tokens")
        job.echo_text = echo
        return await self._respond(request, body, job)

    async def chat(self, request: Request) -> Response:
        body = await self._body(request, CHAT_FIELDS)
        rid = request.headers.get("x-request-id") or f"chatcmpl-{uuid.uuid4().hex}"
        wanted = parse_options(body, chat=True)
        messages = chat_messages(body)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise bad("chat_template_kwargs must be an object", "chat_template_kwargs")
        reserved = sorted(set(kwargs) & {"messages", "add_generation_prompt", "tools"})
        if reserved:
            raise bad(f"chat_template_kwargs cannot set {', '.join(reserved)}: send them as request fields",
                      "chat_template_kwargs")
        add_generation_prompt = body.get("add_generation_prompt", True)
        prompt = self.template().render(messages, add_generation_prompt=add_generation_prompt,
                                        tools=wanted.structured.tools, **kwargs)
        job = self._job(body, [prompt], rid, wanted, chat=True, max_tokens_field="max_completion_tokens")
        return await self._respond(request, body, job)

    def _job(self, body: dict, prompts: list, rid: str, wanted: Wanted, *, chat: bool,
             max_tokens_field: str) -> Job:
        total = len(prompts) * wanted.n
        if total > MAX_CHOICES:
            raise bad(f"{len(prompts)} prompts x n = {wanted.n} is {total} choices; at most {MAX_CHOICES} "
                      f"per request", "n")
        vocab = self._info().vocab_size
        requests, choices = [], []
        for p, prompt in enumerate(prompts):
            base = build_request(body, prompt, rid, max_tokens_field=max_tokens_field, wanted=wanted,
                                 vocab_size=vocab)
            for i in range(wanted.n):
                req = gateway_pb2.GenerateRequest()
                req.CopyFrom(base)
                index = p * wanted.n + i
                if total > 1:
                    req.request_id = f"{rid}-{index}"
                if req.sampling.HasField("seed"):
                    req.sampling.seed = choice_seed(base.sampling.seed, i)
                requests.append(req)
                choices.append(Choice(index, p))
        head = {"id": rid, "created": int(time.time()), "model": self._info().model_id}
        return Job(requests, choices, len(prompts), wanted, chat, [], head)

    # --- generation ------------------------------------------------------------------------
    async def _respond(self, request: Request, body: dict, job: Job) -> Response:
        streams = [inproc.generate(self.servicer, r) for r in job.requests]
        log = logs.get_logger(request_id=job.head["id"])
        if body.get("stream"):
            # Wait for every choice's first message, so a refused request gets its HTTP status,
            # not a 200 with an error event.
            firsts = await asyncio.gather(*(self._first(s) for s in streams), return_exceptions=True)
            try:
                self._raise_refusal(job, firsts)
            except BaseException:
                for s in streams:
                    await s.aclose()
                raise
            opts = body.get("stream_options") or {}
            return EventStream(self._events(job, streams, firsts, bool(opts.get("include_usage"))))
        tasks = [asyncio.ensure_future(self._collect(job, i, s)) for i, s in enumerate(streams)]
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending | {gone}, return_when=asyncio.FIRST_COMPLETED)
                if gone in done:
                    break
                pending.discard(gone)
                refused = [c.error for c in job.choices if c.error is not None and c.error.status == 400]
                if refused:
                    raise refused[0]
        finally:
            gone.cancel()
            left = [t for t in tasks if not t.done()]
            for t in left:       # the client left or the request was refused: free every session
                t.cancel()
            for t in left:
                with contextlib.suppress(BaseException):
                    await t
        if any(not t.done() or t.cancelled() for t in tasks) or (gone.done() and not gone.cancelled()):
            log.info("http_client_disconnected")
            return Response(status_code=499)
        failed = [c for c in job.choices if c.error is not None]
        if len(failed) == len(job.choices):
            raise failed[0].error
        for c in failed:
            log.warning("http_choice_failed", index=c.index, status=c.error.status, message=c.error.message)
        return JSONResponse(self._final(job))

    async def _first(self, stream):
        try:
            return await stream.__anext__()
        except StopAsyncIteration:
            return None

    def _raise_refusal(self, job: Job, firsts: list) -> None:
        errors = [(i, f) for i, f in enumerate(firsts) if isinstance(f, BaseException)]
        for i, exc in errors:
            if not isinstance(exc, inproc.LocalRpcError):
                raise exc
            if exc.code in CLIENT_ERRORS or len(errors) == len(firsts):
                raise self._error(job, i, exc)

    def _error(self, job: Job, i: int, exc: inproc.LocalRpcError) -> ApiError:
        param = None
        if exc.code == grpc.StatusCode.OUT_OF_RANGE:
            param = f"prompt[{job.choices[i].prompt_index}]" if job.prompts > 1 else "prompt"
        elif exc.code == grpc.StatusCode.INVALID_ARGUMENT and CONSTRAINT_ERROR.match(exc.details or ""):
            # The target (or the gateway) refused the grammar: name the field it was built from.
            param = job.wanted.structured.source
        return ApiError.from_grpc(exc.code, exc.details, param)

    async def _collect(self, job: Job, i: int, stream) -> None:
        async with contextlib.aclosing(stream):
            try:
                async for resp in stream:
                    job.choices[i].add(resp)
            except inproc.LocalRpcError as exc:
                job.choices[i].error = self._error(job, i, exc)

    def _final(self, job: Job) -> dict:
        out = []
        for c in job.choices:
            if c.error is not None:
                out.append({"index": c.index, "finish_reason": "error", "logprobs": None,
                            **({"message": {"role": "assistant", "content": ""}} if job.chat else {"text": ""}),
                            "error": c.error.body()["error"]})
                continue
            text = "".join(c.text)
            finish = FINISH.get(c.complete.finish_reason, c.complete.finish_reason)
            choice = {"index": c.index, "finish_reason": finish, "logprobs": None}
            if job.chat:
                choice["message"] = {"role": "assistant", "content": text}
                if job.wanted.structured.parse_tools:
                    content, calls = structured.parse_tool_calls(text, job.wanted.structured.names)
                    if calls:
                        choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                        if finish == "stop":
                            choice["finish_reason"] = "tool_calls"
                if job.wanted.logprobs is not None:
                    choice["logprobs"] = {"content": self._chat_logprobs(c.logprobs, job.wanted.logprobs),
                                          "refusal": None}
            else:
                echo = job.echo_text[c.prompt_index] if job.wanted.echo else ""
                choice["text"] = echo + text
                if job.wanted.logprobs is not None:
                    lps = self._completion_logprobs(job, c, c.logprobs, 0, with_prompt=True)
                    choice["logprobs"] = lps
            out.append(choice)
        done = next(c.complete for c in job.choices if c.complete is not None)
        return {**job.head, "object": "chat.completion" if job.chat else "text_completion", "choices": out,
                "usage": usage(job.choices, job.prompts), "speculative_stats": spec_stats(done)}

    # --- log-probs in OpenAI's shapes --------------------------------------------------------
    def _chat_logprobs(self, lps, top_n: int) -> list[dict]:
        text = self.token_text()
        out = []
        for lp in lps:
            s, b = text(lp.token_id)
            out.append({"token": s, "logprob": _lp(lp.logprob), "bytes": b, "top_logprobs": [
                {"token": text(t)[0], "logprob": _lp(v), "bytes": text(t)[1]}
                for t, v in list(zip(lp.top_token_ids, lp.top_logprobs))[:top_n]]})
        return out

    def _completion_logprobs(self, job: Job, c: Choice, lps, offset: int, *, with_prompt: bool) -> dict:
        """The legacy completions shape. With echo the prompt's tokens come first (the first has
        no log-prob: nothing predicts it); each top_logprobs entry holds the top-N and the chosen token."""
        text = self.token_text()
        tokens, values, tops, offsets = [], [], [], []
        entries = []
        if with_prompt and job.wanted.echo:
            ids = job.requests[c.index].token_ids.ids
            if len(ids):
                entries.append((ids[0], None))
            entries += [(lp.token_id, lp) for lp in c.prompt_logprobs]
        entries += [(lp.token_id, lp) for lp in lps]
        for token_id, lp in entries:
            s = text(token_id)[0]
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            if lp is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(_lp(lp.logprob))
            top = {text(t)[0]: _lp(v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
            top.setdefault(s, _lp(lp.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    # --- streaming ---------------------------------------------------------------------------
    async def _events(self, job: Job, streams, firsts, include_usage: bool):
        kind = "chat.completion.chunk" if job.chat else "text_completion"
        head = job.head
        queue: asyncio.Queue = asyncio.Queue()
        end = object()

        async def pump(i: int, first, stream):
            try:
                async with contextlib.aclosing(stream):
                    if isinstance(first, BaseException):
                        raise first
                    if first is not None:
                        await queue.put((i, first))
                    async for resp in stream:
                        await queue.put((i, resp))
            except inproc.LocalRpcError as exc:
                await queue.put((i, self._error(job, i, exc)))
            finally:
                await queue.put((i, end))

        def event(choice: dict) -> dict:
            return {**head, "object": kind, "choices": [choice]}

        offsets = [0] * len(job.choices)
        # Tool calls: each choice's text goes through a parser; calls come out as deltas.
        tools = job.wanted.structured
        parsers = [structured.ToolCallParser(tools.names) if job.chat and tools.parse_tools else None
                   for _ in job.choices]
        ncalls = [0] * len(job.choices)

        def tool_deltas(i: int, c: Choice, content: str, calls: list[dict], lps) -> list[dict]:
            out = []
            if content or lps is not None:
                out.append({"index": c.index, "delta": {"content": content}, "finish_reason": None, "logprobs": lps})
            for call in calls:
                out.append({"index": c.index, "delta": {"tool_calls": [{"index": ncalls[i], **call}]},
                            "finish_reason": None, "logprobs": None})
                ncalls[i] += 1
            return out

        tasks = [asyncio.ensure_future(pump(i, f, s)) for i, (f, s) in enumerate(zip(firsts, streams))]
        try:
            if job.chat:
                for c in job.choices:
                    yield sse(event({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                     "finish_reason": None, "logprobs": None}))
            running = len(tasks)
            echoed: set[int] = set()
            while running:
                i, item = await queue.get()
                c = job.choices[i]
                if item is end:
                    running -= 1
                    continue
                if isinstance(item, ApiError):
                    c.error = item
                    yield sse({**event({"index": c.index, "finish_reason": "error", "logprobs": None,
                                        **({"delta": {}} if job.chat else {"text": ""})}),
                               **item.body()})
                    continue
                c.add(item)
                if item.HasField("chunk"):
                    chunk = item.chunk
                    text = chunk.text
                    prompt_part = not job.chat and job.wanted.echo and i not in echoed
                    if prompt_part:
                        echoed.add(i)
                        text = job.echo_text[c.prompt_index] + text
                    if not text and not chunk.token_ids and not prompt_part:
                        continue
                    lps = None
                    if job.wanted.logprobs is not None:
                        if job.chat:
                            lps = {"content": self._chat_logprobs(chunk.logprobs, job.wanted.logprobs)}
                        else:
                            lps = self._completion_logprobs(job, c, chunk.logprobs, offsets[i], with_prompt=prompt_part)
                            if lps["text_offset"]:
                                last = lps["text_offset"][-1] + len(lps["tokens"][-1])
                                offsets[i] = last
                    if parsers[i] is not None:
                        for choice in tool_deltas(i, c, *parsers[i].feed(text), lps):
                            yield sse(event(choice))
                        continue
                    if job.chat:
                        choice = {"index": c.index, "delta": {"content": text}, "finish_reason": None, "logprobs": lps}
                    else:
                        choice = {"index": c.index, "text": text, "finish_reason": None, "logprobs": lps}
                    yield sse(event(choice))
                    continue
                complete = item.complete
                finish = FINISH.get(complete.finish_reason, complete.finish_reason)
                if parsers[i] is not None:
                    for choice in tool_deltas(i, c, parsers[i].finish(), [], None):
                        yield sse(event(choice))
                    if ncalls[i] and finish == "stop":
                        finish = "tool_calls"
                if job.chat:
                    choice = {"index": c.index, "delta": {}, "finish_reason": finish, "logprobs": None}
                else:
                    choice = {"index": c.index, "text": "", "finish_reason": finish, "logprobs": None}
                yield sse(event(choice) | {"speculative_stats": spec_stats(complete)})
            if include_usage:
                yield sse({**head, "object": kind, "choices": [], "usage": usage(job.choices, job.prompts)})
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(BaseException):
                    await t
        yield sse(b"[DONE]")


def create_app(servicer, keys: ApiKeys, chat_template: str | None = None) -> Starlette:
    api = OpenAIApi(servicer, keys, chat_template)

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
