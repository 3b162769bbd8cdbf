"""Peak memory of framework tensors: a live-storage tracker for the CPU, CUDA's own counters.

PyTorch keeps no peak-memory statistic for the CPU allocator. :class:`LiveStorageTracker`
is a ``TorchDispatchMode`` that sees every ATen call made while it is active, records each
new tensor storage an op returns (with its size) and forgets it when the storage is freed
(a ``weakref.finalize`` on the storage). ``peak_bytes`` is the largest total of such live
storages at any moment: the memory a call needed beyond what existed before it. Storages
that existed before the tracker started (parameters, inputs, buffers kept between calls)
are not counted; outputs still alive at the end are.

:func:`measure_peak` gives one call's peak: on CUDA with ``torch.cuda.max_memory_allocated``
(the peak during the call minus what was allocated when it started), on the CPU from the
allocator's own records (the profiler's memory events), which also see allocations that
do not pass through the dispatcher, e.g. ``torch.compile``'s buffers.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveStorageTracker(TorchDispatchMode):
    """Counts the bytes of storages created while active; ``peak_bytes`` is their maximum.

    Use as a context manager around the code to measure. Ops that reach the framework
    through another path than the dispatcher (e.g. a C kernel writing into a tensor it was
    given) allocate nothing the tracker could miss: their buffers come from ``torch.empty``,
    which it sees.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.allocated_bytes = 0  # total ever created while active
        self._live: dict[object, int] = {}  # storage data_ptr (opaque: the tensor's id) -> bytes

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        if t.is_mkldnn:  # an opaque oneDNN tensor exposes no storage: count its elements
            key: object = ("opaque", id(t))
            nbytes, owner = t.numel() * t.element_size(), t
        else:
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # other layouts without a storage
                return
            key, nbytes, owner = storage.data_ptr(), storage.nbytes(), storage
            if key == 0:
                return
        if nbytes == 0 or key in self._live:
            return
        self._live[key] = nbytes
        self.live_bytes += nbytes
        self.allocated_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(owner, self._free, key, nbytes)

    def _free(self, key: object, nbytes: int) -> None:
        if self._live.get(key) == nbytes:
            del self._live[key]
            self.live_bytes -= nbytes


def measure_peak(fn: Callable[[], Any], device: torch.device | str = "cpu") -> int:
    """Peak bytes that one call of ``fn()`` allocates beyond what was live before it.

    CUDA: ``torch.cuda.max_memory_allocated``. CPU: the allocator's own records (the
    profiler's memory events, in time order), which see every allocation of the CPU
    allocator, including ``torch.compile``'s buffers and operator workspace; where the
    profiler records none, :class:`LiveStorageTracker` (which sees tensor storages only,
    and makes ``torch.compile`` fall back to eager while active). The result of ``fn`` is
    dropped before returning.
    """
    device = torch.device(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del out
        return int(peak)
    peak = allocator_peak(fn)
    if peak is not None:
        return peak
    with LiveStorageTracker() as tracker:
        out = fn()
        del out
    return int(tracker.peak_bytes)


def allocator_peak(fn: Callable[[], Any]) -> int | None:
    """The CPU allocator's peak during ``fn()`` above its level at the start, from the
    profiler's memory events; None when the profiler recorded no memory event."""
    from torch.profiler import ProfilerActivity, profile

    with (
        _native_stderr_silenced(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        out = fn()
        del out
    events = [
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    if not events:
        return None
    live = peak = 0
    for _, nbytes in sorted(events):
        live += nbytes
        peak = max(peak, live)
    return int(peak)


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Route file descriptor 2 to /dev/null: the profiler's native library logs its start,
    stop and device probing there, which is noise for a memory measurement."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (e.g. captured)
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, fd)
        os.close(saved)
        os.close(devnull)
