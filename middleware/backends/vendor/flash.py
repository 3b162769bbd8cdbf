"""The ``flash`` algorithm of scaled_dot_product_attention: a generated flash-style kernel
(``x86/templates/flash_attention.c.j2``), compiled through the kernel cache.

A tile of ``BR`` query rows against tiles of ``BC`` keys: scores per tile pair, the softmax
kept online per row (running maximum and sum, the output accumulator rescaled), so the
L x S score matrix is never materialised (memory per thread: BR x (BC + Dv) floats).
Applies to float32 q, k, v of rank 3 or 4 with the same leading dims, a float or boolean
mask broadcastable to (..., L, S) (a boolean one becomes an additive 0 / -inf mask, its
own size), ``is_causal`` (PyTorch's top-left alignment) and any ``scale``. Exact up to float
rounding and the summation order; NaN and infinity as ATen's CPU kernel over one key tile
(see the template). Its record is in ``algorithms.py``; the default stays ATen's SDPA, which
measured faster (``bench/attention.py``).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
from collections.abc import Callable
from typing import Any

import torch

from ...graph import Graph, Node
from ...hardware import Hardware
from ...options import Options
from ..x86.render import environment
from .generated import load_kernel

Kernel = Callable[..., Any]

BR = 16  # query rows per tile
BC = 64  # keys per tile
# Score multiply-adds below which a call runs on one thread (OpenMP's fork and join cost
# about as much as 32K multiply-adds on the measured host; direct.py's figure).
PARALLEL_WORK = 1 << 15


def why_not(graph: Graph, node: Node, device: torch.device) -> str | None:
    """None where the generated kernel can run ``node``, else the reason."""
    if device.type != "cpu":
        return f"x86 only, not {device.type}"
    if node.op != "scaled_dot_product_attention":
        return "not scaled_dot_product_attention"
    q, k, v = (graph.values[x] for x in node.inputs[:3])
    if any(t.dtype != "float32" for t in (q, k, v)):
        return "not float32"
    if q.rank not in (3, 4) or not q.rank == k.rank == v.rank:
        return f"ranks {q.rank}, {k.rank}, {v.rank} (3 or 4, all equal)"
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-2] != v.shape[:-2]:
        return "leading dims differ (broadcast or grouped-query attention)"
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        return "q/k head dims or k/v lengths differ"
    if node.attrs.get("has_mask"):
        m = graph.values[node.inputs[3]]
        if m.dtype not in ("float32", "bool"):
            return f"a {m.dtype} mask"
        if m.rank > q.rank:
            return "a mask of higher rank than q"
        target = (*q.shape[:-1], k.shape[-2])
        for a, b in zip(reversed(m.shape), reversed(target), strict=False):
            if a not in (1, b):
                return f"mask {m.shape} does not broadcast to {target}"
    return None


def _sizes(graph: Graph, node: Node) -> dict[str, int]:
    q, k, v = (graph.values[x].shape for x in node.inputs[:3])
    lead = q[:-2]
    b, h = (1, lead[0]) if len(lead) == 1 else (lead[0], lead[1])
    return {"B": b, "H": h, "BH": b * h, "L": q[-2], "S": k[-2], "D": q[-1], "DV": v[-1]}


def render(graph: Graph, node: Node, threads: int) -> tuple[str, str]:
    """(kernel name, C source) of ``node``'s flash attention."""
    sz = _sizes(graph, node)
    scale = node.attrs.get("scale")
    scale = 1.0 / math.sqrt(sz["D"]) if scale is None else float(scale)
    fields = dict(
        sz,
        BR=BR,
        BC=BC,
        scale=repr(float(scale)),
        causal=bool(node.attrs.get("is_causal", False)),
        has_mask=bool(node.attrs.get("has_mask", False)),
        threads=max(1, threads),
        work=sz["BH"] * sz["L"] * sz["S"] * sz["D"],
        parallel_work=PARALLEL_WORK,
    )
    digest = hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:10]
    kname = f"flash_attention_{digest}"
    src = environment().get_template("flash_attention.c.j2").render(name=kname, **fields)
    return kname, src


def kernel(graph: Graph, node: Node, options: Options, hardware: Hardware) -> Kernel | None:
    """The call for ``node`` (``fn(q, k, v[, mask])`` -> a new tensor of the output's
    shape), or None where the kernel does not apply or failed to compile (warned; strict
    raises)."""
    if why_not(graph, node, torch.device("cpu")) is not None:
        return None
    kname, src = render(graph, node, hardware.cores)
    fn = load_kernel(
        node,
        kname,
        src,
        [ctypes.c_void_p] * 5 + [ctypes.c_long] * 4,
        options,
        hardware,
        "ATen's scaled_dot_product_attention",
    )
    if fn is None:
        return None
    sz = _sizes(graph, node)
    out_shape = tuple(graph.values[node.outputs[0]].shape)
    has_mask = bool(node.attrs.get("has_mask", False))
    full = (sz["B"], sz["H"], sz["L"], sz["S"])

    def flash_attention(q, k, v, *mask):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty(out_shape, dtype=torch.float32)
        mp, strides = None, (0, 0, 0, 0)
        m = None
        if has_mask:
            m = mask[0]
            if m.dtype == torch.bool:  # an additive mask: 0 where kept, -inf where not
                m = torch.zeros(m.shape, dtype=torch.float32).masked_fill_(~m, float("-inf"))
            m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape)).expand(full)
            mp, strides = m.data_ptr(), m.stride()
        fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), mp, out.data_ptr(), *strides)
        return out

    flash_attention.algorithm = "flash"  # type: ignore[attr-defined]
    return flash_attention
