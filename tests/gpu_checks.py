"""Whether the GPU tests can run here, and what a test marked `cuda` or `flashinfer` does when
they cannot (the hook is `pytest_runtest_setup` in conftest.py).

By default such a test skips, so the suite passes on CPU-only machines. With
SPLITSPEC_REQUIRE_GPU=1 a missing CUDA device or FlashInfer FAILS it instead: on the GPU
machine a broken driver or a missing `[cuda]` extra would otherwise turn every GPU test into a
skip and the run would still look green (README, "Run it", has the command).

Only "not there" counts as unavailable (no device, ImportError); any other exception while
importing FlashInfer is a broken install and propagates, so it is reported, never mistaken
for "no GPU here"."""
from __future__ import annotations

import functools
import os

import torch

REQUIRE_ENV = "SPLITSPEC_REQUIRE_GPU"


def gpu_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip().lower() not in ("", "0", "false", "no")


@functools.cache
def cuda_missing() -> str | None:
    """Why no CUDA device can be used here, or None when one can."""
    if torch.cuda.is_available():
        return None
    # is_available() folds a driver or runtime failure into a plain False; init() says which.
    try:
        torch.cuda.init()
    except Exception as exc:  # noqa: BLE001 - becomes the reason, shown in the skip or failure
        return f"no usable CUDA device ({type(exc).__name__}: {exc})"
    return "no CUDA device (torch.cuda.is_available() is False)"


@functools.cache
def flashinfer_missing() -> str | None:
    """Why FlashInfer cannot run here, or None when it can."""
    reason = cuda_missing()
    if reason is not None:
        return reason
    try:
        import flashinfer  # noqa: F401
        import flashinfer.sampling  # noqa: F401
    except ImportError as exc:
        return f"FlashInfer is not installed ({exc}); pip install -e '.[cuda]'"
    return None


MARKERS = {"cuda": cuda_missing, "flashinfer": flashinfer_missing}


def check(item) -> None:
    """Skip `item` (or, with SPLITSPEC_REQUIRE_GPU=1, fail it) if a GPU marker's need is unmet."""
    import pytest

    for name, missing in MARKERS.items():
        if item.get_closest_marker(name) is None:
            continue
        reason = missing()
        if reason is None:
            continue
        if gpu_required():
            pytest.fail(f"{REQUIRE_ENV}=1 but {name} is unavailable: {reason}", pytrace=False)
        pytest.skip(f"needs {name}: {reason} (set {REQUIRE_ENV}=1 to fail instead)")
