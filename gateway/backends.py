"""Async clients of the backend services. `TargetSession` wraps one `Target.Session` bidi
stream (open, decode, verify, close); `TargetClient` owns the channel. gRPC failures become
`BackendError` carrying the status code, so the gateway can pass INVALID_ARGUMENT,
OUT_OF_RANGE or RESOURCE_EXHAUSTED through to its client and react to UNAVAILABLE."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc

from splitspec import tracing
from splitspec.serving import channel_options
from splitspec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


class BackendError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, backend: str = "target"):
        super().__init__(f"{backend}: {message}")
        self.code = code
        self.message = message
        self.backend = backend


def make_channel(address: str, max_message_mb: int = 64, reconnect_max_s: float = 5.0,
                 credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
    """`dns:///name:port` (or plain host:port) resolves to every replica; round_robin then
    spreads sessions over them, one stream per RPC. Reconnects to a lost backend back off from
    0.1 s to reconnect_max_s (gRPC's default would wait up to 120 s). With `credentials`
    (splitspec/security.py) the channel speaks TLS / mTLS."""
    ms = int(reconnect_max_s * 1000)
    options = channel_options(max_message_mb, round_robin=True) + [
        ("grpc.initial_reconnect_backoff_ms", min(100, ms)), ("grpc.min_reconnect_backoff_ms", min(100, ms)),
        ("grpc.max_reconnect_backoff_ms", ms)]
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=options)
    return grpc.aio.insecure_channel(address, options=options)


def _error(exc: grpc.aio.AioRpcError, backend: str = "target") -> BackendError:
    return BackendError(exc.code(), exc.details() or exc.code().name, backend)


class _StreamSession:
    """One bidi `Session` stream to a backend. Use as `async with ...:`; leaving the block
    closes the stream, which frees the sequence's state (KV cache, draft cache) there."""

    backend = "backend"

    def __init__(self, call):
        self._call = call
        self._pending = 0           # replies not read yet: the stream is mid-reply
        self.closed = False
        self.opened = False         # Open answered: the backend holds the session's state

    async def _send(self, req) -> None:
        try:
            await self._call.write(req)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, self.backend) from None
        except (grpc.aio.UsageError, asyncio.InvalidStateError):
            # Writing after the server ended the stream: report the server's status instead.
            raise await self._ended() from None

    async def _recv(self, want: str):
        try:
            resp = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, self.backend) from None
        if resp is grpc.aio.EOF:
            raise await self._ended()
        kind = resp.WhichOneof("kind")
        if kind != want:
            raise BackendError(grpc.StatusCode.INTERNAL, f"expected {want}, got {kind}", self.backend)
        return getattr(resp, want)

    async def _ended(self) -> BackendError:
        code = await self._call.code()
        details = await self._call.details()
        if code == grpc.StatusCode.OK:
            return BackendError(grpc.StatusCode.INTERNAL, "the stream ended early", self.backend)
        return BackendError(code, details or code.name, self.backend)

    def _close_request(self):
        raise NotImplementedError

    async def close(self) -> None:
        """Close politely when the stream is idle, else cancel it: either way the backend frees
        the session at once."""
        if self.closed:
            return
        self.closed = True
        if self._pending or self._call.done():
            self.cancel()
            return
        try:
            await self._send(self._close_request())
            await self._recv("closed")
            await self._call.done_writing()
        except BackendError:
            self.cancel()

    def cancel(self) -> None:
        self.closed = True
        self._call.cancel()

    async def __aenter__(self):
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            await self.close()
        else:
            self.cancel()      # includes CancelledError: never await on a cancelled path


class TargetSession(_StreamSession):
    """One sequence on a target replica."""

    backend = "target"

    def __init__(self, stub: target_pb2_grpc.TargetStub, timeout_s: float | None = None):
        super().__init__(stub.Session(timeout=timeout_s, metadata=tracing.outgoing()))

    def _close_request(self):
        return target_pb2.TargetRequest(close=target_pb2.TargetClose())

    async def open(self, session_id: str, prompt_ids: list[int], sampling: common_pb2.SamplingParams, *,
                   hidden_layer_ids=(), max_new_tokens: int = 0, hidden_dtype: int = 0,
                   hidden_stream: str = "", generated_tokens: int = 0,
                   hidden_last: int = 0, cache_salt: str = "") -> target_pb2.TargetOpened:
        """cache_salt: the request's prefix-cache namespace (TargetOpen.cache_salt; "" = shared).
        The answer's cached_tokens says how many prompt tokens the target took from its cache."""
        await self._send(target_pb2.TargetRequest(open=target_pb2.TargetOpen(
            session_id=session_id, prompt_token_ids=prompt_ids, sampling=sampling,
            hidden_layer_ids=list(hidden_layer_ids), max_new_tokens=max_new_tokens,
            hidden_dtype=hidden_dtype, hidden_stream=hidden_stream, generated_tokens=generated_tokens,
            hidden_last=hidden_last, cache_salt=cache_salt)))
        opened = await self._recv("opened")
        self.opened = True
        return opened

    async def decode(self, n: int, return_hidden: bool = False,
                     lookahead: int = 0) -> AsyncIterator[target_pb2.TargetToken]:
        """Stream n tokens, one TargetToken per forward (several tokens in one with lookahead).
        Stopping early leaves the stream mid-reply: only `close` (which then cancels the stream)
        is possible afterwards."""
        await self._send(target_pb2.TargetRequest(decode=target_pb2.TargetDecode(
            n=n, return_hidden=return_hidden, lookahead=lookahead)))
        self._pending = n
        while self._pending > 0:
            tok = await self._recv("token")
            self._pending -= 1 + len(tok.more_token_ids)
            yield tok

    async def extend(self, n: int, return_hidden: bool = False, lookahead: int = 0) -> None:
        """While `decode` streams, add n tokens to its run (TargetDecode's doc): the same
        iterator goes on yielding them. The same lookahead as the run's: it starts a new run if
        the last one ended meanwhile."""
        await self._send(target_pb2.TargetRequest(decode=target_pb2.TargetDecode(
            n=n, return_hidden=return_hidden, lookahead=lookahead)))
        self._pending += n

    async def verify(self, step: int, base_len: int, tree: common_pb2.TokenTree,
                     draft_probs: common_pb2.Tensor | None = None) -> target_pb2.TargetVerified:
        req = target_pb2.TargetRequest()    # built in place: wrapping a finished TargetVerify would copy it
        msg = req.verify
        msg.step, msg.base_len = step, base_len
        msg.tree.CopyFrom(tree)
        if draft_probs is not None:
            msg.draft_probs.CopyFrom(draft_probs)
        await self._send(req)
        return await self._recv("verified")


class DraftSession(_StreamSession):
    """One sequence on a draft replica."""

    backend = "draft"

    def __init__(self, stub: draft_pb2_grpc.DraftStub, timeout_s: float | None = None):
        super().__init__(stub.Session(timeout=timeout_s, metadata=tracing.outgoing()))

    def _close_request(self):
        return draft_pb2.DraftRequest(close=draft_pb2.DraftClose())

    async def open(self, session_id: str, prompt_ids: list[int], prompt_hidden: common_pb2.Tensor | None,
                   speculative: common_pb2.SpeculativeParams, sampling: common_pb2.SamplingParams,
                   target_tokenizer_hash: str = "", prompt_hidden_start: int = 0,
                   generated_tokens: int = 0) -> draft_pb2.DraftOpened:
        req = draft_pb2.DraftRequest()      # built in place: the prompt's hidden states are copied once
        msg = req.open
        msg.session_id, msg.target_tokenizer_hash = session_id, target_tokenizer_hash
        msg.prompt_hidden_start, msg.generated_tokens = prompt_hidden_start, generated_tokens
        msg.prompt_token_ids.extend(prompt_ids)
        if speculative is not None:
            msg.speculative.CopyFrom(speculative)
        if sampling is not None:
            msg.sampling.CopyFrom(sampling)
        if prompt_hidden is not None:
            msg.prompt_hidden.CopyFrom(prompt_hidden)
        await self._send(req)
        opened = await self._recv("opened")
        self.opened = True
        return opened

    async def propose(self, base_len: int, new_token_ids: list[int],
                      new_hidden: common_pb2.Tensor | None) -> draft_pb2.Proposal:
        req = draft_pb2.DraftRequest()      # built in place: no DraftPropose to copy into it
        msg = req.propose
        msg.base_len = base_len
        msg.new_token_ids.extend(new_token_ids)
        if new_hidden is not None:
            msg.new_hidden.CopyFrom(new_hidden)
        await self._send(req)
        return await self._recv("proposal")


class _Client:
    """One backend address (a `dns:///` name may stand for many replicas)."""

    backend = "backend"
    stub_cls = session_cls = None

    def __init__(self, address: str, max_message_mb: int = 64, reconnect_max_s: float = 5.0,
                 credentials: grpc.ChannelCredentials | None = None):
        self.address = address
        self.channel = make_channel(address, max_message_mb, reconnect_max_s, credentials)
        self.stub = self.stub_cls(self.channel)

    def session(self, timeout_s: float | None = None):
        return self.session_cls(self.stub, timeout_s)

    async def get_info(self, *, wait_s: float | None = None):
        """GetInfo; with wait_s, keep waiting that long for the backend to come up."""
        try:
            return await self.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=wait_s or 10.0,
                                           wait_for_ready=wait_s is not None)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, self.backend) from None

    async def close(self) -> None:
        await self.channel.close()


class TargetClient(_Client):
    backend, stub_cls, session_cls = "target", target_pb2_grpc.TargetStub, TargetSession


class DraftClient(_Client):
    backend, stub_cls, session_cls = "draft", draft_pb2_grpc.DraftStub, DraftSession
