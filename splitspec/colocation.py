"""Services started on one host share its cores instead of each taking every core (issue 25).

A target and a draft started by hand at torch's default both run one intra-op thread per core;
on a small machine their OpenMP threads then spin against each other and a batched Propose that
costs 10 ms alone took 110 ms. So every target and DFlash draft service joins a small per-host
registry: one file per live service in a runtime folder (`$SPLITSPEC_RUNTIME_DIR`, else
`$XDG_RUNTIME_DIR/splitspec`, else `<tmp>/splitspec-<uid>`), holding its role and the CPUs it may
run on. Each file stays locked (flock) while its process lives, so a crashed service's file is
recognised as stale and removed by the next reader; the kernel drops the lock, whatever killed
the process. Only peers whose CPU sets overlap ours count (services pinned apart with taskset do
not share).

With `--torch-threads 0` (auto) the service divides the C cores it may use with the T targets
and D drafts it counts (itself included):

* draft: `max(1, C // (T + D))` threads when a target shares the host, else `C // D`;
* target: `max(1, C // T)` threads; for forwards that verify a model draft while sessions
  drafting with the model are at least half of those running (when the draft is computing for
  the other sessions; `Scheduler._draft_busy`), `--verify-torch-threads 0` (auto) leaves the
  drafts their share: `max(1, threads - D * draft share)`.

On 2 cores with one target and one draft that is target 2 threads, 1 while several sessions
verify, draft 1: the setting `splitspec up` measured best (docs/benchmarks.md, issue 15). A
service that joins later is seen within `REFRESH_S`, and the others adjust. Explicit thread
flags (> 0) win; `--core-sharing off` neither joins nor reads the registry (--torch-threads 0
then means torch's default, one thread per core).
"""
from __future__ import annotations

import asyncio
import fcntl
import json
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REFRESH_S = 1.0
ROLES = ("target", "draft")


def registry_dir(environ=None) -> Path:
    env = os.environ if environ is None else environ
    if env.get("SPLITSPEC_RUNTIME_DIR"):
        return Path(env["SPLITSPEC_RUNTIME_DIR"])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "splitspec"
    return Path(tempfile.gettempdir()) / f"splitspec-{os.getuid()}"


def usable_cpus() -> frozenset[int]:
    """The CPUs this process may run on (taskset / cgroup cpusets), not just the host's count."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class Threads:
    """What a service runs with now, and whom it counted."""
    threads: int                  # intra-op threads for its forwards
    verify_threads: int           # target: threads for verify forwards while several sessions run
    cores: int
    targets: int
    drafts: int


def divide(role: str, cores: int, targets: int, drafts: int, *, threads: int = 0, verify_threads: int = 0) -> Threads:
    """The rule of the module doc; explicit `threads` / `verify_threads` (> 0) are kept."""
    draft_share = max(1, cores // (targets + drafts)) if targets else max(1, cores // max(1, drafts))
    if role == "draft":
        n = threads or draft_share
        return Threads(n, n, cores, targets, drafts)
    n = threads or max(1, cores // max(1, targets))
    verify = verify_threads or (max(1, n - drafts * draft_share) if drafts else n)
    return Threads(n, verify, cores, targets, drafts)


class HostShare:
    """This service's entry in the host registry, and its thread counts from who else is there."""

    def __init__(self, role: str, *, threads: int = 0, verify_threads: int = 0, directory: Path | None = None,
                 cpus: frozenset[int] | None = None, refresh_s: float = REFRESH_S):
        if role not in ROLES:
            raise ValueError(f"role {role!r}: expected one of {ROLES}")
        self.role, self.threads, self.verify_threads = role, threads, verify_threads
        self.directory = Path(directory) if directory is not None else registry_dir()
        self.cpus = cpus if cpus is not None else usable_cpus()
        self.refresh_s = refresh_s
        self._file = None
        self._path: Path | None = None
        self._plan: Threads | None = None
        self._at = 0.0

    def join(self) -> "HostShare":
        """Register (a locked file, renamed into place only once locked, so no reader can take a
        half-made entry for a dead one). A registry that cannot be written leaves this service
        counting only itself: it never stops a service from starting."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            name = f"{self.role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            tmp = self.directory / f".{name}.tmp"
            f = open(tmp, "w")
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            json.dump({"role": self.role, "pid": os.getpid(), "cpus": sorted(self.cpus)}, f)
            f.flush()
            self._path = self.directory / f"{name}.json"
            os.rename(tmp, self._path)
            self._file = f
        except OSError:
            self._file = self._path = None
        return self

    def leave(self) -> None:
        if self._file is not None:
            try:
                self._path.unlink(missing_ok=True)
            finally:
                self._file.close()
                self._file = self._path = None

    def peers(self) -> list[dict]:
        """Live entries of other services whose CPUs overlap ours; stale ones are removed."""
        out = []
        try:
            paths = [p for p in self.directory.glob("*.json") if p != self._path]
        except OSError:
            return out
        for path in paths:
            try:
                with open(path) as f:
                    try:
                        fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    except BlockingIOError:
                        entry = json.loads(f.read() or "{}")      # locked: its owner is alive
                    else:
                        path.unlink(missing_ok=True)              # unlocked: its owner is gone
                        continue
            except (OSError, ValueError):
                continue
            if entry.get("role") in ROLES and self.cpus & set(entry.get("cpus") or ()):
                out.append(entry)
        return out

    def plan(self, now: float | None = None) -> Threads:
        """Thread counts now (the registry is read at most every refresh_s)."""
        now = time.monotonic() if now is None else now
        if self._plan is None or now - self._at >= self.refresh_s:
            peers = self.peers() if self._file is not None else []
            targets = sum(p["role"] == "target" for p in peers) + (self.role == "target")
            drafts = sum(p["role"] == "draft" for p in peers) + (self.role == "draft")
            self._plan = divide(self.role, len(self.cpus), targets, drafts, threads=self.threads,
                                verify_threads=self.verify_threads)
            self._at = now
        return self._plan


def start(role: str, args, log) -> HostShare | None:
    """The share of a service with `--torch-threads`, `--core-sharing` (and, on the target,
    `--verify-torch-threads`) flags; None with --core-sharing off. Sets this process's threads."""
    import torch
    if args.core_sharing == "off":
        if args.torch_threads > 0:
            torch.set_num_threads(args.torch_threads)
        return None
    share = HostShare(role, threads=args.torch_threads,
                      verify_threads=getattr(args, "verify_torch_threads", 0)).join()
    plan = share.plan()
    torch.set_num_threads(plan.threads)
    log.info("core_share", registry=str(share.directory) if share._file else None, **plan.__dict__)
    return share


async def follow(share: HostShare, apply, log) -> None:
    """Re-read the registry every refresh_s; `apply(Threads)` when the counts change (services
    joining or leaving this host). Runs until cancelled."""
    last = share.plan()
    while True:
        await asyncio.sleep(share.refresh_s)
        plan = share.plan()
        if plan != last:
            log.info("core_share_changed", **plan.__dict__)
            apply(plan)
            last = plan


def follow_from_now(share: HostShare, apply, log) -> asyncio.Task:
    """`apply` the plan now, then `follow` it as services join and leave this host: the watching
    task, for the service to cancel when it stops (Server.keep)."""
    apply(share.plan())
    return asyncio.ensure_future(follow(share, apply, log))


def add_core_sharing_flag(parser) -> None:
    parser.add_argument(
        "--core-sharing", default="auto", choices=["auto", "off"],
        help="auto: join this host's registry of splitspec services (SPLITSPEC_RUNTIME_DIR, else "
             "$XDG_RUNTIME_DIR/splitspec, else /tmp/splitspec-<uid>) and, where thread flags are 0, divide "
             "the cores with the targets and drafts found there (docs/configuration.md); off: neither, "
             "and --torch-threads 0 takes torch's default (one thread per core)")
