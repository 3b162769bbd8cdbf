"""The ``direct`` algorithm of conv2d: a generated direct convolution with its epilogue
(bias, residual add, activation) fused, compiled through the kernel cache.

Two loop nests, chosen by the layer (``x86/templates/direct_conv.c.j2``):

- depthwise (one input channel per output channel, the bulk of MobileNet's and
  ShuffleNet's convolutions): SIMD over channels, one output pixel at a time, weights
  packed ``[kh][kw][K]``;
- blocked (any other grouping): ``PB`` output pixels x ``KB`` output channels of
  accumulators, one broadcast input value against a vector of weights packed
  ``[g][kh][kw][cg][kg]``.

Both read the input in place (NHWC; an NCHW input is converted first), skip the taps that
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

from ...graph import Graph, Node
from ...hardware import Hardware
from ...options import Options
from ..x86.render import environment
from .calls import _conv_geometry, activation_attrs, holds_constants
from .generated import activation_c, activation_why_not, load_kernel

Kernel = Callable[..., Any]

VB = 16  # the depthwise nest's channel block (one AVX-512 register)
KB = 32  # the blocked nest's output channels per block (two registers)
PB = 4  # the blocked nest's output pixels per block (8 accumulator registers)
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
    return geo


def _depthwise(geo: dict[str, int]) -> bool:
    return geo["CG"] == 1 and geo["KG"] == 1


def extra_bytes(graph: Graph, node: Node) -> int:
    """The packed weight (and padded bias): the vendor call's prepacked weight is not held."""
    geo = _geometry(graph, node)
    if _depthwise(geo):
        return 4 * _pad(geo["K"], VB) * (geo["KH"] * geo["KW"] + 1)
    taps = geo["G"] * geo["KH"] * geo["KW"] * geo["CG"]
    return 4 * taps * _pad(geo["KG"], KB) + 4 * geo["K"]


def pack_weight(weight: np.ndarray, geo: dict[str, int]) -> np.ndarray:
    """PyTorch's ``[K, CG, KH, KW]`` weight in the nest's order, zero-padded lanes."""
    k, kh, kw = geo["K"], geo["KH"], geo["KW"]
    if _depthwise(geo):
        kp = _pad(k, VB)
        out = np.zeros((kh, kw, kp), np.float32)
        out[:, :, :k] = weight[:, 0].transpose(1, 2, 0)
        return out
    g, cg, kg = geo["G"], geo["CG"], geo["KG"]
    out = np.zeros((g, kh, kw, cg, _pad(kg, KB)), np.float32)
    # [G*KG, CG, KH, KW] -> [G, KG, CG, KH, KW] -> [G, KH, KW, CG, KG]
    out[..., :kg] = weight.reshape(g, kg, cg, kh, kw).transpose(0, 3, 4, 2, 1)
    return out


def render(graph: Graph, node: Node, threads: int) -> tuple[str, str]:
    """(kernel name, C source) of ``node``'s direct convolution."""
    geo = _geometry(graph, node)
    residual = bool(node.attrs.get("residual", False))
    bias = len(node.inputs) - int(residual) == 3
    name, _ = activation_attrs(node)
    act = activation_c(node)
    text = "conv(x)" + (" + bias" if bias else "") + (" + residual" if residual else "")
    text = f"{name}({text})" if name else text
    depthwise = _depthwise(geo)
    row_work = geo["OW"] * geo["K"] * geo["KH"] * geo["KW"] * geo["CG"]
    fields = dict(
        geo,
        depthwise=depthwise,
        KP=_pad(geo["K"], VB),
        PD=PD,
        KGP=_pad(geo["KG"], KB),
        KB=KB,
        PB=PB,
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
    kname, src = render(graph, node, hardware.cores)
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

    def dense(t: torch.Tensor) -> torch.Tensor:
        return t if t.is_contiguous(memory_format=cl) else t.contiguous(memory_format=cl)

    def conv_direct(x, _w, *rest):
        x = dense(x)
        y = torch.empty((x.shape[0], *shape), dtype=torch.float32, memory_format=cl)
        r = dense(rest[-1]) if residual else None
        fn(x.data_ptr(), packed.data_ptr(), bias_ptr, r.data_ptr() if r is not None else None,
           y.data_ptr(), x.shape[0])  # fmt: skip
        return y.contiguous() if nchw else y

    conv_direct.algorithm = "direct" + (" depthwise" if _depthwise(geo) else " blocked")  # type: ignore[attr-defined]
    conv_direct.keep = (packed, bias)  # type: ignore[attr-defined]
    return holds_constants(conv_direct, node)
