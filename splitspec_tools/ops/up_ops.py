"""The operations flags of `splitspec up` (issue 18): the OpenAI HTTP front (on by default),
Prometheus metrics on every service, mTLS between everything with a `splitspec certs` folder,
and the client flags of `splitspec generate` / `health`. Kept out of cli.py so that the flags
and the per-service arguments they turn into live in one place."""
from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_HTTP_PORT = 8000
METRICS_OFFSET = {"gateway": 0, "target": 1, "draft": 2}


def add_up_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--http-port", type=int, default=DEFAULT_HTTP_PORT,
      help="the gateway's OpenAI-compatible HTTP API (0: off; the default one, if taken, falls back to a free port)")
    a("--chat-template", default=None,
      help="the gateway's chat template for /v1/chat/completions: a file or the Jinja text (the bundled "
           "models have none)")
    a("--metrics-port", type=int, default=0,
      help="Prometheus metrics: the gateway on this port, the target on +1, the draft on +2 (0: off)")
    a("--tls-dir", default=None,
      help="a `splitspec certs` folder: every service serves mTLS with its certificate and dials the others "
           "with it (ca.pem, NAME.pem, NAME-key.pem)")


def add_client_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--tls-ca", default=None, help="CA certificate(s) to verify the server with (turns TLS on)")
    a("--tls-cert", default=None, help="client certificate, for a server that requires one (mTLS)")
    a("--tls-key", default=None, help="private key of --tls-cert")


def add_api_key_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", default=None, help="API key sent as 'authorization: Bearer KEY'")


def tls_files(tls_dir: str | None, name: str) -> dict | None:
    if not tls_dir:
        return None
    d = Path(tls_dir)
    files = dict(cert=d / f"{name}.pem", key=d / f"{name}-key.pem", ca=d / "ca.pem")
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise SystemExit(f"--tls-dir {tls_dir}: missing {', '.join(missing)} (write them with "
                         f"`splitspec certs --out {tls_dir}`)")
    return {k: str(v) for k, v in files.items()}


def service_args(args, name: str) -> list[str]:
    """Extra flags of service `name` under `up`."""
    out = []
    if args.metrics_port:
        out += ["--metrics-port", str(args.metrics_port + METRICS_OFFSET[name])]
    tls = tls_files(args.tls_dir, name)
    if tls:
        out += ["--tls-cert", tls["cert"], "--tls-key", tls["key"], "--tls-ca", tls["ca"]]
    return out


def gateway_args(args, host: str) -> list[str]:
    from splitspec_tools.ops.launch import port_available
    out = service_args(args, "gateway")
    if args.http_port:
        port = args.http_port
        if port == DEFAULT_HTTP_PORT and not port_available(host, port):
            from splitspec_tools.ops.launch import free_port
            port = free_port(host)
        out += ["--http-port", str(port)]
    if args.chat_template:
        out += ["--chat-template", args.chat_template]
    return out


def client_credentials(args, name: str = "client"):
    """Channel credentials for up's own clients (health checks, the --prompt generation)."""
    tls = tls_files(args.tls_dir, name)
    if not tls:
        return None
    from splitspec.security import channel_credentials
    return channel_credentials(tls["cert"], tls["key"], tls["ca"])


def print_endpoints(args, gateway_ops: list[str], out) -> None:
    scheme = "https" if args.tls_dir else "http"
    if "--http-port" in gateway_ops:
        port = gateway_ops[gateway_ops.index("--http-port") + 1]
        print(f"http    {scheme}://{args.host}:{port}/v1  (OpenAI-compatible)", file=out)
    if args.metrics_port:
        ports = ", ".join(f"{name} :{args.metrics_port + off}" for name, off in METRICS_OFFSET.items())
        print(f"metrics http://{args.host}:PORT/metrics  ({ports})", file=out)


def env_api_key() -> str | None:
    """A key for up's own --prompt request when the environment gives the gateway keys
    (SPLITSPEC_API_KEY / SPLITSPEC_API_KEY_FILE reach the gateway `up` starts)."""
    import os

    from splitspec.security import load_api_keys
    keys = load_api_keys(argparse.Namespace(api_key=os.environ.get("SPLITSPEC_API_KEY", "").split(","),
                                            api_key_file=os.environ.get("SPLITSPEC_API_KEY_FILE")))
    return keys[0] if keys else None
