"""The OpenAI-compatible HTTP API of the gateway (FastAPI; served by uvicorn in the gateway's
own event loop, gateway/http_server.py):

    POST /v1/completions        POST /v1/chat/completions    (stream and non-stream)
    GET  /v1/models             GET  /health                 GET /openapi.json

The routes are thin: the bodies are declared in gateway/openai_protocol.py (FastAPI validates
them and publishes the schema), gateway/openai_mapping.py turns a valid body into GenerateRequests,
gateway/openai_answer.py and gateway/openai_stream.py shape the answer, gateway/openai_logprobs.py
the log-probs, and gateway/openai_errors.py every error (OpenAI's shape, `param` naming the field).

Every generation runs through the gateway's gRPC `Generate` handler in process
(gateway/inproc.py), so HTTP and gRPC clients get the same validation, limits, speculation,
failover and metrics. One HTTP request is one Generate call per choice: a list of prompts and
`n` fan out into prompts x n calls run concurrently (choice index = prompt index * n + i, as
OpenAI numbers them), each through the batched services like any other request. Each call has
a deadline, as a gRPC call does: --http-timeout-s, or less with an `x-request-timeout` header
(seconds); past it the answer is 504 (or a streamed choice ends with a timeout_error).

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
A body over MAX_BODY_BYTES is a 413, one nested deeper than MAX_JSON_DEPTH a 400, before it is parsed
(gateway/http_guard.py, with the API key check).
gRPC statuses become OpenAI-style error bodies with the matching HTTP status (`http_status`)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import time
import uuid

import grpc
from fastapi import Body, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from splitspec import logs
from splitspec.security import ApiKeys
from splitspec.v1 import gateway_pb2

from . import inproc, web_page
from .chat import ChatTemplate, ChatTemplateError
from .openai_answer import Choice, Job, final
from .http_guard import Guard
from .openai_errors import ApiError, bad, from_validation
from .openai_logprobs import TokenText
from .openai_mapping import (Wanted, build_request, chat_messages, check_token_ids, choice_seed, parse_options,
                             template_kwargs)
from .openai_protocol import MAX_CHOICES, ChatCompletionRequest, CompletionRequest, ErrorResponse, Health, ModelList
from .openai_stream import EventStream, events
from .request import encode

# A refusal of the request itself: the same parameters go to every choice, so the whole
# request gets the 400 (as vLLM answers a batch); other failures end one choice only.
CLIENT_ERRORS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                           grpc.StatusCode.FAILED_PRECONDITION})
# A refusal of the request's grammar, as the gateway or the target (through the gateway, whose
# message names the backend) words it.
CONSTRAINT_ERROR = re.compile(r"^(?:(?:target|draft): )?(?:open\.)?sampling\.constraint\b")
DEFAULT_TIMEOUT_S = 600.0      # --http-timeout-s


# --- the API -----------------------------------------------------------------------------------

class OpenAIApi:
    def __init__(self, servicer, chat_template: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.servicer = servicer
        self.chat_template = chat_template      # --chat-template: wins over the model's own
        self.timeout_s = timeout_s              # --http-timeout-s (0: none)
        self._template: ChatTemplate | None = None
        self._token_text: TokenText | None = None

    def info(self):
        info = self.servicer.backends.info
        if info is None or not self.servicer.server.serving:
            raise ApiError(503, "the gateway is not connected to a target yet", "service_unavailable_error")
        return info

    def checked(self, request: Request, body) -> dict:
        """The body as the mapping reads it, after the checks that need the target."""
        info = self.info()
        if body.model not in (None, "", info.model_id):
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {info.model_id!r}",
                           "not_found_error", "model", "model_not_found")
        if body.model_extra:     # ignored, as vLLM does; the log says so
            logs.get_logger().info("http_unknown_fields", fields=sorted(body.model_extra), path=request.url.path)
        return body.model_dump(exclude_unset=True)

    def template(self) -> ChatTemplate:
        info = self.info()
        if self._template is None or self._template.model_id != info.model_id:
            config = info.tokenizer_config_json
            if self.chat_template is not None:
                config = with_template(config, self.chat_template)
            self._template = ChatTemplate(config, info.model_id)
        return self._template

    def token_text(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self.servicer.backends.tokenizer)
        return self._token_text

    def deadline(self, request: Request) -> float | None:
        """Seconds this request may run: --http-timeout-s, or less if the client says so."""
        limit = self.timeout_s or None
        asked = request.headers.get("x-request-timeout")
        if asked is not None:
            try:
                seconds = float(asked)
            except ValueError:
                seconds = float("nan")
            if not 0 < seconds < float("inf"):
                raise bad(f"x-request-timeout must be a positive number of seconds, got {asked!r}",
                          "x-request-timeout")
            limit = seconds if limit is None else min(limit, seconds)
        return limit

    async def options(self, body: dict, *, chat: bool) -> Wanted:
        """The request's options, in a worker thread: checking a request's schemas and tools walks
        and serializes each of them (up to 128 tools of 64 KB)."""
        return await asyncio.to_thread(parse_options, body, chat=chat)

    async def tokenize(self, prompts: list) -> list:
        """Text prompts as token ids, in a worker thread: a long prompt must not stall the event
        loop that serves every other request. The ids are the ones Generate would make."""
        tok = self.servicer.backends.tokenizer

        def ids() -> list:
            return [encode(tok, p, chat=False) if isinstance(p, str) else p for p in prompts]
        if all(not isinstance(p, str) for p in prompts):
            return prompts
        return await asyncio.to_thread(ids)

    async def chat_prompt(self, body: dict, wanted: Wanted) -> list[int]:
        """The messages through the chat template, as token ids: rendered and tokenized in a
        worker thread, encoded as gRPC chat input is (no special tokens on top of the template's)."""
        kwargs = template_kwargs(body)
        template = self.template()
        tok = self.servicer.backends.tokenizer

        def ids() -> list[int]:
            text = template.render(chat_messages(body), add_generation_prompt=body.get("add_generation_prompt", True),
                                   tools=wanted.structured.tools, **kwargs)
            return encode(tok, text, chat=True)
        try:
            prompt = await asyncio.to_thread(ids)
        except ChatTemplateError as exc:
            raise bad(str(exc), "messages") from None
        return prompt

    # --- endpoints -------------------------------------------------------------------------
    async def completions(self, request: Request, model: CompletionRequest) -> Response:
        body = self.checked(request, model)
        rid = request.headers.get("x-request-id") or f"cmpl-{uuid.uuid4().hex}"
        wanted = await self.options(body, chat=False)
        prompt = body["prompt"]
        single = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], int))
        prompts = await self.tokenize([prompt] if single else list(prompt))
        check_token_ids(prompts, self.info().vocab_size)
        job = self._job(body, prompts, rid, wanted, chat=False, max_tokens_field="max_tokens")
        if wanted.echo:
            # decode_batch lets go of the GIL (decode does not): a long prompt's text is made
            # off the event loop
            job.echo_text = await asyncio.to_thread(self.servicer.backends.tokenizer.decode_batch, prompts,
                                                    skip_special_tokens=False)
        return await self._respond(request, body, job)

    async def chat(self, request: Request, model: ChatCompletionRequest) -> Response:
        body = self.checked(request, model)
        rid = request.headers.get("x-request-id") or f"chatcmpl-{uuid.uuid4().hex}"
        wanted = await self.options(body, chat=True)
        prompt = await self.chat_prompt(body, wanted)
        job = self._job(body, [prompt], rid, wanted, chat=True, max_tokens_field="max_completion_tokens")
        return await self._respond(request, body, job)

    def _job(self, body: dict, prompts: list, rid: str, wanted: Wanted, *, chat: bool,
             max_tokens_field: str) -> Job:
        total = len(prompts) * wanted.n
        if total > MAX_CHOICES:
            raise bad(f"{len(prompts)} prompts x n = {wanted.n} is {total} choices; at most {MAX_CHOICES} "
                      f"per request", "n")
        vocab = self.info().vocab_size
        requests, choices = [], []
        # One seed for the whole body, the client's or drawn here (so every choice's seed derives
        # from it), returned as the answer's "seed": sending it back replays every choice.
        seed = body.get("seed")
        if seed is None:
            seed = secrets.randbits(64)
        for p, prompt in enumerate(prompts):
            base = build_request(body, prompt, rid, max_tokens_field=max_tokens_field, wanted=wanted,
                                 vocab_size=vocab)
            base.sampling.seed = seed
            for i in range(wanted.n):
                req = gateway_pb2.GenerateRequest()
                req.CopyFrom(base)
                index = p * wanted.n + i
                if total > 1:
                    req.request_id = f"{rid}-{index}"
                req.sampling.seed = choice_seed(seed, i)
                requests.append(req)
                choices.append(Choice(index, p))
        head = {"id": rid, "created": int(time.time()), "model": self.info().model_id, "seed": seed}
        return Job(requests, choices, len(prompts), wanted, chat, [], head)

    # --- generation ------------------------------------------------------------------------
    async def _respond(self, request: Request, body: dict, job: Job) -> Response:
        timeout_s = self.deadline(request)
        streams = [inproc.generate(self.servicer, r, timeout_s=timeout_s) for r in job.requests]
        log = logs.get_logger(request_id=job.head["id"])
        if body.get("stream"):
            # Wait for every choice's first message, so a refused request gets its HTTP status,
            # not a 200 with an error event.
            firsts = await asyncio.gather(*(_first(s) for s in streams), return_exceptions=True)
            try:
                self._raise_refusal(job, firsts)
            except BaseException:
                for s in streams:
                    await s.aclose()
                raise
            opts = body.get("stream_options") or {}
            return EventStream(events(job, streams, firsts, bool(opts.get("include_usage")), self.token_text(),
                                      self._error, token_sources_wanted=bool(opts.get("token_sources"))))
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
        return JSONResponse(final(job, self.token_text()))

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


def with_template(config_json: str, template: str) -> str:
    try:
        cfg = json.loads(config_json) if config_json else {}
    except json.JSONDecodeError:
        cfg = {}
    return json.dumps({**(cfg if isinstance(cfg, dict) else {}), "chat_template": template})


async def _first(stream):
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# --- the app -------------------------------------------------------------------------------------

ERRORS = {status: {"model": ErrorResponse, "description": what} for status, what in (
    (400, "a field refused (param names it), or a body that is not JSON or nests too deep"),
    (401, "no or a wrong API key"), (404, "a model this server does not serve"),
    (413, "a body over the size limit"), (429, "the gateway is at --max-sessions"),
    (499, "the client went away"), (500, "a server fault"),
    (503, "no target connected, or none left to serve the request"), (504, "the request's deadline passed"))}
GENERATION = {200: {"description": "the answer; with stream: true, server-sent events",
                    "content": {"application/json": {}, "text/event-stream": {}}}, **ERRORS}


def create_app(servicer, keys: ApiKeys, chat_template: str | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> FastAPI:
    api = OpenAIApi(servicer, chat_template, timeout_s)
    app = FastAPI(title="splitspec gateway: OpenAI-compatible API", version="1",
                  docs_url=None, redoc_url=None)    # the docs pages load scripts from a CDN: off

    @app.get("/health", responses={503: {"model": Health}}, response_model=Health)
    async def health() -> Response:
        ok = servicer.backends.limits is not None and servicer.server.serving
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/v1/models", responses=ERRORS, response_model=ModelList)
    async def models() -> Response:
        info = api.info()
        return JSONResponse({"object": "list", "data": [{
            "id": info.model_id, "object": "model", "created": 0, "owned_by": "splitspec",
            "max_model_len": info.max_context}]})

    @app.post("/v1/completions", responses=GENERATION)
    async def completions(request: Request, body: CompletionRequest = Body()) -> Response:
        return await api.completions(request, body)

    @app.post("/v1/chat/completions", responses=GENERATION)
    async def chat_completions(request: Request, body: ChatCompletionRequest = Body()) -> Response:
        return await api.chat(request, body)

    web_page.add_page(app)
    app.add_exception_handler(ApiError, lambda _, exc: exc.response())
    app.add_exception_handler(RequestValidationError, lambda _, exc: from_validation(exc.errors()).response())
    app.add_exception_handler(ChatTemplateError, lambda _, exc: bad(str(exc), "messages").response())
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _fault)
    app.openapi = lambda: _openapi(app)
    app.add_middleware(Guard, keys=keys)
    return app


def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
    """FastAPI's own refusals (a body that is not UTF-8, no such path or method) in OpenAI's shape."""
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if message == "There was an error parsing the body":
        message = "the body is not valid JSON (UTF-8)"
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return JSONResponse(ApiError(exc.status_code, message, kind).body(), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


def _fault(request: Request, exc: Exception) -> Response:
    """A bug answers one request with a 500 in OpenAI's shape; the log has the traceback."""
    logs.get_logger().error("http_request_failed", path=request.url.path, error=repr(exc)[:500], exc_info=exc)
    return ApiError(500, f"server error: {type(exc).__name__}", "server_error", code="internal").response()


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema without its 422 answers: a refused body is a 400 in OpenAI's shape here."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
