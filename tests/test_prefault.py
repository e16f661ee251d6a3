"""`populate` (splitspec/engine/prefault.py), which maps the prefix cache's tap-row arena: it maps
the pages asked for and no others, without changing a byte of what is already there."""
import ctypes
import mmap

import pytest
import torch

from splitspec.engine.kv_pool import KVPool
from splitspec.engine.prefault import page_ranges, populate

PAGE = mmap.PAGESIZE


def resident(t: torch.Tensor, layer: int, start: int, stop: int) -> list[bool]:
    """mincore over rows [start, stop) of layer `layer` of a [layers, rows, ...] tensor."""
    libc = ctypes.CDLL(None, use_errno=True)
    lo, n = page_ranges(t, start, stop)[layer]
    vec = (ctypes.c_ubyte * (n // PAGE))()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(lo), n, vec) == 0, ctypes.get_errno()
    return [bool(v & 1) for v in vec]


def evict(t: torch.Tensor, start: int, stop: int) -> None:
    """Unmap rows [start, stop) of every layer (MADV_DONTNEED), so that a test starts from pages known
    not to be resident: a full suite run once found such rows of a fresh pool resident before anything
    wrote them (cause not found; memory the allocator had mapped before is the likely one), and only
    what `populate` maps is under test. The rows were never written, so dropping them loses nothing."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for lo, n in page_ranges(t, start, stop):
        assert libc.madvise(ctypes.c_void_p(lo), n, 4) == 0, ctypes.get_errno()     # MADV_DONTNEED


def pool(blocks=2048):
    # 2 layers x 16 slots x 8 heads x 64 x 4 bytes: one block is 32 KiB, 8 pages, per layer; 64 MiB
    # a layer, above glibc's largest mmap threshold, so the tensors are fresh mappings.
    p = KVPool(num_layers=2, num_kv_heads=8, head_dim=64, num_blocks=blocks, block_size=16)
    # 4 KiB pages only. Two full suite runs found rows resident that nothing had written, once a block
    # 384 KiB past the populated ones: what a transparent huge page does (on memory advised
    # MADV_HUGEPAGE, populating one block here maps the 2 MiB around it).
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for t in (p.k, p.v):
        lo = t.data_ptr() - t.data_ptr() % PAGE
        hi = t.data_ptr() + t.numel() * t.element_size()
        libc.madvise(ctypes.c_void_p(lo), hi - lo, 15)         # MADV_NOHUGEPAGE; best effort
    return p


def test_populate_maps_pages_and_keeps_their_contents():
    p = pool()
    if not populate(p.k, 0, 0):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    # Rows of block 40 on, and block 60: nothing wrote there, and nothing maps them now.
    evict(p.k, 40 * 16, 48 * 16)
    evict(p.k, 60 * 16, 61 * 16)
    assert not any(resident(p.k, 1, 40 * 16, 48 * 16))
    p.k[:, 40 * 16:41 * 16] = 7.0          # block 40 touched by a "forward" first
    assert populate(p.k, 40 * 16, 48 * 16)
    assert all(resident(p.k, 0, 40 * 16, 48 * 16)) and all(resident(p.k, 1, 40 * 16, 48 * 16))
    assert torch.all(p.k[:, 40 * 16:41 * 16] == 7.0)
    # Only what was asked: block 60 stays untouched.
    assert not any(resident(p.k, 0, 60 * 16, 61 * 16))
