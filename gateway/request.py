"""Validation of a GenerateRequest into a plain `Request`. Every refusal names the field to
fix; `RequestError.code` is the gRPC status (INVALID_ARGUMENT, or OUT_OF_RANGE for a prompt
longer than the context)."""
from __future__ import annotations

import math
import secrets
import uuid
from dataclasses import dataclass

import grpc

from splitspec.engine.sample import COUPLED_BY_DEFAULT
from splitspec.limits import (MAX_CACHE_SALT, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOP_STRINGS,
                              MAX_STOP_TOKEN_IDS)
from splitspec.v1 import common_pb2, gateway_pb2

from .chat import ChatTemplateError
from .config import DRAFT_SAMPLING, METHODS, GatewayConfig, SpeculativeConfig
from .structured import constraint_problem


class RequestError(Exception):
    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ModelLimits:
    """What the gateway knows about the target from GetInfo."""
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: common_pb2.SamplingParams     # temperature/top_p/top_k/seed, forwarded to the target
    max_new_tokens: int                      # after clamping to the context
    stop: list[str]
    stop_token_ids: frozenset[int]
    eos_token_ids: frozenset[int]           # empty with ignore_eos
    speculative: SpeculativeConfig           # the request's choices over the gateway's defaults
    logprobs: int | None = None              # top alternatives per emitted token; None: no log-probs
    prompt_logprobs: int | None = None       # the same for the prompt; None: none
    cache_salt: str = ""                     # prefix-cache namespace, sent on every TargetOpen ("": shared)

    @property
    def prompt_only(self) -> bool:
        """max_new_tokens = 0 with prompt log-probs: score the prompt, generate nothing."""
        return self.max_new_tokens == 0


def parse_request(req: gateway_pb2.GenerateRequest, cfg: GatewayConfig, limits: ModelLimits,
                  tokenizer, template=None) -> Request:
    """template: the model's `chat.ChatTemplate`, for `chat` input."""
    s = req.sampling
    if s.HasField("temperature") and (math.isnan(s.temperature) or s.temperature < 0):
        raise RequestError(f"sampling.temperature must be >= 0 (0 = greedy), got {s.temperature}")
    if s.HasField("top_p") and (math.isnan(s.top_p) or not 0.0 < s.top_p <= 1.0):
        raise RequestError(f"sampling.top_p must be in (0, 1], got {s.top_p}")
    if s.HasField("top_k") and s.top_k < 0:
        raise RequestError(f"sampling.top_k must be >= 0 (0 = off), got {s.top_k}")
    if s.sampler not in common_pb2.Sampler.values():
        raise RequestError(f"sampling.sampler = {s.sampler} is not a Sampler value "
                           f"({', '.join(common_pb2.Sampler.keys())})")
    max_new = s.max_new_tokens if s.HasField("max_new_tokens") else cfg.default_max_new_tokens
    if max_new < 0 or (max_new == 0 and not s.HasField("prompt_logprobs")):
        raise RequestError(f"sampling.max_new_tokens must be >= 1 (0 only with prompt_logprobs, to score "
                           f"the prompt), got {max_new}")
    if max_new > cfg.max_new_tokens_cap:
        raise RequestError(f"sampling.max_new_tokens = {max_new} is above the gateway's cap of "
                           f"{cfg.max_new_tokens_cap} (--max-new-tokens-cap)")
    _list_sizes(s)
    for i, stop in enumerate(s.stop):
        if not stop:
            raise RequestError(f"sampling.stop[{i}] is empty")
        if len(stop) > MAX_STOP_CHARS:
            raise RequestError(f"sampling.stop[{i}] has {len(stop)} characters; at most {MAX_STOP_CHARS} are accepted")
    for i, t in enumerate(s.stop_token_ids):
        if not 0 <= t < limits.vocab_size:
            raise RequestError(f"sampling.stop_token_ids[{i}] = {t} is outside the vocabulary "
                               f"[0, {limits.vocab_size})")
    _processors(s, limits, max_new)
    if s.HasField("constraint"):
        problem = constraint_problem(s.constraint)
        if problem:
            raise RequestError(problem)
        if s.ignore_eos:
            raise RequestError(f"sampling.ignore_eos cannot be combined with sampling.constraint."
                               f"{s.constraint.WhichOneof('kind')}: a constrained answer ends (eos) where its "
                               f"grammar is complete")
    if len(req.cache_salt) > MAX_CACHE_SALT:
        raise RequestError(f"cache_salt has {len(req.cache_salt)} characters; at most {MAX_CACHE_SALT} are "
                           f"accepted (a tenant or user id, or a hash of one)")

    prompt = _prompt(req, limits, tokenizer, template)
    if cfg.max_prompt_tokens and len(prompt) > cfg.max_prompt_tokens:
        raise RequestError(f"the prompt has {len(prompt)} tokens; this gateway accepts at most "
                           f"{cfg.max_prompt_tokens} (--max-prompt-tokens)", grpc.StatusCode.OUT_OF_RANGE)
    if len(prompt) >= limits.max_context:
        raise RequestError(f"the prompt has {len(prompt)} tokens; the model's max context is "
                           f"{limits.max_context} (prompt + at least one new token)",
                           grpc.StatusCode.OUT_OF_RANGE)
    sampling = common_pb2.SamplingParams()
    for name in FORWARDED:
        if s.HasField(name):
            setattr(sampling, name, getattr(s, name))
    # What the target's processors need: penalties and bias, and for min_tokens the stop tokens
    # it holds back (stop strings and max_new_tokens stay the gateway's business).
    sampling.presence_penalty, sampling.frequency_penalty = s.presence_penalty, s.frequency_penalty
    sampling.min_tokens, sampling.ignore_eos = s.min_tokens, s.ignore_eos
    sampling.logit_bias.update(s.logit_bias)
    # Resolved here, so the target and the draft sessions of a request (and those a failover
    # opens) draw with the same noise whatever their own defaults. An unseeded request gets a
    # seed of its own, reported in Complete.seed, so any answer can be replayed.
    sampling.sampler = s.sampler or (common_pb2.SAMPLER_COUPLED if COUPLED_BY_DEFAULT else common_pb2.SAMPLER_STREAM)
    if not s.HasField("seed"):
        sampling.seed = secrets.randbits(64)
    if s.HasField("constraint"):
        sampling.constraint.CopyFrom(s.constraint)      # the target (and the draft) constrain with it
    if s.min_tokens:
        sampling.stop_token_ids.extend(s.stop_token_ids)
    return Request(
        request_id=req.request_id or uuid.uuid4().hex[:16],
        prompt_ids=prompt, sampling=sampling,
        # Past the context there is no room; stop there with finish_reason "length".
        max_new_tokens=min(max_new, limits.max_context - len(prompt)),
        stop=list(s.stop), stop_token_ids=frozenset(s.stop_token_ids),
        eos_token_ids=frozenset() if s.ignore_eos else frozenset(limits.eos_token_ids),
        speculative=_speculative(req.speculative, cfg.speculative),
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        cache_salt=req.cache_salt)


# Sampling fields the target gets as they are (when set).
FORWARDED = ("temperature", "top_p", "top_k", "seed", "repetition_penalty", "logprobs", "prompt_logprobs")


def _list_sizes(s: common_pb2.SamplingParams) -> None:
    """The lists whose entries cost work at every step, counted before any entry is read."""
    for name, limit in (("stop", MAX_STOP_STRINGS), ("stop_token_ids", MAX_STOP_TOKEN_IDS),
                        ("logit_bias", MAX_LOGIT_BIAS)):
        size = len(getattr(s, name))
        if size > limit:
            raise RequestError(f"sampling.{name} has {size} entries; at most {limit} are accepted")


def _processors(s: common_pb2.SamplingParams, limits: ModelLimits, max_new: int) -> None:
    """The logit processors' and log-probs' ranges (vLLM's), each refusal naming its field."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if math.isnan(value) or not -2.0 <= value <= 2.0:
            raise RequestError(f"sampling.{name} must be in [-2, 2], got {value}")
    if s.HasField("repetition_penalty") and (math.isnan(s.repetition_penalty) or not 0 < s.repetition_penalty < math.inf):
        raise RequestError(f"sampling.repetition_penalty must be > 0 (1 = off), got {s.repetition_penalty}")
    for token, bias in sorted(s.logit_bias.items()):
        if not 0 <= token < limits.vocab_size:
            raise RequestError(f"sampling.logit_bias: token id {token} is outside the vocabulary "
                               f"[0, {limits.vocab_size})")
        if math.isnan(bias) or not -100.0 <= bias <= 100.0:
            raise RequestError(f"sampling.logit_bias[{token}] must be in [-100, 100], got {bias}")
    if not 0 <= s.min_tokens <= max_new:
        raise RequestError(f"sampling.min_tokens must be in [0, max_new_tokens = {max_new}], got {s.min_tokens}")
    for name in ("logprobs", "prompt_logprobs"):
        if s.HasField(name) and not 0 <= getattr(s, name) <= MAX_LOGPROBS:
            raise RequestError(f"sampling.{name} must be in [0, {MAX_LOGPROBS}], got {getattr(s, name)}")


def _render_chat(chat: gateway_pb2.ChatMessages, template) -> str:
    if not chat.messages:
        raise RequestError("chat.messages is empty")
    for i, m in enumerate(chat.messages):
        if not m.role:
            raise RequestError(f"chat.messages[{i}].role is empty")
    if template is None:
        raise RequestError("chat input needs the model's chat template and this gateway has none; send text")
    try:
        return template.render([{"role": m.role, "content": m.content} for m in chat.messages])
    except ChatTemplateError as exc:
        raise RequestError(f"chat: {exc}") from None


def encode(tokenizer, text: str, *, chat: bool) -> list[int]:
    """A prompt's token ids, the same for gRPC and HTTP. A plain text gets the special tokens the
    tokenizer adds (BOS where the model wants one, as vLLM does); a rendered chat template none,
    since the template writes them itself (a second BOS would shift every answer). encode_batch,
    not encode: only the batch call lets go of the GIL, so a long prompt tokenized in a worker
    thread leaves the event loop free."""
    return tokenizer.encode_batch([text], add_special_tokens=not chat)[0].ids


def _prompt(req: gateway_pb2.GenerateRequest, limits: ModelLimits, tokenizer, template=None) -> list[int]:
    kind = req.WhichOneof("input")
    if kind is None:
        raise RequestError("input is not set: give text or token_ids")
    if kind == "chat":
        return encode(tokenizer, _render_chat(req.chat, template), chat=True)
    if kind == "text":
        if not req.text:
            raise RequestError("text is empty")
        return encode(tokenizer, req.text, chat=False)
    ids = list(req.token_ids.ids)
    if not ids:
        raise RequestError("token_ids.ids is empty")
    for i, t in enumerate(ids):
        if not 0 <= t < limits.vocab_size:
            raise RequestError(f"token_ids.ids[{i}] = {t} is outside the vocabulary [0, {limits.vocab_size})")
    return ids


def _speculative(msg: common_pb2.SpeculativeParams, default: SpeculativeConfig) -> SpeculativeConfig:
    method = msg.method.lower() or default.method
    if method not in METHODS:
        raise RequestError(f"speculative.method {msg.method!r} is not one of {', '.join(METHODS)}")
    draft_sampling = msg.draft_sampling.lower() or default.draft_sampling
    if draft_sampling not in DRAFT_SAMPLING:
        raise RequestError(f"speculative.draft_sampling {msg.draft_sampling!r} is not one of "
                           f"{', '.join(DRAFT_SAMPLING)}")
    values = {}
    for name, attr, low in (("num_steps", "num_steps", 1), ("topk", "eagle_topk", 1),
                            ("num_draft_tokens", "num_draft_tokens", 2)):
        value = getattr(msg, name) if msg.HasField(name) else getattr(default, attr)
        if value < low:
            raise RequestError(f"speculative.{name} must be >= {low}, got {value}")
        values[attr] = value
    return SpeculativeConfig(method=method, draft_sampling=draft_sampling, target_lookahead=default.target_lookahead,
                             **values)
