"""The services a bench starts: a target, a draft and a gateway with the bench's own flags.

Every function takes the bench (a `run.Bench`: its args, target_path, width and procs) and
records each process in `bench.procs` as soon as it starts, so the bench's `finally` stops it
even when a later start or health wait fails."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def add_flags(add, request_timeout_s: float) -> None:
    """The flags the functions below read (`add`: a parser's add_argument), and the deadline per request."""
    add("--device", default="cpu")
    add("--target-torch-threads", type=int, default=0)
    add("--target-verify-torch-threads", type=int, default=1)
    add("--draft-torch-threads", type=int, default=1)
    add("--timeout-s", type=float, default=request_timeout_s, help="deadline per request")
    add("--startup-timeout-s", type=float, default=600.0)


def start(bench, kind: str, args: list[str], log_dir: Path):
    from splitspec_tools.ops.launch import start_service
    proc = start_service(kind, args, log_dir=log_dir)
    bench.procs.append(proc)
    return proc


def start_target(bench, log_dir: Path, extra: Sequence[str] = ()):
    """A target with the bench's thread flags (as `splitspec up` runs it); `extra` follows them."""
    a = bench.args
    return start(bench, "target", ["--model-path", str(bench.target_path), "--device", a.device,
                                   "--log-level", "warning", "--torch-threads", str(a.target_torch_threads),
                                   "--verify-torch-threads", str(a.target_verify_torch_threads), *extra], log_dir)


def start_draft(bench, draft_path: Path | None, log_dir: Path):
    """A DFlash draft from draft_path, or model-free ngram drafting the bench's verify width."""
    a = bench.args
    if draft_path is not None:
        method = ["--method", "dflash", "--model-path", str(draft_path)]
    else:
        method = ["--method", "ngram", "--speculative-num-draft-tokens", str(bench.width)]
    return start(bench, "draft", [*method, "--target-model-path", str(bench.target_path), "--device", a.device,
                                  "--log-level", "warning", "--torch-threads", str(a.draft_torch_threads)], log_dir)


def start_gateway(bench, target: str, draft: str | None, log_dir: Path, extra: Sequence[str] = ()):
    """A gateway over target (one address or several, comma-separated) and draft (None: target
    only) with the bench's verify width; its token cap never cuts a request the bench sends."""
    a = bench.args
    return start(bench, "gateway", ["--target", target, *(["--draft", draft] if draft else []),
                                    "--max-new-tokens-cap", str(max(2048, a.max_new_tokens)),
                                    "--speculative-num-draft-tokens", str(bench.width),
                                    "--speculative-num-steps", str(bench.width - 1), "--log-level", "warning",
                                    *extra], log_dir)


def wait_healthy(bench, procs) -> None:
    for proc in procs:
        proc.wait_healthy(bench.args.startup_timeout_s)
