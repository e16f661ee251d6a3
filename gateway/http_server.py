"""Run the OpenAI-compatible HTTP API (gateway/http_api.py) with uvicorn inside the gateway's
own event loop, next to the gRPC server, so both share the servicer, its backends and its
metrics. The gateway keeps its own SIGTERM handling (drain): uvicorn's is switched off."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
from pathlib import Path

import uvicorn

from splitspec import tracing
from splitspec.security import ApiKeys

from .chat import ChatTemplate, ChatTemplateError
from .http_api import DEFAULT_TIMEOUT_S, create_app


class _Server(uvicorn.Server):
    # Signals belong to the gateway (splitspec/serving.py drains on SIGTERM); uvicorn must not
    # take them over (capture_signals in recent uvicorn, install_signal_handlers in older ones).
    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:
        pass


class HttpFront:
    def __init__(self, server: _Server, task: asyncio.Task, port: int):
        self.server, self.task, self.port = server, task, port

    def drain(self) -> None:
        """SIGTERM: stop accepting; uvicorn lets in-flight responses finish."""
        self.server.should_exit = True

    async def stop(self, timeout_s: float = 5.0) -> None:
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout_s)
        except (asyncio.TimeoutError, Exception):   # noqa: BLE001 - stopping; nothing to report to
            self.server.force_exit = True
            self.task.cancel()


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file holding a Jinja template, or the template itself (as vLLM's flag
    takes it); compiled now so a broken one stops the gateway at start-up, not every chat request."""
    if not value:
        return None
    path = Path(value)
    if path.is_file():
        text = path.read_text()
    elif "{" in value:
        text = value
    else:
        raise SystemExit(f"--chat-template {value}: no such file, and not a Jinja template either")
    try:
        ChatTemplate(json.dumps({"chat_template": text}), "--chat-template")
    except ChatTemplateError as exc:
        raise SystemExit(str(exc)) from None
    return text


async def start_http(servicer, keys: ApiKeys, args, log) -> HttpFront:
    """Listen on --host:--http-port (TLS with --tls-cert; client certificates required with
    --tls-ca, as on the gRPC port) and serve in this event loop."""
    host = args.host
    if getattr(args, "http_timeout_s", 0) < 0:
        raise SystemExit("--http-timeout-s must be >= 0 (0: no deadline)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio turns Nagle's algorithm off only on sockets that say they are TCP,
    # and with it on, a response written as headers then body waited for the client's delayed ACK
    # (40 ms on every keep-alive request).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, args.http_port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"--http-port {args.http_port}: cannot listen on {host}: {exc.strerror}") from None
    sock.listen(128)
    tls = {}
    if args.tls_cert:
        tls = dict(ssl_certfile=args.tls_cert, ssl_keyfile=args.tls_key)
        if args.tls_ca:
            tls.update(ssl_ca_certs=args.tls_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    app = create_app(servicer, keys, load_chat_template(getattr(args, "chat_template", None)),
                     timeout_s=getattr(args, "http_timeout_s", DEFAULT_TIMEOUT_S))
    app = tracing.asgi(app)         # a traceparent header parents the request's trace (no-op when off)
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=args.drain_timeout_s, **tls)
    server = _Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    port = sock.getsockname()[1]
    log.info("http_listening", host=host, port=port, tls=bool(tls))
    return HttpFront(server, task, port)
