"""The ``direct`` algorithm of conv2d: a generated direct convolution with its epilogue
(bias, residual add, activation) fused, compiled through the kernel cache.

Two loop nests, chosen by the layer (``x86/templates/direct_conv.c.j2``):

- depthwise (one input channel per output channel, the bulk of MobileNet's and
  ShuffleNet's convolutions): SIMD over channels, one output pixel at a time, weights
  packed ``[kh][kw][K]``;
- blocked (any other grouping): ``PB`` output pixels x ``KB`` output channels of
  accumulators, one broadcast input value against a vector of weights packed
  ``[g][kh][kw][cg][kg]``.

Both read the input in place (NHWC; an NCHW input is converted first, except where a
blocked layer has at most ``NCHW_MAX_CG`` input channels per group: the network's stem
reads the user's NCHW image in place, its few planes by stride), skip the taps that
fall in the padding instead of reading a padded copy, and write the output once, with the
epilogue applied in registers: no workspace. Rows of the output run in parallel only where
a row's work pays for OpenMP's fork (small layers at batch 1 run on one thread). The sums
are the convolution's own, so the algorithm is exact up to float rounding, NaN and
infinity included. Its record is in ``algorithms.py``.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ...graph import Graph, Node, TensorType
from ...hardware import Hardware
from ...loops import pair as _pair
from ...options import Options
from ..interface import NativeCall, holds_inputs, native_address
from ..x86.backend import stream_min_bytes
from ..x86.render import environment
from .calls import _conv_geometry, activation_attrs, holds_constants
from .generated import activation_c, activation_why_not, load_kernel

Kernel = Callable[..., Any]

VB = 16  # the depthwise nest's channel block (one AVX-512 register)
KB = 32  # the blocked nest's output channels per block (two registers)
PB = 6  # the blocked nest's output pixels per block (12 accumulator registers)
# A layer of at most 16 output channels per group: one register of them per pixel, and
# PB_ONE pixels per block (as many independent accumulators as KB x PB's).
PB_ONE = 8
# The most input channels per group the blocked nest reads from an NCHW input in place
# (a broadcast per channel plane; more planes than this convert to NHWC first).
NCHW_MAX_CG = 4
PD = 8  # the depthwise nest's output pixels per block (independent accumulator registers)
# Multiply-adds below which a call runs on one thread (OpenMP's fork and join cost about
# as much as 32K multiply-adds on the measured host).
PARALLEL_WORK = 1 << 15


def _pad(n: int, m: int) -> int:
    return -(-n // m) * m


def why_not(graph: Graph, node: Node, device: torch.device) -> str | None:
    """None where the direct kernel can run ``node``, else the reason."""
    if device.type != "cpu":
        return f"x86 only, not {device.type}"
    if node.op != "conv2d":
        return "not a convolution"
    if isinstance(node.attrs["padding"], str):
        return "string padding"
    x_t = graph.values[node.inputs[0]]
    if x_t.rank != 4 or x_t.dtype != "float32":
        return f"not a float32 4-d input ({x_t.dtype}, rank {x_t.rank})"
    if not graph.is_param(node.inputs[1]):
        return "weight is computed"
    residual = bool(node.attrs.get("residual", False))
    if len(node.inputs) - int(residual) == 3 and not graph.is_param(node.inputs[2]):
        return "bias is computed"
    return activation_why_not(node)


def _geometry(graph: Graph, node: Node) -> dict[str, int]:
    x_t, out_t = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    w_t = graph.values[node.inputs[1]]
    (ph, pw), (sh, sw), (dh, dw), groups = _conv_geometry(node)
    _, c, h, w = x_t.shape
    k, oh, ow = out_t.shape[1], out_t.shape[2], out_t.shape[3]
    kh, kw = w_t.shape[2], w_t.shape[3]
    geo = dict(C=c, H=h, W=w, K=k, OH=oh, OW=ow, KH=kh, KW=kw, SH=sh, SW=sw, PH=ph, PW=pw)
    geo.update(DH=dh, DW=dw, G=groups, CG=c // groups, KG=k // groups)
    # output columns whose taps all fall inside the input: [OW_LO, OW_HI)
    lo = min(ow, -(-pw // sw))
    hi = (w - 1 + pw - (kw - 1) * dw) // sw + 1  # Python's floor division
    geo.update(OW_LO=lo, OW_HI=max(lo, min(ow, hi)))
    # the input's element strides within an image (channel, row, column)
    nchw = reads_nchw(graph, node)
    geo.update(XSC=h * w if nchw else 1, XSH=w if nchw else w * c, XSW=1 if nchw else c)
    return geo


def _dense(t: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
    """``t`` dense in ``fmt`` (itself where it is)."""
    return t if t.is_contiguous(memory_format=fmt) else t.contiguous(memory_format=fmt)


def _laid_out(t: torch.Tensor, fmt: torch.memory_format, dims: tuple[int, ...]) -> bool:
    """``t`` has shape ``dims`` and is dense in ``fmt``."""
    return tuple(t.shape) == dims and t.is_contiguous(memory_format=fmt)


def _stream_min(hardware: Hardware) -> int | None:
    """The output size from which the kernels store non-temporally (AVX-512 stores: None,
    never, on a CPU without them)."""
    return stream_min_bytes(hardware) if hardware.simd_bytes >= 64 else None


def reads_nchw(graph: Graph, node: Node) -> bool:
    """The blocked nest reads ``node``'s input in NCHW in place (a dense layer with few
    input channels whose input is NCHW: the stem, on the user's image)."""
    x_t, w_t = graph.values[node.inputs[0]], graph.values[node.inputs[1]]
    groups = int(node.attrs.get("groups", 1))
    depthwise = groups == x_t.shape[1] and w_t.shape[0] == groups
    return x_t.layout != "nhwc" and not depthwise and w_t.shape[1] <= NCHW_MAX_CG


def _blocking(geo: dict[str, int]) -> tuple[int, int]:
    """(output channels, output pixels) per block of the blocked nest."""
    return (VB, PB_ONE) if geo["KG"] <= VB else (KB, PB)


def _depthwise(geo: dict[str, int]) -> bool:
    return geo["CG"] == 1 and geo["KG"] == 1


def extra_bytes(graph: Graph, node: Node) -> int:
    """The packed weight (and padded bias): the vendor call's prepacked weight is not held."""
    geo = _geometry(graph, node)
    if _depthwise(geo):
        return 4 * _pad(geo["K"], VB) * (geo["KH"] * geo["KW"] + 1)
    taps = geo["G"] * geo["KH"] * geo["KW"] * geo["CG"]
    return 4 * taps * _pad(geo["KG"], _blocking(geo)[0]) + 4 * geo["K"]


def pack_weight(weight: np.ndarray, geo: dict[str, int]) -> np.ndarray:
    """PyTorch's ``[K, CG, KH, KW]`` weight in the nest's order, zero-padded lanes."""
    k, kh, kw = geo["K"], geo["KH"], geo["KW"]
    if _depthwise(geo):
        kp = _pad(k, VB)
        out = np.zeros((kh, kw, kp), np.float32)
        out[:, :, :k] = weight[:, 0].transpose(1, 2, 0)
        return out
    g, cg, kg = geo["G"], geo["CG"], geo["KG"]
    out = np.zeros((g, kh, kw, cg, _pad(kg, _blocking(geo)[0])), np.float32)
    # [G*KG, CG, KH, KW] -> [G, KG, CG, KH, KW] -> [G, KH, KW, CG, KG]
    out[..., :kg] = weight.reshape(g, kg, cg, kh, kw).transpose(0, 3, 4, 2, 1)
    return out


def render(
    graph: Graph, node: Node, threads: int, stream_min: int | None = None
) -> tuple[str, str]:
    """(kernel name, C source) of ``node``'s direct convolution. ``stream_min``: the
    output size from which the blocked nest stores non-temporally (None: never)."""
    geo = _geometry(graph, node)
    residual = bool(node.attrs.get("residual", False))
    bias = len(node.inputs) - int(residual) == 3
    name, _ = activation_attrs(node)
    act = activation_c(node)
    text = "conv(x)" + (" + bias" if bias else "") + (" + residual" if residual else "")
    text = f"{name}({text})" if name else text
    depthwise = _depthwise(geo)
    row_work = geo["OW"] * geo["K"] * geo["KH"] * geo["KW"] * geo["CG"]
    kb, pb = _blocking(geo)
    fields = dict(
        geo,
        depthwise=depthwise,
        x_nchw=geo["XSC"] != 1,
        fused_dw=False,
        stream_dw=False,
        stream=stream_min is not None
        and not depthwise
        and graph.values[node.outputs[0]].nbytes >= stream_min,
        KP=_pad(geo["K"], VB),
        PD=PD,
        KGP=_pad(geo["KG"], kb),
        KB=kb,
        PB=pb,
        bias=bias,
        residual=residual,
        activation=act,
        epilogue_text=text,
        threads=max(1, threads),
        row_work=row_work,
        parallel_work=PARALLEL_WORK,
    )
    digest = hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:10]
    kname = f"conv_direct_{'dw' if depthwise else 'blk'}_{digest}"
    src = environment().get_template("direct_conv.c.j2").render(name=kname, **fields)
    return kname, src


def kernel(graph: Graph, node: Node, options: Options, hardware: Hardware) -> Kernel | None:
    """The call for ``node`` (the catalogue reference's arguments, ``fn(x, w[, b][,
    residual])``, and its result in the node's layout), or None where the direct kernel
    does not apply or failed to compile (warned; ``options.strict`` raises)."""
    if why_not(graph, node, torch.device("cpu")) is not None:
        return None
    kname, src = render(graph, node, hardware.cores, _stream_min(hardware))
    fn = load_kernel(
        node,
        kname,
        src,
        [ctypes.c_void_p] * 5 + [ctypes.c_int],
        options,
        hardware,
        "oneDNN's convolution",
    )
    if fn is None:
        return None

    geo = _geometry(graph, node)
    out_t = graph.values[node.outputs[0]]
    residual = bool(node.attrs.get("residual", False))
    has_bias = len(node.inputs) - int(residual) == 3
    packed = torch.from_numpy(
        pack_weight(np.asarray(graph.params[node.inputs[1]], np.float32), geo)
    )
    bias = None
    if has_bias:
        b = np.zeros(_pad(geo["K"], VB), np.float32)
        b[: geo["K"]] = graph.params[node.inputs[2]]
        bias = torch.from_numpy(b)
    bias_ptr = bias.data_ptr() if bias is not None else None
    cl = torch.channels_last
    shape = (geo["K"], geo["OH"], geo["OW"])
    nchw = out_t.layout != "nhwc"
    # the layout the kernel reads its input in (the stem's NCHW image in place)
    x_fmt = torch.contiguous_format if geo["XSC"] != 1 else cl
    batch = graph.values[node.inputs[0]].shape[0]

    def call(x: torch.Tensor, r: torch.Tensor | None, y: torch.Tensor) -> None:
        fn(x.data_ptr(), packed.data_ptr(), bias_ptr, r.data_ptr() if r is not None else None,
           y.data_ptr(), x.shape[0])  # fmt: skip

    def conv_direct(x, _w, *rest):
        x = _dense(x, x_fmt)
        y = torch.empty((x.shape[0], *shape), dtype=torch.float32, memory_format=cl)
        call(x, _dense(rest[-1], cl) if residual else None, y)
        return y.contiguous() if nchw else y

    if not nchw:

        def conv_direct_out(x, _w, *rest):
            """Destination form: ``rest`` ends with the dense channels_last output."""
            y = rest[-1]
            if not _laid_out(y, cl, (x.shape[0], *shape)):
                raise ValueError(f"{node.name}: the direct convolution writes a dense output")
            call(_dense(x, x_fmt), _dense(rest[-2], cl) if residual else None, y)

        def conv_direct_native(x, _w, *rest):
            y = rest[-1]
            r = rest[-2] if residual else None
            dims = (batch, *shape)
            if not (_laid_out(x, x_fmt, (batch, *graph.values[node.inputs[0]].shape[1:]))
                    and _laid_out(y, cl, dims) and (r is None or _laid_out(r, cl, dims))):  # fmt: skip
                return None
            return NativeCall(
                address,
                (x, packed.data_ptr(), bias_ptr or 0, 0 if r is None else r, y, batch),
                keep=(packed, bias),
            )

        address = native_address(fn)
        conv_direct_out.native = conv_direct_native  # type: ignore[attr-defined]
        conv_direct_out.dense_only = True  # type: ignore[attr-defined]
        conv_direct.out = conv_direct_out  # type: ignore[attr-defined]

    conv_direct.algorithm = "direct" + (" depthwise" if _depthwise(geo) else " blocked")  # type: ignore[attr-defined]
    conv_direct.keep = (packed, bias)  # type: ignore[attr-defined]
    return holds_constants(conv_direct, node)


# ------------------------------------------------ a stem and its depthwise layer, fused
def stem_dw_why_not(graph: Graph, node: Node, device: torch.device) -> str | None:
    """None where the direct kernel can run ``node``, a ``conv2d_dw`` made of a stem
    convolution and the depthwise 3x3 layer that reads it (the fuse_stem pass), else why
    not."""
    if device.type != "cpu":
        return f"x86 only, not {device.type}"
    if node.op != "conv2d_dw":
        return "not a fused convolution pair"
    if "stride1" not in node.attrs:
        return "a 1x1 and a depthwise layer (oneDNN's fused primitive runs them)"
    x_t = graph.values[node.inputs[0]]
    if x_t.rank != 4 or x_t.dtype != "float32":
        return f"not a float32 4-d input ({x_t.dtype}, rank {x_t.rank})"
    if not all(graph.is_param(v) for v in node.inputs[1:]):
        return "a weight or bias is computed"
    k, c = graph.values[node.inputs[1]].shape[:2]
    if c != x_t.shape[1] or c > NCHW_MAX_CG:
        return f"a stem of {c} input channels per group on {x_t.shape[1]} (dense, <= {NCHW_MAX_CG})"
    if graph.values[node.inputs[3]].shape != (k, 1, 3, 3) or int(node.attrs["stride"]) not in (
        1,
        2,
    ):
        return "not a depthwise 3x3 layer of stride 1 or 2"
    return activation_why_not(node) or activation_why_not(node, "dw_activation")


class _Values:
    """A graph's value table with one value more (the stem's output, which the fused
    layer never writes out)."""

    def __init__(self, graph: Graph, extra: dict[str, Any]) -> None:
        self.values = {**graph.values, **extra}


def _stem_of(graph: Graph, node: Node) -> tuple[Any, Node]:
    """The first convolution of a fused stem ``conv2d_dw`` as a ``conv2d`` node (its
    activation included) over a value table that holds its output."""
    x, w1, b1 = node.inputs[:3]
    a = node.attrs
    x_t, w_t = graph.values[x], graph.values[w1]
    (sh, sw), (ph, pw) = _pair(a["stride1"]), _pair(a["padding1"])
    n, _, h, w = x_t.shape
    k, _, kh, kw = w_t.shape
    mid = TensorType(
        (n, k, (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1), "float32", "nhwc"
    )
    attrs = dict(stride=(sh, sw), padding=(ph, pw), dilation=1, groups=1)
    if a.get("activation"):
        attrs.update(activation=a["activation"], activation_attrs=a.get("activation_attrs", ()))
    conv = Node(node.name, "conv2d", (x, w1, b1), (f"{node.name}.stem",), attrs)
    return _Values(graph, {conv.outputs[0]: mid}), conv


def stem_dw_extra_bytes(graph: Graph, node: Node) -> int:
    """What a fused stem holds: the packed stem weight (as :func:`pack_weight` pads it),
    the packed depthwise weight and both biases, padded to 16 lanes."""
    values, conv = _stem_of(graph, node)
    geo = _geometry(values, conv)  # type: ignore[arg-type]
    kp = _pad(geo["K"], VB)
    taps = geo["KH"] * geo["KW"] * geo["CG"]
    return 4 * (taps * _pad(geo["KG"], _blocking(geo)[0]) + 9 * kp + 2 * kp)


def render_stem_dw(
    graph: Graph, node: Node, threads: int, stream_min: int | None = None
) -> tuple[str, str]:
    """(kernel name, C source) of a fused stem ``conv2d_dw`` (:func:`stem_dw_why_not`)."""
    values, conv = _stem_of(graph, node)
    geo = _geometry(values, conv)  # type: ignore[arg-type]
    out_t = graph.values[node.outputs[0]]
    kb, pb = _blocking(geo)
    ds = int(node.attrs["stride"])
    name, _ = activation_attrs(node)
    name2, _ = activation_attrs(node, "dw_activation")
    text = f"{name}(conv(x) + b1)" if name else "conv(x) + b1"
    dw_text = f"dw({text}) + bdw"
    fields = dict(
        geo,
        depthwise=False,
        fused_dw=True,
        x_nchw=geo["XSC"] != 1,
        KP=_pad(geo["K"], VB),
        KGP=_pad(geo["KG"], kb),
        KB=kb,
        PB=pb,
        PD=PD,
        bias=True,
        residual=False,
        activation=activation_c(node),
        dw_activation=activation_c(node, "dw_activation"),
        epilogue_text=text,
        dw_epilogue_text=f"{name2}({dw_text})" if name2 else dw_text,
        DS=ds,
        OH2=out_t.shape[2],
        OW2=out_t.shape[3],
        # depthwise output columns whose taps are all inside the stem's row (padding 1)
        OW2_LO=min(out_t.shape[3], 1),
        OW2_HI=max(min(out_t.shape[3], 1), min(out_t.shape[3], (geo["OW"] - 2) // ds + 1)),
        stream=False,  # the stem's rows go to the ring, which is read right away
        stream_dw=stream_min is not None and out_t.nbytes >= stream_min,
        threads=max(1, threads),
        # a depthwise output row's work: its share of the stem's rows and its own taps
        row_work=int(node.attrs["stride"])
        * geo["OW"]
        * geo["K"]
        * geo["KH"]
        * geo["KW"]
        * geo["CG"]
        + out_t.shape[3] * geo["K"] * 9,
        parallel_work=PARALLEL_WORK,
    )
    digest = hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:10]
    kname = f"conv_stem_dw_{digest}"
    src = environment().get_template("direct_conv.c.j2").render(name=kname, **fields)
    return kname, src


def stem_dw_kernel(graph: Graph, node: Node, options: Options, hardware: Hardware) -> Kernel | None:
    """The call for a fused stem ``conv2d_dw`` (``fn(x, w1, b1, wdw, bdw)``, every weight
    held, returning the channels_last output), or None where it does not apply or failed
    to compile (warned; ``options.strict`` raises)."""
    if stem_dw_why_not(graph, node, torch.device("cpu")) is not None:
        return None
    kname, src = render_stem_dw(graph, node, hardware.cores, _stream_min(hardware))
    fn = load_kernel(
        node, kname, src, [ctypes.c_void_p] * 6 + [ctypes.c_int], options, hardware,
        "the reference's two convolutions",
    )  # fmt: skip
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    values, conv = _stem_of(graph, node)
    geo = _geometry(values, conv)  # type: ignore[arg-type]
    k = geo["K"]
    params = [np.asarray(graph.params[v], np.float32) for v in node.inputs[1:]]
    packed = torch.from_numpy(pack_weight(params[0], geo))
    kp = _pad(k, VB)
    b1, bdw = np.zeros(kp, np.float32), np.zeros(kp, np.float32)
    b1[:k], bdw[:k] = params[1], params[3]
    wdw = np.zeros((3, 3, kp), np.float32)
    wdw[:, :, :k] = params[2][:, 0].transpose(1, 2, 0)
    held = (packed, torch.from_numpy(b1), torch.from_numpy(wdw), torch.from_numpy(bdw))
    ptrs = [t.data_ptr() for t in held]
    cl = torch.channels_last
    x_fmt = torch.contiguous_format if geo["XSC"] != 1 else cl
    x_dims = tuple(graph.values[node.inputs[0]].shape)
    out_dims = tuple(graph.values[node.outputs[0]].shape)

    def call(x: torch.Tensor, y: torch.Tensor) -> None:
        if fn(x.data_ptr(), *ptrs, y.data_ptr(), x.shape[0]):
            raise MemoryError(f"{node.name}: the fused stem kernel could not allocate its rows")

    def stem_dw(x, *_params):
        y = torch.empty((x.shape[0], *out_dims[1:]), dtype=torch.float32, memory_format=cl)
        call(_dense(x, x_fmt), y)
        return y

    def stem_dw_out(x, *rest):
        """Destination form: ``rest`` ends with the dense channels_last output."""
        y = rest[-1]
        if not _laid_out(y, cl, (x.shape[0], *out_dims[1:])):
            raise ValueError(f"{node.name}: the fused stem kernel writes a dense output")
        call(_dense(x, x_fmt), y)

    def stem_dw_native(x, *rest):
        y = rest[-1]
        if not (_laid_out(x, x_fmt, x_dims) and _laid_out(y, cl, out_dims)):
            return None
        return NativeCall(address, (x, *ptrs, y, x_dims[0]), True, keep=held)

    address = native_address(fn)
    stem_dw_out.native = stem_dw_native  # type: ignore[attr-defined]
    stem_dw_out.dense_only = True  # type: ignore[attr-defined]
    stem_dw.out = stem_dw_out  # type: ignore[attr-defined]
    stem_dw.algorithm = "direct stem + depthwise"  # type: ignore[attr-defined]
    stem_dw.keep = held  # type: ignore[attr-defined]
    return holds_inputs(stem_dw, range(1, 5))
