"""The ``im2col_gemm`` algorithm of conv2d: the input's patches copied into a workspace
(im2row, whole samples per chunk) and multiplied with the framework's GEMM (``addmm``;
``bmm`` per group), then the node's residual add and activation in place. Its record is
in ``algorithms.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ...graph import Graph, Node
from ...hardware import Hardware
from ...options import Options
from .calls import _conv_geometry, activation_attrs, holds_constants, inplace_activation

Kernel = Callable[..., Any]

IM2COL_DTYPES = frozenset({"float32", "float64"})
# Bytes of one chunk of the im2row workspace (whole samples per chunk, at least one).
IM2COL_WORKSPACE_BYTES = 32 << 20


def im2col_applies(graph: Graph, node: Node, device: torch.device, options: Options) -> str | None:
    if node.op != "conv2d":
        return "not a convolution"
    if isinstance(node.attrs["padding"], str):
        return "string padding"
    x_t = graph.values[node.inputs[0]]
    if x_t.rank != 4 or x_t.dtype not in IM2COL_DTYPES:
        return f"not a float32/float64 4-d input ({x_t.dtype}, rank {x_t.rank})"
    if not graph.is_param(node.inputs[1]):
        return "weight is computed"
    residual = bool(node.attrs.get("residual", False))
    if len(node.inputs) - int(residual) == 3 and not graph.is_param(node.inputs[2]):
        return "bias is computed"
    return None


def _im2col_sizes(graph: Graph, node: Node) -> tuple[int, int]:
    """(bytes of one sample's im2row rows, samples per workspace chunk)."""
    x_t, out_t = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    w_t = graph.values[node.inputs[1]]
    per_sample = out_t.shape[2] * out_t.shape[3] * x_t.shape[1] * w_t.shape[2] * w_t.shape[3]
    per_sample *= np.dtype(x_t.dtype).itemsize
    return per_sample, max(1, IM2COL_WORKSPACE_BYTES // max(1, per_sample))


def im2col_extra(graph: Graph, node: Node) -> int:
    """The workspace of one call at the graph's batch, plus the zero-padded input copy."""
    x_t = graph.values[node.inputs[0]]
    per_sample, chunk = _im2col_sizes(graph, node)
    (ph, pw), _, _, _ = _conv_geometry(node)
    n, c, h, w = x_t.shape
    padded = n * c * (h + 2 * ph) * (w + 2 * pw) * np.dtype(x_t.dtype).itemsize
    return per_sample * min(n, chunk) + padded


def im2col_build(
    graph: Graph, node: Node, device: torch.device, options: Options, hardware: Hardware
) -> Kernel | None:
    return im2col_kernel(graph, node)


def im2col_kernel(graph: Graph, node: Node) -> Kernel:
    """conv2d (+bias, +residual, +activation) as im2row into a workspace and the
    framework's GEMM: ``y[n, oh, ow, :] = rows[n, oh, ow, (kh, kw, c)] @ W[(kh, kw, c), k]
    + bias``, written NHWC (a channels_last result; a contiguous copy where the node's
    output is "nchw"), then the residual add and the activation in place. Grouped
    convolutions run one GEMM per group (``bmm``). Never writes into its inputs."""
    x_t, out_t = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    c, h, w = x_t.shape[1], x_t.shape[2], x_t.shape[3]
    k, oh, ow = out_t.shape[1], out_t.shape[2], out_t.shape[3]
    (ph, pw), (sh, sw), (dh, dw), groups = _conv_geometry(node)
    dtype = getattr(torch, x_t.dtype)
    weight = torch.from_numpy(np.ascontiguousarray(graph.params[node.inputs[1]])).to(dtype)
    kh, kw = weight.shape[2], weight.shape[3]
    cg, kg = c // groups, k // groups
    cols = kh * kw * cg
    # [G][(kh, kw, cg)][kg]: the rows of W in the workspace's column order
    wmat = (
        weight.reshape(groups, kg, cg, kh, kw).permute(0, 3, 4, 2, 1).reshape(groups, cols, kg)
    ).contiguous()
    residual = bool(node.attrs.get("residual", False))
    has_bias = len(node.inputs) - int(residual) == 3
    bias = (
        torch.from_numpy(np.ascontiguousarray(graph.params[node.inputs[2]])).to(dtype)
        if has_bias
        else None
    )
    name, attrs = activation_attrs(node)
    act = inplace_activation(name, attrs)
    _, chunk = _im2col_sizes(graph, node)
    nchw_out = out_t.layout != "nhwc"

    def conv_im2col(x, _w, *rest):
        nb = x.shape[0]
        xp = torch.zeros((nb, h + 2 * ph, w + 2 * pw, c), dtype=dtype)
        xp[:, ph : ph + h, pw : pw + w].copy_(x.permute(0, 2, 3, 1))
        s_n, s_h, s_w, s_c = xp.stride()
        y = torch.empty((nb, oh, ow, k), dtype=dtype)
        per = min(nb, chunk)
        ws = torch.empty(groups * per * oh * ow * cols, dtype=dtype)
        for n0 in range(0, nb, per):
            m = min(per, nb - n0)
            rows = m * oh * ow
            patches = xp.as_strided(
                (m, oh, ow, kh, kw, groups, cg),
                (s_n, s_h * sh, s_w * sw, s_h * dh, s_w * dw, cg * s_c, s_c),
                n0 * s_n,
            )
            out = y[n0 : n0 + m].view(rows, k)
            if groups == 1:
                a = ws[: rows * cols].view(m, oh, ow, kh, kw, 1, cg)
                a.copy_(patches)
                a2 = a.view(rows, cols)
                if bias is None:
                    torch.mm(a2, wmat[0], out=out)
                else:
                    torch.addmm(bias, a2, wmat[0], out=out)
            else:
                a = ws[: groups * rows * cols].view(groups, m, oh, ow, kh, kw, cg)
                a.copy_(patches.permute(5, 0, 1, 2, 3, 4, 6))
                prod = torch.bmm(a.view(groups, rows, cols), wmat)  # [G][rows][kg]
                out.view(rows, groups, kg).copy_(prod.permute(1, 0, 2))
                if bias is not None:
                    out.add_(bias)
        yt = y.permute(0, 3, 1, 2)  # channels_last
        if residual:
            yt.add_(rest[-1])
        if act is not None:
            yt = act(yt)
        return yt.contiguous() if nchw_out else yt

    def workspace(n: int) -> int:
        per_sample, ch = _im2col_sizes(graph, node)
        padded = n * c * (h + 2 * ph) * (w + 2 * pw) * np.dtype(x_t.dtype).itemsize
        return per_sample * min(n, ch) + padded

    conv_im2col.workspace_bytes = workspace  # type: ignore[attr-defined]
    return holds_constants(conv_im2col, node)
