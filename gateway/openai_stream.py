"""Server-sent events for stream=true: every choice's Generate stream fanned into one event
stream (chunks in arrival order, tagged with their choice index), tool calls parsed out of
the text as deltas, a final usage event when asked, then [DONE]."""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Callable

from starlette.responses import StreamingResponse

from splitspec.v1 import gateway_pb2

from . import inproc, structured
from .openai_answer import FINISH, Choice, Job, spec_stats, usage
from .openai_errors import ApiError
from .openai_logprobs import TokenText, chat_logprobs, completion_logprobs


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


SOURCE_NAMES = {gateway_pb2.TOKEN_SOURCE_TARGET: "target", gateway_pb2.TOKEN_SOURCE_DFLASH: "dflash",
                gateway_pb2.TOKEN_SOURCE_NGRAM: "ngram"}


def token_sources(chunk: gateway_pb2.Chunk) -> dict:
    """stream_options.token_sources: the chunk's text cut into its tokens' pieces, each with who
    proposed it, and the running totals a live display shows (tau, Propose / Verify / wire).
    An extra field of the chunk event, which OpenAI clients ignore."""
    pieces, at = [], 0
    for source, n in zip(chunk.sources, chunk.text_lengths):
        pieces.append([SOURCE_NAMES.get(source, ""), chunk.text[at:at + n]])
        at += n
    if at < len(chunk.text):        # text with no token of its own (the tail a stop string released)
        pieces.append(["", chunk.text[at:]])
    p = chunk.progress
    return {"pieces": pieces, "progress": {
        "verify_steps": p.verify_steps, "committed": p.committed, "draft_ms": round(p.draft_ms, 3),
        "verify_ms": round(p.verify_ms, 3), "wire_ms": round(p.wire_ms, 3)}}


async def events(job: Job, streams, firsts, include_usage: bool, text: TokenText,
                 error: Callable[[Job, int, inproc.LocalRpcError], ApiError], token_sources_wanted: bool = False):
    """The SSE body. `firsts` holds each stream's first message (already awaited, so a refused
    request got its HTTP status before this starts)."""
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
            await queue.put((i, error(job, i, exc)))
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
                piece = chunk.text
                prompt_part = not job.chat and job.wanted.echo and i not in echoed
                if prompt_part:
                    echoed.add(i)
                    piece = job.echo_text[c.prompt_index] + piece
                if not piece and not chunk.token_ids and not prompt_part:
                    continue
                lps = None
                if job.wanted.logprobs is not None:
                    if job.chat:
                        lps = {"content": chat_logprobs(text, chunk.logprobs, job.wanted.logprobs)}
                    else:
                        lps = completion_logprobs(text, chunk.logprobs, offsets[i],
                                                  prompt_ids=job.prompt_ids(c) if prompt_part else (),
                                                  prompt_lps=c.prompt_logprobs)
                        if lps["text_offset"]:
                            offsets[i] = lps["text_offset"][-1] + len(lps["tokens"][-1])
                if parsers[i] is not None:
                    for choice in tool_deltas(i, c, *parsers[i].feed(piece), lps):
                        yield sse(event(choice))
                    continue
                if job.chat:
                    choice = {"index": c.index, "delta": {"content": piece}, "finish_reason": None, "logprobs": lps}
                else:
                    choice = {"index": c.index, "text": piece, "finish_reason": None, "logprobs": lps}
                if token_sources_wanted:
                    choice["splitspec"] = token_sources(chunk)     # per choice: n > 1 interleaves them
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
