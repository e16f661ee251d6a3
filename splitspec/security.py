"""TLS / mTLS credentials for every gRPC server and client, and the gateway's API keys.

* `--tls-cert` + `--tls-key` serve gRPC over TLS; the same pair is this process's client
  certificate when it dials another service. `--tls-ca` makes servers require a client
  certificate signed by that CA (mTLS) and makes clients verify servers against it.
* `--api-key` (repeatable) / `--api-key-file` on the gateway: every RPC but health and reflection
  needs `authorization: Bearer <key>` metadata, else UNAUTHENTICATED. Keys are compared in
  constant time and never logged.
"""
from __future__ import annotations

import hmac
from pathlib import Path

import grpc

from .flags import ListFlag

# Probes (compose health checks, load balancers) and grpcurl's discovery carry no key.
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
BEARER = "bearer "


def add_tls_flags(parser) -> None:
    a = parser.add_argument
    a("--tls-cert", default=None,
      help="PEM certificate (chain) of this service: serve gRPC over TLS, and present it as the client "
           "certificate when dialing other services")
    a("--tls-key", default=None, help="PEM private key of --tls-cert")
    a("--tls-ca", default=None,
      help="PEM CA certificate(s): servers require client certificates signed by it (mTLS); clients "
           "verify the services they dial against it")


def add_api_key_flags(parser) -> None:
    a = parser.add_argument
    a("--api-key", action=ListFlag, default=[],
      help="accepted API key, sent as 'authorization: Bearer KEY' (gRPC metadata or HTTP header); "
           "repeatable or comma-separated; prefer --api-key-file or the environment over the command line")
    a("--api-key-file", default=None, help="file with one accepted API key per line (# comments)")


def _read(path: str | None, flag: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SystemExit(f"{flag} {path}: {exc.strerror or exc}") from None


def check_tls_args(args, *, server: bool = True) -> None:
    cert, key, ca = args.tls_cert, args.tls_key, args.tls_ca
    if bool(cert) != bool(key):
        raise SystemExit("--tls-cert and --tls-key go together")
    if server and ca and not cert:
        raise SystemExit("--tls-ca on a server needs --tls-cert and --tls-key (it requires client certificates)")


def server_credentials(args) -> grpc.ServerCredentials | None:
    """TLS for a server from its flags (None: plaintext). With --tls-ca, client certificates
    are required (mTLS)."""
    check_tls_args(args)
    if not args.tls_cert:
        return None
    ca = _read(args.tls_ca, "--tls-ca")
    return grpc.ssl_server_credentials([(_read(args.tls_key, "--tls-key"), _read(args.tls_cert, "--tls-cert"))],
                                       root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(cert: str | None = None, key: str | None = None,
                        ca: str | None = None) -> grpc.ChannelCredentials | None:
    """TLS for a client (None: plaintext): any of the three flags turns it on. Without a CA
    the system's roots verify the server; with cert + key the client presents them (mTLS)."""
    if not (cert or key or ca):
        return None
    if bool(cert) != bool(key):
        raise SystemExit("--tls-cert and --tls-key go together")
    return grpc.ssl_channel_credentials(root_certificates=_read(ca, "--tls-ca"),
                                        private_key=_read(key, "--tls-key"),
                                        certificate_chain=_read(cert, "--tls-cert"))


def client_credentials(args) -> grpc.ChannelCredentials | None:
    return channel_credentials(args.tls_cert, args.tls_key, args.tls_ca)


def load_api_keys(args) -> tuple[str, ...]:
    keys = [k.strip() for k in args.api_key if k.strip()]
    if args.api_key_file:
        text = _read(args.api_key_file, "--api-key-file").decode("utf-8")
        keys += [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return tuple(dict.fromkeys(keys))


class ApiKeys:
    """The accepted keys; `check` takes an `authorization` header value."""

    def __init__(self, keys: tuple[str, ...]):
        self._keys = tuple(k.encode() for k in keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def check(self, authorization: str | None) -> bool:
        if not authorization or authorization[:len(BEARER)].lower() != BEARER:
            return False
        given = authorization[len(BEARER):].strip().encode()
        # Compare with every key, so the time taken says nothing about which one nearly matched.
        return any([hmac.compare_digest(given, k) for k in self._keys])


UNAUTHENTICATED_MESSAGE = "missing or invalid API key: send 'authorization: Bearer <key>'"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any RPC without a valid key, except health and reflection."""

    def __init__(self, keys: ApiKeys):
        self.keys = keys

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        auth = next((v for k, v in (details.invocation_metadata or ()) if k == "authorization"), None)
        if self.keys.check(auth if isinstance(auth, str) else None):
            return handler
        from .logs import (
            get_logger,  # not at import: `splitspec health` loads this module too
        )
        get_logger().info("request_unauthenticated", method=details.method, key_given=auth is not None)
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only aborts UNAUTHENTICATED."""
    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kw)
    return grpc.unary_unary_rpc_method_handler(refuse, **kw)
