"""C++ kernels built on first use with torch's extension API (a compiler and ninja needed), cached
per source and per CPU, and optional: where the build fails the caller keeps its pure-torch path,
said once in the log.

The build directory is keyed by the CPU's feature flags because the kernels are compiled for the
host (`-march=native`): a cache folder shared with another kind of CPU must not hand it code it
cannot run. `SPLITSPEC_NATIVE=0` turns the kernels off (the fallback's tests use it)."""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)
CSRC = Path(__file__).parent / "csrc"


def _cpu_tag() -> str:
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def _build_root() -> Path:
    root = os.environ.get("SPLITSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "splitspec")
    return Path(root) / "native"


def enabled() -> bool:
    return os.environ.get("SPLITSPEC_NATIVE", "1") != "0"


@functools.lru_cache(maxsize=None)
def load(name: str):
    """The extension module built from csrc/<name>.cpp, or None (logged) where it cannot be built."""
    if not enabled():
        return None
    module = f"splitspec_{name}_{_cpu_tag()}"
    try:
        from torch.utils.cpp_extension import load as build
        folder = _build_root() / module
        folder.mkdir(parents=True, exist_ok=True)
        return build(name=module, sources=[str(CSRC / f"{name}.cpp")], build_directory=str(folder),
                     extra_cflags=["-O3", "-march=native"], verbose=False)
    except Exception as exc:       # no compiler, no ninja, headers missing: the torch path serves
        log.warning("native_kernel_unavailable", kernel=name, why=f"{type(exc).__name__}: {str(exc)[:300]}",
                    fallback="the pure-torch path")
        return None
