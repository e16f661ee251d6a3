"""What every splitspec gRPC server shares: the flags they take alike, message-size options,
standard health (grpc.health.v1) and reflection, a SIGTERM/SIGINT drain, the end of a session
stream and of the process. The target, draft and gateway servers each build one `Server` and
register their own servicer on `server.grpc`."""
from __future__ import annotations

import asyncio
import signal
import socket
import threading
from dataclasses import dataclass, field
from typing import Awaitable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from . import logs, tracing
from .colocation import add_core_sharing_flag
from .logs import get_logger
from .metrics import add_metrics_flag
from .security import add_tls_flags, server_credentials

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ProtocolError(Exception):
    """Messages in the wrong order on a session stream: FAILED_PRECONDITION."""


class IdleError(Exception):
    """No message for --idle-timeout-s while a session was waiting: DEADLINE_EXCEEDED."""


class UnparsableError(ValueError):
    """A session message protobuf could not parse (garbage on the wire): INVALID_ARGUMENT."""


class AdmissionError(Exception):
    """The service is full (waiting queue, open sessions, or a request the KV pool can never
    hold): RESOURCE_EXHAUSTED."""


class DrainingError(Exception):
    """The service is shutting down and takes no new sessions: UNAVAILABLE."""


# What any server raises -> the status a client can act on. A server puts its own first.
STATUS = [
    (ProtocolError, grpc.StatusCode.FAILED_PRECONDITION),
    (IdleError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (AdmissionError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DrainingError, grpc.StatusCode.UNAVAILABLE),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),     # WireError, TreeError, UnparsableError too
]


def status_for(exc: BaseException, own: list = ()) -> grpc.StatusCode:
    for cls, code in (*own, *STATUS):
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


class Unparsable:
    """What a lenient deserializer returns for bytes protobuf cannot parse, so that the handler
    answers INVALID_ARGUMENT with the parser's message instead of gRPC's bare INTERNAL."""

    def __init__(self, error: str):
        self.error = error
        self.request_id = ""


def lenient(cls):
    """A request deserializer for `cls` that returns `Unparsable` instead of raising."""
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return Unparsable(f"the message is not a valid {cls.DESCRIPTOR.full_name}: {exc}")
    return parse


def _guarded(fn):
    async def call(request, context):
        if isinstance(request, Unparsable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        return await fn(request, context)
    return call


def add_lenient_servicer(server: grpc.aio.Server, service: str, servicer, methods: dict) -> None:
    """Register `servicer` for `service` like the generated add_*Servicer_to_server, but with
    lenient request parsing. methods: name -> (kind, request class, response class), kind one of
    unary_unary / unary_stream / stream_stream. Unary-unary methods are guarded here; a
    unary_stream method checks `isinstance(request, Unparsable)` itself, and stream readers get
    UnparsableError from `read_message`."""
    handlers = {}
    for name, (kind, req, resp) in methods.items():
        fn = getattr(servicer, name)
        if kind == "unary_unary":
            fn = _guarded(fn)
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        handlers[name] = make(fn, request_deserializer=lenient(req), response_serializer=resp.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))


async def read_message(context, idle_timeout_s: float | None, what: str = "its state was freed"):
    """The next message of a session stream (or grpc.aio.EOF); IdleError after
    `idle_timeout_s` of silence, so a client that vanished without closing cannot pin memory."""
    return await await_message(context.read(), idle_timeout_s, what)


async def await_message(reading, idle_timeout_s: float | None, what: str = "its state was freed"):
    """`read_message` over a read already started (`context.read()`, or a task of it)."""
    try:
        msg = await asyncio.wait_for(reading, idle_timeout_s)
    except asyncio.TimeoutError:
        raise IdleError(f"session idle for more than {idle_timeout_s:g} s (--idle-timeout-s); {what}") from None
    if isinstance(msg, Unparsable):
        raise UnparsableError(msg.error)
    return msg


async def end_session(context, exc: BaseException, status, log) -> None:
    """End one session stream because of `exc`; the service itself goes on. A cancellation (the
    client left, or the server is stopping) is logged and raised on; any other failure aborts
    the stream with the service's `status(exc)`."""
    if isinstance(exc, asyncio.CancelledError):
        log.info("session_cancelled")
        raise exc
    code = status(exc)
    # A write to a stream the client just cancelled (gRPC raises ExecuteBatchError before it
    # marks the call cancelled): nothing failed here.
    if context.cancelled() or context.done() or type(exc).__name__ == "ExecuteBatchError":
        log.info("session_cancelled")
        return
    if code == grpc.StatusCode.INTERNAL:
        log.exception("session_failed")
    else:
        log.info("session_refused", code=code.name, message=str(exc))
    await context.abort(code, str(exc))


def start_observing(service: str, args) -> None:
    """JSON logs at --log-level and, with --otlp-traces-endpoint, traces: before anything logs."""
    logs.configure(service, args.log_level)
    tracing.configure(service, args, get_logger())


def run_main(program: str, serve, errors: tuple[type[BaseException], ...], share=None) -> None:
    """Run a service's `serve` coroutine; a start-up error in `errors` exits with a one-line
    message (and a JSON log event) instead of a traceback; Ctrl-C exits quietly. Whatever way it
    ends, the process leaves the host's core registry (`share`, splitspec/colocation.py) and
    sends the traces it still holds."""
    try:
        asyncio.run(serve)
    except errors as exc:
        get_logger().error("startup_failed", error=str(exc))
        raise SystemExit(f"{program}: {exc}") from None
    except KeyboardInterrupt:
        pass
    finally:
        if share is not None:
            share.leave()
        tracing.shutdown()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it), for a server or a rendezvous started next."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def channel_options(max_message_mb: int, *, round_robin: bool = False) -> list[tuple]:
    """Options for servers and clients. round_robin spreads RPCs (for us: whole sessions)
    over every address a name resolves to, e.g. the replicas behind `dns:///target:50051`."""
    size = max_message_mb * 1024 * 1024
    opts = [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size),
            # A client stream left open by a crashed peer must not pin a KV cache forever.
            ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.max_pings_without_data", 0), ("grpc.keepalive_permit_without_calls", 1)]
    if round_robin:
        opts.append(("grpc.service_config", '{"loadBalancingConfig": [{"round_robin": {}}]}'))
    return opts


def add_connection_age_flags(parser) -> None:
    """--max-connection-age-s and its grace: gRPC clients re-resolve a name (a Kubernetes headless
    Service, compose's service name) only when a connection closes, so a server that ends its
    connections after a while lets the gateway learn new replicas (docs/kubernetes.md)."""
    a = parser.add_argument
    a("--max-connection-age-s", type=float, default=0.0,
      help="send each client GOAWAY once its connection is this old (0: never), so it reconnects, re-resolves "
           "the service name and reaches new replicas; streams in flight go on (see the grace)")
    a("--max-connection-age-grace-s", type=float, default=0.0,
      help="after that GOAWAY, how long streams still running on the old connection may go on before it is "
           "closed (0: no limit); make it longer than the longest session stream")


def add_server_flags(parser, *, port: int, in_flight: str = "sessions") -> None:
    """The flags every service takes alike: where it listens, its largest message, how it drains
    and ages its connections, its logs, metrics, traces and TLS."""
    a = parser.add_argument
    a("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in containers)")
    a("--port", type=int, default=port, help="port to listen on (0: any free port)")
    a("--max-message-mb", type=int, default=64, help="largest gRPC message, either direction")
    a("--drain-timeout-s", type=float, default=30.0,
      help=f"on SIGTERM, how long in-flight {in_flight} may run before the server stops")
    add_connection_age_flags(parser)
    a("--log-level", default="info", choices=list(logs.LEVELS), help="JSON log lines at this level and above")
    add_metrics_flag(parser)
    tracing.add_flags(parser)
    add_tls_flags(parser)


def add_model_flags(parser, *, threads_help: str, dtype_help: str) -> None:
    """The flags of a service that runs a model (the target, the draft): the id it reports, its
    device, its threads (and its share of this host's cores) and its dtype."""
    a = parser.add_argument
    a("--served-model-name", default=None, help="model id reported by GetInfo (default: the folder name)")
    a("--device", default="cpu", help="cpu, cuda or cuda:N")
    a("--torch-threads", type=int, default=0, help=threads_help)
    add_core_sharing_flag(parser)
    a("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help=dtype_help)


def server_options(max_message_mb: int, max_connection_age_s: float = 0.0,
                   max_connection_age_grace_s: float = 0.0) -> list[tuple]:
    opts = channel_options(max_message_mb) + [
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.so_reuseport", 0),  # two servers on one port would split sessions silently
    ]
    if max_connection_age_s < 0 or max_connection_age_grace_s < 0:
        raise SystemExit("--max-connection-age-s and --max-connection-age-grace-s must be >= 0")
    if max_connection_age_s > 0:
        opts.append(("grpc.max_connection_age_ms", max(1, round(max_connection_age_s * 1000))))
        if max_connection_age_grace_s > 0:
            opts.append(("grpc.max_connection_age_grace_ms", max(1, round(max_connection_age_grace_s * 1000))))
    return opts


@dataclass
class Server:
    """A grpc.aio server with health and reflection for `services` (full names, e.g.
    "splitspec.v1.Target"). Health starts NOT_SERVING; call `set_serving(True)` once the
    service can take work (weights loaded and warmed up). `credentials` (grpc server
    credentials, splitspec/security.py) serve TLS instead of plaintext; `interceptors` run
    before every handler (the gateway's API-key check)."""
    services: list[str]
    max_message_mb: int = 64
    credentials: grpc.ServerCredentials | None = None
    interceptors: tuple = ()
    max_connection_age_s: float = 0.0
    max_connection_age_grace_s: float = 0.0
    grpc: grpc.aio.Server = field(init=False)
    health: health.aio.HealthServicer = field(init=False)

    @classmethod
    def from_args(cls, services: list[str], args, interceptors: tuple = ()) -> "Server":
        """The server `add_server_flags`' flags describe."""
        return cls(services, max_message_mb=args.max_message_mb, credentials=server_credentials(args),
                   interceptors=interceptors, max_connection_age_s=args.max_connection_age_s,
                   max_connection_age_grace_s=args.max_connection_age_grace_s)

    def __post_init__(self):
        self.grpc = grpc.aio.server(options=server_options(self.max_message_mb, self.max_connection_age_s,
                                                           self.max_connection_age_grace_s),
                                    interceptors=list(self.interceptors) or None)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        names = [*self.services, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.grpc)
        self.serving = False
        self.draining = False
        self._kept: list[asyncio.Future] = []

    async def start(self, host: str, port: int) -> int:
        """Bind and start with health NOT_SERVING; returns the bound port (useful with port 0).
        From here on SIGTERM/SIGINT request a drain, even during start-up."""
        for name in ("", *self.services):
            await self.health.set(name, NOT_SERVING)
        try:
            if self.credentials is not None:
                bound = self.grpc.add_secure_port(_address(host, port), self.credentials)
            else:
                bound = self.grpc.add_insecure_port(_address(host, port))
        except RuntimeError:
            bound = 0
        if bound == 0:
            raise SystemExit(f"cannot listen on {host}:{port}: the port is in use or the address is not local")
        await self.grpc.start()
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self._stop.set)
        return bound

    def keep(self, task: asyncio.Future) -> None:
        """A watcher that lives as long as the server (the core-share follower): `run` cancels it."""
        self._kept.append(task)

    def request_stop(self) -> None:
        """Same as SIGTERM; callable from any thread."""
        self._loop.call_soon_threadsafe(self._stop.set)

    async def set_serving(self, ok: bool) -> None:
        self.serving = ok
        for name in ("", *self.services):
            await self.health.set(name, SERVING if ok else NOT_SERVING)

    async def run(self, startup: Awaitable, drain_timeout_s: float, on_drain=None) -> bool:
        """Run `startup` (load weights and warm up, or connect to backends), go SERVING, serve
        until SIGTERM/SIGINT, then drain: health goes NOT_SERVING (load balancers and compose
        stop sending work), new RPCs are refused, in-flight ones get `drain_timeout_s` to
        finish, and the server stops. Returns False if stopped before start-up finished."""
        log = get_logger()
        stopper = asyncio.ensure_future(self._stop.wait())
        task = asyncio.ensure_future(startup)
        try:
            await asyncio.wait([task, stopper], return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                log.info("stopped_during_startup")
                return False
            task.result()                       # start-up errors propagate
            await self.set_serving(True)
            waiter = asyncio.ensure_future(self.grpc.wait_for_termination())
            await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
            if not waiter.done():
                log.info("draining", timeout_s=drain_timeout_s)
                self.draining = True
                await self.health.enter_graceful_shutdown()
                if on_drain is not None:
                    on_drain()
                await self.grpc.stop(drain_timeout_s)
            log.info("stopped")
            return True
        finally:
            for t in (task, stopper, *self._kept):
                t.cancel()
            await self.grpc.stop(0)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
