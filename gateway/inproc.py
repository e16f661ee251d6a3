"""Call the gateway's own `Generate` handler in process, without a network hop: the HTTP front
(gateway/http_api.py) serves OpenAI requests through exactly the code gRPC clients get
(validation, limits, the speculative loop, failover, stop strings, metrics).

`LocalContext` stands in for grpc.aio's servicer context: `write` queues a response,
`abort` raises `LocalRpcError` with the status. Closing the iterator early (the HTTP client went
away) cancels the handler task, which frees the request's target and draft sessions the way a
cancelled gRPC call does.

A call may have a deadline (`timeout_s`), as a gRPC call does: the handler sees it through
`time_remaining()` (and passes it on to the backend sessions), and past it the call is
cancelled and ends DEADLINE_EXCEEDED, whatever the handler is waiting on."""
from __future__ import annotations

import asyncio
import contextlib
import time
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

    def __init__(self, metadata: tuple = (), timeout_s: float | None = None):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
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
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic())

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


async def generate(servicer, request, timeout_s: float | None = None) -> AsyncIterator:
    """The GenerateResponse messages of `servicer.Generate(request)`; LocalRpcError when it
    aborts with a status, DEADLINE_EXCEEDED once `timeout_s` has passed."""
    ctx = LocalContext(timeout_s=timeout_s)
    task = asyncio.ensure_future(servicer.Generate(request, ctx))
    task.add_done_callback(lambda _: ctx.queue.put_nowait(_END))
    try:
        while True:
            try:
                msg = await asyncio.wait_for(ctx.queue.get(), ctx.time_remaining())
            except asyncio.TimeoutError:
                # The deadline passed with the handler still at work (a stuck backend included):
                # the finally below cancels it, which frees its sessions.
                raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"the request's deadline ({timeout_s:g} s) passed") from None
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
