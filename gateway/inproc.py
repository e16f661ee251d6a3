"""Call the gateway's own `Generate` handler in process, without a network hop: the HTTP front
(gateway/http_api.py) serves OpenAI requests through exactly the code gRPC clients get
(validation, limits, the speculative loop, failover, stop strings, metrics).

`LocalContext` stands in for grpc.aio's servicer context: `write` queues a response,
`abort` raises `LocalRpcError` with the status. Closing the iterator early (the HTTP client went
away) cancels the handler task, which frees the request's target and draft sessions the way a
cancelled gRPC call does."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

_END = object()


class LocalRpcError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class LocalContext:
    """The parts of grpc.aio.ServicerContext a servicer uses."""

    def __init__(self, metadata: tuple = ()):
        self.queue: asyncio.Queue = asyncio.Queue()
        self._metadata = metadata
        self._cancelled = False
        self._done = False
        self.code: grpc.StatusCode | None = None
        self.details = ""

    async def write(self, message) -> None:
        if self._cancelled:
            raise asyncio.CancelledError()
        self.queue.put_nowait(message)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()):
        self.code, self.details = code, details
        raise LocalRpcError(code, details)

    def time_remaining(self) -> float | None:
        return None            # HTTP requests carry no deadline; a client that leaves cancels

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._done

    def peer(self) -> str:
        return "http"

    def invocation_metadata(self):
        return self._metadata

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    async def send_initial_metadata(self, metadata) -> None:
        pass

    def set_trailing_metadata(self, metadata) -> None:
        pass


async def generate(servicer, request) -> AsyncIterator:
    """The GenerateResponse messages of `servicer.Generate(request)`; LocalRpcError when it
    aborts with a status."""
    ctx = LocalContext()
    task = asyncio.ensure_future(servicer.Generate(request, ctx))
    task.add_done_callback(lambda _: ctx.queue.put_nowait(_END))
    try:
        while True:
            msg = await ctx.queue.get()
            if msg is _END:
                break
            yield msg
        ctx._done = True
        exc = task.exception()
        if exc is not None:
            if isinstance(exc, LocalRpcError):
                raise exc
            raise LocalRpcError(grpc.StatusCode.INTERNAL, f"gateway error: {exc}") from exc
    finally:
        if not task.done():
            ctx._cancelled = True
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, LocalRpcError, Exception):
                await task
