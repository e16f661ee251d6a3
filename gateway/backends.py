"""Async clients of the backend services. `TargetSession` wraps one `Target.Session` bidi
stream (open, decode, verify, close); `TargetClient` owns the channel. gRPC failures become
`BackendError` carrying the status code, so the gateway can pass INVALID_ARGUMENT,
OUT_OF_RANGE or RESOURCE_EXHAUSTED through to its client and react to UNAVAILABLE."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc

from splitspec.serving import channel_options
from splitspec.v1 import common_pb2, target_pb2, target_pb2_grpc


class BackendError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, backend: str = "target"):
        super().__init__(f"{backend}: {message}")
        self.code = code
        self.message = message
        self.backend = backend


def make_channel(address: str, max_message_mb: int = 64) -> grpc.aio.Channel:
    """`dns:///name:port` (or plain host:port) resolves to every replica; round_robin then
    spreads sessions over them, one stream per RPC."""
    return grpc.aio.insecure_channel(address, options=channel_options(max_message_mb, round_robin=True))


def _error(exc: grpc.aio.AioRpcError, backend: str = "target") -> BackendError:
    return BackendError(exc.code(), exc.details() or exc.code().name, backend)


class TargetSession:
    """One sequence on a target replica. Use as `async with client.session() as s:`; leaving
    the block closes the stream, which frees the sequence's KV cache on the target."""

    def __init__(self, stub: target_pb2_grpc.TargetStub, timeout_s: float | None = None):
        self._call = stub.Session(timeout=timeout_s)
        self._pending = 0           # tokens of a Decode not read yet: the stream is mid-reply
        self.closed = False

    async def _send(self, req: target_pb2.TargetRequest) -> None:
        try:
            await self._call.write(req)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None
        except (grpc.aio.UsageError, asyncio.InvalidStateError):
            # Writing after the server ended the stream: report the server's status instead.
            raise await self._ended() from None

    async def _recv(self, want: str):
        try:
            resp = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None
        if resp is grpc.aio.EOF:
            raise await self._ended()
        kind = resp.WhichOneof("kind")
        if kind != want:
            raise BackendError(grpc.StatusCode.INTERNAL, f"expected {want}, got {kind}")
        return getattr(resp, want)

    async def _ended(self) -> BackendError:
        code = await self._call.code()
        details = await self._call.details()
        if code == grpc.StatusCode.OK:
            return BackendError(grpc.StatusCode.INTERNAL, "the stream ended early")
        return BackendError(code, details or code.name)

    async def open(self, session_id: str, prompt_ids: list[int], sampling: common_pb2.SamplingParams, *,
                   hidden_layer_ids=(), max_new_tokens: int = 0, hidden_dtype: int = 0) -> target_pb2.TargetOpened:
        await self._send(target_pb2.TargetRequest(open=target_pb2.TargetOpen(
            session_id=session_id, prompt_token_ids=prompt_ids, sampling=sampling,
            hidden_layer_ids=list(hidden_layer_ids), max_new_tokens=max_new_tokens,
            hidden_dtype=hidden_dtype)))
        return await self._recv("opened")

    async def decode(self, n: int, return_hidden: bool = False) -> AsyncIterator[target_pb2.TargetToken]:
        """Stream n tokens. Stopping early leaves the stream mid-reply: only `close` (which then
        cancels the stream) is possible afterwards."""
        await self._send(target_pb2.TargetRequest(decode=target_pb2.TargetDecode(n=n, return_hidden=return_hidden)))
        self._pending = n
        while self._pending:
            tok = await self._recv("token")
            self._pending -= 1
            yield tok

    async def verify(self, step: int, base_len: int, tree: common_pb2.TokenTree,
                     draft_probs: common_pb2.Tensor | None = None) -> target_pb2.TargetVerified:
        msg = target_pb2.TargetVerify(step=step, base_len=base_len, tree=tree)
        if draft_probs is not None:
            msg.draft_probs.CopyFrom(draft_probs)
        await self._send(target_pb2.TargetRequest(verify=msg))
        return await self._recv("verified")

    async def close(self) -> None:
        """Close politely when the stream is idle, else cancel it: either way the target frees
        the session at once."""
        if self.closed:
            return
        self.closed = True
        if self._pending or self._call.done():
            self.cancel()
            return
        try:
            await self._send(target_pb2.TargetRequest(close=target_pb2.TargetClose()))
            await self._recv("closed")
            await self._call.done_writing()
        except BackendError:
            self.cancel()

    def cancel(self) -> None:
        self.closed = True
        self._call.cancel()

    async def __aenter__(self) -> "TargetSession":
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            await self.close()
        else:
            self.cancel()      # includes CancelledError: never await on a cancelled path


class TargetClient:
    """One target address (a `dns:///` name may stand for many replicas)."""

    def __init__(self, address: str, max_message_mb: int = 64):
        self.address = address
        self.channel = make_channel(address, max_message_mb)
        self.stub = target_pb2_grpc.TargetStub(self.channel)

    def session(self, timeout_s: float | None = None) -> TargetSession:
        return TargetSession(self.stub, timeout_s)

    async def get_info(self, *, wait_s: float | None = None) -> target_pb2.TargetInfo:
        """GetInfo; with wait_s, keep waiting that long for the target to come up."""
        try:
            return await self.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=wait_s or 10.0,
                                           wait_for_ready=wait_s is not None)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None

    async def close(self) -> None:
        await self.channel.close()
