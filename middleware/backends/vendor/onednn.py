"""oneDNN convolution primitives created once at plan time and executed directly.

The ``vendor`` convolution through ``torch.ops.mkldnn._convolution_pointwise`` pays a fixed
cost at every call that is most of a small layer's time (bench/results/overhead_cpu.md:
ideep builds memory descriptors, a primitive attribute and a scratchpad and allocates at
every call; about 60 us quiet where the convolution itself takes 3-5 us). Here the same
library, PyTorch's own oneDNN, is called through its C API: the primitive (the same
convolution with the same post-ops: oneDNN picks the same kernel) is created once, its
weight reordered once into a framework tensor, the scratchpad the calling thread's (a
framework tensor too), and a call is a few ``dnnl_memory_set_data_handle`` and one
``dnnl_primitive_execute`` (``x86/templates/onednn_conv.c.j2``).

PyTorch links oneDNN statically and exports none of its C API, but ships its headers and
an unstripped ``libtorch_cpu``: :func:`api_addresses` reads the functions' offsets from the
library's ELF symbol table and adds the address the library is loaded at. Where anything of
that is missing (a stripped build, another version than the headers', a failed compile),
:func:`direct_conv` returns None and the ideep call runs, with the reason in
:func:`unavailable`.

A source laid out otherwise than the dense one the primitive was built for (a channel
slice of a split, an NCHW image into a channels_last network) gets a primitive of its own,
built on first use, or is made dense first where oneDNN has no fast kernel for it.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import CompileError
from ...graph import Graph, Node
from ...options import Options
from ..interface import SCRATCH, NativeCall, Workspace, native_address
from ..x86.build import load_shared
from ..x86.compile import build_c
from ..x86.render import environment
from ..x86.runner import strided_copy

Kernel = Callable[..., Any]

# PyTorch's mkldnn post-op names (calls.OneDnnPostOp.attr, with its scalars and algorithm)
# as oneDNN eltwise algorithms and their (alpha, beta), as PyTorch's own mapping gives them
# (aten/src/ATen/native/mkldnn/Utils.cpp, fusion_unary_attr_map)
ELTWISE: dict[str, Callable[[tuple[float, ...], str], tuple[str, float, float]]] = {
    "relu": lambda s, a: ("relu", 0.0, 0.0),
    "leaky_relu": lambda s, a: ("relu", s[0], 0.0),
    "hardtanh": lambda s, a: ("clip", s[0], s[1]),
    "hardswish": lambda s, a: ("hardswish", 1.0 / 6.0, 0.5),
    "hardsigmoid": lambda s, a: ("hardsigmoid", 1.0 / 6.0, 0.5),
    "swish": lambda s, a: ("swish", 1.0, 0.0),
    "sigmoid": lambda s, a: ("logistic", 0.0, 0.0),
    "tanh": lambda s, a: ("tanh", 0.0, 0.0),
    "gelu": lambda s, a: ("gelu_tanh" if a == "tanh" else "gelu_erf", 0.0, 0.0),
}


def _torch_cpu_library() -> Path:
    return Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"


def _header() -> Path:
    return Path(torch.__file__).parent / "include" / "oneapi" / "dnnl" / "dnnl.h"


_SYM = np.dtype(
    [("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
     ("value", "<u8"), ("size", "<u8")]
)  # fmt: skip
_SECTION = np.dtype(
    [("name", "<u4"), ("type", "<u4"), ("flags", "<u8"), ("addr", "<u8"), ("offset", "<u8"),
     ("size", "<u8"), ("link", "<u4"), ("info", "<u4"), ("align", "<u8"), ("entsize", "<u8")]
)  # fmt: skip


def elf_function_offsets(path: Path, names: list[str]) -> dict[str, int]:
    """The offsets (``st_value``) of the defined functions ``names`` in the ELF symbol table
    (``.symtab``, local symbols included) of the shared library at ``path``; a name that is
    missing is absent from the result."""
    with open(path, "rb") as f:

        def read(offset: int, size: int) -> bytes:
            f.seek(offset)
            return f.read(size)

        ident = read(0, 64)
        if ident[:4] != b"\x7fELF" or ident[4] != 2:
            return {}
        shoff = int.from_bytes(ident[0x28:0x30], "little")
        shnum = int.from_bytes(ident[0x3C:0x3E], "little")
        heads = np.frombuffer(read(shoff, 64 * shnum), dtype=_SECTION)
        found: dict[str, int] = {}
        for sec in heads[heads["type"] == 2]:  # SHT_SYMTAB
            strs = heads[int(sec["link"])]
            table = read(int(strs["offset"]), int(strs["size"]))
            syms = np.frombuffer(read(int(sec["offset"]), int(sec["size"])), dtype=_SYM)
            funcs = syms[((syms["info"] & 0xF) == 2) & (syms["shndx"] != 0)]  # defined FUNC
            # a symbol's name is the bytes from its st_name up to a NUL, so every place a
            # name ends at a NUL is a candidate (a linker may share a name as the tail of a
            # longer string); one pass over the table per group of names none of which is
            # the tail of another (a match would hide the other)
            starts: dict[int, str] = {}
            for group in _tail_free_groups(names):
                alternatives = b"|".join(re.escape(n.encode()) for n in group)
                pattern = re.compile(b"(" + alternatives + b")(?=\\0)")
                starts.update((m.start(), m.group(1).decode()) for m in pattern.finditer(table))
            hit = funcs[np.isin(funcs["name"], np.fromiter(starts, dtype=np.uint32))]
            for sym in hit:
                found.setdefault(starts[int(sym["name"])], int(sym["value"]))
        return found


def _tail_free_groups(names: list[str]) -> list[list[str]]:
    """``names`` in groups where no name ends with another of its group (greedy)."""
    groups: list[list[str]] = []
    for name in sorted(names, key=len, reverse=True):
        for group in groups:
            if not any(other.endswith(name) or name.endswith(other) for other in group):
                group.append(name)
                break
        else:
            groups.append([name])
    return groups


def _load_base(path: Path) -> int | None:
    """Where the library at ``path`` is mapped in this process (its mapping at file offset
    0), or None; None too where the mapped file is not the one at ``path`` now (replaced on
    disk while the process runs: its symbol table would not describe the mapped code)."""
    real = os.path.realpath(path)
    inode = os.stat(real).st_ino
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.rstrip("\n").split(maxsplit=5)
            if len(parts) < 6 or int(parts[2], 16) != 0:
                continue
            if parts[5] == real or os.path.realpath(parts[5]) == real:
                return int(parts[0].split("-")[0], 16) if int(parts[4]) == inode else None
    return None


_API = (
    "dnnl_engine_create dnnl_stream_create dnnl_memory_desc_create_with_strides "
    "dnnl_memory_desc_create_with_tag dnnl_memory_desc_destroy dnnl_memory_desc_get_size "
    "dnnl_memory_desc_equal "
    "dnnl_memory_create dnnl_memory_destroy dnnl_memory_set_data_handle "
    "dnnl_primitive_attr_create dnnl_primitive_attr_destroy dnnl_primitive_attr_set_post_ops "
    "dnnl_primitive_attr_set_scratchpad_mode dnnl_post_ops_create dnnl_post_ops_destroy "
    "dnnl_post_ops_append_eltwise dnnl_post_ops_append_binary dnnl_post_ops_append_sum "
    "dnnl_post_ops_append_dw "
    "dnnl_convolution_forward_primitive_desc_create dnnl_primitive_desc_query_md "
    "dnnl_primitive_desc_query "
    "dnnl_primitive_desc_destroy dnnl_primitive_create dnnl_primitive_destroy "
    "dnnl_primitive_execute dnnl_reorder_primitive_desc_create dnnl_stream_wait "
    "dnnl_matmul_primitive_desc_create dnnl_version"
).split()  # the order of API() in onednn_conv.c.j2


def api_addresses(cache_dir: Path | None = None) -> list[int] | str:
    """The addresses of the oneDNN C API functions this module calls, in PyTorch's loaded
    oneDNN, or the reason they cannot be found. The offsets are kept in ``cache_dir``
    under the library's path, size and modification time (reading a 400 MB library's
    symbol table takes most of a second)."""
    lib = _torch_cpu_library()
    if not lib.exists():
        return f"no {lib}"
    base = _load_base(lib)
    if base is None:
        return f"{lib.name} is not mapped in this process"
    offsets = _cached_offsets(lib, cache_dir)
    missing = [n for n in _API if n not in offsets]
    if missing:
        return f"{lib.name} has no symbol table entry for {missing[0]} (a stripped build?)"
    return [base + offsets[n] for n in _API]


def _cached_offsets(lib: Path, cache_dir: Path | None) -> dict[str, int]:
    st = lib.stat()
    key = f"{os.path.realpath(lib)}|{st.st_size}|{st.st_mtime_ns}|{' '.join(_API)}"
    path = None if cache_dir is None else Path(cache_dir) / "onednn_symbols.json"
    if path is not None:
        try:
            stored = json.loads(path.read_text())
            if stored.get("key") == key:
                return {k: int(v) for k, v in stored["offsets"].items()}
        except (OSError, ValueError, KeyError, AttributeError):
            pass
    offsets = elf_function_offsets(lib, _API)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "offsets": offsets}))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache: read the table again next time
    return offsets


class _Library:
    """The compiled shim, bound to PyTorch's oneDNN."""

    def __init__(self, lib: ctypes.CDLL, folder: Path, root: Path) -> None:
        self.folder, self.root = folder, root  # the kernel cache entry, and its cache
        self.create = lib.mw_conv_create
        self.create.restype = ctypes.c_void_p
        self.create.argtypes = [
            ctypes.POINTER(ctypes.c_long), ctypes.c_char_p, ctypes.c_float, ctypes.c_float,
            ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
        ]  # fmt: skip
        self.bytes = lib.mw_conv_bytes
        self.bytes.restype = ctypes.c_long
        self.bytes.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self.impl = lib.mw_conv_impl
        self.impl.restype = ctypes.c_char_p
        self.impl.argtypes = [ctypes.c_void_p]
        self.prepare = lib.mw_conv_prepare
        self.prepare.restype = ctypes.c_int
        self.prepare.argtypes = [ctypes.c_void_p] * 5
        self.same_weights = lib.mw_conv_same_weights
        self.same_weights.restype = ctypes.c_int
        self.same_weights.argtypes = [ctypes.c_void_p] * 2
        self.destroy = lib.mw_conv_destroy
        self.destroy.restype = None
        self.destroy.argtypes = [ctypes.c_void_p]
        self.run = lib.mw_conv_run
        self.run.restype = ctypes.c_int
        self.run.argtypes = [ctypes.c_void_p] * 5
        self.dw_create = lib.mw_conv_dw_create
        self.dw_create.restype = ctypes.c_void_p
        self.dw_create.argtypes = [
            ctypes.POINTER(ctypes.c_long), ctypes.c_char_p, ctypes.c_float, ctypes.c_float,
            ctypes.c_char_p, ctypes.c_float, ctypes.c_float, ctypes.c_char_p, ctypes.c_int,
        ]  # fmt: skip
        self.dw_bytes = lib.mw_conv_dw_bytes
        self.dw_bytes.restype = ctypes.c_long
        self.dw_bytes.argtypes = [ctypes.c_void_p]
        self.dw_prepare = lib.mw_conv_dw_prepare
        self.dw_prepare.restype = ctypes.c_int
        self.dw_prepare.argtypes = [ctypes.c_void_p] * 7
        self.matmul_create = lib.mw_matmul_create
        self.matmul_create.restype = ctypes.c_void_p
        self.matmul_create.argtypes = [ctypes.POINTER(ctypes.c_long), ctypes.c_char_p, ctypes.c_int]
        self.unpack = lib.mw_conv_unpack
        self.unpack.restype = ctypes.c_int
        self.unpack.argtypes = [ctypes.c_void_p] * 3


_lock = threading.Lock()
_state: dict[str, Any] = {}


def _library(cache_dir: Path) -> _Library | str:
    """The shim, compiled and bound once per process, or why it is not available. Every
    kernel cache it is asked under gets the binary too (one copy is loaded and bound), so a
    later process on that cache compiles nothing."""
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"] = _bind(cache_dir)
            except Exception as e:  # noqa: BLE001 - an unreadable library must not stop optimize()
                _state["lib"] = f"binding PyTorch's oneDNN failed ({type(e).__name__}: {e})"
            _state["caches"] = {str(cache_dir)}
        elif str(cache_dir) not in _state.setdefault("caches", set()):
            _state["caches"].add(str(cache_dir))
            if not isinstance(_state["lib"], str):
                _copy_shim(_state["lib"].folder, _state["lib"].root, Path(cache_dir))
        return _state["lib"]


def _copy_shim(folder: Path, root: Path, cache_dir: Path) -> None:
    """Put the bound shim's cache folder (binary, source, meta.json: the kernel cache
    verifies it like any entry) into ``cache_dir`` too, unless it is there; a copy, not a
    compile."""
    try:
        target = cache_dir.expanduser().resolve() / folder.relative_to(root)
    except (OSError, ValueError):
        return  # the next process on that cache compiles it
    if target.exists():
        return
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        shutil.copytree(folder, tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won, or a read-only cache


def _build_shim(cache_dir: Path) -> Any:
    """The shim's binary in ``cache_dir`` (compiled there if missing); raises CompileError."""
    header = _header()
    src = environment().get_template("onednn_conv.c.j2").render(header=str(header))
    return build_c(
        "onednn_conv",
        src,
        cache_dir,
        key_extra=(torch.__version__,),
        flags=(f"-I{header.parent.parent.parent}",),
    )


def _bind(cache_dir: Path) -> _Library | str:
    if not torch.backends.mkldnn.is_available():
        return "PyTorch was built without oneDNN"
    header = _header()
    if not header.exists():
        return f"PyTorch ships no oneDNN headers ({header})"
    table = api_addresses(cache_dir)
    if isinstance(table, str):
        return table
    try:
        built = _build_shim(cache_dir)
    except CompileError as e:
        return f"the oneDNN shim failed to compile ({e.source_path})"
    lib = load_shared(built.binary)
    if lib.mw_api_count() != len(_API):
        return "the oneDNN shim and its symbol list disagree"
    arr = (ctypes.c_void_p * len(table))(*table)
    version = lib.mw_bind(arr)
    if version < 0:
        return f"PyTorch's oneDNN is not the version of its headers (mw_bind: {version})"
    return _Library(lib, built.binary.resolve().parent, Path(cache_dir).expanduser().resolve())


def unavailable(options: Options) -> str | None:
    """None where direct oneDNN primitives can be built in this process, else why not."""
    lib = _library(options.cache_dir)
    return lib if isinstance(lib, str) else None


def primitives_note(steps: Sequence[Any]) -> str | None:
    """The report's note on how the CPU vendor convolutions among ``steps`` (a plan's) call
    oneDNN: as primitives created once, or through ``torch.ops.mkldnn`` and why."""
    with_prims = sum(1 for st in steps if hasattr(st.fn, "primitives"))
    fused = sum(1 for st in steps if getattr(st.fn, "primitives", None) == FUSED_DW)
    if with_prims:
        pairs = (
            f" ({fused} of them a 1x1 and a depthwise 3x3 convolution as one, the dw post-op)"
            if fused
            else ""
        )
        return (
            f"{with_prims} convolution(s) run as oneDNN primitives created once{pairs} "
            "(PyTorch's oneDNN through its C API: no per-call setup); "
            "Options(onednn_primitives=False) calls torch.ops.mkldnn instead"
        )
    why = _state.get("lib")
    if isinstance(why, str) and any(
        getattr(st.fn, "__name__", "").startswith("conv_") for st in steps
    ):
        return f"vendor convolutions call oneDNN through torch.ops.mkldnn: {why}"
    return None


def direct_conv(
    graph: Graph,
    node: Node,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    post: Any,  # calls.OneDnnPostOp: the activation fused into the oneDNN call
    geometry_attrs: tuple[list[int], list[int], list[int], int],  # calls._conv_geometry
    options: Options,
) -> Kernel | None:
    """The CPU conv2d ``node`` (+bias, +residual, then the activation ``post``) as oneDNN
    primitives created here, once; None where they cannot be built (the caller takes the
    ideep call). The result takes the node's inputs (``fn(x, w[, b][, residual])``, the
    weight and bias held, not read) and returns ``act(conv(x) + b + residual)`` in the
    output's declared layout; with a residual it offers ``into_residual`` (the sum written
    over the residual), as the ideep call does."""
    lib = _library(options.cache_dir)
    if isinstance(lib, str):
        return None
    x_t, out_t = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    if x_t.rank != 4 or out_t.rank != 4 or x_t.dtype != "float32":
        return None
    eltwise = _eltwise(post)
    if eltwise is None:
        return None
    residual = bool(node.attrs.get("residual", False))
    (ph, pw), (sh, sw), (dh, dw), groups = geometry_attrs
    n, c, h, w = x_t.shape
    _, k, oh, ow = out_t.shape
    kh, kw = int(weight.shape[2]), int(weight.shape[3])
    # oneDNN's right padding: what makes the output size come out
    pb = (oh - 1) * sh + (kh - 1) * dh + 1 - h - ph
    pr = (ow - 1) * sw + (kw - 1) * dw + 1 - w - pw
    src_nhwc = x_t.layout == "nhwc"
    dst_nhwc = out_t.layout == "nhwc"
    if residual and graph.values[node.inputs[-1]].layout != out_t.layout:
        return None
    # an input in the other layout (the stem's NCHW image into a channels_last network) is
    # converted by the framework first: oneDNN has only its reference loops for a
    # convolution that changes the layout
    convert = src_nhwc != dst_nhwc
    src_nhwc = dst_nhwc
    geometry = [int(v) for v in (
        n, c, h, w, k, oh, ow, kh, kw, sh, sw, ph, pw, pb, pr, dh - 1, dw - 1, groups,
        src_nhwc, dst_nhwc, bias is not None,
    )]  # fmt: skip
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    fmt = torch.channels_last if dst_nhwc else torch.contiguous_format
    shape = tuple(out_t.shape)
    x_strides = _strides(x_t.shape, src_nhwc)
    out_strides = _strides(out_t.shape, dst_nhwc)
    prims = _Primitives(lib, geometry, eltwise, weight, bias)
    # the dense source's primitives now, which also packs the weight (the plain one is then
    # let go): a problem oneDNN has no fast kernel for is refused here, at plan time
    for kind in [1, 2] if residual else [0]:
        if prims.get(kind, x_strides) is None:
            prims.close()
            return None
    prims.weight = None
    run = lib.run
    run_address = native_address(run)

    def source(kind: int, x: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The primitive for ``x`` as it is laid out, or the dense one and ``x`` made dense
        (a layout oneDNN refuses, the stem's NCHW image into a channels_last network)."""
        strides = x.stride()
        if not convert and 0 not in strides:  # a broadcast (expanded) source: made dense
            handle = prims.get(kind, strides)
            if handle is not None:
                return handle, x
        return prims.dense(kind, x_strides), x.contiguous(memory_format=fmt)

    def converted_native(x: torch.Tensor, handle: int, y: torch.Tensor, r: Any = 0) -> Any:
        """A source ``source`` makes dense first (the stem's NCHW image into a channels_last
        network, a channel slice of a split): its elements in the dense layout's order
        copied into a workspace, then the call."""
        if x.dim() != 4:
            return None
        ws = Workspace(x.numel() * 4)
        copy = strided_copy(x.permute(0, 2, 3, 1) if dst_nhwc else x, ws)
        if copy is None:
            return None
        call = NativeCall(run_address, (handle, ws, y, r, SCRATCH), True, prims.scratch_bytes)
        return [copy, call]

    def dense(t: torch.Tensor) -> bool:
        return _laid_out(t, shape, out_strides)

    def dense_out(y: torch.Tensor) -> None:
        if not dense(y):
            raise ValueError(
                f"{node.name}: the oneDNN convolution writes a dense {shape} output "
                f"(strides {out_strides}), got {tuple(y.shape)} strided {y.stride()}"
            )

    if not residual:

        def conv_onednn_out(x, *rest):
            """Destination form: ``rest`` ends with the dense output to write."""
            y = rest[-1]
            dense_out(y)
            with prims.busy:  # the step's memory objects and scratchpad: one call at a time
                handle, x = source(0, x)
                if run(handle, x.data_ptr(), y.data_ptr(), None, scratch(prims.scratch_bytes)):
                    raise RuntimeError(f"{node.name}: the oneDNN convolution failed")

        def conv_onednn_native(x, *rest):
            y = rest[-1]
            if not dense(y):
                return None
            handle, src = source(0, x)
            if src is x:
                return NativeCall(
                    run_address, (handle, x, y, 0, SCRATCH), True, prims.scratch_bytes
                )
            return converted_native(x, handle, y)

        conv_onednn_out.native = conv_onednn_native  # type: ignore[attr-defined]

        def conv_onednn(x, *rest):
            y = torch.empty(shape, dtype=torch.float32, device="cpu", memory_format=fmt)
            conv_onednn_out(x, *rest, y)
            return y

        fn = conv_onednn
        fn.out = conv_onednn_out  # type: ignore[attr-defined]
    else:

        def conv_add_onednn_out(x, *rest):
            """Destination form: ``rest`` ends with the residual, then the dense output."""
            r, y = rest[-2], rest[-1]
            dense_out(y)
            r = r if dense(r) else r.contiguous(memory_format=fmt)
            with prims.busy:
                handle, x = source(1, x)
                if run(
                    handle, x.data_ptr(), y.data_ptr(), r.data_ptr(), scratch(prims.scratch_bytes)
                ):
                    raise RuntimeError(f"{node.name}: the oneDNN convolution failed")

        def conv_add_onednn_native(x, *rest):
            r, y = rest[-2], rest[-1]
            if not (dense(y) and dense(r)):
                return None
            handle, src = source(1, x)
            if src is not x:
                return converted_native(x, handle, y, r)
            return NativeCall(run_address, (handle, x, y, r, SCRATCH), True, prims.scratch_bytes)

        conv_add_onednn_out.native = conv_add_onednn_native  # type: ignore[attr-defined]

        def conv_add_onednn(x, *rest):
            y = torch.empty(shape, dtype=torch.float32, device="cpu", memory_format=fmt)
            conv_add_onednn_out(x, *rest, y)
            return y

        def conv_add_into_residual_onednn(x, *rest):
            r = rest[-1]
            if not dense(r):  # not the dense buffer the sum form accumulates into
                r.copy_(conv_add_onednn(x, *rest))
                return r
            with prims.busy:
                handle, x = source(2, x)
                if run(handle, x.data_ptr(), r.data_ptr(), None, scratch(prims.scratch_bytes)):
                    raise RuntimeError(f"{node.name}: the oneDNN convolution failed")
            return r

        def into_residual_native(x, *rest):
            r = rest[-1]
            if not dense(r):
                return None
            handle, src = source(2, x)
            if src is not x:
                return converted_native(x, handle, r)
            return NativeCall(run_address, (handle, x, r, 0, SCRATCH), True, prims.scratch_bytes)

        conv_add_into_residual_onednn.native = into_residual_native  # type: ignore[attr-defined]
        fn = conv_add_onednn
        fn.into_residual = conv_add_into_residual_onednn  # type: ignore[attr-defined]
        fn.out = conv_add_onednn_out  # type: ignore[attr-defined]
    # the destination form writes dense outputs only: never a channel slice of a concat
    fn.out.dense_only = True  # type: ignore[attr-defined]
    fn.keep = prims.tensors  # type: ignore[attr-defined]
    fn.primitives = prims  # type: ignore[attr-defined]
    # not at interpreter exit: a daemon thread may still be inside a call then
    weakref.finalize(fn, prims.close).atexit = False
    return fn


class _Primitives:
    """The primitives of one convolution node, by (kind, source strides): kind 0 plain,
    1 a binary add of the residual, 2 the residual accumulated into (sum); each built on
    first use (a source that is a slice of a concat or split gets its own), None where
    oneDNN refuses it or has only its reference loops; one per thread count too. At most
    ``MAX_VARIANTS`` per kind; another source layout runs through the dense one. The weight is packed once (by the
    first primitive, from the plain weight) and shared by every primitive that reads the
    same format (another is reordered from it). ``tensors``: the packed weights and the
    bias, framework tensors (the plan's memory accounting reads them). ``busy``: held
    around a call (the memory objects are the node's own). The scratchpad is the calling
    thread's (:func:`scratch`), shared by every primitive that thread runs."""

    MAX_VARIANTS = 6

    def __init__(
        self,
        lib: _Library,
        geometry: list[int],
        eltwise: tuple[str, float, float],
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> None:
        self.lib, self.geometry, self.eltwise = lib, geometry, eltwise
        self.weight, self.bias = weight, bias
        self.handles: dict[tuple[int, tuple[int, ...], int], int | None] = {}
        self.tensors: list[torch.Tensor] = []
        self.busy = threading.Lock()
        self.scratch_bytes = 0  # the largest scratchpad of its primitives
        self._first: tuple[int, torch.Tensor] | None = None  # (handle, its packed weight)
        self._lock = threading.Lock()

    def dense(self, kind: int, strides: tuple[int, ...]) -> int:
        """The primitive of the dense source (built at plan time for the thread count then;
        for another, built now, whatever the variant count)."""
        h = self.get(kind, strides, limit=False)
        if h is None:
            raise RuntimeError("oneDNN refused a convolution primitive it built before")
        return h

    def get(self, kind: int, strides: tuple[int, ...], limit: bool = True) -> int | None:
        # oneDNN sizes a primitive's scratchpad and splits its work for the thread count
        # at creation: one per count (torch.set_num_threads after optimize())
        key = (kind, strides, torch.get_num_threads())
        h = self.handles.get(key, 0)
        if h != 0:
            return h
        with self._lock:
            if key not in self.handles:
                built = sum(1 for k in self.handles if k[0] == kind)
                ok = not limit or built < self.MAX_VARIANTS
                self.handles[key] = self._build(kind, strides) if ok else None
            return self.handles[key]

    def _create(self, kind: int, strides: tuple[int, ...]) -> int | None:
        """A new primitive of this node for ``kind`` and source ``strides`` (None: refused)."""
        g = (ctypes.c_long * 25)(*self.geometry, *strides)
        elt, alpha, beta = self.eltwise
        err = ctypes.create_string_buffer(256)
        return self.lib.create(g, elt.encode(), alpha, beta, kind, err, 256)

    def _build(self, kind: int, strides: tuple[int, ...]) -> int | None:
        lib = self.lib
        h = self._create(kind, strides)
        if not h:
            return None
        if lib.impl(h).decode().startswith("ref"):
            lib.destroy(h)
            return None  # oneDNN's reference loops: no fast kernel for this problem
        first = self._first
        if first is not None and lib.same_weights(h, first[0]):
            packed, source = first[1], first[1]
        else:
            packed = torch.empty(max(1, lib.bytes(h, 0)), dtype=torch.uint8, device="cpu")
            source = first[1] if first is not None else self.weight
        self.scratch_bytes = max(self.scratch_bytes, lib.bytes(h, 1))
        bias = self.bias
        assert source is not None, "the plain weight is let go only after the first primitive"
        rc = lib.prepare(
            h,
            None if first is None else first[0],
            source.data_ptr(),
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
        )
        if rc != 0:
            lib.destroy(h)
            return None
        if first is None:
            self._first = (h, packed)
            self.tensors.extend(t for t in (packed, bias) if t is not None)
        elif packed is not first[1]:
            self.tensors.append(packed)
        return h

    def close(self) -> None:
        """Destroy every primitive (the step is gone)."""
        with self.busy, self._lock:
            for h in self.handles.values():
                if h:
                    self.lib.destroy(h)
            self.handles.clear()
            self._first = None


class BatchedMatmul(_Primitives):
    """``dst[b] = src[b] @ W[b]`` for a constant ``W`` (B x K x N, float32) as oneDNN matmul
    primitives (brgemm kernels: 2.2x MKL's ``torch.bmm`` on the AMD EPYC host, whose MKL
    takes its AVX2 path there). One primitive per row count ``M`` (a ``get`` key of kind 0
    and strides ``(M,)``) and thread count, built on first use; ``W`` packed once, by the
    first, then let go (``plain()`` reorders it back where a caller needs it)."""

    def __init__(self, lib: _Library, weight: torch.Tensor) -> None:
        super().__init__(lib, [], ("", 0.0, 0.0), weight.contiguous(), None)
        self.dims = tuple(int(d) for d in weight.shape)

    def _create(self, kind: int, strides: tuple[int, ...]) -> int | None:
        b, k, n = self.dims
        g = (ctypes.c_long * 4)(b, strides[0], k, n)
        err = ctypes.create_string_buffer(256)
        return self.lib.matmul_create(g, err, 256)

    def rows(self, m: int) -> int:
        """The primitive for ``m`` rows (built now at another thread count); raises where
        oneDNN refuses a size it accepted at plan time."""
        return self.dense(0, (m,))

    def run(self, m: int, src: int, dst: int) -> None:
        """One product of ``m`` rows: ``src`` (B x m x K) and ``dst`` (B x m x N) addresses."""
        h = self.rows(m)
        with self.busy:
            if self.lib.run(h, src, dst, None, scratch(self.scratch_bytes)):
                raise RuntimeError("the oneDNN matmul failed")

    def plain(self) -> torch.Tensor:
        """``W`` as given (B x K x N), reordered back from the packed copy."""
        first = self._first
        assert first is not None, "no primitive was built"
        out = torch.empty(self.dims, dtype=torch.float32)
        if self.lib.unpack(first[0], first[1].data_ptr(), out.data_ptr()):
            raise RuntimeError("unpacking the oneDNN matmul weight failed")
        return out


def batched_matmul(
    weight: torch.Tensor, rows: Sequence[int], options: Options
) -> BatchedMatmul | None:
    """oneDNN matmul primitives for ``weight`` (B x K x N) at each row count of ``rows``
    (built and the weight packed now), or None where oneDNN cannot be called directly or
    has only its reference loops for them (the caller keeps ``torch.bmm``)."""
    if options.onednn_primitives is False:
        return None
    lib = _library(options.cache_dir)
    if isinstance(lib, str):
        return None
    mm = BatchedMatmul(lib, weight)
    for m in dict.fromkeys(rows):
        if mm.get(0, (int(m),), limit=False) is None:
            mm.close()
            return None
    mm.weight = None  # packed: the plain weight is let go
    return mm


_threads = threading.local()


def scratch(nbytes: int) -> int:
    """The address of the calling thread's oneDNN scratchpad, at least ``nbytes`` long (a
    framework tensor, grown when a primitive needs more; one per thread because the
    primitives of one plan run one after another, and two threads never share one)."""
    if nbytes == 0:
        return 0  # a primitive that books no scratchpad (depthwise kernels)
    if nbytes <= getattr(_threads, "size", 0):
        return _threads.ptr
    buf = torch.empty(
        max(nbytes, 2 * getattr(_threads, "size", 0)), dtype=torch.uint8, device="cpu"
    )
    _threads.buf, _threads.size, _threads.ptr = buf, buf.numel(), buf.data_ptr()
    return _threads.ptr


def _eltwise(post: Any) -> tuple[str, float, float] | None:
    """The shim's (eltwise name, alpha, beta) of a ``calls.OneDnnPostOp`` ("" for none),
    or None where oneDNN has no such eltwise post-op."""
    if post is None or (post.attr != "none" and post.attr not in ELTWISE):
        return None
    if post.attr == "none":
        return "", 0.0, 0.0
    return ELTWISE[post.attr](tuple(post.scalars), post.algorithm)


def _laid_out(t: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """``t`` lies in memory as a dense tensor of ``shape`` and ``strides`` does (a size-1
    dimension's stride, such as a concat slice's batch stride at batch 1, moves nothing)."""
    return tuple(t.shape) == shape and all(
        a == b for a, b, n in zip(t.stride(), strides, shape, strict=True) if n != 1
    )


def _strides(shape: tuple[int, ...], nhwc: bool) -> tuple[int, ...]:
    n, c, h, w = shape
    return (c * h * w, 1, w * c, c) if nhwc else (c * h * w, h * w, w, 1)


# the marker of a fused 1x1 + depthwise call (its ``primitives`` attribute)
FUSED_DW = "fused_dw"


def fused_dw_conv(
    node_name: str,
    in_shape: tuple[int, ...],
    out_shape: tuple[int, ...],
    stride: int,
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    posts: tuple[Any, Any],  # calls.OneDnnPostOp of the 1x1 and of the depthwise layer
    options: Options,
    reference: Callable[[torch.Tensor], torch.Tensor],
) -> Kernel | None:
    """A 1x1 convolution and the depthwise 3x3 convolution (padding 1, ``stride``) that
    reads it, channels_last, as one oneDNN primitive with the depthwise layer fused as its
    ``dw`` post-op (``mw_conv_dw_create``): oneDNN computes the expanded tensor between
    them a few rows at a time in cache instead of writing and reading it whole. ``params``:
    the 1x1 weight (OC, IC, 1, 1) and bias, the depthwise weight (OC, 1, 3, 3) and bias;
    ``posts``: each layer's activation. None where it cannot be built (no shim, an
    activation oneDNN does not fuse, only oneDNN's reference loops, another output size).
    The result takes the node's inputs (the weights held, not read) and returns the
    depthwise layer's output, dense channels_last; ``out`` writes a given dense output,
    ``native`` offers the call to the native runner. ``reference``: the layer on a source
    (the catalogue's two convolutions), for a thread count oneDNN refuses the primitive
    at."""
    lib = _library(options.cache_dir)
    if isinstance(lib, str):
        return None
    elts = [_eltwise(post) for post in posts]
    if None in elts:
        return None
    n, ic, h, w = (int(v) for v in in_shape)
    shape = tuple(int(v) for v in out_shape)
    w1, b1, wdw, bdw = (t.contiguous() for t in params)
    geometry = (ctypes.c_long * 6)(n, ic, h, w, shape[1], stride)
    in_strides, out_strides = _strides(tuple(in_shape), True), _strides(shape, True)
    handles: dict[int, int | None] = {}
    tensors: list[torch.Tensor] = [w1, b1, wdw, bdw]  # the plain weights: for another
    state = {"scratch": 0}  # thread count's primitive (packed formats may differ)
    busy = threading.Lock()

    def build() -> int | None:
        err = ctypes.create_string_buffer(256)
        (e1, a1, c1), (e2, a2, c2) = elts
        hd = lib.dw_create(geometry, e1.encode(), a1, c1, e2.encode(), a2, c2, err, 256)
        if not hd:
            return None
        impl = lib.impl(hd).decode()
        # "ref_fused_convolution:any:<1x1>:<dw>" runs the two fast kernels row block by
        # row block; a plain "ref:" (or a reference part) is oneDNN's slow loops (the
        # output's size and layout mw_conv_dw_create checked)
        parts = impl.removeprefix("ref_fused_convolution:any:")
        if "ref" in parts:
            lib.destroy(hd)
            return None
        packed = torch.empty(max(1, lib.bytes(hd, 0)), dtype=torch.uint8)
        packed_dw = torch.empty(max(1, lib.dw_bytes(hd)), dtype=torch.uint8)
        rc = lib.dw_prepare(
            hd, w1.data_ptr(), packed.data_ptr(), b1.data_ptr(),
            wdw.data_ptr(), packed_dw.data_ptr(), bdw.data_ptr(),
        )  # fmt: skip
        if rc != 0:
            lib.destroy(hd)
            return None
        tensors.extend((packed, packed_dw))
        state["scratch"] = max(state["scratch"], lib.bytes(hd, 1))
        return hd

    def handle() -> int | None:
        # oneDNN splits the work for the thread count at creation: one per count
        k = torch.get_num_threads()
        if k not in handles:
            with busy:
                if k not in handles:
                    handles[k] = build()
        return handles[k]

    def close() -> None:
        with busy:
            for hd in handles.values():
                if hd:
                    lib.destroy(hd)
            handles.clear()

    if handle() is None:  # refused at plan time
        close()
        return None

    run = lib.run
    run_address = native_address(run)

    def conv_dw_out(x, *rest):
        """Destination form: ``rest`` ends with the dense channels_last output."""
        y = rest[-1]
        if not _laid_out(y, shape, out_strides):
            raise ValueError(
                f"{node_name}: the fused oneDNN convolution writes a dense {shape} "
                f"channels_last output, got {tuple(y.shape)} strided {y.stride()}"
            )
        if not _laid_out(x, tuple(in_shape), in_strides):
            x = x.contiguous(memory_format=torch.channels_last)
        hd = handle()
        if hd is None:  # refused at this thread count (built at the plan's)
            y.copy_(reference(x))
            return
        with busy:  # the primitive's memory objects: one call at a time
            if run(hd, x.data_ptr(), y.data_ptr(), None, scratch(state["scratch"])):
                raise RuntimeError(f"{node_name}: the fused oneDNN convolution failed")

    def conv_dw_native(x, *rest):
        y = rest[-1]
        hd = handle()
        if (
            hd is None
            or not _laid_out(y, shape, out_strides)
            or not _laid_out(x, tuple(in_shape), in_strides)
        ):
            return None
        return NativeCall(run_address, (hd, x, y, 0, SCRATCH), True, state["scratch"])

    def conv_dw(x, *rest):
        y = torch.empty(shape, dtype=torch.float32, memory_format=torch.channels_last)
        conv_dw_out(x, *rest, y)
        return y

    conv_dw_out.native = conv_dw_native  # type: ignore[attr-defined]
    conv_dw_out.dense_only = True  # type: ignore[attr-defined]
    conv_dw.out = conv_dw_out  # type: ignore[attr-defined]
    conv_dw.keep = tensors  # type: ignore[attr-defined]
    conv_dw.primitives = FUSED_DW  # type: ignore[attr-defined]  # primitives_note counts it
    # not at interpreter exit: a daemon thread may still be inside a call then
    weakref.finalize(conv_dw, close).atexit = False
    return conv_dw
