"""Launching what a bench measures: the models it names, and a target, drafts and gateways started
as `splitspec up` runs them (`Stack`), bare with nothing but their model paths (`hand`), or by
`splitspec up` itself (`up`). A Stack records each process as soon as it starts, so the bench's
`finally: stack.stop()` stops it even when a later start or health wait fails."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def add_flags(add, request_timeout_s: float = 900.0, out: str | None = None) -> None:
    """The flags a Stack reads (`add`: a parser's add_argument); with `out` (the bench's default
    folder), also those every bench that starts one shares."""
    if out is not None:
        add("--target-model-path", default=None, help="target model folder or .gguf (default: the bundled target)")
        add("--top-p", type=float, default=0.95, help="applies at temperature > 0")
        add("--seed", type=int, default=0, help="request i of repeat r uses seed + 1000 r + i at T > 0")
        add("--out", default=out, help="folder for results.json, results.md and the service logs")
        add("--num-draft-tokens", type=int, default=None, help="verify width (default: the draft's block size, else 8)")
    add("--device", default="cpu", help="device of the services")
    add("--target-torch-threads", type=int, default=0, help="the target's --torch-threads (as `splitspec up`)")
    add("--target-verify-torch-threads", type=int, default=1,
        help="the target's --verify-torch-threads (as `splitspec up`: the draft computes meanwhile)")
    add("--draft-torch-threads", type=int, default=1, help="the draft's --torch-threads (as `splitspec up`)")
    add("--timeout-s", type=float, default=request_timeout_s, help="deadline per request")
    add("--startup-timeout-s", type=float, default=600.0)


def models(target: str | None, draft: str | None, required: bool = True) -> tuple[Path | None, Path | None]:
    """(target folder, draft folder or None). The bundled draft is paired only with the bundled
    target, for which it was trained; draft 'none' means no draft (the draft service runs n-gram)."""
    from splitspec.models.loader import model_folder
    from splitspec_tools.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir
    target_path = model_dir(target, DEFAULT_TARGET)
    if target_path is None and required:
        raise SystemExit("no target model: pass --target-model-path")
    if target_path is not None:             # a .gguf file: the folder built from its metadata
        target_path = model_folder(target_path)
        if not (target_path / "config.json").is_file():
            raise SystemExit(f"target model {target_path}: no config.json there")
    draft_path = None
    if (draft or "").lower() != "none" and (draft is not None or target is None):
        draft_path = model_dir(draft, DEFAULT_DRAFT)
        if draft_path is not None and not (draft_path / "config.json").is_file():
            raise SystemExit(f"draft model {draft_path}: no config.json there")
    return target_path, draft_path


def draft_width(draft_path: Path | None, asked: int | None = None) -> int:
    """The verify width (root + drafted tokens): as asked, else the draft's block size, else 8."""
    if asked is None and draft_path is not None:
        from draft_service.architectures import draft_classes
        raw = json.loads((draft_path / "config.json").read_text())
        asked = draft_classes(raw)[0].from_dict(raw).block_size
    width = asked or 8
    if width < 2:
        raise SystemExit("--num-draft-tokens must be >= 2")
    return width


def architecture(path: Path, flag: str) -> str:
    """The architecture a model folder's config.json names; `flag` (the option that named the folder) says
    which option was wrong where there is none."""
    if not (path / "config.json").is_file():
        raise SystemExit(f"{flag} {path}: no config.json there")
    return json.loads((path / "config.json").read_text()).get("architectures", [""])[0]


def metrics_port() -> tuple[list[str], str]:
    """The flags that give a service a Prometheus exporter on a free port, and its URL."""
    from splitspec_tools.ops.launch import free_port
    port = free_port()
    return ["--metrics-port", str(port)], f"http://127.0.0.1:{port}/metrics"


class Stack:
    """Services a bench starts, with its flags (`args` from `add_flags`) and verify width."""

    def __init__(self, args, target_path: Path, width: int, logs: Path):
        self.args, self.target_path, self.width, self.logs = args, target_path, width, logs
        self.procs: list = []

    def start(self, kind: str, argv: Sequence[str], name: str = ""):
        from splitspec_tools.ops.launch import start_service
        proc = start_service(kind, list(argv), log_dir=self.logs / (name or kind))
        self.procs.append(proc)
        return proc

    def target(self, extra: Sequence[str] = (), name: str = ""):
        a = self.args
        return self.start("target", ["--model-path", str(self.target_path), "--device", a.device, "--log-level",
                                     "warning", "--torch-threads", str(a.target_torch_threads),
                                     "--verify-torch-threads", str(a.target_verify_torch_threads), *extra], name)

    def draft(self, draft_path: Path | None, extra: Sequence[str] = (), name: str = ""):
        """A DFlash draft service, or model-free n-gram drafting when draft_path is None."""
        method = (["--method", "dflash", "--model-path", str(draft_path)] if draft_path else
                  ["--method", "ngram", "--speculative-num-draft-tokens", str(self.width)])
        return self.start("draft", [*method, "--target-model-path", str(self.target_path), "--device",
                                    self.args.device, "--log-level", "warning", "--torch-threads",
                                    str(self.args.draft_torch_threads), *extra], name or "draft")

    def gateway(self, target: str, draft: str | None, extra: Sequence[str] = (), name: str = ""):
        """A gateway over target (one address, or several comma-separated) and draft (None: target
        only) with the bench's verify width; its token cap never cuts a request the bench sends."""
        return self.start("gateway", ["--target", target, *(["--draft", draft] if draft else []),
                                      "--max-new-tokens-cap", "4096", "--log-level", "warning",
                                      "--speculative-num-draft-tokens", str(self.width),
                                      "--speculative-num-steps", str(self.width - 1), *extra], name or "gateway")

    def bare(self, draft_path: Path | None, extra: Sequence[str] = (), name: str = ""):
        """A target, a draft (n-gram without draft_path) and a gateway with nothing but the flags they
        cannot do without (their own defaults) and `extra`: (gateway, target)."""
        target = self.start("target", ["--model-path", str(self.target_path), *extra], f"{name}target")
        draft = self.start("draft", [*(["--model-path", str(draft_path)] if draft_path else ["--method", "ngram"]),
                                     "--target-model-path", str(self.target_path), *extra], f"{name}draft")
        self.wait(target, draft)
        gateway = self.start("gateway", ["--target", target.address, "--draft", draft.address, *extra], f"{name}gateway")
        self.wait(gateway)
        return gateway, target

    def wait(self, *procs) -> None:
        for p in procs:
            p.wait_healthy(self.args.startup_timeout_s)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop() if hasattr(p, "stop") else _terminate(p)
        self.procs.clear()


def hand(args, target_path: Path, draft_path: Path, logs: Path) -> tuple[Stack, str, str, str]:
    """`Stack.bare` with a DFlash draft: (stack, gateway address, target address, description)."""
    stack = Stack(args, target_path, 8, logs)
    try:
        gateway, target = stack.bare(draft_path)
    except BaseException:
        stack.stop()
        raise
    return stack, gateway.address, target.address, (
        f"splitspec-target --model-path {target_path}; splitspec-draft --model-path {draft_path} "
        f"--target-model-path {target_path}; splitspec-gateway --target T --draft D")


def up(args, target_path: Path, draft_path: Path, logs: Path) -> tuple[Stack, str, str, str]:
    """`splitspec up` as a user runs it (its defaults but the models, named: up's own default target
    may be another), the addresses read from what it prints: (stack, gateway, target, description)."""
    logs.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "splitspec_tools.cli", "up", "--gateway-port", "0", "--log-dir", str(logs),
           "--model-path", str(target_path), "--draft-model-path", str(draft_path)]
    stack = Stack(args, target_path, 8, logs)
    with open(logs / "up.log", "w") as out:
        stack.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    deadline = time.monotonic() + 2 * args.startup_timeout_s
    while time.monotonic() < deadline:
        text = (logs / "up.log").read_text(errors="replace")
        target = re.search(r"^target\s+(\S+)\s+loading", text, re.M)
        gateway = re.search(r"^gateway\s+(\S+)\s+serving", text, re.M)
        if target and gateway:
            return stack, gateway.group(1), target.group(1), "splitspec up " + shlex.join(cmd[4:])
        if stack.procs[0].poll() is not None:
            raise RuntimeError(f"splitspec up exited with {stack.procs[0].returncode}:\n{text[-2000:]}")
        time.sleep(0.5)
    stack.stop()
    raise TimeoutError("splitspec up did not serve in time")


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def tokenizer(target_path: Path):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(target_path / "tokenizer.json"))


def max_context(target_path: Path) -> int:
    return int(json.loads((target_path / "config.json").read_text()).get("max_position_embeddings", 4096))
