"""Transparent huge pages for the runtime's long-lived CPU buffers.

A plan keeps a few large CPU buffers for its whole life: the arena of its intermediate
values, a graph output's recycled buffers (``planned_steps.Recycled``) and the framework
allocations of spilled storage classes. With 4 KiB pages, a generated kernel that
streams through such a buffer pays a TLB miss per page, and the hardware prefetchers
stop at every page boundary. Measured on the 2-core AMD host (bench/io_patterns.py
kernels, one thread, caches evicted; the output on 2 MiB pages instead of 4 KiB ones):
concat -> 3x3/1 max-pool NCHW 818 -> 544 us, channels_last 922 -> 713 us,
BN -> ReLU -> 3x3/2 max-pool channels_last 2248 -> 2050 us, while a kernel that only
streams the same bytes moved by 0-4%.

Linux backs anonymous memory with 2 MiB pages where ``madvise(MADV_HUGEPAGE)`` asks for
them, if ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` (most
distributions' default; ``always`` does it unasked, ``never`` refuses). Only whole 2 MiB
blocks inside the buffer are advised, so no page reaches beyond the buffer's own memory
and the resident size does not grow. Advice is given right after the allocation, before
the first write: a large ``torch.empty`` is fresh memory from the C library's ``mmap``,
whose pages are then allocated huge on first touch. ``Options(huge_pages=False)`` (or
``$MIDDLEWARE_HUGE_PAGES=0``) keeps 4 KiB pages.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux, every architecture
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_ENABLED) -> str:
    """The kernel's transparent huge page mode (the bracketed word of ``path``:
    "always", "madvise" or "never"), or "" where there is none (not Linux)."""
    try:
        text = path.read_text()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's madvise where advice changes anything (THP in "madvise" mode), else None."""
    if not sys.platform.startswith("linux") or thp_mode() != "madvise":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def huge_range(start: int, nbytes: int) -> tuple[int, int]:
    """The whole 2 MiB blocks inside ``[start, start + nbytes)``: (first address, bytes),
    bytes 0 when there is none."""
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = (start + nbytes) // HUGE_PAGE * HUGE_PAGE
    return lo, max(hi - lo, 0)


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for 2 MiB pages under ``t``'s storage (CPU only; a no-op where the kernel's mode
    makes advice pointless or the storage holds no whole 2 MiB block). True when advised.
    Never raises: the advice only changes speed."""
    if t.device.type != "cpu":
        return False
    fn = _madvise()
    if fn is None:
        return False
    if t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last):
        # the tensor's own bytes (inside its storage), without making the storage's Python
        # object: once made, it lives as long as the storage, and a new buffer with one is
        # never kept by the C++ output pool (runtime/shortcut.cpp's Recycler)
        lo, n = huge_range(t.data_ptr(), t.numel() * t.element_size())
    else:
        st = t.untyped_storage()
        lo, n = huge_range(st.data_ptr(), st.nbytes())
    if n == 0:
        return False
    return fn(lo, n, MADV_HUGEPAGE) == 0
