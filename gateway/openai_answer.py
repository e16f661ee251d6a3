"""One HTTP request's choices as they come back from Generate, and the non-streamed answer
built from them (text, finish reasons, tool calls, log-probs, usage, speculation stats)."""
from __future__ import annotations

from dataclasses import dataclass, field

from splitspec.v1 import gateway_pb2

from . import structured
from .openai_errors import ApiError
from .openai_logprobs import TokenText, chat_logprobs, completion_logprobs
from .openai_mapping import Wanted

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


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

    def prompt_ids(self, c: Choice):
        """The prompt's token ids as scored, for echo's log-probs."""
        return self.requests[c.index].token_ids.ids if self.wanted.echo else ()


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


def final(job: Job, text: TokenText) -> dict:
    """The non-streamed answer; a failed choice carries its error (the others their text)."""
    out = []
    for c in job.choices:
        if c.error is not None:
            out.append({"index": c.index, "finish_reason": "error", "logprobs": None,
                        **({"message": {"role": "assistant", "content": ""}} if job.chat else {"text": ""}),
                        "error": c.error.body()["error"]})
            continue
        body = "".join(c.text)
        finish = FINISH.get(c.complete.finish_reason, c.complete.finish_reason)
        choice = {"index": c.index, "finish_reason": finish, "logprobs": None}
        if job.chat:
            choice["message"] = {"role": "assistant", "content": body}
            if job.wanted.structured.parse_tools:
                content, calls = structured.parse_tool_calls(body, job.wanted.structured.names)
                if calls:
                    choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                    if finish == "stop":
                        choice["finish_reason"] = "tool_calls"
            if job.wanted.logprobs is not None:
                choice["logprobs"] = {"content": chat_logprobs(text, c.logprobs, job.wanted.logprobs),
                                      "refusal": None}
        else:
            echo = job.echo_text[c.prompt_index] if job.wanted.echo else ""
            choice["text"] = echo + body
            if job.wanted.logprobs is not None:
                choice["logprobs"] = completion_logprobs(text, c.logprobs, 0, prompt_ids=job.prompt_ids(c),
                                                         prompt_lps=c.prompt_logprobs)
        out.append(choice)
    done = next(c.complete for c in job.choices if c.complete is not None)
    return {**job.head, "object": "chat.completion" if job.chat else "text_completion", "choices": out,
            "usage": usage(job.choices, job.prompts), "speculative_stats": spec_stats(done)}
