"""Start splitspec services as local processes, wait for their grpc.health.v1 SERVING, stop
them. Used by `splitspec up` and by the tests, which run the real servers this way."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitspec.serving import free_port  # noqa: F401  (the tests and `up` take it from here too)

MODULES = {"target": "target_service.server", "draft": "draft_service.server", "gateway": "gateway.server"}


def port_available(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def health_status(address: str, service: str = "", timeout_s: float = 1.0,
                  credentials: grpc.ChannelCredentials | None = None) -> int | None:
    """grpc.health.v1 Check (over TLS with `credentials`); the status enum, or None when
    nothing answers."""
    with (grpc.secure_channel(address, credentials) if credentials is not None
          else grpc.insecure_channel(address)) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s).status
        except grpc.RpcError:
            return None


@dataclass
class ServiceProcess:
    name: str
    address: str
    proc: subprocess.Popen
    log_path: Path
    credentials: grpc.ChannelCredentials | None = None     # for the health checks of a TLS service

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_healthy(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} before serving; "
                                   f"last log lines ({self.log_path}):\n{self.log_tail()}")
            if health_status(self.address, credentials=self.credentials) == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} at {self.address} not SERVING after {timeout_s:g} s; "
                           f"last log lines ({self.log_path}):\n{self.log_tail()}")

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM (the service drains), then SIGKILL if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_service(name: str, args: list[str], *, log_dir: Path, host: str = "127.0.0.1",
                  port: int | None = None, env: dict | None = None,
                  credentials: grpc.ChannelCredentials | None = None) -> ServiceProcess:
    """Run `python -m <module of name> --host H --port P *args` with its logs in log_dir/name.log.
    `credentials`: what health checks dial it with when it serves TLS."""
    port = port or free_port(host)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    cmd = [sys.executable, "-m", MODULES[name], "--host", host, "--port", str(port), *args]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})})
    return ServiceProcess(name, f"{host}:{port}", proc, log_path, credentials)


def first_to_exit(procs) -> ServiceProcess:
    """Wait until one of the running services `procs` exits: that one."""
    procs = list(procs)
    while all(p.proc.poll() is None for p in procs):
        time.sleep(0.5)
    return next(p for p in procs if p.proc.poll() is not None)


def run_stack(program: str, run, stop) -> int:
    """The exit code of a command that starts services (`run()`): Ctrl-C (and SIGTERM made into
    it) is a clean stop, 0; a service that could not start, a one-line message and 1; whatever
    way it ends, `stop()` stops the services."""
    try:
        return run()
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"{program}: {exc}", file=sys.stderr)
        return 1
    finally:
        stop()
