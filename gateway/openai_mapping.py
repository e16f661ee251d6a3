"""A valid OpenAI body (gateway/openai_protocol.py) -> the gateway's GenerateRequest, in one place.

The schema has already checked every field's type and range; what is left here are the checks
that span fields or need the model (max_tokens 0 only with echo, min_tokens <= max_tokens,
token ids inside the vocabulary, a constraint with ignore_eos), the options the answer needs
beyond the request (`Wanted`), and the fields OpenAI names differently from the proto."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from splitspec.v1 import common_pb2, gateway_pb2

from . import structured
from .openai_errors import bad


@dataclass
class Wanted:
    """What the response needs beyond the text (not part of the gRPC request)."""
    n: int = 1
    logprobs: int | None = None          # alternatives per token; None: no logprobs in the answer
    echo: bool = False
    structured: structured.Structured = field(default_factory=structured.Structured)


def _unsupported(body: dict) -> None:
    """Refuse known fields we cannot honour rather than silently ignoring them."""
    best_of = body.get("best_of")
    if best_of not in (None, 1) and best_of != body.get("n", 1):
        # best_of ranks extra samples by cumulative log-prob and returns the best n: a choice the
        # target's exact distribution does not make; vLLM's V1 engine dropped it too.
        raise bad("best_of is not supported (only best_of = n); use n to get several samples", "best_of")
    if body.get("suffix"):
        raise bad("suffix is not supported", "suffix")


def parse_options(body: dict, *, chat: bool) -> Wanted:
    _unsupported(body)
    w = Wanted(n=body.get("n") or 1)
    try:
        w.structured = structured.from_request(body, chat=chat)
    except structured.StructuredError as exc:
        raise bad(exc.message, exc.param) from None
    if w.structured.constraint is not None and body.get("ignore_eos"):
        raise bad(f"ignore_eos cannot be combined with {w.structured.source}: a constrained answer ends (eos) "
                  f"where its grammar is complete", "ignore_eos")
    if chat:
        if body.get("echo"):
            raise bad("echo is a /v1/completions field", "echo")
        if body.get("logprobs"):
            w.logprobs = body.get("top_logprobs") or 0
        elif body.get("top_logprobs"):
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    else:
        logprobs = body.get("logprobs")
        if logprobs is not None and logprobs is not False:
            w.logprobs = logprobs
        w.echo = bool(body.get("echo"))
    return w


def check_token_ids(prompts: list, vocab_size: int | None) -> None:
    """Tokenized prompts: not empty, and inside the vocabulary (checked before echo decodes them)."""
    for p, prompt in enumerate(prompts):
        param = f"prompt[{p}]" if len(prompts) > 1 else "prompt"
        if not len(prompt):
            raise bad(f"{param} makes no tokens", param)
        for t in prompt:
            if vocab_size is not None and t >= vocab_size:
                raise bad(f"{param}: token id {t} is outside the vocabulary [0, {vocab_size})", param)


def build_request(body: dict, prompt, request_id: str, *, max_tokens_field: str = "max_tokens",
                  wanted: Wanted | None = None, vocab_size: int | None = None) -> gateway_pb2.GenerateRequest:
    wanted = wanted or Wanted()
    s = common_pb2.SamplingParams()
    temperature = body.get("temperature")
    s.temperature = 1.0 if temperature is None else temperature     # OpenAI's default
    if body.get("top_p") is not None:
        s.top_p = body["top_p"]
    if body.get("top_k") is not None:
        s.top_k = max(body["top_k"], 0)                            # vLLM: -1 = off
    if body.get("seed") is not None:
        s.seed = body["seed"]
    max_tokens = body.get(max_tokens_field)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens = body.get("max_tokens")
    if max_tokens == 0 and not wanted.echo:
        raise bad(f"{max_tokens_field} must be >= 1 (0 only with echo, to score the prompt)", max_tokens_field)
    if max_tokens is not None:
        s.max_new_tokens = max_tokens
    stop = body.get("stop")
    if stop is not None:
        s.stop.extend([stop] if isinstance(stop, str) else stop)
    s.stop_token_ids.extend(body.get("stop_token_ids") or [])
    if body.get("ignore_eos") is not None:
        s.ignore_eos = body["ignore_eos"]
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if body.get(name) is not None:
            setattr(s, name, body[name])
    min_tokens = body.get("min_tokens")
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
                                      cache_salt=body.get("cache_salt") or "")
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def _speculative(body: dict) -> common_pb2.SpeculativeParams:
    out = common_pb2.SpeculativeParams()
    for name, value in (body.get("speculative") or {}).items():
        if value is not None:
            setattr(out, name, value)
    return out


def _logit_bias(bias: dict | None, s: common_pb2.SamplingParams, vocab_size: int | None) -> None:
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad(f"logit_bias: key {key!r} is not a token id", "logit_bias") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise bad(f"logit_bias: token id {token} is outside the vocabulary [0, {vocab_size})", "logit_bias")
        s.logit_bias[token] = float(value)


def chat_messages(body: dict) -> list[dict]:
    """The messages as chat templates read them: text parts joined, tool-call arguments parsed."""
    out = []
    for m in body["messages"]:
        content = m.get("content")
        if isinstance(content, list):   # content parts: text only (the schema refuses others)
            content = "".join(p.get("text", "") for p in content)
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
        except (json.JSONDecodeError, RecursionError):
            return call
        if isinstance(parsed, dict):
            return {**call, "function": {**call["function"], "arguments": parsed}}
    return call


# chat_template_kwargs that chat templates read as a given type: the special tokens the template
# writes (a number there fails the render or ends up in the prompt as digits), and the switches
# of the common templates (Qwen3's enable_thinking, ...), whose truthiness a string would invert.
TEMPLATE_STRINGS = frozenset({"bos_token", "eos_token", "pad_token", "unk_token", "reasoning_effort", "date_string"})
TEMPLATE_BOOLS = frozenset({"enable_thinking", "thinking", "add_vision_id", "tools_in_user_message"})
TEMPLATE_RESERVED = frozenset({"messages", "add_generation_prompt", "tools", "raise_exception"})


def template_kwargs(body: dict) -> dict:
    kwargs = body.get("chat_template_kwargs") or {}
    reserved = sorted(set(kwargs) & TEMPLATE_RESERVED)
    if reserved:
        raise bad(f"chat_template_kwargs cannot set {', '.join(reserved)}: messages, add_generation_prompt and "
                  f"tools are request fields, raise_exception the template's own", "chat_template_kwargs")
    for key, value in kwargs.items():
        if key in TEMPLATE_STRINGS and not isinstance(value, str):
            raise bad(f"chat_template_kwargs.{key} must be a string, got {type(value).__name__}",
                      f"chat_template_kwargs.{key}")
        if key in TEMPLATE_BOOLS and not isinstance(value, bool):
            raise bad(f"chat_template_kwargs.{key} must be a boolean, got {type(value).__name__}",
                      f"chat_template_kwargs.{key}")
    return kwargs


def choice_seed(seed: int, i: int) -> int:
    """The seed of choice i of a seeded request: the request's own for the first (so n = 1 is
    unchanged and a prompt samples the same alone or in a batch), then a hash of (seed, i), which
    unlike seed + i never collides with another request's seed."""
    if i == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1      # 63 bits: every generator takes it
