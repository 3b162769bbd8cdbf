"""The algorithms of each op that has alternatives, as data, and the per-layer choice.

An :class:`Algorithm` is a record: its name, an applicability predicate (``applies``:
None where it can run the node, else the reason it cannot), its extra memory in bytes
(``extra_bytes``: parameters and workspace beyond the direct vendor call's), whether it is
exact (float rounding only) or approximate (with ``error_bound``: the largest
``max|y - ref| / max|ref|`` measured against ``F.conv2d``), and ``build``, which returns
the callable (the catalogue reference's arguments and result, epilogue included).

conv2d, built in (``ALGORITHMS["conv2d"]``):

- ``vendor``: oneDNN's choice through PyTorch, with a prepacked weight and fused post-ops
  (``calls.vendor_kernel``); the default.
- ``winograd_f4x4``: Winograd F(4x4,3x3), generated transforms around oneDNN's batched
  matmul (``winograd.py``); approximate. The default picks it where
  ``Options.winograd`` is on and its measured rule (``winograd.why_not``) says it is
  faster; named in ``algorithms=`` it runs wherever it applies.
- ``winograd_f2x2``: Winograd F(2x2,3x3) (``winograd_f2.py``: transforms generated from
  its matrices); 16/9 of the weight instead of 36/9, approximate with a smaller measured
  bound; runs where named or tuned, never by the default's rule.
- ``direct``: a generated direct convolution with the epilogue fused (``direct.py``):
  depthwise layers SIMD over channels, others blocked over output pixels and channels;
  exact, no workspace.
- ``im2col_gemm``: the input's patches copied into a workspace (im2row: one row per output
  pixel, columns (kh, kw, c)) and multiplied by the weight with the framework's GEMM
  (``addmm``; ``bmm`` per group), then the residual add and the activation in place.

linear: ``vendor``, and ``gemv`` (``gemv.py``: a generated streaming matrix-vector
product for up to 8 rows, the weight read once and in place; exact).

:func:`choose` picks one algorithm per layer from ``Options.algorithms`` (a string, a
list by layer index, or a callable on a :class:`Layer`; "default" lets the middleware
decide; with no selection at all, a layer takes the stored tuning decision for its problem
where one exists, :func:`_stored_choice`; "autotune" measures every usable one, :func:`tuned_choice` and ``tuning.py``,
after which ``pipeline.network_choice`` chooses the network's plan as a whole;
"auto" takes the stored tuning decision for the layer's problem size where one exists,
else the default, :func:`auto_choice`); a
named algorithm that does not apply, or whose extra bytes exceed
``Options.max_extra_param_bytes``, falls back to the default with the reason.
:func:`register_algorithm` adds a user's algorithm (a Python callable with
``F.conv2d``'s signature), selectable by name like a built-in one.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import math
import re
import time
from collections.abc import Callable
from typing import Any

import jinja2
import numpy as np
import torch

from ...errors import CompileError, OptionsError
from ...graph import PARAM_SOURCES, RELEASE_AS_BUILT, Graph, Node
from ...hardware import Hardware
from ...ops import get_op
from ...options import Options
from ...version import __version__
from ..interface import held_inputs
from ..x86.build import load_shared
from ..x86.compile import build_c
from . import direct, flash, gemv, onednn, tuning
from . import winograd as wg
from . import winograd_f2 as wg2
from .calls import (
    _conv_geometry,
    activation_attrs,
    holds_constants,
    inplace_activation,
    vendor_kernel,
)
from .im2col import (
    im2col_applies,
    im2col_build,
    im2col_extra,
    im2col_kernel,
)

Kernel = Callable[..., Any]
# (graph, node, device, options) -> None where the algorithm applies, else why not
Applies = Callable[[Graph, Node, torch.device, Options], str | None]
# (graph, node, device, options, hardware) -> the call, or None where building it failed
Build = Callable[[Graph, Node, torch.device, Options, Hardware], Kernel | None]

DEFAULT = "default"
AUTOTUNE = "autotune"  # measure every applicable algorithm on the layer (tuning.py)
AUTO = "auto"  # the stored tuning decision for the layer's problem, else the default


def _no_extra(graph: Graph, node: Node) -> int:
    return 0


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One way to compute an op (see the module docstring)."""

    name: str
    op: str
    applies: Applies
    build: Build
    extra_bytes: Callable[[Graph, Node], int] = _no_extra
    exact: bool = True
    error_bound: float | None = None  # approximate: measured max|y - ref| / max|ref|
    description: str = ""
    builtin: bool = True


@dataclasses.dataclass(frozen=True)
class Layer:
    """What a selector callable and a user algorithm's predicate see of one layer."""

    index: int  # the i-th layer of its op, in graph order
    name: str
    op: str
    source: str
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]
    dtype: str
    layout: str
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1
    bias: bool = False
    residual: bool = False
    activation: str | None = None


def layer_of(graph: Graph, node: Node, index: int) -> Layer:
    """The :class:`Layer` record of ``node``, the ``index``-th layer of its op."""
    x_t, out_t = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    w_t = graph.values[node.inputs[1]] if len(node.inputs) > 1 else None
    residual = bool(node.attrs.get("residual", False))
    geo: dict[str, Any] = {}
    if node.op == "conv2d" and not isinstance(node.attrs["padding"], str):
        padding, stride, dilation, groups = _conv_geometry(node)
        geo = dict(
            padding=tuple(padding), stride=tuple(stride), dilation=tuple(dilation), groups=groups
        )
    return Layer(
        index=index,
        name=node.name,
        op=node.op,
        source=node.source,
        input_shape=tuple(x_t.shape),
        output_shape=tuple(out_t.shape),
        weight_shape=tuple(w_t.shape) if w_t is not None else (),
        dtype=x_t.dtype,
        layout=out_t.layout,
        bias=len(node.inputs) - int(residual) == 3,
        residual=residual,
        activation=activation_attrs(node)[0],
        **geo,
    )


# ------------------------------------------------------------------------ vendor
def _vendor_applies(graph: Graph, node: Node, device: torch.device, options: Options) -> str | None:
    return None  # vendor_kernel itself declines (the catalogue reference then runs)


def _vendor_build(
    graph: Graph, node: Node, device: torch.device, options: Options, hardware: Hardware
) -> Kernel | None:
    return vendor_kernel(graph, node, device, hardware, options)


# ---------------------------------------------------------------------- winograd
def _winograd_applies(
    graph: Graph, node: Node, device: torch.device, options: Options
) -> str | None:
    if device.type != "cpu":
        return f"x86 only, not {device.type}"
    return wg.why_not_applicable(graph, node)


def _winograd_build(
    graph: Graph, node: Node, device: torch.device, options: Options, hardware: Hardware
) -> Kernel | None:
    return wg.winograd_kernel(graph, node, options, hardware, rule=False)


def _winograd_f2_build(
    graph: Graph, node: Node, device: torch.device, options: Options, hardware: Hardware
) -> Kernel | None:
    return wg2.kernel(graph, node, options, hardware)


# ------------------------------------------------------------------------ direct
def _direct_applies(graph: Graph, node: Node, device: torch.device, options: Options) -> str | None:
    return direct.why_not(graph, node, device)


def _direct_build(
    graph: Graph, node: Node, device: torch.device, options: Options, hardware: Hardware
) -> Kernel | None:
    return direct.kernel(graph, node, options, hardware)


# ----------------------------------------------------------------- the tables
VENDOR = Algorithm(
    "vendor",
    "conv2d",
    _vendor_applies,
    _vendor_build,
    description="oneDNN's choice through PyTorch: prepacked weight, fused post-ops",
)
WINOGRAD_F4X4 = Algorithm(
    "winograd_f4x4",
    "conv2d",
    _winograd_applies,
    _winograd_build,
    wg.extra_bytes,
    exact=False,
    # tests/test_winograd.py: about 1e-5 of the output's scale measured per layer; the
    # bound the tests hold it to
    error_bound=1e-4,
    description="Winograd F(4x4,3x3): generated transforms around oneDNN's batched matmul",
)
IM2COL_GEMM = Algorithm(
    "im2col_gemm",
    "conv2d",
    im2col_applies,
    im2col_build,
    im2col_extra,
    description="im2row of the input into a workspace, then the framework's GEMM",
)
WINOGRAD_F2X2 = Algorithm(
    "winograd_f2x2",
    "conv2d",
    _winograd_applies,
    _winograd_f2_build,
    wg2.extra_bytes,
    exact=False,
    error_bound=wg2.ERROR_BOUND,  # measured: see winograd_f2.py
    description="Winograd F(2x2,3x3): transforms generated from its matrices around the "
    "framework's GEMM; 16/9 of the weight instead of F(4x4)'s 36/9",
)
DIRECT = Algorithm(
    "direct",
    "conv2d",
    _direct_applies,
    _direct_build,
    direct.extra_bytes,
    description="generated direct convolution (depthwise: SIMD over channels; else blocked "
    "pixels x output channels), epilogue fused, no workspace",
)


def _conv_dw_vendor_applies(
    graph: Graph, node: Node, device: torch.device, options: Options
) -> str | None:
    if "stride1" in node.attrs:
        return "a stem and its depthwise layer (the fuse_stem pass): oneDNN fuses a 1x1 only"
    return None


def _stem_dw_applies(
    graph: Graph, node: Node, device: torch.device, options: Options
) -> str | None:
    return direct.stem_dw_why_not(graph, node, device)


def _stem_dw_build(
    graph: Graph, node: Node, device: torch.device, options: Options, hardware: Hardware
) -> Kernel | None:
    return direct.stem_dw_kernel(graph, node, options, hardware)


CONV_DW_VENDOR = dataclasses.replace(
    VENDOR,
    op="conv2d_dw",
    applies=_conv_dw_vendor_applies,
    description="oneDNN: the 1x1 convolution with the depthwise 3x3 one fused as its "
    "post-op (one primitive; the expanded tensor stays in cache)",
)
STEM_DW_DIRECT = Algorithm(
    "direct",
    "conv2d_dw",
    _stem_dw_applies,
    _stem_dw_build,
    direct.stem_dw_extra_bytes,
    description="generated: the stem's rows computed a few at a time into a ring in cache, "
    "the depthwise layer read from there (its input never written out)",
)
LINEAR_VENDOR = dataclasses.replace(
    VENDOR, op="linear", description="oneDNN/MKL (packed where measured faster) or F.linear"
)


def _gemv_applies(graph: Graph, node: Node, device: torch.device, options: Options) -> str | None:
    return gemv.why_not(graph, node, device)


def _gemv_build(
    graph: Graph, node: Node, device: torch.device, options: Options, hardware: Hardware
) -> Kernel | None:
    return gemv.kernel(graph, node, options, hardware)


GEMV = Algorithm(
    "gemv",
    "linear",
    _gemv_applies,
    _gemv_build,
    description="generated, for a few rows: up to 4 a streaming GEMV (the weight read once, "
    "in place, at memory speed), up to 16 a blocked product (4 weight x 4 input rows); "
    "activation fused",
)

# ------------------------------------------------------------------ attention
SDPA = "scaled_dot_product_attention"
# Why the default runs ATen's kernel: bench/attention.py (one process, interleaved),
# session 9: see the README's attention table.
SDPA_DEFAULT_REASON = (
    "ATen's scaled_dot_product_attention (its CPU flash-attention kernel: tiles with an "
    "online softmax and GEMMs inside): measured faster than the generated flash kernel "
    "(bench/attention.py); algorithms={'scaled_dot_product_attention': 'flash'} runs ours"
)


def _sdpa_vendor_build(
    graph: Graph, node: Node, device: torch.device, options: Options, hardware: Hardware
) -> Kernel | None:
    return get_op(node.op).bind(node)


def _flash_applies(graph: Graph, node: Node, device: torch.device, options: Options) -> str | None:
    return flash.why_not(graph, node, device)


def _flash_build(
    graph: Graph, node: Node, device: torch.device, options: Options, hardware: Hardware
) -> Kernel | None:
    return flash.kernel(graph, node, options, hardware)


SDPA_VENDOR = Algorithm(
    "vendor",
    SDPA,
    _vendor_applies,
    _sdpa_vendor_build,
    description="ATen's scaled_dot_product_attention (on the CPU its flash-attention kernel)",
)
FLASH = Algorithm(
    "flash",
    SDPA,
    _flash_applies,
    _flash_build,
    description="generated flash attention: query tiles against key/value tiles, online "
    "softmax, the score matrix never materialised",
)

# Per op, its algorithms by name; the first is the default's fallback.
ALGORITHMS: dict[str, dict[str, Algorithm]] = {
    "conv2d": {a.name: a for a in (VENDOR, WINOGRAD_F4X4, IM2COL_GEMM, WINOGRAD_F2X2, DIRECT)},
    "conv2d_dw": {a.name: a for a in (CONV_DW_VENDOR, STEM_DW_DIRECT)},
    "linear": {a.name: a for a in (LINEAR_VENDOR, GEMV)},
    SDPA: {a.name: a for a in (SDPA_VENDOR, FLASH)},
}


def algorithm_names(op: str) -> list[str]:
    """The names ``algorithms=`` takes for ``op``: "default", "autotune", "auto" and every
    registered one."""
    return [DEFAULT, AUTOTUNE, AUTO, *ALGORITHMS.get(op, {})]


# A user algorithm's call: F.conv2d's signature (x, weight, bias, stride, padding,
# dilation, groups) -> conv(x) + bias; the middleware adds the residual and the activation.
ConvFn = Callable[..., torch.Tensor]


def register_algorithm(
    op: str,
    name: str,
    fn: ConvFn | None = None,
    *,
    c_template: str | None = None,
    applies: Callable[[Layer], str | None] | None = None,
    exact: bool = True,
    error_bound: float | None = None,
    extra_bytes: Callable[[Layer], int] | None = None,
    description: str = "",
    replace: bool = False,
) -> Algorithm:
    """Add algorithm ``name`` for ``op`` (conv2d), selectable by name in
    ``optimize(..., algorithms={op: name})``.

    Either ``fn(x, weight, bias, stride, padding, dilation, groups)``, computing ``conv(x)
    + bias`` on tensors like ``F.conv2d`` (``bias`` may be None; weight and bias are the
    layer's constants, converted once), or ``c_template``: the text of a jinja2 template
    of C, rendered per layer with the :class:`Layer`'s fields (``input_shape``,
    ``weight_shape``, ``output_shape``, ``stride``, ``padding``, ``dilation``, ``groups``,
    ``bias``, ..., the layer's own name as ``layer_name``) and ``name``, the function it
    must define::

        void {{ name }}(const float *x, const float *w, const float *b, float *y, int n)

    with ``x`` the float32 NCHW input of batch ``n``, ``w`` PyTorch's ``[K, C/groups, KH,
    KW]`` weight, ``b`` the bias or NULL, and ``y`` the NCHW output to fill with ``conv(x)
    + bias`` (float32 layers only). It is compiled through the kernel cache (gcc -O3
    -march=native -fopenmp), once per distinct layer. Either way the middleware adds the
    residual and applies the fused activation after it and returns the node's layout. ``applies(layer)`` returns None
    where ``fn`` can run the :class:`Layer`, else the reason (the default then runs that
    layer and the report says why). ``replace`` allows redefining a user algorithm; a
    built-in one cannot be replaced."""
    if op != "conv2d":
        raise OptionsError(f"register_algorithm: only conv2d takes user algorithms, not {op!r}")
    if not name or name in (DEFAULT, AUTOTUNE, AUTO):
        raise OptionsError(f"register_algorithm: {name!r} is not a valid algorithm name")
    table = ALGORITHMS[op]
    old = table.get(name)
    if old is not None and (old.builtin or not replace):
        raise OptionsError(
            f"algorithm {name!r} for {op} exists already"
            + (" (built in)" if old.builtin else "; pass replace=True to redefine it")
        )
    if not exact and error_bound is None:
        raise OptionsError(f"algorithm {name!r} is approximate: give its error_bound")
    if (fn is None) == (c_template is None):
        raise OptionsError(
            f"register_algorithm({op!r}, {name!r}): give exactly one of fn (a Python "
            "callable on tensors) and c_template (C source as a jinja2 template)"
        )
    if c_template is not None:
        try:
            template = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(c_template)
        except jinja2.TemplateSyntaxError as e:
            raise OptionsError(
                f"register_algorithm({op!r}, {name!r}): c_template is not a valid jinja2 "
                f"template: {e} (line {e.lineno})"
            ) from e

    def index_of(graph: Graph, node: Node) -> Layer:
        return layer_of(graph, node, layer_indices(graph, op).get(node.name, -1))

    def user_applies(
        graph: Graph, node: Node, device: torch.device, options: Options
    ) -> str | None:
        why = im2col_applies(graph, node, device, options)  # constant weight, numeric padding
        if why is None and c_template is not None:
            if device.type != "cpu":
                why = f"a C algorithm runs on the CPU, not {device.type}"
            elif graph.values[node.inputs[0]].dtype != "float32":
                why = "a C algorithm takes float32 layers"
        if why is None and applies is not None:
            why = applies(index_of(graph, node))
        return why

    def user_build(
        graph: Graph, node: Node, device: torch.device, options: Options, hardware: Hardware
    ) -> Kernel | None:
        if c_template is None:
            assert fn is not None
            return python_kernel(graph, node, device, fn)
        conv = c_conv_fn(name, template, index_of(graph, node), options, hardware)
        return python_kernel(graph, node, device, conv)

    def user_extra(graph: Graph, node: Node) -> int:
        return 0 if extra_bytes is None else int(extra_bytes(index_of(graph, node)))

    algorithm = Algorithm(
        name, op, user_applies, user_build, user_extra, exact, error_bound, description, False
    )
    table[name] = algorithm
    return algorithm


def unregister_algorithm(op: str, name: str) -> None:
    """Remove user algorithm ``name`` of ``op`` (built-in ones stay)."""
    old = ALGORITHMS.get(op, {}).get(name)
    if old is not None and old.builtin:
        raise OptionsError(f"algorithm {name!r} for {op} is built in and cannot be removed")
    ALGORITHMS.get(op, {}).pop(name, None)


def c_conv_fn(
    algorithm: str, template: jinja2.Template, layer: Layer, options: Options, hardware: Hardware
) -> ConvFn:
    """A user's C template rendered for ``layer``, compiled through the kernel cache and
    wrapped as an ``F.conv2d``-like callable (see :func:`register_algorithm`). A template
    that does not render, or C that does not compile, raises :class:`OptionsError` naming
    the algorithm, the layer and the compiler's message."""
    fields = dataclasses.asdict(layer)
    fields["layer_name"] = fields.pop("name")  # ``name`` is the function to define
    digest = hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:10]
    fname = f"user_{re.sub(r'[^0-9A-Za-z_]', '_', algorithm)}_{digest}"
    try:
        src = template.render(name=fname, **fields)
    except jinja2.TemplateError as e:
        raise OptionsError(
            f"algorithm {algorithm!r}: its c_template does not render for layer {layer.name}: {e}"
        ) from e
    try:
        built = build_c(fname, src, options.cache_dir, key_extra=(hardware.key(),))
    except CompileError as e:
        raise OptionsError(
            f"algorithm {algorithm!r}: its C for layer {layer.name} does not compile "
            f"(source: {e.source_path}):\n{e}"
        ) from e
    cfn = getattr(load_shared(built.binary), fname, None)
    if cfn is None:
        raise OptionsError(
            f"algorithm {algorithm!r}: its C defines no function {fname} (use "
            "void {{ name }}(const float *x, const float *w, const float *b, float *y, int n))"
        )
    cfn.restype = None
    cfn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int]
    out_shape = layer.output_shape[1:]

    def conv_c(x, weight, bias, stride, padding, dilation, groups):
        x = x.contiguous()
        w = weight.contiguous()
        y = torch.empty((x.shape[0], *out_shape), dtype=x.dtype)
        b = bias.data_ptr() if bias is not None else None
        cfn(x.data_ptr(), w.data_ptr(), b, y.data_ptr(), x.shape[0])
        return y

    return conv_c


def python_kernel(graph: Graph, node: Node, device: torch.device, fn: ConvFn) -> Kernel:
    """A user's ``F.conv2d``-like ``fn`` as the node's call: constants converted once,
    then the residual add and the activation, in the node's output layout."""
    x_t, out_t = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    dtype = getattr(torch, x_t.dtype)
    padding, stride, dilation, groups = _conv_geometry(node)
    weight = torch.from_numpy(np.ascontiguousarray(graph.params[node.inputs[1]])).to(device, dtype)
    residual = bool(node.attrs.get("residual", False))
    has_bias = len(node.inputs) - int(residual) == 3
    bias = (
        torch.from_numpy(np.ascontiguousarray(graph.params[node.inputs[2]])).to(device, dtype)
        if has_bias
        else None
    )
    name, attrs = activation_attrs(node)
    act = inplace_activation(name, attrs)
    fmt = torch.channels_last if out_t.layout == "nhwc" else torch.contiguous_format

    def conv_user(x, _w, *rest):
        y = fn(x, weight, bias, tuple(stride), tuple(padding), tuple(dilation), groups)
        y = y.contiguous(memory_format=fmt)
        if y.data_ptr() == x.data_ptr():
            y = y.clone(memory_format=fmt)  # never hand back (and then overwrite) an input
        if residual:
            y = y.add_(rest[-1])
        return y if act is None else act(y)

    return holds_constants(conv_user, node)


# -------------------------------------------------------------------- the choice
@dataclasses.dataclass(frozen=True)
class Choice:
    """The call chosen for one layer, the algorithm's name and the reason for the report
    ("" where the default vendor call runs and nothing else was asked for)."""

    fn: Kernel
    algorithm: str
    reason: str


def layer_indices(graph: Graph, op: str) -> dict[str, int]:
    """Node name -> its index among the nodes of ``op``, in graph order."""
    return {n.name: i for i, n in enumerate(x for x in graph.nodes() if x.op == op)}


def check_selection(algorithms: Any) -> None:
    """Raise :class:`OptionsError` for an unknown op or name in ``Options.algorithms`` (a
    callable's answers are checked per layer, when it is asked)."""
    for op, sel in algorithms or ():
        if op not in ALGORITHMS:
            raise OptionsError(
                f"algorithms={{{op!r}: ...}}: no algorithms for op {op!r}; ops with "
                f"algorithms: {', '.join(sorted(ALGORITHMS))}"
            )
        if isinstance(sel, str):
            _lookup(op, sel)
        elif isinstance(sel, tuple):
            for name in sel:
                _lookup(op, name)
        elif not callable(sel):
            raise OptionsError(
                f"algorithms[{op!r}] is {type(sel).__name__}: use a name, a list of names "
                "(one per layer) or a callable (layer) -> name"
            )


def _lookup(op: str, name: Any) -> Algorithm | None:
    """The algorithm ``name`` of ``op``; None for "default", "autotune" and "auto";
    OptionsError when unknown."""
    if name in (DEFAULT, AUTOTUNE, AUTO):
        return None
    table = ALGORITHMS.get(op, {})
    if not isinstance(name, str) or name not in table:
        raise OptionsError(
            f"unknown {op} algorithm {name!r}; known: {', '.join(algorithm_names(op))}"
        )
    return table[name]


def requested(options: Options, graph: Graph, node: Node, index: int) -> str:
    """The name ``options.algorithms`` asks for at ``node`` ("default" where it says nothing)."""
    sel = dict(options.algorithms or ()).get(node.op)
    if sel is None:
        return DEFAULT
    if isinstance(sel, str):
        return sel
    if isinstance(sel, tuple):
        n_layers = len(layer_indices(graph, node.op))
        if len(sel) != n_layers:
            raise OptionsError(
                f"algorithms[{node.op!r}] lists {len(sel)} names but the model has "
                f"{n_layers} {node.op} layers (in graph order; 'default' lets the "
                "middleware decide one)"
            )
        return sel[index]
    name = sel(layer_of(graph, node, index))
    return DEFAULT if name is None else name


def over_cap(algorithm: Algorithm, graph: Graph, node: Node, options: Options) -> str | None:
    """Why ``algorithm``'s extra bytes exceed ``options.max_extra_param_bytes`` at ``node``, or
    None."""
    cap = options.max_extra_param_bytes
    if cap is None:
        return None
    extra = int(algorithm.extra_bytes(graph, node))
    if extra <= cap:
        return None
    return (
        f"{extra / 2**20:.2f} MiB extra memory over max_extra_param_bytes ({cap / 2**20:.2f} MiB)"
    )


def _usable(
    algorithm: Algorithm, graph: Graph, node: Node, device: torch.device, options: Options
) -> str | None:
    """None where ``algorithm`` applies to ``node`` within the memory cap, else why not."""
    why = algorithm.applies(graph, node, device, options)
    return why if why is not None else over_cap(algorithm, graph, node, options)


# The default's depthwise rule, measured (bench/depthwise.py, session 9, quiet host, two
# threads, whole networks through optimize()): the direct kernel for every depthwise layer
# took 0.80-0.92x oneDNN's time at batch 1 (mobilenet_v2, mobilenet_v3_small,
# shufflenet_v2_x1_0) and 1.05-1.13x at batch 16; a rerun timed by zoo.timed_blocks
# (bench/results/depthwise_cpu.md): 0.88-0.97x and 1.01-1.16x.
DIRECT_DEPTHWISE_REASON = (
    "direct (depthwise at batch 1): measured faster than oneDNN's depthwise call through "
    "torch.ops.mkldnn there (bench/depthwise.py); at larger batches, and as a oneDNN "
    "primitive created once (Options.onednn_primitives), oneDNN's is"
)


def _depthwise_at_batch_one(graph: Graph, node: Node) -> bool:
    x_t = graph.values[node.inputs[0]]
    groups = int(node.attrs.get("groups", 1))
    return x_t.rank == 4 and x_t.shape[0] == 1 and groups > 1 and groups == x_t.shape[1]


# The default's stem rule, measured (the layer alone, its output written into a kept
# channels_last buffer, the caches evicted between calls, median of 15, two threads, AMD
# EPYC Zen 5; session 19): a dense convolution of at most 32 output channels on the user's
# NCHW image runs the direct kernel, which reads the image in place instead of converting
# it, and stores its large output non-temporally. Batch 16 (1) against oneDNN, ms:
# mobilenet_v3_small 0.98 vs 1.80 (0.080 vs 0.152), mobilenet_v2 1.53 vs 2.34 (0.111 vs
# 0.187), shufflenet_v2 1.52 vs 2.96 (0.110 vs 0.205), inception_v3 2.78 vs 5.33 (0.191
# vs 0.366). With 64 output channels oneDNN's is as fast or faster (direct vs oneDNN:
# resnet's 7x7 stem 11.4 vs 9.7, vgg16's 13.8 vs 10.7, alexnet's 8.3 vs 5.7, squeezenet's
# 3.6 vs 3.6). Measured with AVX-512 only: the rule wants it (the nest's blocks count on
# its 32 registers).
DIRECT_STEM_MAX_K = 32
DIRECT_STEM_REASON = (
    "direct (a stem: at most 32 output channels on the NCHW image): reads the image in "
    "place and streams its output; measured 1.5-2x faster than oneDNN's call there "
    "(algorithms.DIRECT_STEM_REASON's comment)"
)


STEM_DW_REASON = (
    "direct (a stem and its depthwise layer, fused by the fuse_stem pass): the stem's "
    "output is computed a few rows at a time in cache and never written out"
)


def _stem(graph: Graph, node: Node) -> bool:
    return (
        node.op == "conv2d"
        and int(node.attrs.get("groups", 1)) == 1
        and direct.reads_nchw(graph, node)
        and graph.values[node.outputs[0]].layout == "nhwc"  # (measured so; else a copy)
        and graph.values[node.outputs[0]].shape[1] <= DIRECT_STEM_MAX_K
    )


GEMV_ONE_ROW_REASON = (
    "gemv (a linear layer on one row): the generated streaming GEMV measured faster than "
    "F.linear and oneDNN's linear there (AMD EPYC host, 2 threads, 576->1024 to "
    "25088->4096: 0.025 vs 0.036 ms .. 9.7 vs 14.1 ms; oneDNN 10.7; on the Intel Xeon host "
    "whole networks at batch 1 with the weights from memory, against the same plan with "
    "F.linear: alexnet 0.94x, vgg16 0.91x); from 2 rows oneDNN's "
    "is (4 rows, 9216->4096: 3.4 ms against the GEMV's 4.9)"
)


def _linear_on_one_row(graph: Graph, node: Node) -> bool:
    return node.op == "linear" and gemv.rows_of(graph, node) == 1


# The default's few-rows rule, measured (the layer alone, the caches evicted between calls,
# median of 40, two threads, AMD EPYC Zen 5; session 19): from 5 to 16 rows a classifier's
# weight of at most 8 MiB runs the generated blocked product (gemm_rows.c.j2: 4 weight rows
# x 4 input rows a block) faster than oneDNN's linear on the plain weight, us: 16 rows
# 576->1024 168 vs 219, 1024->1000 234 vs 287, 2048->1000 410 vs 459; 8 rows 118 vs 199,
# 156 vs 253, 250 vs 371; 5 rows 117 vs 193. Larger weights stay oneDNN's (16 rows,
# 9216->4096: 6.9 vs 6.2 ms; 4096->4096 3.1 vs 2.7).
GEMM_ROWS_MAX_WEIGHT_BYTES = 8 * 2**20
GEMV_ROWS_REASON = (
    "gemv (a linear layer on 5 to 16 rows with a weight of at most 8 MiB): the generated "
    "blocked product measured 10-45% faster than oneDNN's linear there "
    "(algorithms.GEMM_ROWS_MAX_WEIGHT_BYTES's comment)"
)


def _linear_on_few_rows(graph: Graph, node: Node) -> bool:
    return (
        node.op == "linear"
        and gemv.STREAM_ROWS < gemv.rows_of(graph, node) <= gemv.MAX_ROWS
        and graph.values[node.inputs[1]].nbytes <= GEMM_ROWS_MAX_WEIGHT_BYTES
    )


def default_choice(
    graph: Graph, node: Node, device: torch.device, options: Options, hardware: Hardware
) -> Choice | None:
    """The middleware's own choice: conv2d as Winograd where ``options.winograd`` is on,
    its measured rule picks the layer and its extra bytes are within
    ``options.max_extra_param_bytes``, the direct kernel for depthwise layers at batch 1
    (without oneDNN primitives) and for a stem of few output channels on the NCHW image,
    else the vendor call; a linear layer on one row as
    the generated GEMV where it applies; None where nothing offers a call (the catalogue
    reference runs)."""
    if (
        node.op == "conv2d"
        and options.winograd
        and device.type == "cpu"
        and wg.why_not(graph, node, hardware) is None
        and over_cap(WINOGRAD_F4X4, graph, node, options) is None
    ):
        fn = wg.winograd_kernel(graph, node, options, hardware)
        if fn is not None:
            return Choice(fn, WINOGRAD_F4X4.name, fn.algorithm)
    if (
        node.op == "conv2d"
        and device.type == "cpu"
        and _depthwise_at_batch_one(graph, node)
        and (not options.onednn_primitives or onednn.unavailable(options) is not None)
        and _usable(DIRECT, graph, node, device, options) is None
    ):
        fn = DIRECT.build(graph, node, device, options, hardware)
        if fn is not None:
            return Choice(fn, DIRECT.name, DIRECT_DEPTHWISE_REASON)
    if (
        device.type == "cpu"
        and node.op == "conv2d_dw"
        and _usable(STEM_DW_DIRECT, graph, node, device, options) is None
    ):
        fn = STEM_DW_DIRECT.build(graph, node, device, options, hardware)
        if fn is not None:
            return Choice(fn, STEM_DW_DIRECT.name, STEM_DW_REASON)
    if (
        device.type == "cpu"
        and hardware.simd_bytes >= 64  # (measured with AVX-512: the blocks count on 32 registers)
        and _stem(graph, node)
        and _usable(DIRECT, graph, node, device, options) is None
    ):
        fn = DIRECT.build(graph, node, device, options, hardware)
        if fn is not None:
            return Choice(fn, DIRECT.name, DIRECT_STEM_REASON)
    if (
        device.type == "cpu"
        and _linear_on_one_row(graph, node)
        and _usable(GEMV, graph, node, device, options) is None
    ):
        fn = GEMV.build(graph, node, device, options, hardware)
        if fn is not None:
            return Choice(fn, GEMV.name, GEMV_ONE_ROW_REASON)
    if (
        device.type == "cpu"
        and hardware.simd_bytes >= 64  # (measured with AVX-512: 16 accumulators of 16 lanes)
        and _linear_on_few_rows(graph, node)
        and _usable(GEMV, graph, node, device, options) is None
    ):
        fn = GEMV.build(graph, node, device, options, hardware)
        if fn is not None:
            return Choice(fn, GEMV.name, GEMV_ROWS_REASON)
    if node.op not in ALGORITHMS:
        return None
    if node.op == SDPA:
        return Choice(get_op(node.op).bind(node), SDPA_VENDOR.name, SDPA_DEFAULT_REASON)
    fn = vendor_kernel(graph, node, device, hardware, options)
    return None if fn is None else Choice(fn, VENDOR.name, "")


def choose(
    graph: Graph,
    node: Node,
    device: torch.device,
    options: Options,
    hardware: Hardware,
    index: int | None = None,
) -> Choice | None:
    """The call for ``node`` by ``options.algorithms``: the named algorithm where it
    applies (and builds), else the default with the reason; None where no algorithm
    offers a call. ``index``: the node's position among its op's nodes (computed when
    not given). Unknown names raise :class:`OptionsError` listing the known ones.

    On a graph marked ``RELEASE_AS_BUILT`` (the pipeline's, while it builds the plan),
    the weights the chosen call holds its own copy of are released as soon as it is
    built (:func:`release_built`)."""
    choice = _choose(graph, node, device, options, hardware, index)
    if choice is not None and graph.meta.get(RELEASE_AS_BUILT):
        release_built(graph, node, choice.fn)
    return choice


def release_built(graph: Graph, node: Node, fn: Kernel) -> list[str]:
    """Stand in for the arrays of the parameters ``fn`` holds its own copy of
    (``interface.held_inputs``) where ``node`` is their only reader and they are not the
    user's own memory (a folded weight and bias): the plan will keep no constant for them
    and nothing else reads them, so the prepacked or transformed copy need not share the
    process with the folded one until the whole plan is built. Returns the names."""
    sources = graph.meta.get(PARAM_SOURCES, {})
    outputs = set(graph.output_values())
    names = []
    for i in held_inputs(fn):
        v = node.inputs[i]
        arr = graph.params.get(v)
        if arr is None or v in outputs or v in graph.released():
            continue
        source = sources.get(v)
        if source is not None and source[0] is arr:
            continue  # the user's own memory: releasing it frees nothing
        if [c.name for c in graph.consumers(v)] == [node.name]:
            names.append(v)
    graph.stand_in_params(names, f"held by {node.name}'s call (built from it)")
    return names


def _choose(
    graph: Graph,
    node: Node,
    device: torch.device,
    options: Options,
    hardware: Hardware,
    index: int | None,
) -> Choice | None:
    if node.op not in ALGORITHMS:
        return None
    if index is None:
        index = layer_indices(graph, node.op).get(node.name, 0)
    name = requested(options, graph, node, index)
    algorithm = _lookup(node.op, name)
    if name == AUTOTUNE:
        return tuned_choice(graph, node, device, options, hardware)
    if name == AUTO:
        return auto_choice(graph, node, device, options, hardware)
    if algorithm is None:
        if not options.algorithms:  # nothing asked: a stored tuning decision, else the rule
            stored = _stored_choice(graph, node, device, options, hardware)
            if stored is not None:
                return stored
        return default_choice(graph, node, device, options, hardware)
    why = _usable(algorithm, graph, node, device, options)
    if why is None:
        fn = algorithm.build(graph, node, device, options, hardware)
        if fn is not None:
            detail = getattr(fn, "algorithm", "")
            return Choice(fn, name, f"{detail or name}, chosen by algorithms=")
        why = "it declined (or failed to build) this layer"
    fallback = default_choice(graph, node, device, options, hardware)
    if fallback is None:
        return None
    note = f"algorithms= asked for {name}, which does not apply: {why}; the default runs"
    reason = f"{fallback.reason}; {note}" if fallback.reason else note
    return Choice(fallback.fn, fallback.algorithm, reason)


def problem_of(graph: Graph, node: Node) -> dict[str, Any]:
    """What a tuning decision depends on of a layer: shapes, geometry, epilogue, dtype and
    the layouts (the layer's index and name do not: identical problems are tuned once)."""
    layer = dataclasses.asdict(layer_of(graph, node, 0))
    for k in ("index", "name", "source"):
        layer.pop(k)
    layer["activation_attrs"] = sorted(activation_attrs(node)[1].items())
    layer["input_layout"] = graph.values[node.inputs[0]].layout
    return layer


def _tuning_inputs(graph: Graph, node: Node, device: torch.device) -> list[torch.Tensor]:
    """Seeded random inputs of the layer's shapes and layouts (weights: its constants)."""
    gen = torch.Generator().manual_seed(0)

    def rand(value: str) -> torch.Tensor:
        t = graph.values[value]
        x = torch.randn(t.shape, generator=gen, dtype=getattr(torch, t.dtype))
        if t.layout == "nhwc" and t.rank == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x.to(device)

    args = []
    for v in node.inputs:
        arr = graph.params.get(v)
        args.append(
            torch.from_numpy(np.ascontiguousarray(arr)).to(device) if arr is not None else rand(v)
        )
    return args


def _candidates(graph: Graph, node: Node, device: torch.device, options: Options) -> list[str]:
    """The algorithms autotuning measures at ``node``: every one that applies within the
    memory cap (a decision is stored under this set)."""
    table = ALGORITHMS.get(node.op, {})
    return [n for n, a in table.items() if _usable(a, graph, node, device, options) is None]


# An exact candidate's largest tolerated difference from the vendor call on the tuning
# input, relative to the output's scale (float rounding of reordered sums).
EXACT_TOLERANCE = 1e-4


def _layers_to_tune(graph: Graph, options: Options) -> int:
    """The layers of ``graph`` that ``options.algorithms`` sends to autotuning (for the
    progress bar; 0 where a callable selects: it is not asked twice per layer)."""
    count = 0
    for op, sel in options.algorithms or ():
        n_layers = len(layer_indices(graph, op))
        if sel == AUTOTUNE:
            count += n_layers
        elif isinstance(sel, tuple) and len(sel) == n_layers:
            count += sum(name == AUTOTUNE for name in sel)
    return count


def _stored_choice(
    graph: Graph, node: Node, device: torch.device, options: Options, hardware: Hardware
) -> Choice | None:
    """The algorithm a stored tuning decision names for ``node``'s problem (as "auto"
    takes it), or None where there is none, it no longer builds, it is a user's algorithm
    (those run where asked for only) or it is approximate while ``options.winograd`` is
    off."""
    names = _candidates(graph, node, device, options)
    if len(names) < 2:
        return None
    key = tuning.decision_key(problem_of(graph, node), names, hardware.key())
    record, whence = tuning.DecisionStore(options.cache_dir).get(key)
    if record is None or record.get("algorithm") not in names:
        return None
    name = record["algorithm"]
    algorithm = ALGORITHMS[node.op][name]
    if not algorithm.builtin:
        return None  # a user's algorithm runs where asked for, never by default
    if not algorithm.exact and not options.winograd:
        return None  # winograd=False keeps the default on exact algorithms
    fn = algorithm.build(graph, node, device, options, hardware)
    if fn is None:
        return None
    how = "in the cache directory" if whence == "cached" else "in this process"
    return Choice(fn, name, f"default: stored tuning decision ({how}): {record['summary']}")


def auto_choice(
    graph: Graph, node: Node, device: torch.device, options: Options, hardware: Hardware
) -> Choice | None:
    """``"auto"``: the algorithm a stored tuning decision names for ``node``'s problem size
    (the one "autotune" would reuse: same problem, candidate set, hardware and version),
    else :func:`default_choice`; never times anything. The reason says which, and why."""
    table = ALGORITHMS.get(node.op, {})
    names = _candidates(graph, node, device, options)
    why = "no stored tuning decision for this problem size"
    if names:
        key = tuning.decision_key(problem_of(graph, node), names, hardware.key())
        record, whence = tuning.DecisionStore(options.cache_dir).get(key)
        if record is not None and record.get("algorithm") in names:
            name = record["algorithm"]
            fn = table[name].build(graph, node, device, options, hardware)
            if fn is not None:
                how = "in the cache directory" if whence == "cached" else "in this process"
                return Choice(fn, name, f"auto: stored decision ({how}): {record['summary']}")
            why = f"the stored decision ({name}) failed to build"
        elif record is not None:
            why = f"the stored decision ({record.get('algorithm')}) is no longer usable"
    fallback = default_choice(graph, node, device, options, hardware)
    if fallback is None:
        return None
    rule = f"the default rule: {fallback.reason or fallback.algorithm}"
    return Choice(fallback.fn, fallback.algorithm, f"auto: {why}; {rule}")


_TIME = re.compile(r"([A-Za-z_][\w]*) ([0-9.]+(?:e[+-]?\d+)?) ms")


def candidate_times(reason: str) -> dict[str, float]:
    """Candidate -> milliseconds, read back from a report row's reason as
    :func:`tuned_choice` writes it ("tuned: X best of N: a 0.38 ms, b 0.49 ms (pruned
    after round 2)"; "tuned: cached; X best of N: ..."); {} for a row that was not timed."""
    tail = (
        reason.split(" best of ", 1)[1]
        if reason.startswith("tuned:") and " best of " in reason
        else ""
    )
    tail = tail.split("; ", 1)[0]  # rejected candidates follow
    return {m.group(1): float(m.group(2)) for m in _TIME.finditer(tail)}


def tuned_choice(
    graph: Graph, node: Node, device: torch.device, options: Options, hardware: Hardware
) -> Choice | None:
    """The fastest applicable algorithm for ``node``, measured on its problem size
    (:func:`tuning.best_of`) or taken from a stored decision (no timing). Approximate
    candidates whose error against the vendor call on the tuning input exceeds their
    ``error_bound`` are rejected. Decisions are stored in ``options.cache_dir``."""
    table = ALGORITHMS.get(node.op, {})
    names = _candidates(graph, node, device, options)
    if not names:
        return default_choice(graph, node, device, options, hardware)
    key = tuning.decision_key(problem_of(graph, node), names, hardware.key())
    store = tuning.DecisionStore(options.cache_dir)
    record, whence = store.get(key)
    sess = tuning.session(graph, options.tune_budget_s, lambda: _layers_to_tune(graph, options))
    if record is not None and record["algorithm"] in names:
        fn = table[record["algorithm"]].build(graph, node, device, options, hardware)
        if fn is not None:
            sess.tuned(0.0, node.name)
            how = "cached" if whence == "cached" else "same problem tuned before"
            return Choice(fn, record["algorithm"], f"tuned: {how}; {record['summary']}")
    if sess.over_budget():
        sess.tuned(0.0, node.name)
        fallback = default_choice(graph, node, device, options, hardware)
        if fallback is None:
            return None
        note = (
            f"not tuned: the tuning budget (tune_budget_s={options.tune_budget_s:g}) was "
            f"spent after {sess.done - 1} layer(s); the default runs"
        )
        reason = f"{fallback.reason}; {note}" if fallback.reason else note
        return Choice(fallback.fn, fallback.algorithm, reason)
    started = time.perf_counter()
    built = {}
    for n in names:
        fn = table[n].build(graph, node, device, options, hardware)
        if fn is not None:
            built[n] = fn
    if not built:
        return default_choice(graph, node, device, options, hardware)
    args = _tuning_inputs(graph, node, device)
    rejected = []
    # Every candidate's result against the vendor call's (the catalogue reference where
    # there is none) on the tuning input: an exact one within float rounding, an
    # approximate one within its error bound; a wrong one never wins.
    with torch.inference_mode():
        ref_fn = built.get(VENDOR.name) or get_op(node.op).bind(node)
        ref = ref_fn(*args)
        scale = max(float(ref.abs().max()), 1e-30)
        for n in [n for n in built if n != VENDOR.name]:
            bound = EXACT_TOLERANCE if table[n].exact else float(table[n].error_bound or 0.0)
            try:
                y = built[n](*args)
                err = float((y - ref).abs().max()) / scale if y.shape == ref.shape else math.inf
            except Exception as e:  # a user's algorithm that raises is not a candidate
                rejected.append(f"{n} rejected (raised {type(e).__name__}: {e})")
                del built[n]
                continue
            if not err <= bound:
                rejected.append(f"{n} rejected (error {err:.1e} of scale)")
                del built[n]
    if not built:
        sess.tuned(time.perf_counter() - started, node.name)
        fallback = default_choice(graph, node, device, options, hardware)
        if fallback is None:
            return None
        note = "tuned: every candidate rejected: " + ", ".join(rejected)
        return Choice(fallback.fn, fallback.algorithm, note)

    def call(fn: Kernel) -> Callable[[], Any]:
        def run() -> Any:
            with torch.inference_mode():
                return fn(*args)

        return run

    # the activations only: the weights are to come from beyond L2, as in the network
    activations = tuple(a for a, v in zip(args, node.inputs, strict=True) if v not in graph.params)
    before = (
        tuning.cpu_context(hardware.l2_bytes * hardware.cores, activations)
        if device.type == "cpu"
        else None
    )
    outcome = tuning.best_of({n: call(fn) for n, fn in built.items()}, before=before)
    sess.tuned(time.perf_counter() - started, node.name)
    times = ", ".join(
        f"{n} {t * 1e3:.3g} ms"
        + (f" (pruned after round {outcome.pruned[n]})" if n in outcome.pruned else "")
        for n, t in sorted(outcome.times.items(), key=lambda p: p[1])
    )
    summary = f"{outcome.best} best of {len(built)}" + (f": {times}" if times else "")
    if rejected:
        summary += "; " + ", ".join(rejected)
    store.put(
        key,
        {
            "algorithm": outcome.best,
            "times_s": outcome.times,
            "pruned": outcome.pruned,
            "summary": summary,
            "problem": problem_of(graph, node),
            "hardware": hardware.key(),
            "version": __version__,
        },
    )
    return Choice(built[outcome.best], outcome.best, f"tuned: {summary}")


def vendor_call(
    graph: Graph, node: Node, device: torch.device, options: Options, hardware: Hardware
) -> tuple[Callable[..., Any], str] | None:
    """The call :func:`choose` picks for ``node`` with the reason the report shows ("" for
    the vendor's direct call by default), or None (the catalogue reference runs)."""
    choice = choose(graph, node, device, options, hardware)
    return None if choice is None else (choice.fn, choice.reason)


def describe(op: str = "conv2d") -> list[str]:
    """One line per algorithm of ``op``: name, exact or its error bound, description."""
    lines = []
    for a in ALGORITHMS.get(op, {}).values():
        kind = "exact" if a.exact else f"approximate (error <= {a.error_bound:g} of scale)"
        lines.append(f"{a.name}: {kind}; {a.description}")
    return lines


__all__ = [
    "ALGORITHMS",
    "AUTO",
    "DEFAULT",
    "Algorithm",
    "Choice",
    "Layer",
    "algorithm_names",
    "auto_choice",
    "check_selection",
    "choose",
    "im2col_kernel",
    "layer_of",
    "register_algorithm",
    "unregister_algorithm",
    "vendor_call",
]
