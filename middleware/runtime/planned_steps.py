"""Step construction: the function the plan calls for each unit under a buffer plan.

The buffer planner's last stage (runtime/memory.py tells the whole story): each unit's
step writes into its arena view, over a dead input or into its concat slice, through the
unit's destination-passing form (a generated kernel's ``out_fn``, an op's ATen ``out=``
form) or a copy right after it; ``check_memory`` wraps every step with a check of where
its outputs landed.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..enums import RunsAs
from ..graph import Graph, TensorType
from ..ops import get_op, torch_dtype
from ..options import check_memory_default
from .arena import BufferPlan, MemoryPlan
from .pages import advise_huge_pages
from .storage_classes import StorageClasses


@dataclasses.dataclass
class PlannedUnits:
    """The planner's product: the memory plan, the arena and one step function per unit
    (same calling convention as ``Unit.fn``: input tensors in, output(s) returned)."""

    memory: MemoryPlan
    arena: torch.Tensor | None
    fns: list[Callable[..., Any]]
    # the graph outputs' kept buffers (Recycled), held by the plan between calls
    recycled: list[Recycled] = dataclasses.field(default_factory=list)


def build_steps(
    graph: Graph,
    units: Sequence[Any],
    device: torch.device,
    plan: BufferPlan,
    check: bool | None = None,
    huge_pages: bool = False,
) -> PlannedUnits:
    """The arena of ``plan`` and one step function per unit (see ``plan_memory``).
    ``huge_pages``: the buffers that live as long as the plan (the arena, spilled classes,
    recycled outputs) ask for 2 MiB pages (runtime/pages.py)."""
    pl, memory, where, scratch, types = (
        plan.classes,
        plan.memory,
        plan.where,
        plan.scratch,
        plan.types,
    )
    placements, offsets, arena_bytes = memory.placements, memory.offsets, memory.arena_bytes
    arena = torch.empty(arena_bytes, dtype=torch.uint8, device=device) if arena_bytes else None
    if huge_pages and arena is not None:
        advise_huge_pages(arena)

    def lasting(t: TensorType) -> torch.Tensor:
        """A framework allocation the plan keeps between calls."""
        return empty_of(t, device, huge_pages)

    getters: dict[str, Callable[[], torch.Tensor]] = {}
    holders: dict[str, list[Any]] = {}

    def getter(v: str) -> Callable[[], torch.Tensor]:
        """How a step gets the tensor of value ``v`` (arena view, slice, or the framework
        allocation of a spilled class made by the class's first writer)."""
        if v in getters:
            return getters[v]
        p = placements[v]
        if p.kind == "slice":
            parent, dim, start, length = getter(p.parent), p.dim, p.start, p.length
            static = getattr(parent, "static", None)
            if static is not None:
                g = _const(static.narrow(dim, start, length))
            else:

                def g() -> torch.Tensor:
                    return parent().narrow(dim, start, length)

        elif p.kind == "arena":
            g = _const(_arena_view(arena, offsets[v], types[v]))
        else:  # a spilled class: allocated by the framework when first written
            holder = holders.setdefault(v, [None])
            t = types[v]

            def g() -> torch.Tensor:
                if holder[0] is None:
                    holder[0] = lasting(t)
                return holder[0]

        getters[v] = g
        return g

    recycled: list[Recycled] = []
    fns = [
        _step_fn(pl, i, u, where, scratch, getter, holders, recycled, lasting)
        for i, u in enumerate(units)
    ]
    for i in pl.copies:  # planned as copies: never an alias at run time
        if fns[i] is units[i].fn:
            fns[i] = _fresh_result(fns[i])
    for i, (fn, u) in enumerate(zip(fns, units, strict=True)):
        nd = pl.single[i]
        temp = 0 if nd is None else get_op(nd.op).temp_bytes_per_elem
        if fn is u.fn and temp:  # ATen's max-pool indices
            memory.temps[i] = graph.values[u.outputs[0]].numel * temp
        elif getattr(fn, "__name__", "").startswith("copy_into"):
            memory.temps[i] = graph.values[u.outputs[0]].nbytes
        work = getattr(u.fn, "workspace_bytes", None)
        if work is not None:  # a Winograd convolution's transformed tiles
            memory.temps[i] = memory.temps.get(i, 0) + work(graph.values[u.outputs[0]].shape[0])
    if check is None:
        check = check_memory_default()
    if check and arena is not None:
        fns = [
            _checked(fn, i, u, memory, arena)
            for i, (fn, u) in enumerate(zip(fns, units, strict=True))
        ]
    return PlannedUnits(memory, arena, fns, recycled)


class MemoryCheckError(RuntimeError):
    """A step's output overlaps arena bytes that the buffer plan did not give its value
    (``Options(check_memory=True)``): a framework allocation aliasing the arena, or a value
    written over another one that is still live."""


def _checked(
    fn: Callable[..., Any], i: int, u: Any, memory: MemoryPlan, arena: torch.Tensor
) -> Callable[..., Any]:
    """``fn`` followed by the check that each output lies outside the arena, or inside the
    bytes of its own arena storage class (a view, an in-place write, a concat slice)."""
    base, end = arena.data_ptr(), arena.data_ptr() + arena.numel()
    own: list[tuple[int, int] | None] = []
    for v in u.outputs:
        root = memory.placements[v].storage
        off = memory.offsets.get(root)
        own.append(None if off is None else (base + off, base + off + memory.sizes[root]))
    multi = len(u.outputs) > 1

    def live_arena(lo: int, hi: int) -> list[str]:
        return [
            c
            for c, off in memory.offsets.items()
            if memory.intervals[c][0] <= i <= memory.intervals[c][1]
            and lo < base + off + memory.sizes[c]
            and base + off < hi
        ]

    def checked(*ins: Any) -> Any:
        r = fn(*ins)
        for v, t, mine in zip(u.outputs, r if multi else (r,), own, strict=True):
            if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.device != arena.device:
                continue
            lo, hi = _byte_range(t)
            if hi <= base or lo >= end or (mine is not None and mine[0] <= lo and hi <= mine[1]):
                continue
            kind = memory.placements[v].kind
            raise MemoryCheckError(
                f"step {i} ({u.name}): output {v!r} (placed {kind!r}) overlaps arena bytes "
                f"[{lo - base}, {hi - base}) outside its own; live arena values there: "
                f"{live_arena(lo, hi) or 'none'}"
            )
        return r

    checked.__name__ = getattr(fn, "__name__", "step")  # the profiler names steps by it
    checked.checks_memory = True  # type: ignore[attr-defined]
    return checked


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` a strided tensor can touch."""
    lo = t.data_ptr()
    span = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True) if s > 0)
    return lo, lo + (span + 1) * t.element_size()


def _const(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    def g() -> torch.Tensor:
        return t

    g.static = t  # type: ignore[attr-defined]
    return g


class Recycled:
    """The memory of one graph output, handed to the user call after call.

    Eager PyTorch gets a new output from the allocator on every call; above glibc's mmap
    threshold that is new pages, and the kernel clears each page on its first write (an
    extra write of the whole output, plus a fault per 4 KiB). Here the plan keeps up to
    ``KEEP`` output buffers and writes a call's output into one that nothing outside the
    plan references any more: no tensor, view, storage object, NumPy array or DLPack
    capsule of the user's (each holds the storage, and the storage's C++ use count and its
    Python object's reference count are checked against the values they had when nobody
    else could hold them), not moved to shared memory, not resized. Otherwise a new buffer
    is allocated, and it replaces the oldest one kept. Each call hands out a new tensor
    object over a buffer made in the call's inference mode (``detach()`` keeps it: an
    output is an inference tensor exactly when eager's would be), never a view; a free
    buffer of the other mode is replaced (a caller alternating the modes call by call
    allocates each time: a cost taken for one buffer, not one a mode, in the usual order).

    A plan runs its planned steps under a lock (``Plan.run``), so two threads never take
    the same buffer. At most ``KEEP`` outputs stay allocated after the user dropped them.
    Where the module's call is one C++ function, the pool is the extension's
    (``adopt``): the same rules on the storage's C++ use count (and, where its Python
    object exists, that object's references), address and size.
    """

    KEEP = 2
    # below this the allocator reuses freed memory without new pages (glibc's default
    # mmap threshold is 128 KiB)
    MIN_BYTES = 256 * 1024
    _use_count = getattr(torch._C, "_storage_Use_Count", None)

    @classmethod
    def applies(cls, t: TensorType, device: torch.device) -> bool:
        return device.type == "cpu" and t.nbytes >= cls.MIN_BYTES and cls._use_count is not None

    def __init__(
        self,
        t: TensorType,
        device: torch.device,
        allocate: Callable[[TensorType], torch.Tensor] | None = None,
    ) -> None:
        self.type, self.device = t, device
        # how a new buffer is made (build_steps: with huge pages where the plan asks)
        self.allocate = allocate or (lambda t: empty_of(t, device))
        # ((buffer, its storage's Python object, the storage's C++ address), the state of
        # the buffer while nobody else holds it); the storage object and address are taken
        # once: the per-call check is three cheap queries, not a new storage object
        self.kept: list[tuple[tuple[torch.Tensor, Any, int], tuple[int, int, int]]] = []
        self.next = 0  # the kept buffer a new allocation replaces
        # the C++ pool (runtime/shortcut.cpp's Recycler) once adopted: both the module's C++
        # call and the Python steps take from it
        self.fast: Any = None

    def adopt(self, extension: Any) -> Any:
        """Hand the pool to ``extension``'s Recycler (the same rules, checked in C++: the
        storage's use count, address and size) and return it. The buffers kept so far are
        let go (those the user holds stay the user's); the C++ pool starts empty. Called
        while the plan is built or under its lock, so no call takes a buffer meanwhile."""
        if self.fast is None:
            self.fast = extension.Recycler(functools.partial(self.allocate, self.type), self.KEEP)
            self.kept = []
        return self.fast

    def buffers(self) -> list[torch.Tensor]:
        """The buffers kept (each also in the hands of the user or free for the next call)."""
        if self.fast is not None:
            return self.fast.buffers()
        return [held[0] for held, _ in self.kept]

    def _state(self, held: tuple[torch.Tensor, Any, int]) -> tuple[int, int, int]:
        """Where the buffer is and who holds its storage (the storage object's references
        here: ``held``, this frame and getrefcount's own). Moving the storage to shared
        memory (``share_memory_()``) or resizing it moves its data: the address tells."""
        st = held[1]
        return st.data_ptr(), self._use_count(held[2]), sys.getrefcount(st)  # type: ignore[misc]

    def take(self) -> torch.Tensor:
        """A tensor of the output's type over memory nothing outside the plan holds: a new
        tensor object over a kept buffer's storage (``detach``: no autograd link, not a
        view; a third of ``torch.empty(0).set_()``'s cost on a cold cache). ``detach``
        keeps the buffer's inference mode, so a free buffer made in the call's mode serves
        (an output is an inference tensor exactly when eager's would be); a free one of
        the other mode is replaced by a new one of this mode (the first call under
        ``torch.inference_mode()`` after one outside it: one buffer, not one a mode)."""
        if self.fast is not None:
            return self.fast.take()
        mode = _inference_mode()
        use_count = self._use_count
        spare = -1
        for i, (held, free) in enumerate(self.kept):
            st = held[1]  # _state, inlined: one local reference to the storage, as there
            if (st.data_ptr(), use_count(held[2]), sys.getrefcount(st)) == free:  # type: ignore[misc]
                if held[0].is_inference() == mode:
                    return held[0].detach()
                spare = i
        mine = self.allocate(self.type)  # never handed out: only shares its storage
        st = mine.untyped_storage()
        held = (mine, st, st._cdata)
        del st  # the storage object's references must be those _state counts in the loop
        entry = (held, self._state(held))  # measured while nobody else can hold it
        if spare >= 0:
            self.kept[spare] = entry
        elif len(self.kept) < self.KEEP:
            self.kept.append(entry)
        else:
            self.kept[self.next] = entry
            self.next = (self.next + 1) % self.KEEP
        return mine.detach()


_inference_mode = torch.is_inference_mode_enabled


def empty_of(t: TensorType, device: torch.device, huge_pages: bool = False) -> torch.Tensor:
    """A framework allocation of value type ``t`` (``huge_pages``: asking for 2 MiB pages,
    before anything writes it)."""
    fmt = torch.channels_last if t.rank == 4 and t.layout == "nhwc" else torch.contiguous_format
    out = torch.empty(t.shape, dtype=torch_dtype(t.dtype), device=device, memory_format=fmt)
    if huge_pages:
        advise_huge_pages(out)
    return out


def _step_fn(
    pl: StorageClasses,
    i: int,
    u: Any,
    where: dict[str, str],
    scratch: dict[int, list[str]],
    getter: Callable[[str], Callable[[], torch.Tensor]],
    holders: dict[str, list[Any]],
    recycled_pools: list[Recycled],
    lasting: Callable[[TensorType], torch.Tensor],
) -> Callable[..., Any]:
    """The function the plan calls for unit ``i`` under the memory plan (a graph output's
    ``Recycled`` buffers are appended to ``recycled_pools``)."""
    form = pl.forms[i]
    if i in pl.inplace_fn:
        into_residual = pl.inplace_fn[i]
        native = getattr(into_residual, "native", None)
        if native is None:
            return into_residual
        return _offered(into_residual, lambda ins, r: native(*ins))
    if i in pl.inplace_of:
        k, out_form = pl.inplace_of[i], form[0]

        def in_place(*ins):
            out_form(*ins, ins[k])
            return ins[k]

        _native_form(in_place, out_form, lambda ins, r: (*ins, ins[k]))
        return in_place
    if len(u.outputs) != 1:
        nd = pl.single[i]
        if nd is None or u.runs_as == RunsAs.FALLBACK or not get_op(nd.op).view_like:
            return u.fn
        return _offered(u.fn, _views_nothing)  # a split: views of its input, no call
    y = u.outputs[0]
    root = pl.cls.find(y)
    if (
        where[root] == "fresh"
        and y == root
        and form is not None
        and not form[1]  # no scratch outputs: a fresh class gets no scratch (max-pool's indices)
        and pl.kind.get(y) != "view"
        and Recycled.applies(pl.graph.values[y], pl.device)
    ):
        # a graph output written through its destination form into memory that the user
        # has let go of (see Recycled): no page faults for a fresh allocation per call
        recycled, out_form = Recycled(pl.graph.values[y], pl.device, lasting), form[0]
        recycled_pools.append(recycled)

        def into_recycled(*ins):
            o = recycled.take()
            out_form(*ins, o)
            return o

        into_recycled.__name__ = getattr(u.fn, "__name__", "into_recycled")
        _native_form(into_recycled, out_form, lambda ins, r: (*ins, r))
        into_recycled.output_source = recycled.take  # type: ignore[attr-defined]
        return into_recycled
    if (
        where[root] == "fresh"
        and y == root
        and form is not None
        and not form[1]
        and pl.kind.get(y) != "view"
        and i not in pl.copies  # (wrapped by _fresh_result instead)
        and getattr(form[0], "native", None) is not None
    ):
        # a graph output the unit allocates itself (too small to recycle): the native
        # runner allocates it and calls the destination form
        t, device, native = pl.graph.values[y], pl.device, form[0].native
        fresh_output = _offered(u.fn, lambda ins, r: native(*ins, r))
        fresh_output.output_source = lambda: empty_of(t, device)  # type: ignore[attr-defined]
        return fresh_output
    if (
        pl.kind.get(y) == "view"
        and i not in pl.copies
        and u.runs_as != RunsAs.FALLBACK  # (its result may alias what it computed in place)
        and pl.single[i] is not None
        and get_op(pl.single[i].op).view_like
    ):
        # a view of its input: nothing to run natively where the result does alias it
        return _offered(u.fn, _view_nothing)
    if where[root] not in ("arena", "spilled") or pl.kind.get(y) == "view":
        return u.fn
    if y != root and y not in pl.slice_of:
        return u.fn
    writers = [v for v in pl.cls.members(root) if v == root or v in pl.slice_of]
    if where[root] == "spilled" and y == root and writers == [y]:
        if form is None or not scratch.get(i):
            return u.fn  # a spilled plain class: the unit allocates it itself
        # a destination form with scratch (the chunked max-pool): fresh result, small scratch
        out_form, t, device = form[0], pl.graph.values[y], pl.device
        extra = [
            (getter(nm) if where[nm] == "arena" else None, tt)
            for nm, tt in zip(scratch[i], form[1], strict=True)
        ]

        def alloc_into(*ins):
            o = empty_of(t, device)
            out_form(*ins, o, *[e() if e is not None else empty_of(tt, device) for e, tt in extra])
            return o

        return alloc_into
    get = getter(y)
    static = getattr(get, "static", None)
    # a spilled concat destination is released by its last writer (the outermost concat)
    last_writer = max(pl.producer[v] for v in writers)
    release = holders.get(root) if i == last_writer else None
    mode = pl.cat_mode.get(i)
    if mode == "view":
        if static is not None:

            def free_concat(*ins):
                return static

            free_concat.native_step = lambda ins, r: NATIVE_NOTHING  # type: ignore[attr-defined]
            return free_concat

        def free_concat_dyn(*ins):
            return get()

        return free_concat_dyn
    if mode == "dest":
        slices = []
        start, dim = 0, pl.single[i].attrs["dim"] % pl.graph.values[y].rank
        for j, x in enumerate(u.inputs):
            size = pl.graph.values[x].shape[dim]
            # copied unless it already lives in exactly this slice (an input that is also
            # a view of another slice of the destination, or repeated, is copied)
            if pl.slice_of.get(x) != (y, dim, start, size):
                slices.append((j, dim, start, size))
            start += size

        def concat_into(*ins):
            o = get()
            for j, d, st, ln in slices:
                o.narrow(d, st, ln).copy_(ins[j])
            if release is not None:
                release[0] = None
            return o

        return concat_into
    if form is not None:
        out_form = form[0]
        extra_get = [getter(nm) if where[nm] == "arena" else None for nm in scratch.get(i, ())]
        extra_types = form[1] if scratch.get(i) else ()
        if static is not None and all(e is not None for e in extra_get):
            extra = (static,) + tuple(e() for e in extra_get)

            def into(*ins):
                out_form(*ins, *extra)
                return static

            _native_form(into, out_form, lambda ins, r: (*ins, *extra))
            return into
        device = pl.device

        def into_dyn(*ins):
            o = get()
            tmp = [
                e() if e is not None else empty_of(t, device)
                for e, t in zip(extra_get, extra_types, strict=True)
            ]
            out_form(*ins, o, *tmp)
            return o

        return into_dyn
    fn = u.fn  # no destination form, placed in a concat slice: copy right after it

    if static is not None:

        def copy_into(*ins):
            static.copy_(fn(*ins))
            return static

        return copy_into

    def copy_into_dyn(*ins):
        o = get()
        o.copy_(fn(*ins))
        return o

    return copy_into_dyn


# A planned step that does nothing at run time (a concat whose inputs were written into
# their slices): the native runner skips it.
NATIVE_NOTHING = "nothing"


def _native_form(
    step: Callable[..., Any],
    out_form: Callable[..., Any],
    operands: Callable[[tuple[Any, ...], Any], tuple[Any, ...]],
) -> None:
    """Offer ``step`` to the native runner (runtime/native.py) where its destination form
    can be one C call: ``step.native_step(ins, result)`` gives the form's
    ``interface.NativeCall`` on ``operands(ins, result)`` (the tensors the form reads and
    writes when the step runs on ``ins`` and returns ``result``)."""
    native = getattr(out_form, "native", None)
    if native is not None:
        step.native_step = lambda ins, r: native(*operands(ins, r))  # type: ignore[attr-defined]


def _offered(
    fn: Callable[..., Any], native_step: Callable[[tuple[Any, ...], Any], Any]
) -> Callable[..., Any]:
    """``fn`` behind a step of its own that offers ``native_step`` to the native runner
    (``fn`` itself may be shared: the unit's function, the unplanned program's step)."""

    def step(*ins):
        return fn(*ins)

    step.__name__ = getattr(fn, "__name__", "step")
    step.native_step = native_step  # type: ignore[attr-defined]
    return step


def _views_nothing(ins: tuple[Any, ...], rs: Any) -> str | None:
    """A split's native call: nothing, where every result aliases its first input."""
    if not isinstance(rs, (list, tuple)) or not rs:
        return None
    results = [_view_nothing(ins, r) for r in rs]
    return NATIVE_NOTHING if all(x is NATIVE_NOTHING for x in results) else None


def _view_nothing(ins: tuple[Any, ...], r: Any) -> str | None:
    """A view step's native call: nothing, where its result lies inside its first input's
    storage (the later steps then read the same bytes at the recorded addresses)."""
    x = ins[0] if ins else None
    if not isinstance(r, torch.Tensor) or not isinstance(x, torch.Tensor) or r.numel() == 0:
        return None
    if r.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
        return None
    return NATIVE_NOTHING


def _fresh_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` whose result never shares its input's storage. The planner gives a class of
    its own to a ``to_layout`` that converts and to a reshape of a permuted view, from the
    value types; where the run-time strides allow ATen a view after all (a framework result
    strided otherwise than its type, a permutation of size-1 dims, a permutation undone) the
    result is copied, so that it never reads bytes the plan reuses."""

    def fresh(x: torch.Tensor) -> torch.Tensor:
        y = fn(x)
        if y.numel() and y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            y = y.clone(memory_format=torch.preserve_format)
        return y

    fresh.__name__ = getattr(fn, "__name__", "fresh")
    return fresh


def _arena_view(arena: torch.Tensor, offset: int, t: TensorType) -> torch.Tensor:
    """A typed view of ``t.nbytes`` arena bytes at ``offset``, strided in ``t``'s layout."""
    flat = arena[offset : offset + t.nbytes].view(torch_dtype(t.dtype))
    if t.rank == 4 and t.layout == "nhwc":
        n, c, h, w = t.shape
        return flat.as_strided(t.shape, (h * w * c, 1, w * c, c))
    return flat.view(t.shape)
