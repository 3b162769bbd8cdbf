"""The ``gemv`` algorithm of linear: a generated streaming matrix-vector product for a few
rows (batch 1 classifiers: alexnet's and vgg16's fully connected layers read 100+ MB of
weights per call), with the activation fused (``x86/templates/gemv.c.j2``); from
``STREAM_ROWS + 1`` to ``MAX_ROWS`` rows a blocked product instead
(``x86/templates/gemm_rows.c.j2``: 4 weight rows x 4 input rows of 16-lane sums a block,
the loads one per two multiply-adds; a batch-16 classifier).

At ``rows`` <= ``MAX_ROWS`` a linear layer is bound by reading its weight: the kernel
reads PyTorch's own row-major weight in place (no packed copy), every element once per
``NB`` rows, output rows split evenly over the threads, with independent accumulators and
prefetch. Exact up to float rounding (a fixed summation order). Its record is in
``algorithms.py``.
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
from ..interface import NativeCall, native_address
from ..x86.render import environment
from .calls import activation_attrs, holds_constants
from .direct import PARALLEL_WORK  # (the multiply-adds OpenMP's fork costs)
from .generated import activation_c, activation_why_not, load_kernel

Kernel = Callable[..., Any]

MAX_ROWS = 16  # rows (the input's leading dims multiplied) this algorithm takes
STREAM_ROWS = 4  # up to here the streaming GEMV (gemv.c.j2), above it the blocked product
NB = 4  # rows per pass over the weight
U = 4  # 16-lane accumulators per row
OB, RB = 4, 4  # the blocked product's weight rows x input rows (16 sums) per block


def rows_of(graph: Graph, node: Node) -> int:
    x_t = graph.values[node.inputs[0]]
    return x_t.numel // max(1, x_t.shape[-1])


def why_not(graph: Graph, node: Node, device: torch.device) -> str | None:
    """None where the GEMV can run ``node``, else the reason."""
    if device.type != "cpu":
        return f"x86 only, not {device.type}"
    if node.op != "linear":
        return "not a linear layer"
    x_t = graph.values[node.inputs[0]]
    if x_t.dtype != "float32" or x_t.rank < 2:
        return f"not a float32 input of rank >= 2 ({x_t.dtype}, rank {x_t.rank})"
    if not graph.is_param(node.inputs[1]):
        return "weight is computed"
    if len(node.inputs) > 2 and not graph.is_param(node.inputs[2]):
        return "bias is computed"
    rows = rows_of(graph, node)
    if rows > MAX_ROWS:
        return f"{rows} rows: a GEMV pays below {MAX_ROWS + 1} (above, the weight is reused)"
    return activation_why_not(node)


def stream_form(hardware: Hardware, out_f: int) -> dict[str, Any]:
    """How the streaming GEMV reads W on this CPU: rows of W side by side per pass
    (``wrows``, per row count of x), the prefetch distance, hint and spacing. On Intel
    four rows of W at once, every line prefetched into L1 4 KiB ahead: 9216 -> 4096 at
    one row, two threads, the Intel Xeon host (triad 20 GB/s), interleaved, 7.7 ms
    against 13.4 one row at a time with one non-temporal prefetch per 256 bytes (the AMD
    form), 8.5 with every line into L1, F.linear (MKL) 7.3. On AMD the form measured
    there (session 13: 1.4-2x F.linear, whose MKL takes its AVX2 path on AMD). Without
    AVX-512 one row of W at a time (16 accumulators of 16 floats need its 32 vector
    registers). The per-output sum of the accumulators is a tree on every CPU."""
    if hardware.amd:
        return dict(wrows=[1] * NB, PREFETCH=16 * 64, PF_HINT=0, PF_EVERY=U * 16)
    wrows = []
    for r in range(1, NB + 1):
        # at most 16 accumulators (of 32 vector registers): 4 rows of W at one row of x
        k = max(1, 16 // (r * U)) if hardware.simd_bytes >= 64 else 1
        while out_f % k:
            k //= 2
        wrows.append(k)
    return dict(wrows=wrows, PREFETCH=16 * 64, PF_HINT=3, PF_EVERY=16)


def render(graph: Graph, node: Node, hardware: Hardware) -> tuple[str, str]:
    """(kernel name, C source): the streaming GEMV up to ``STREAM_ROWS`` rows, above it the
    blocked few-rows product (``gemm_rows.c.j2``)."""
    threads = hardware.cores
    w_t = graph.values[node.inputs[1]]
    out_f, in_f = w_t.shape
    bias = len(node.inputs) > 2
    name, _ = activation_attrs(node)
    act = activation_c(node)
    text = "sum_i W[o][i] * x[r][i]" + (" + b[o]" if bias else "")
    text = f"{name}({text})" if name else text
    blocked = rows_of(graph, node) > STREAM_ROWS
    fields = dict(
        IN=in_f, OUT=out_f, bias=bias, activation=act, epilogue_text=text,
        threads=max(1, threads),
    )  # fmt: skip
    if blocked:
        fields.update(OB=OB, RB=RB, MAXR=MAX_ROWS, parallel_work=PARALLEL_WORK)
    else:
        fields.update(NB=NB, U=U, **stream_form(hardware, out_f))
    digest = hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:10]
    kname = f"{'gemm_rows' if blocked else 'gemv'}_{digest}"
    template = "gemm_rows.c.j2" if blocked else "gemv.c.j2"
    return kname, environment().get_template(template).render(name=kname, **fields)


def kernel(graph: Graph, node: Node, options: Options, hardware: Hardware) -> Kernel | None:
    """The call for ``node`` (``fn(x, w[, b])`` -> a new tensor of the output's shape), or
    None where the GEMV does not apply or failed to compile (warned; strict raises)."""
    if why_not(graph, node, torch.device("cpu")) is not None:
        return None
    kname, src = render(graph, node, hardware)
    fn = load_kernel(
        node,
        kname,
        src,
        [ctypes.c_void_p] * 4 + [ctypes.c_long],
        options,
        hardware,
        "the vendor's linear",
    )
    if fn is None:
        return None
    weight = torch.from_numpy(np.ascontiguousarray(graph.params[node.inputs[1]], np.float32))
    bias = None
    if len(node.inputs) > 2:
        bias = torch.from_numpy(np.ascontiguousarray(graph.params[node.inputs[2]], np.float32))
    wp, bp = weight.data_ptr(), bias.data_ptr() if bias is not None else None
    out_f = weight.shape[0]

    def linear_gemv_out(x, *rest):
        """Destination form: ``rest`` ends with the dense output."""
        y = rest[-1]
        if not y.is_contiguous() or tuple(y.shape) != (*x.shape[:-1], out_f):
            raise ValueError(f"{node.name}: the GEMV writes a dense output")
        x = x.contiguous()
        fn(x.data_ptr(), wp, bp, y.data_ptr(), x.numel() // x.shape[-1])

    def linear_gemv_native(x, *rest):
        y = rest[-1]
        if not (x.is_contiguous() and y.is_contiguous()):
            return None
        if tuple(y.shape) != (*x.shape[:-1], out_f):
            return None
        return NativeCall(address, (x, wp, bp or 0, y, x.numel() // x.shape[-1]))

    def linear_gemv(x, _w, *_rest):
        y = torch.empty((*x.shape[:-1], out_f), dtype=torch.float32)
        linear_gemv_out(x, y)
        return y

    address = native_address(fn)
    linear_gemv_out.native = linear_gemv_native  # type: ignore[attr-defined]
    linear_gemv_out.dense_only = True  # type: ignore[attr-defined]
    linear_gemv.out = linear_gemv_out  # type: ignore[attr-defined]

    linear_gemv.algorithm = "gemv"  # type: ignore[attr-defined]
    linear_gemv.keep = (weight, bias)  # type: ignore[attr-defined]
    return holds_constants(linear_gemv, node)
