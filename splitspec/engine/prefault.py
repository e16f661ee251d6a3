"""Map a CPU tensor's pages before they are written: `madvise(MADV_POPULATE_WRITE)` maps a
range writable without touching its contents (~1 µs a 4 KiB page, in the kernel, GIL released),
where first touches from the engine would cost a page fault each (~3 µs on a Firecracker VM).
The prefix cache maps its tap-row arena whole with it when the arena is taken
(`prefix_cache.py`). Linux >= 5.14 only; elsewhere `populate` says so and pages fault in as
they are written."""
from __future__ import annotations

import ctypes
import functools
import mmap

import torch

MADV_POPULATE_WRITE = 23
PAGE = mmap.PAGESIZE


@functools.cache
def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def page_ranges(t: torch.Tensor, start: int, stop: int) -> list[tuple[int, int]]:
    """(address, bytes) of the whole pages holding rows [start, stop) of dim 1 of t, one range per
    slice of dim 0 (a pool's [layers, slots, ...] layout)."""
    elem = t.element_size()
    layer_bytes, row_bytes = t.stride(0) * elem, t.stride(1) * elem
    out = []
    for layer in range(t.shape[0]):
        lo = t.data_ptr() + layer * layer_bytes + start * row_bytes
        hi = lo + (stop - start) * row_bytes
        lo -= lo % PAGE
        hi += -hi % PAGE
        out.append((lo, hi - lo))
    return out


def populate(t: torch.Tensor, start: int, stop: int) -> bool:
    """Map the pages of rows [start, stop) of dim 1 of t, in every slice of dim 0. False when the
    kernel cannot (the caller stops asking)."""
    fn = _madvise()
    if fn is None or t.device.type != "cpu" or not t.is_contiguous() or stop <= start:
        return fn is not None
    return all(fn(lo, n, MADV_POPULATE_WRITE) == 0 for lo, n in page_ranges(t, start, stop))
