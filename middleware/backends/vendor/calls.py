"""Fast vendor calls for compute- and param-bound nodes: oneDNN through PyTorch on CPU,
cuDNN/cuBLAS through PyTorch on CUDA.

``vendor_kernel(graph, node, device, hardware)`` is called once per node at plan-build
time and returns a callable over the node's input tensors (the same arguments as the
catalogue reference, ``get_op(node.op).bind(node)``), or None where the reference path
should run instead.

CPU (oneDNN):

- conv2d: ``torch.ops.mkldnn._convolution_pointwise`` with the weight reordered into
  oneDNN's blocked format once, here (``_reorder_convolution_weight``), not at every call,
  and the node's post-ops fused: the activation as a oneDNN eltwise post-op, the residual
  add as a binary post-op (``_convolution_pointwise.binary``). A packed weight makes
  oneDNN write a channels_last output, so the packed call is used only where the node's
  output is declared "nhwc"; an "nchw" output gets the same fused call with the plain
  weight (output in the input's layout).
- linear: ``torch.ops.mkldnn._linear_pointwise`` with a weight packed for the node's row
  count where ``LINEAR_RULES`` says it is faster, otherwise ``F.linear``; activations fused
  (oneDNN) or applied in place (ATen).
- Activations oneDNN cannot fuse at a given call (anything but relu after a binary
  post-op) run after the call as in-place ATen ops, so no extra buffer is made.

CUDA (cuDNN): ``torch.conv2d``/``F.linear`` followed by the residual add and the
activation as in-place ATen ops. ``torch.backends.cudnn.benchmark`` is left to the user.

Every kernel here computes ``act(conv(x, w) + b + residual)`` like the reference
(``middleware.ops._conv2d``) and is tested against it (tests/test_vendor.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ...graph import Graph, Node
from ...hardware import Hardware
from ...ops import CATALOGUE, activation_fn, get_op
from ...options import Options
from ..interface import holds_inputs
from . import onednn

Kernel = Callable[..., Any]

# dtypes tested through these oneDNN ops (others, e.g. float64, take the reference path)
ONEDNN_DTYPES = frozenset({"float32"})


# ------------------------------------------------------------------- post-ops
# How each activation is spelled as a oneDNN post-op, its attr defaults and its in-place
# ATen form are facts of its registry entry (``OpDef.post_op``, ``defaults``, ``inplace``).


@dataclasses.dataclass(frozen=True)
class OneDnnPostOp:
    """A oneDNN eltwise post-op as the mkldnn ops take it: (attr, scalars, algorithm)."""

    attr: str = "none"
    scalars: tuple[float, ...] = ()
    algorithm: str = ""


def activation_attrs(node: Node, key: str = "activation") -> tuple[str | None, dict[str, Any]]:
    """The node's fused activation name (None if none) and its attrs, defaults filled in
    (``key``: "dw_activation", the depthwise layer's of a ``conv2d_dw``)."""
    name = node.attrs.get(key) or None
    if name is None:
        return None, {}
    attrs = dict(get_op(name).defaults)
    attrs.update(dict(node.attrs.get(f"{key}_attrs", ())))
    return name, attrs


def onednn_post_op(name: str | None, attrs: Mapping[str, Any]) -> OneDnnPostOp | None:
    """The oneDNN spelling of activation ``name``; ``OneDnnPostOp()`` ("none") for no
    activation; None where oneDNN has no such post-op."""
    if name is None:
        return OneDnnPostOp()
    op = CATALOGUE.get(name)
    spec = None if op is None else op.post_op
    if spec is None:
        return None
    scalars = tuple(float(attrs[k]) for k in spec.scalar_keys)
    algorithm = str(attrs[spec.algorithm_key]) if spec.algorithm_key else ""
    return OneDnnPostOp(spec.onednn, scalars, algorithm)


def _after_binary(name: str | None) -> bool:
    """oneDNN takes activation ``name`` after a binary (residual add) post-op."""
    spec = None if name is None else get_op(name).post_op
    return spec is not None and spec.after_binary


def inplace_activation(name: str | None, attrs: Mapping[str, Any]) -> Callable[[Any], Any] | None:
    """An ATen activation that overwrites its argument (no new buffer) and returns it (the
    registry entry's ``inplace`` form; one without an in-place form, such as gelu, returns
    a new tensor). None for no activation."""
    if name is None:
        return None
    op = get_op(name)
    if op.inplace is not None:
        return op.inplace(attrs)
    return activation_fn(name, dict(attrs))  # any other activation, out of place


# ----------------------------------------------------------------------- rules (data)
# How a linear layer runs, by the number of rows (product of the input's leading dims):
# "onednn" (oneDNN's linear with fused post-ops on the plain weight, which is the user's
# own tensor where no pass changed it: no copy), "onednn_packed" (the same call on a weight
# reordered for the row count once: a second copy of the weight), "aten" (F.linear, then
# the activation in place). Measured interleaved on the 2-core Sapphire Rapids host (torch
# 2.14.1): rows 16: packed 36 ms vs F.linear 123 ms (9216->4096), 12 vs 46 ms
# (4096->4096), 0.67 vs 1.16 ms (2048->1000); rows 2..8: packed 2-3x faster than F.linear;
# rows 1: mixed (quiet host: within noise for 512..4096 inputs, F.linear faster for
# 9216/25088->4096, 7.4 vs 8.5 and 40 vs 60 ms; host loaded by other jobs: the packed call
# stalls ~20 ms on small classifiers, 23 ms vs F.linear 0.4-1 ms for 576..4096->1000).
# The plain weight against the packed one (session 8, loaded host, median of 7-15
# interleaved calls, ms): rows 16: 25.6 vs 28.0 (9216->4096), 72 vs 68 (25088->4096), 16.0
# vs 16.0 (4096->4096), 0.88 vs 0.89 (2048->1000); rows 8 and 32 within noise of each other
# on the same layers; rows 2: the plain weight slower (24 vs 17 ms, 9216->4096; 0.51 vs
# 0.32, 2048->1000). The packed copy costs its whole size in resident memory (25088->4096:
# +398 MiB; the plain call allocates nothing per call), so from 8 rows the plain weight
# runs. (min_rows, implementation), first match from the top wins.
LINEAR_RULES: tuple[tuple[int, str], ...] = ((8, "onednn"), (2, "onednn_packed"), (1, "aten"))

# A 1x1 stride-1 convolution over at most this many pixels (batch x height x width) runs
# as one GEMM (torch.addmm) instead of the oneDNN call, whose fixed cost per call (ideep
# builds descriptors, attributes and a scratchpad and allocates at every call: 60 us quiet,
# 150 us on a loaded host at one thread, where the convolution itself takes 3-5 us) is
# most of a small layer's time (bench/results/overhead_cpu.md). Measured at 1 thread on the
# loaded 2-core host, the addmm path against the oneDNN step on the 1x1 layers of
# mobilenet_v2 and shufflenet_v2 at batch 1: faster on 35 of 38 layers of 49..784 pixels,
# slower at 3136 and more; an SE FC (one pixel) 3-5 us against 150. 256 keeps every
# batch-16 layer of those networks on oneDNN (16 x 7 x 7 = 784 pixels) but their SE FCs.
GEMM_1X1_MAX_ROWS = 256


def linear_impl(rows: int) -> str:
    """The linear implementation ``LINEAR_RULES`` picks for ``rows`` rows."""
    for min_rows, impl in LINEAR_RULES:
        if rows >= min_rows:
            return impl
    return "aten"


# --------------------------------------------------------------------------- entry
def vendor_kernel(
    graph: Graph,
    node: Node,
    device: torch.device,
    hardware: Hardware | None = None,
    options: Options | None = None,
) -> Kernel | None:
    """The fastest correct vendor call for ``node`` on ``device``, or None.

    Expects a node whose input values carry concrete types in ``graph`` and whose weight
    (input 1) is normally a graph parameter (then it is reordered/packed here, once).
    Guarantees: the callable takes the node's input tensors in order, returns a tensor
    equal to the catalogue reference within float rounding, in the declared layout of the
    node's output value, and never writes into its inputs. None for ops this module does
    not handle (the caller runs the catalogue reference). ``hardware`` is accepted for
    per-machine rules; today's rules (``LINEAR_RULES``, the post-op tables) are measured
    tables that do not depend on it. ``options``: where given and its ``onednn_primitives``
    is on, a CPU convolution runs as a oneDNN primitive created here (``onednn.py``).
    """
    dev = torch.device(device)
    if dev.type == "cpu" and node.op == "conv2d_dw":
        fn = _cpu_conv_dw(graph, node, options)
        return None if fn is None else holds_constants(fn, node)
    if dev.type == "cpu" and node.op in ("conv2d", "linear"):
        fn = _cpu_conv(graph, node, options) if node.op == "conv2d" else _cpu_linear(graph, node)
        return None if fn is None else holds_constants(fn, node)
    if node.op == "conv2d" and dev.type == "cuda":
        return _cuda_conv(graph, node, dev)
    if node.op == "linear" and dev.type == "cuda":
        return _cuda_linear(graph, node)
    return None


def holds_constants(fn: Kernel, node: Node) -> Kernel:
    """Mark ``fn``, a CPU call of ``node`` built with its weight and bias captured (plain,
    prepacked or transformed), as never reading them from its arguments: it reads only the
    input (position 0) and the residual (last, where the node has one). The plan keeps no
    constant for a weight that no step reads, and the graph drops its array
    (``interface.holds_inputs``), so a derived weight lives once, in the call. Returns
    ``fn``."""
    n = len(node.inputs) - int(bool(node.attrs.get("residual", False)))
    return holds_inputs(fn, range(1, n))


def _param(graph: Graph, value: str, device: torch.device | str = "cpu") -> torch.Tensor | None:
    arr = graph.params.get(value)
    if arr is None:
        return None
    t = torch.from_numpy(np.ascontiguousarray(arr))
    return t.to(device) if torch.device(device).type != "cpu" else t


def _conv_geometry(node: Node) -> tuple[list[int], list[int], list[int], int]:
    def pair(v: Any) -> list[int]:
        return [int(v), int(v)] if isinstance(v, int) else [int(s) for s in v]

    a = node.attrs
    return pair(a["padding"]), pair(a["stride"]), pair(a["dilation"]), int(a["groups"])


# ---------------------------------------------------------------------------- CPU
def _cpu_conv(graph: Graph, node: Node, options: Options | None = None) -> Kernel | None:
    """conv2d (+bias, +residual, +activation) as one oneDNN call with a prepacked weight;
    with ``options.onednn_primitives``, as primitives created once (``onednn.py``) where
    they apply."""
    if options is None or not options.onednn_primitives or onednn.unavailable(options):
        return _cpu_conv_ideep(graph, node)
    direct = _cpu_conv_primitive(graph, node, options)
    return _cpu_conv_ideep(graph, node) if direct is None else direct


def _cpu_conv_primitive(graph: Graph, node: Node, options: Options) -> Kernel | None:
    """The conv2d node as oneDNN primitives created once (``onednn.py``); None where they
    do not apply. Every 1x1 layer too: without the per-call setup the primitive beats the
    GEMM form (measured on mobilenet_v3_small at batch 1: 10-39 us against 15-86 us per
    layer)."""
    operands = _conv_operands(graph, node)
    if operands is None:
        return None
    weight, bias, residual = operands
    name, attrs = activation_attrs(node)
    post = onednn_post_op(name, attrs)
    if residual and post is not None and post.attr != "none" and not _after_binary(name):
        return None  # oneDNN refuses it after the binary add: the ideep call's ATen form
    return onednn.direct_conv(graph, node, weight, bias, post, _conv_geometry(node), options)


def _cpu_conv_dw(graph: Graph, node: Node, options: Options | None) -> Kernel | None:
    """A ``conv2d_dw`` node (passes/fuse_depthwise.py) as one oneDNN primitive with the
    depthwise layer fused as a post-op (``onednn.fused_dw_conv``); None without the
    primitives (the catalogue reference then runs the two convolutions)."""
    if options is None or not options.onednn_primitives or onednn.unavailable(options):
        return None
    if "stride1" in node.attrs or graph.values[node.inputs[1]].shape[2:] != (1, 1):
        return None  # a stem and its depthwise layer (fuse_stem): the direct kernel's
    x_t, out_t = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    params = [_param(graph, v) for v in node.inputs[1:]]
    if x_t.dtype != "float32" or any(p is None for p in params):
        return None
    posts = (
        onednn_post_op(*activation_attrs(node)),
        onednn_post_op(*activation_attrs(node, "dw_activation")),
    )
    ref = get_op(node.op).bind(node)
    held = tuple(params)
    return onednn.fused_dw_conv(
        node.name,
        tuple(x_t.shape),
        tuple(out_t.shape),
        int(node.attrs["stride"]),
        held,  # type: ignore[arg-type]
        posts,
        options,
        lambda x: ref(x, *held),
    )


def _conv_operands(
    graph: Graph, node: Node
) -> tuple[torch.Tensor, torch.Tensor | None, bool] | None:
    """(weight, bias or None, has a residual) of a rank-4 float32 conv2d node with numeric
    padding whose weight and bias are parameters; None otherwise (a computed weight or
    bias: the reference handles it)."""
    x_t = graph.values[node.inputs[0]]
    if x_t.rank != 4 or x_t.dtype not in ONEDNN_DTYPES or isinstance(node.attrs["padding"], str):
        return None
    residual = bool(node.attrs.get("residual", False))
    has_bias = len(node.inputs) - int(residual) == 3
    weight = _param(graph, node.inputs[1])
    bias = _param(graph, node.inputs[2]) if has_bias else None
    if weight is None or (has_bias and bias is None):
        return None
    return weight, bias, residual


def _cpu_conv_ideep(graph: Graph, node: Node) -> Kernel | None:
    """conv2d (+bias, +residual, +activation) as one oneDNN call with a prepacked weight."""
    x_t = graph.values[node.inputs[0]]
    out_t = graph.values[node.outputs[0]]
    operands = _conv_operands(graph, node)
    if operands is None or not torch.backends.mkldnn.is_available():
        return None
    weight, bias, residual = operands
    padding, stride, dilation, groups = _conv_geometry(node)
    gemm = _cpu_conv1x1_gemm(graph, node, weight, bias)
    if gemm is not None:
        return gemm
    if out_t.layout == "nhwc":
        # oneDNN's blocked weight; a packed weight makes oneDNN write channels_last
        w = torch.ops.mkldnn._reorder_convolution_weight(
            weight, padding, stride, dilation, groups, list(x_t.shape)
        )
    else:
        w = weight  # plain weight: the output follows the (nchw) input
    name, attrs = activation_attrs(node)
    post = onednn_post_op(name, attrs)
    conv = torch.ops.mkldnn._convolution_pointwise.default  # the overload: no resolution per call
    if not residual:
        after = None
        if post is None:  # oneDNN lacks it: plain conv, then the ATen activation in place
            post, after = OneDnnPostOp(), inplace_activation(name, attrs)
        attr, scalars, algorithm = post.attr, list(post.scalars), post.algorithm
        if after is None:

            def conv_post(x, _w, *_rest):
                return conv(x, w, bias, padding, stride, dilation, groups, attr, scalars, algorithm)

            return conv_post

        def conv_then_act(x, _w, *_rest):
            y = conv(x, w, bias, padding, stride, dilation, groups, attr, scalars, algorithm)
            return after(y)

        return conv_then_act

    binary = torch.ops.mkldnn._convolution_pointwise.binary
    if post is not None and _after_binary(name):
        unary, u_scalars, u_alg, after = post.attr, list(post.scalars), post.algorithm, None
    else:
        unary, u_scalars, u_alg, after = None, [], None, inplace_activation(name, attrs)

    def conv_add(x, _w, *rest):
        y = binary(
            x, rest[-1], w, bias, padding, stride, dilation, groups, "add", None, unary,
            u_scalars, u_alg,
        )  # fmt: skip
        return y if after is None else after(y)

    binary_ = torch.ops.mkldnn._convolution_pointwise_.binary

    def conv_add_into_residual(x, _w, *rest):
        # the same call writing over the residual (the buffer planner uses it when the
        # residual dies here): no output allocation
        y = binary_(
            rest[-1], x, w, bias, padding, stride, dilation, groups, "add", None, unary,
            u_scalars, u_alg,
        )  # fmt: skip
        return y if after is None else after(y)

    conv_add.into_residual = conv_add_into_residual  # type: ignore[attr-defined]
    return conv_add


def _rows(t: torch.Tensor) -> torch.Tensor:
    """The (pixels, channels) matrix of an NHWC (or one-pixel) tensor: a view where its
    memory allows, else a copy (read only)."""
    return t.permute(0, 2, 3, 1).reshape(-1, t.shape[1])


def _cpu_conv1x1_gemm(
    graph: Graph, node: Node, weight: torch.Tensor, bias: torch.Tensor | None
) -> Kernel | None:
    """A 1x1 stride-1 convolution over at most ``GEMM_1X1_MAX_ROWS`` pixels (a
    squeeze-excitation FC, the 7x7 and 14x14 layers of mobile networks at batch 1) as one
    ``torch.addmm`` on the NHWC matrix, then the residual add and the activation in place;
    None where it does not apply (another geometry, more pixels, an NCHW tensor of more than
    one pixel). Same result as the oneDNN call: ``act(x @ w.T + b + residual)`` per pixel,
    written in the node's output layout, inputs untouched."""
    x_t, out_t = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    padding, stride, dilation, groups = _conv_geometry(node)
    if tuple(weight.shape[2:]) != (1, 1) or groups != 1 or padding != [0, 0]:
        return None
    if stride != [1, 1] or x_t.rank != 4 or out_t.rank != 4:
        return None
    n, c, h, w = x_t.shape
    rows, k = n * h * w, int(weight.shape[0])
    if rows > GEMM_1X1_MAX_ROWS:
        return None
    if h * w != 1 and (x_t.layout != "nhwc" or out_t.layout != "nhwc"):
        return None
    residual = bool(node.attrs.get("residual", False))
    act = inplace_activation(*activation_attrs(node))
    wt = weight.reshape(k, c).t()  # a transposed view: the GEMM reads it as is, no copy
    shape = tuple(out_t.shape)
    fmt = torch.channels_last if out_t.layout == "nhwc" else torch.contiguous_format

    def conv1x1_gemm(x, _w, *rest):
        out = torch.empty(shape, dtype=x.dtype, memory_format=fmt)
        o = out.permute(0, 2, 3, 1).view(rows, k)
        if bias is None:
            torch.mm(_rows(x), wt, out=o)
        else:
            torch.addmm(bias, _rows(x), wt, out=o)
        if residual:
            o.add_(_rows(rest[-1]))
        return out if act is None else act(out)

    if not residual:
        return conv1x1_gemm

    def conv1x1_gemm_into_residual(x, _w, *rest):
        # accumulate into the residual (the buffer planner uses it when the residual dies
        # here); through a copy where its memory is not an NHWC matrix
        r = rest[-1]
        view = r.permute(0, 2, 3, 1)
        if not view.is_contiguous():
            r.copy_(conv1x1_gemm(x, _w, *rest))
            return r
        m = view.view(rows, k)
        m.addmm_(_rows(x), wt)
        if bias is not None:
            m.add_(bias)
        return r if act is None else act(r)

    conv1x1_gemm.into_residual = conv1x1_gemm_into_residual  # type: ignore[attr-defined]
    return conv1x1_gemm


def _cpu_linear(graph: Graph, node: Node) -> Kernel | None:
    """linear (+activation): oneDNN's call on the plain or a packed weight, or F.linear, as
    ``LINEAR_RULES`` says."""
    x_t = graph.values[node.inputs[0]]
    if x_t.dtype not in ONEDNN_DTYPES or x_t.rank < 2:
        return None
    weight = _param(graph, node.inputs[1])
    bias = _param(graph, node.inputs[2]) if len(node.inputs) > 2 else None
    if weight is None or (len(node.inputs) > 2 and bias is None):
        return None
    rows = x_t.numel // x_t.shape[-1]
    name, attrs = activation_attrs(node)
    post = onednn_post_op(name, attrs)
    impl = linear_impl(rows)
    if impl != "aten" and torch.backends.mkldnn.is_available() and weight.is_contiguous():
        w = (
            torch.ops.mkldnn._reorder_linear_weight(weight, rows)
            if impl == "onednn_packed"
            else weight
        )
        lin = torch.ops.mkldnn._linear_pointwise.default
        after = None
        if post is None:
            post, after = OneDnnPostOp(), inplace_activation(name, attrs)
        attr, scalars, algorithm = post.attr, list(post.scalars), post.algorithm

        def linear_onednn(x, _w, *_rest):
            y = lin(x, w, bias, attr, scalars, algorithm)
            return y if after is None else after(y)

        return linear_onednn
    return _aten_linear(weight, bias, inplace_activation(name, attrs))


def _aten_linear(weight: torch.Tensor, bias: torch.Tensor | None, act: Kernel | None) -> Kernel:
    def linear_aten(x, _w, *_rest):
        y = F.linear(x, weight, bias)
        return y if act is None else act(y)

    return linear_aten


# --------------------------------------------------------------------------- CUDA
def _cuda_conv(graph: Graph, node: Node, device: torch.device) -> Kernel | None:
    """cuDNN convolution, then the residual add and the activation in place. Where the
    output is "nhwc" a constant weight is made channels_last once, here (else PyTorch
    would convert it at every call)."""
    x_t = graph.values[node.inputs[0]]
    if x_t.rank != 4 or isinstance(node.attrs["padding"], str):
        return None
    padding, stride, dilation, groups = _conv_geometry(node)
    residual = bool(node.attrs.get("residual", False))
    has_bias = len(node.inputs) - int(residual) == 3
    name, attrs = activation_attrs(node)
    act = inplace_activation(name, attrs)
    fixed = None
    if graph.values[node.outputs[0]].layout == "nhwc":
        fixed = _param(graph, node.inputs[1], device)
        if fixed is not None:
            fixed = fixed.contiguous(memory_format=torch.channels_last)

    def conv_cuda(x, w, *rest):
        w = w if fixed is None else fixed
        b = rest[0] if has_bias else None
        y = torch.conv2d(x, w, b, stride, padding, dilation, groups)
        if residual:
            y.add_(rest[-1])
        return y if act is None else act(y)

    return conv_cuda


def _cuda_linear(graph: Graph, node: Node) -> Kernel | None:
    name, attrs = activation_attrs(node)
    act = inplace_activation(name, attrs)

    def linear_cuda(x, w, b=None):
        y = F.linear(x, w, b)
        return y if act is None else act(y)

    return linear_cuda
