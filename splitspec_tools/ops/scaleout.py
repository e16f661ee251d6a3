"""`splitspec scaleout`: the compose topology run for real without a container engine.

Two target replicas, two draft replicas and the gateway run as processes inside a private
network and mount namespace (`unshare --net --mount`, as root). Each replica listens on its own
loopback address, as each compose container has its own IP, on the port compose gives it; a
hosts file bind-mounted over /etc/hosts (in the namespace only) maps the compose service names
to both replicas' addresses; and the gateway runs with exactly the command line of compose.yaml
(`--target dns:///target:50051 --draft dns:///draft:50052`). gRPC's resolver (c-ares, the
default, and the `native` getaddrinfo one alike) reads /etc/hosts, so the names resolve to both
replicas and round_robin spreads sessions over them, as Docker's DNS would.

    splitspec scaleout --check --report r.json   # spread, kill one replica of each, restart: a JSON report
    splitspec scaleout                           # just run it; prints how to enter the namespace

Exit code 77 (and a one-line reason) where namespaces are not permitted, so a test can skip.

The report holds raw facts (each request's prompt, tokens and stats; the replicas' logs) so
that the caller judges them: tests/test_scaleout.py compares the tokens with target-only greedy
decoding and counts each replica's sessions in its own log."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

NOT_PERMITTED = 77
IN_NAMESPACE = "SPLITSPEC_SCALEOUT_NAMESPACE"
TARGETS = {"target-a": "127.0.0.2", "target-b": "127.0.0.3"}
DRAFTS = {"draft-a": "127.0.0.4", "draft-b": "127.0.0.5"}
# A third replica of each, started and added to the names during the scale-up check.
ADDED_TARGETS = {"target-c": "127.0.0.6"}
ADDED_DRAFTS = {"draft-c": "127.0.0.7"}
GATEWAY_HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[2]


def add_parser(sub) -> None:
    p = sub.add_parser("scaleout", help="dev: the compose topology (2 targets, 2 drafts behind DNS names) in a "
                                        "private network namespace; --check runs the scale-out checks")
    a = p.add_argument
    a("--model-path", default=None, help="target model folder (default: models/splitspec-code-target)")
    a("--draft-model-path", default=None,
      help="DFlash draft folder (default: models/splitspec-code-draft with the default target; else ngram)")
    a("--compose-file", default=str(ROOT / "compose.yaml"), help="where the gateway's command line comes from")
    a("--log-dir", default=None, help="replica logs, hosts file, report (default: a temporary folder)")
    a("--check", action="store_true", help="run the checks, write the report, stop everything")
    a("--report", default=None, help="write the JSON report here (default: LOG_DIR/report.json)")
    a("--requests", type=int, default=8, help="sequential requests of the spread check")
    a("--streams", type=int, default=4, help="concurrent requests while one replica of each is killed")
    a("--max-new-tokens", type=int, default=64, help="tokens per request")
    a("--startup-timeout-s", type=float, default=300.0)
    a("--max-connection-age-s", type=float, default=2.0,
      help="the replicas' --max-connection-age-s: how soon the gateway re-resolves the names and finds the "
           "replicas the scale-up check adds")


def namespace_problem() -> str | None:
    """Why a private network + mount namespace cannot be made here, or None."""
    if shutil.which("unshare") is None or shutil.which("mount") is None or shutil.which("ip") is None:
        return "needs the unshare, mount and ip commands (util-linux, iproute2)"
    try:
        probe = subprocess.run(["unshare", "--net", "--mount", "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    if probe.returncode != 0:
        return (f"unshare --net --mount is not permitted here (uid {os.geteuid()}; needs root or user "
                f"namespaces): {probe.stderr.strip()}")
    return None


def main(args) -> int:
    if os.environ.get(IN_NAMESPACE) != "1":
        problem = namespace_problem()
        if problem:
            print(f"splitspec scaleout: {problem}", file=sys.stderr)
            return NOT_PERMITTED
        # Re-run this very command inside a fresh network + mount namespace (private mount
        # propagation: the hosts bind mount never reaches the host).
        cmd = ["unshare", "--net", "--mount", "--propagation", "private", "--fork", "--",
               sys.executable, "-m", "splitspec_tools.cli", *sys_argv()]
        return subprocess.call(cmd, env={**os.environ, IN_NAMESPACE: "1"})
    return run_inside(args)


def sys_argv() -> list[str]:
    return sys.argv[1:]


def _compose_services(compose_file: str) -> dict:
    try:
        import yaml
    except ImportError:
        raise SystemExit("splitspec scaleout reads compose.yaml with PyYAML: pip install pyyaml "
                         "(or pip install -e '.[test]')") from None
    return yaml.safe_load(Path(compose_file).read_text())["services"]


def compose_gateway_command(compose_file: str) -> list[str]:
    """The gateway's flags exactly as compose.yaml runs it (without the program name)."""
    command = _compose_services(compose_file)["gateway"]["command"]
    assert command[0] == "splitspec-gateway", command
    return list(command[1:])


def compose_port(compose_file: str, service: str) -> int:
    command = _compose_services(compose_file)[service]["command"]
    return int(command[command.index("--port") + 1])


def write_hosts(hosts: Path, targets: dict, drafts: dict) -> None:
    """The names as DNS would answer them. Rewritten in place (same inode), so the bind mount
    over /etc/hosts shows the new replicas, as a headless Service's DNS does when pods join."""
    lines = ["127.0.0.1 localhost gateway", "::1 localhost"]
    lines += [f"{ip} target" for ip in targets.values()] + [f"{ip} draft" for ip in drafts.values()]
    with open(hosts, "r+" if hosts.exists() else "w") as f:
        f.seek(0)
        f.write("\n".join(lines) + "\n")
        f.truncate()


def setup_network(log_dir: Path) -> Path:
    """Loopback up; /etc/hosts (here only) maps `target` and `draft` to both replicas each."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    hosts = log_dir / "hosts"
    write_hosts(hosts, TARGETS, DRAFTS)
    subprocess.run(["mount", "--bind", str(hosts), "/etc/hosts"], check=True)
    return hosts


class Topology:
    def __init__(self, args, log_dir: Path):
        from splitspec_tools.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir
        self.args, self.log_dir = args, log_dir
        self.model = model_dir(args.model_path, DEFAULT_TARGET)
        if self.model is None:
            raise SystemExit("splitspec scaleout: no target model (pass --model-path)")
        self.draft_model = model_dir(args.draft_model_path, DEFAULT_DRAFT) \
            if (args.draft_model_path or args.model_path is None) else None
        self.target_port = compose_port(args.compose_file, "target")
        self.draft_port = compose_port(args.compose_file, "draft")
        self.gateway_flags = compose_gateway_command(args.compose_file)
        self.procs: dict = {}

    def _start(self, name: str, kind: str, host: str, port: int, extra: list[str]):
        from splitspec_tools.ops.launch import start_service
        svc = start_service(kind, extra, log_dir=self.log_dir / name, host=host, port=port)
        self.procs[name] = svc
        return svc

    def age_flags(self) -> list[str]:
        # Each replica ends its connections after this age (GOAWAY); streams in flight go on.
        return ["--max-connection-age-s", str(self.args.max_connection_age_s), "--max-connection-age-grace-s", "600"]

    def start_target(self, name: str):
        return self._start(name, "target", {**TARGETS, **ADDED_TARGETS}[name], self.target_port,
                           ["--model-path", str(self.model), "--torch-threads", "1", *self.age_flags()])

    def start_draft(self, name: str):
        if self.draft_model is not None:
            extra = ["--method", "dflash", "--model-path", str(self.draft_model)]
        else:
            extra = ["--method", "ngram"]
        return self._start(name, "draft", {**DRAFTS, **ADDED_DRAFTS}[name], self.draft_port,
                           [*extra, "--target-model-path", str(self.model), "--torch-threads", "1",
                            *self.age_flags()])

    def start_all(self) -> None:
        t = self.args.startup_timeout_s
        backends = [self.start_target(n) for n in TARGETS] + [self.start_draft(n) for n in DRAFTS]
        for svc in backends:
            svc.wait_healthy(t)
        # start_service adds --host/--port first; compose's own --host/--port come later and win.
        self.gateway = self._start("gateway", "gateway", GATEWAY_HOST, 50050, self.gateway_flags)
        self.gateway.wait_healthy(t)
        self.gateway_address = f"{GATEWAY_HOST}:{self.gateway_port()}"

    def gateway_port(self) -> int:
        flags = self.gateway_flags
        return int(flags[flags.index("--port") + 1]) if "--port" in flags else 50050

    def kill(self, name: str) -> None:
        svc = self.procs[name]
        svc.proc.send_signal(signal.SIGKILL)
        svc.proc.wait()

    def stop(self) -> None:
        for svc in reversed(list(self.procs.values())):
            svc.stop()

    def log_events(self, name: str, event: str) -> int:
        path = self.log_dir / name / f"{self.procs[name].name}.log"
        return sum(1 for line in path.read_text(errors="replace").splitlines() if f'"event": "{event}"' in line)


def prompt_for(i: int) -> list[int]:
    import random
    rng = random.Random(1000 + i)
    base = [rng.randrange(3, 250) for _ in range(rng.randrange(4, 9))]
    return base * 2      # repeats, so prompt lookup (ngram) has something to find


def generate(address: str, prompt: list[int], n: int, method: str, first_chunk=None) -> dict:
    import grpc

    from splitspec_tools.client import build_request
    from splitspec.v1 import gateway_pb2_grpc
    ids, complete = [], None
    with grpc.insecure_channel(address) as ch:
        for resp in gateway_pb2_grpc.GenerationStub(ch).Generate(
                build_request(prompt, max_new_tokens=n, temperature=0, ignore_eos=True, method=method), timeout=600):
            if resp.HasField("chunk"):
                ids.extend(resp.chunk.token_ids)
                if first_chunk is not None:
                    first_chunk()
                    first_chunk = None
            else:
                complete = resp.complete
    s = complete.stats
    return {"prompt": prompt, "max_new_tokens": n, "ids": ids, "finish_reason": complete.finish_reason,
            "method": s.method, "target_failovers": s.target_failovers, "draft_fallbacks": s.draft_fallbacks,
            "draft_tokens": s.draft_tokens}


def run_checks(top: Topology) -> dict:
    import threading
    a = top.args
    method = "dflash" if top.draft_model is not None else "ngram"
    report = {"method": method, "gateway_command": ["splitspec-gateway", *top.gateway_flags],
              "replicas": {**TARGETS, **DRAFTS}, "logs": {}}

    # 1. Sessions spread over both replicas of each backend: at least --requests requests, and
    # on until every replica has had a session (the gateway's connections to a replica may come
    # up later than to its twin on a loaded machine), within a bound.
    def opened(names) -> dict:
        return {n: top.log_events(n, "session_opened") for n in names}
    report["spread"] = []
    deadline = time.monotonic() + 300
    while len(report["spread"]) < 10 * a.requests:
        report["spread"].append(generate(top.gateway_address, prompt_for(len(report["spread"])), a.max_new_tokens,
                                         method))
        spread = opened([*TARGETS, *DRAFTS])
        if len(report["spread"]) >= a.requests and all(spread.values()) or time.monotonic() > deadline:
            break
    report["sessions_after_spread"] = opened([*TARGETS, *DRAFTS])

    # 2. Kill one replica of each while requests stream: once every request has its first
    # chunk and both victims hold sessions in flight.
    firsts = [threading.Event() for _ in range(a.streams)]

    def open_now() -> dict:
        return {n: top.log_events(n, "session_opened") - top.log_events(n, "session_closed")
                for n in [*TARGETS, *DRAFTS]}
    with ThreadPoolExecutor(a.streams) as pool:
        futures = [pool.submit(generate, top.gateway_address, prompt_for(100 + i), 10 * a.max_new_tokens, method,
                               firsts[i].set) for i in range(a.streams)]
        for e in firsts:
            e.wait(300)
        deadline = time.monotonic() + 30
        while (busy := open_now())["target-a"] < 1 or busy["draft-a"] < 1:
            if time.monotonic() > deadline or all(f.done() for f in futures):
                break
            time.sleep(0.005)
        top.kill("target-a")
        top.kill("draft-a")
        report["killed"] = [f.result() for f in futures]
    report["open_sessions_at_kill"] = busy

    # 3. The restarted replicas get sessions again.
    before = {n: top.log_events(n, "session_opened") for n in ("target-a", "draft-a")}   # same log files
    top.start_target("target-a").wait_healthy(a.startup_timeout_s)
    top.start_draft("draft-a").wait_healthy(a.startup_timeout_s)
    report["after_restart"] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        report["after_restart"].append(generate(top.gateway_address, prompt_for(len(report["after_restart"])),
                                                a.max_new_tokens // 2, method))
        got = {n: top.log_events(n, "session_opened") for n in ("target-a", "draft-a")}
        if all(got[n] > before[n] for n in got) and len(report["after_restart"]) >= 2:
            break
    report["sessions_on_restarted"] = {n: top.log_events(n, "session_opened") - before[n]
                                       for n in ("target-a", "draft-a")}

    # 4. Scale up: a third replica of each starts and joins the names (as a new pod joins a
    # headless Service). The gateway resolved the names long ago and keeps its connections, so
    # it finds the new replicas only by re-resolving, which it does when a replica ends a
    # connection at its --max-connection-age-s; sessions then reach the new replicas.
    for name in ADDED_TARGETS:
        top.start_target(name).wait_healthy(a.startup_timeout_s)
    for name in ADDED_DRAFTS:
        top.start_draft(name).wait_healthy(a.startup_timeout_s)
    write_hosts(top.hosts, {**TARGETS, **ADDED_TARGETS}, {**DRAFTS, **ADDED_DRAFTS})
    report["after_scale_up"] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        report["after_scale_up"].append(generate(top.gateway_address, prompt_for(300 + len(report["after_scale_up"])),
                                                 a.max_new_tokens // 2, method))
        if all(opened([*ADDED_TARGETS, *ADDED_DRAFTS]).values()):
            break
    report["sessions_on_added"] = opened([*ADDED_TARGETS, *ADDED_DRAFTS])
    report["added_replicas"] = {**ADDED_TARGETS, **ADDED_DRAFTS}
    report["logs"] = {n: str(top.log_dir / n / f"{svc.name}.log") for n, svc in top.procs.items()}
    return report


def run_inside(args) -> int:
    from splitspec_tools.ops.launch import first_to_exit, run_stack
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="splitspec-scaleout-")).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    hosts = setup_network(log_dir)
    top = Topology(args, log_dir)
    top.hosts = hosts

    def run() -> int:
        top.start_all()
        print(f"scale-out topology up in a private namespace (pid {os.getpid()}): gateway "
              f"{top.gateway_address}, targets {list(TARGETS.values())}, drafts {list(DRAFTS.values())}; "
              f"logs in {log_dir}", file=sys.stderr)
        if not args.check:
            print(f"enter it with: nsenter --target {os.getpid()} --net --mount splitspec generate --gateway "
                  f"{top.gateway_address} \"def fibonacci(n):\"   (Ctrl-C stops)", file=sys.stderr)
            first_to_exit(top.procs.values())
            return 1
        report = run_checks(top)
        path = Path(args.report or log_dir / "report.json")
        path.write_text(json.dumps(report))
        print(f"report: {path}", file=sys.stderr)
        return 0
    return run_stack("splitspec scaleout", run, top.stop)
