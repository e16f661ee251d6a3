"""One request, start to finish. A *token source* is an async generator that yields lists of
newly committed tokens: `failover.ResilientSource.steps` (the speculative loop of `spec_loop.py`,
surviving the loss of the draft or of the target replica). `stream_response` consumes it: it applies eos / stop tokens / stop strings / max_new_tokens,
detokenizes incrementally and turns the tokens into Chunk messages, then one Complete."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from splitspec.v1 import gateway_pb2

from .detok import IncrementalDetokenizer
from .request import Request
from .stops import StopMatcher


class Tokens(list):
    """The tokens one step committed, with the target's log-probs when the request asked for
    them. A list of ids first, so the consumers of plain token lists (the request's history, the
    n-gram index, the draft's owed tokens) take it as is."""

    def __init__(self, ids, logprobs=(), prompt_logprobs=(), sources=()):
        super().__init__(ids)
        self.logprobs = list(logprobs)            # common_pb2.TokenLogprob, one per id (or none)
        self.prompt_logprobs = list(prompt_logprobs)
        self.sources = list(sources)              # gateway_pb2.TokenSource, one per id (or none: unknown)


TARGET = gateway_pb2.TOKEN_SOURCE_TARGET
_DRAFTED = {"dflash": gateway_pb2.TOKEN_SOURCE_DFLASH, "ngram": gateway_pb2.TOKEN_SOURCE_NGRAM}


def step_sources(method: str, accepted: int, committed: int) -> list[int]:
    """Who proposed each token of one step: its first `accepted` tokens are the drafter's (those
    the target accepted from it), the rest the target's own (the bonus, grammar-forced tokens)."""
    accepted = max(0, min(accepted, committed))
    return [_DRAFTED.get(method, TARGET)] * accepted + [TARGET] * (committed - accepted)


@dataclass
class Stats:
    """Filled in by the token source as it goes; becomes SpeculativeStats."""
    method: str = "none"
    verify_steps: int = 0                  # Verify calls, or Decode steps target-only
    committed: int = 0                     # tokens committed by those steps (not b0)
    accepted_per_position: list[int] = field(default_factory=list)
    draft_tokens: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    model_ms: float = 0.0                  # time inside the models, as the services report it
    queue_ms: float = 0.0                  # time waiting for the services' batched forwards
    hidden_state_bytes: int = 0
    draft_fallbacks: int = 0
    target_failovers: int = 0
    time_to_first_token_ms: float = 0.0
    decode_runs: int = 0                   # target-only runs started
    decode_extensions: int = 0             # ... and extended before their last token
    cached_tokens: int = 0                 # prompt tokens the target took from its prefix cache (the
                                           # first Open of the prompt; a failover's reopen is not counted)
    steps: list[tuple[str, int, int, int]] = field(default_factory=list)   # (method, nodes drafted, accepted, depth) per step
    steps_by_method: dict[str, int] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)   # when the request arrived
    trace: object = field(default=None, repr=False)   # splitspec.tracing.RequestTrace when traced

    def progress(self) -> gateway_pb2.SpeculativeProgress:
        return gateway_pb2.SpeculativeProgress(verify_steps=self.verify_steps, committed=self.committed,
                                               draft_ms=self.draft_ms, verify_ms=self.verify_ms,
                                               wire_ms=self.wire_ms)

    def to_pb(self) -> gateway_pb2.SpeculativeStats:
        return gateway_pb2.SpeculativeStats(
            method=self.method, verify_steps=self.verify_steps,
            accept_length=self.committed / self.verify_steps if self.verify_steps else 0.0,
            accepted_per_position=self.accepted_per_position, draft_tokens=self.draft_tokens,
            draft_ms=self.draft_ms, verify_ms=self.verify_ms,
            wire_ms=self.wire_ms,
            queue_ms=self.queue_ms,
            hidden_state_bytes=self.hidden_state_bytes, draft_fallbacks=self.draft_fallbacks,
            target_failovers=self.target_failovers, time_to_first_token_ms=self.time_to_first_token_ms,
            steps_by_method=self.steps_by_method,
            decode_runs=self.decode_runs, decode_extensions=self.decode_extensions,
            steps=[gateway_pb2.SpeculativeStep(method=m, k=k, accepted=a, depth=d) for m, k, a, d in self.steps])

    @property
    def wire_ms(self) -> float:
        """Round-trip time neither in a model nor queued: network and (de)serialisation."""
        return max(0.0, self.draft_ms + self.verify_ms - self.model_ms - self.queue_ms)

    @property
    def steps_by_k(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for _, k, _, _ in self.steps:
            out[k] = out.get(k, 0) + 1
        return out


async def stream_response(req: Request, steps: AsyncIterator[list[int]], tokenizer,
                          stats: Stats) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    detok = IncrementalDetokenizer(tokenizer, req.prompt_ids)
    stops = StopMatcher(req.stop)
    generated = 0
    finish = None
    if req.prompt_only:
        finish = "length"        # nothing to generate: only the prompt's log-probs (echo)
    async for tokens in steps:
        ids, text = [], []
        lps = getattr(tokens, "logprobs", [])
        prompt_lps = getattr(tokens, "prompt_logprobs", [])
        sources = getattr(tokens, "sources", None) or [gateway_pb2.TOKEN_SOURCE_UNSPECIFIED] * len(tokens)
        if req.prompt_only:
            yield gateway_pb2.GenerateResponse(chunk=gateway_pb2.Chunk(prompt_logprobs=prompt_lps))
            break
        for tok in tokens:
            ids.append(tok)
            generated += 1
            text.append(stops.feed(detok.add([tok])))
            if stops.stopped:
                finish = "stop"
            elif tok in req.eos_token_ids:
                finish = "eos"
            elif tok in req.stop_token_ids:
                finish = "stop"
            elif generated >= req.max_new_tokens:
                finish = "length"
            if finish:
                break
        lengths = [len(piece) for piece in text]      # one per token, before the flush below
        if finish and not stops.stopped:
            text.append(stops.feed(detok.flush()))
            if not stops.stopped:
                text.append(stops.flush())
            if stops.stopped:
                finish = "stop"      # a stop string held back behind a longer candidate
            if lengths:
                lengths[-1] += sum(len(piece) for piece in text[len(lengths):])
        if not stats.time_to_first_token_ms:
            stats.time_to_first_token_ms = (time.perf_counter() - stats.started) * 1e3
        yield gateway_pb2.GenerateResponse(chunk=gateway_pb2.Chunk(
            token_ids=ids, text="".join(text), logprobs=lps[:len(ids)], prompt_logprobs=prompt_lps,
            sources=sources[:len(ids)], text_lengths=lengths, progress=stats.progress()))
        if finish:
            break
    if finish is None:   # the source ended on its own: only at the context limit
        tail = stops.feed(detok.flush()) + ("" if stops.stopped else stops.flush())
        finish = "stop" if stops.stopped else "length"
        if tail:
            yield gateway_pb2.GenerateResponse(chunk=gateway_pb2.Chunk(text=tail))
    yield gateway_pb2.GenerateResponse(complete=gateway_pb2.Complete(
        finish_reason=finish,
        usage=gateway_pb2.Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=generated,
                                cached_tokens=min(stats.cached_tokens, len(req.prompt_ids))),
        stats=stats.to_pb(), seed=req.sampling.seed))
