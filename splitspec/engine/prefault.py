"""Touch-ahead for a CPU KV pool: a thread maps the pool's pages in before the engine writes
to them, so first touches (page faults) stay off the forward path.

Not used by the served pools since issue 54: the pool now reuses touched blocks, cached ones
included, before never-touched ones, so a prefix-cache pool first-touches memory only while its
most blocks held at once grows, as a plain pool does, and mapping ahead would only add resident
memory. `populate` still maps the prefix cache's tap-row arena whole. What it was for (issue 40):
without the cache a freed block is the next one reused, so a
long run touches only its peak use. With the cache, freed blocks stay cached and new sessions
take never-touched blocks until the whole budget has been used once; on a VM (Firecracker here)
each first touch of a 4 KiB page costs ~3 µs, which made a cache-on target 5–9 % slower on
prompts that share nothing (issue 40). `madvise(MADV_POPULATE_WRITE)` maps a range writable
without touching its contents (~1 µs a page, in the kernel, GIL released), so it is safe while
the engine writes K/V into the same pages.

The thread keeps `ahead` blocks mapped beyond the highest block ever handed out (the free list
hands out low ids first), so resident memory still grows with use, not with the budget.
Linux >= 5.14 only; anywhere else it turns itself off and the engine faults pages in itself."""
from __future__ import annotations

import ctypes
import functools
import mmap
import threading

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


class Prefaulter:
    """Keeps the pages of blocks [1, high + ahead) of `tensors` mapped, where `need(high)` is told
    the highest block handed out so far. A worker thread runs only while there is mapping to do
    (it is started again when less than half the margin is left), so a pool nobody uses any more
    is not kept alive by it."""

    def __init__(self, tensors: list[torch.Tensor], *, block_size: int, num_blocks: int, ahead: int,
                 chunk: int = 256):
        self.tensors, self.block_size, self.num_blocks = tensors, block_size, num_blocks
        self.ahead, self.chunk = max(1, ahead), max(1, chunk)
        self.done = 1           # blocks [0, done) are mapped (block 0 is zeroed at start)
        self.want = 1
        self.failed = False
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self.need(0)

    def need(self, high: int) -> None:
        if self.failed or high + 1 + self.ahead // 2 < self.want:
            return
        with self._lock:
            self.want = max(self.want, min(self.num_blocks, high + 1 + self.ahead))
            if self._worker is None and self.done < self.want:
                self._worker = threading.Thread(target=self._run, name="kv-prefault", daemon=True)
                self._worker.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Until what was asked for so far is mapped (tests); False on timeout or failure."""
        worker = self._worker
        if worker is not None:
            worker.join(timeout)
        return self.done >= self.want and not self.failed

    def _run(self) -> None:
        while True:
            with self._lock:
                if self.failed or self.done >= self.want:
                    self._worker = None
                    return
                start, stop = self.done, min(self.want, self.done + self.chunk)
            ok = all(populate(t, start * self.block_size, stop * self.block_size) for t in self.tensors)
            with self._lock:
                self.failed = not ok
                self.done = stop if ok else self.done
