"""Small I/O-bound groups for the CUDA backend's tests (emulation, nvcc, real GPU).

Each case builds a graph in a given layout whose nodes all form one group; the group's
outputs are the graph's outputs, so ``Graph.evaluate`` gives PyTorch's answer for exactly
what the kernel computes. ``CASES`` render to one kernel each (the schedule of
``passes/schedule.py``); ``FRAMEWORK_OPS`` are cases holding an op without loop semantics
that the CUDA backend leaves to the framework (cuDNN/ATen), and ``SPLIT_CASES`` groups the
group pass cuts into one kernel per output. Shapes are odd on purpose: sizes that are no multiple of a warp,
1x1 and 2x2 spatial, windows larger than the input, ceil_mode edge windows, padding wider
than half the window where PyTorch allows it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from middleware.graph import Graph, Node, TensorType
from middleware.hardware import Hardware
from middleware.ops import CATALOGUE, infer_types
from middleware.passes.schedule import schedule_group
from middleware.passes.schedule_ir import Schedule


def gpu_skip_reason() -> str:
    """Why the GPU tests cannot run here ("" when they can): no CUDA device, no kernel
    loader (pycuda or cuda-python) or no CUDA compiler (nvcc or NVRTC)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    from middleware.backends.cuda.build import find_nvcc, nvrtc_available
    from middleware.backends.cuda.loader import available_loaders

    if not available_loaders():
        return "no CUDA kernel loader (pip install 'middleware[cuda]' or cuda-python)"
    if find_nvcc() is None and not nvrtc_available():
        return "no CUDA compiler (nvcc or NVRTC)"
    return ""


# A GPU description for rendering without a GPU (an H100-like part, small enough figures
# that the emulated grids stay short).
FAKE_GPU = Hardware(
    kind="cuda",
    name="test-gpu",
    cores=4,
    simd_bytes=128,
    l1_bytes=256 * 1024,
    l2_bytes=50 * 1024 * 1024,
    l3_bytes=0,
    peak_gflops=60000.0,
    bandwidth_gbs=3000.0,
    warp_size=32,
    shared_mem_bytes=227 * 1024,
    arch="sm_90",
)


class Builder:
    """Adds nodes with inferred types; parameters from a seeded generator."""

    def __init__(self, layout: str, seed: int = 0) -> None:
        self.g = Graph()
        self.layout = layout
        self.rng = np.random.default_rng(seed)
        self.names: list[str] = []

    def input(self, name: str, shape: tuple[int, ...]) -> str:
        lay = self.layout if len(shape) == 4 else "nchw"
        return self.g.add_input(name, TensorType(shape, layout=lay))

    def param(self, name: str, shape: tuple[int, ...], positive: bool = False) -> str:
        a = self.rng.standard_normal(shape).astype(np.float32)
        if positive:
            a = np.abs(a) + np.float32(0.5)
        return self.g.add_param(name, a)

    def node(self, op: str, inputs: tuple[str, ...], n_out: int = 1, **attrs) -> str | tuple:
        name = f"n{len(self.names)}_{op}"
        outs = tuple(f"{name}_out{k}" if n_out > 1 else f"{name}_out" for k in range(n_out))
        node = Node(name, op, inputs, outs, attrs, bound="io", source=f"layer{len(self.names)}")
        self.g.add_node(node, infer_types(self.g.values, node))
        self.names.append(name)
        return outs if n_out > 1 else outs[0]

    def bn(self, x: str) -> str:
        c = self.g.values[x].shape[1]
        k = len(self.names)
        ps = (
            self.param(f"bn{k}_mean", (c,)),
            self.param(f"bn{k}_var", (c,), positive=True),
            self.param(f"bn{k}_weight", (c,)),
            self.param(f"bn{k}_bias", (c,)),
        )
        return self.node("batch_norm", (x, *ps), eps=1e-5)

    def done(self, *outputs: str) -> tuple[Graph, list[str]]:
        self.g.set_outputs(outputs[0] if len(outputs) == 1 else tuple(outputs))
        return self.g, list(self.names)


def pool_attrs(k, s, p=0, d=1, ceil=False) -> dict:  # noqa: ANN001
    return dict(kernel_size=k, stride=s, padding=p, dilation=d, ceil_mode=ceil)


def avg_attrs(k, s, p=0, ceil=False, cip=True, div=None) -> dict:  # noqa: ANN001
    return dict(
        kernel_size=k,
        stride=s,
        padding=p,
        ceil_mode=ceil,
        count_include_pad=cip,
        divisor_override=div,
    )


def _chain(lay: str) -> tuple[Graph, list[str]]:
    b = Builder(lay)
    x = b.input("x", (2, 5, 9, 7))
    y = b.node("max_pool2d", (b.node("relu", (b.bn(x),)),), **pool_attrs(3, 2, 1))
    return b.done(y)


def _chain_ceil(lay: str) -> tuple[Graph, list[str]]:
    b = Builder(lay)
    x = b.input("x", (3, 6, 10, 11))
    y = b.node("max_pool2d", (b.node("relu", (b.bn(x),)),), **pool_attrs(3, 2, 0, ceil=True))
    return b.done(y)


def _remap(op: str, in_shape: tuple[int, ...], then: str | None = None, **attrs) -> Callable:  # noqa: ANN003
    """An index remap of op_shapes.py (slice, expand, repeat, roll) after a batch-norm, then
    ``then`` (an activation, or a 3x3/2 max-pool reading the remapped values)."""

    def build(lay: str) -> tuple[Graph, list[str]]:
        b = Builder(lay)
        y = b.node(op, (b.bn(b.input("x", in_shape)),), **attrs)
        if then == "max_pool2d":
            y = b.node("max_pool2d", (y,), **pool_attrs(3, 2, 1))
        elif then is not None:
            y = b.node(then, (y,))
        return b.done(y)

    return build


def _unary(op: str, **attrs) -> Callable[[str], tuple[Graph, list[str]]]:  # noqa: ANN003
    def build(lay: str) -> tuple[Graph, list[str]]:
        b = Builder(lay)
        x = b.input("x", (2, 3, 5, 7))
        return b.done(b.node(op, (x,), **attrs))

    return build


def _binary(op: str, other: tuple[int, ...] | None, **attrs) -> Callable:  # noqa: ANN003
    def build(lay: str) -> tuple[Graph, list[str]]:
        b = Builder(lay)
        x = b.input("x", (2, 6, 5, 3))
        if other is None:
            return b.done(b.node(op, (x,), **attrs))
        y = b.input("y", other)
        return b.done(b.node(op, (x, y), **attrs))

    return build


def _pool(op: str, shape: tuple[int, ...], **attrs) -> Callable:  # noqa: ANN003
    def build(lay: str) -> tuple[Graph, list[str]]:
        b = Builder(lay)
        x = b.input("x", shape)
        return b.done(b.node(op, (x,), **attrs))

    return build


def _maxpool_act(act: str, act_attrs: tuple) -> Callable:
    def build(lay: str) -> tuple[Graph, list[str]]:
        b = Builder(lay)
        x = b.input("x", (2, 4, 7, 9))
        y = b.node(
            "maxpool_relu", (x,), **pool_attrs(3, 2, 1), activation=act, activation_attrs=act_attrs
        )
        return b.done(y)

    return build


def _mean(keep: bool) -> Callable:
    def build(lay: str) -> tuple[Graph, list[str]]:
        b = Builder(lay)
        x = b.input("x", (3, 5, 6, 7))
        return b.done(b.node("mean", (b.node("silu", (x,)),), dims=(2, 3), keepdim=keep))

    return build


def _se_block(lay: str) -> tuple[Graph, list[str]]:
    """Squeeze-excitation's scale: x * hardsigmoid(s) with s per channel (N, C, 1, 1)."""
    b = Builder(lay)
    x = b.input("x", (2, 6, 5, 7))
    s = b.input("s", (2, 6, 1, 1))
    return b.done(b.node("mul", (x, b.node("hardsigmoid", (s,)))))


def _cat(lay: str) -> tuple[Graph, list[str]]:
    b = Builder(lay)
    x = b.input("x", (2, 3, 6, 5))
    y = b.input("y", (2, 4, 6, 5))
    c = b.node("cat", (b.node("relu", (x,)), b.node("sigmoid", (y,))), dim=1)
    return b.done(b.node("max_pool2d", (c,), **pool_attrs(2, 2, 0, ceil=True)))


def _shuffle(lay: str) -> tuple[Graph, list[str]]:
    """shufflenet's split + channel shuffle: split, relu one half, cat, reshape/permute."""
    b = Builder(lay)
    x = b.input("x", (2, 8, 5, 3))
    a, c = b.node("split", (x,), n_out=2, split_sizes=(4, 4), dim=1)
    y = b.node("cat", (a, b.node("relu", (c,))), dim=1)
    r = b.node("reshape", (y,), shape=(2, 2, 4, 5, 3))
    p = b.node("permute", (r,), dims=(0, 2, 1, 3, 4))
    return b.done(b.node("reshape", (p,), shape=(2, 8, 5, 3)))


def _head(lay: str) -> tuple[Graph, list[str]]:
    b = Builder(lay)
    x = b.input("x", (3, 7, 5, 6))
    p = b.node("adaptive_avg_pool2d", (b.node("relu", (x,)),), output_size=(1, 1))
    f = b.node("flatten", (p,), start_dim=1, end_dim=-1)
    return b.done(b.node("dropout", (f,)))


def _softmax(op: str) -> Callable:
    def build(lay: str) -> tuple[Graph, list[str]]:
        b = Builder(lay)
        x = b.input("x", (3, 13))
        return b.done(b.node(op, (x,), dim=1))

    return build


def _depthwise(stride: int, act: str | None, residual: bool = False) -> Callable:
    def build(lay: str) -> tuple[Graph, list[str]]:
        b = Builder(lay)
        x = b.input("x", (2, 6, 9, 8))
        w = b.param("dw_w", (6, 1, 3, 3))
        bias = b.param("dw_b", (6,))
        ins = (x, w, bias)
        attrs = dict(stride=(stride, stride), padding=(1, 1), dilation=(1, 1), groups=6)
        if act:
            attrs.update(activation=act, activation_attrs=(("min_val", 0.0), ("max_val", 6.0)))
        if residual:
            ins = (*ins, b.input("res", (2, 6, 9, 8)))
            attrs["residual"] = True
        return b.done(b.node("conv2d", ins, **attrs))

    return build


def _grouped_conv(lay: str) -> tuple[Graph, list[str]]:
    b = Builder(lay)
    x = b.input("x", (2, 4, 6, 5))
    w = b.param("g_w", (6, 2, 2, 3))
    y = b.node("conv2d", (x, w), stride=(1, 2), padding=(1, 0), dilation=(2, 1), groups=2)
    return b.done(b.node("relu", (y,)))


def _two_outputs(lay: str) -> tuple[Graph, list[str]]:
    """A group with two outputs of different shapes (the activation is read outside too)."""
    b = Builder(lay)
    x = b.input("x", (2, 3, 7, 6))
    r = b.node("relu", (b.bn(x),))
    return b.done(r, b.node("avg_pool2d", (r,), **avg_attrs(2, 2, ceil=True)))


def _rank2(lay: str) -> tuple[Graph, list[str]]:
    """A classifier head's elementwise ops on (N, C): C is the innermost memory dim."""
    b = Builder(lay)
    x = b.input("x", (3, 12))
    return b.done(b.node("relu", (b.node("add", (x,), scalar=0.5),)))


def _residual_add(lay: str) -> tuple[Graph, list[str]]:
    b = Builder(lay)
    x = b.input("x", (2, 5, 4, 3))
    y = b.input("y", (2, 5, 4, 3))
    return b.done(b.node("relu", (b.node("add", (b.bn(x), y), alpha=1),)))


ALL_CASES: dict[str, Callable[[str], tuple[Graph, list[str]]]] = {
    "bn_relu_maxpool": _chain,
    "bn_relu_maxpool_ceil": _chain_ceil,
    "relu": _unary("relu"),
    "relu6": _unary("hardtanh", min_val=0.0, max_val=6.0),
    "leaky_relu": _unary("leaky_relu", negative_slope=0.1),
    "sigmoid": _unary("sigmoid"),
    "tanh": _unary("tanh"),
    "silu": _unary("silu"),
    "hardswish": _unary("hardswish"),
    "hardsigmoid": _unary("hardsigmoid"),
    "gelu": _unary("gelu", approximate="none"),
    "gelu_tanh": _unary("gelu", approximate="tanh"),
    "identity": _unary("identity"),
    "add": _binary("add", (2, 6, 5, 3)),
    "sub_alpha": _binary("sub", (2, 6, 5, 3), alpha=0.5),
    "mul_channel": _binary("mul", (1, 6, 1, 1)),
    "div_row": _binary("div", (3,)),
    "add_scalar": _binary("add", None, scalar=1.5),
    "rsub_scalar": _binary("sub", None, scalar=2.0, reverse=True),
    "rdiv_scalar": _binary("div", None, scalar=3.0, reverse=True),
    "se_scale": _se_block,
    "residual_add_relu": _residual_add,
    "maxpool_2x2": _pool("max_pool2d", (2, 3, 8, 6), **pool_attrs(2, 2)),
    "maxpool_dilated": _pool("max_pool2d", (2, 3, 9, 8), **pool_attrs(3, 1, 1, d=2)),
    "maxpool_ceil_edge": _pool("max_pool2d", (1, 3, 6, 6), **pool_attrs(3, 2, 1, ceil=True)),
    "maxpool_window_gt_input": _pool("max_pool2d", (2, 3, 1, 1), **pool_attrs(3, 2, 1)),
    "maxpool_2x2_input": _pool("max_pool2d", (2, 3, 2, 2), **pool_attrs(3, 1, 1)),
    "avgpool_pad_include": _pool("avg_pool2d", (2, 3, 7, 5), **avg_attrs(3, 2, 1)),
    "avgpool_pad_exclude": _pool("avg_pool2d", (2, 3, 7, 5), **avg_attrs(3, 2, 1, cip=False)),
    "avgpool_ceil": _pool("avg_pool2d", (2, 3, 8, 7), **avg_attrs(3, 2, 1, ceil=True)),
    "avgpool_divisor": _pool("avg_pool2d", (2, 3, 6, 6), **avg_attrs(2, 2, div=3)),
    "avgpool_inception": _pool("avg_pool2d", (2, 5, 5, 5), **avg_attrs(3, 1, 1, cip=False)),
    "adaptive_avg_1x1": _pool("adaptive_avg_pool2d", (2, 5, 7, 6), output_size=(1, 1)),
    "adaptive_avg_3x2": _pool("adaptive_avg_pool2d", (2, 5, 7, 5), output_size=(3, 2)),
    "adaptive_max_2x3": _pool("adaptive_max_pool2d", (2, 5, 5, 7), output_size=(2, 3)),
    "adaptive_avg_upsample": _pool("adaptive_avg_pool2d", (1, 2, 2, 3), output_size=(5, 4)),
    "maxpool_relu": _maxpool_act("relu", ()),
    "maxpool_relu6": _maxpool_act("hardtanh", (("min_val", 0.0), ("max_val", 6.0))),
    "mean_hw": _mean(False),
    "mean_hw_keepdim": _mean(True),
    "cat_pool": _cat,
    "channel_shuffle": _shuffle,
    "head_flatten": _head,
    "softmax": _softmax("softmax"),
    "log_softmax": _softmax("log_softmax"),
    "depthwise_relu6": _depthwise(1, "hardtanh"),
    "depthwise_stride2": _depthwise(2, None),
    "depthwise_residual": _depthwise(1, None, residual=True),
    "grouped_conv_relu": _grouped_conv,
    "two_outputs": _two_outputs,
    "rank2_add_relu": _rank2,
    "slice_step_relu": _remap(
        "slice", (2, 7, 6, 9), "relu", index=(("slice", 0, 2, 1), ("slice", 1, 7, 2))
    ),
    "slice_spatial_pool": _remap(
        "slice",
        (2, 3, 11, 10),
        "max_pool2d",
        index=(("slice", 0, 2, 1), ("slice", 0, 3, 1), ("slice", 1, 10, 1), ("slice", 0, 10, 3)),
    ),
    "expand_relu": _remap("expand", (2, 1, 5, 1), "relu", shape=(2, 4, 5, 6)),
    "repeat_sigmoid": _remap("repeat", (1, 3, 4, 5), "sigmoid", repeats=(2, 1, 2, 3)),
    "roll_relu": _remap("roll", (2, 5, 6, 7), "relu", shifts=(2, -3), dims=(2, 3)),
    "roll_pool": _remap("roll", (2, 4, 9, 8), "max_pool2d", shifts=(5,), dims=(1,)),
    "channel_shuffle_op": _remap("channel_shuffle", (2, 6, 5, 7), "relu", groups=3),
}

# Every activation of the registry (an op with scalar semantics), with its default attrs:
# an op added to the registry is rendered, compiled and checked here without a new case.
REGISTRY_ACTIVATIONS = sorted(n for n, op in CATALOGUE.items() if op.pointwise is not None)
for _name in REGISTRY_ACTIVATIONS:
    ALL_CASES[f"registry_{_name}"] = _unary(_name, **dict(CATALOGUE[_name].defaults))

# case -> (the op of the case that has no loop semantics, so no generated kernel, and the
# reason the report gives): the CUDA backend runs it through the framework (cuDNN/ATen)
FRAMEWORK_OPS: dict[str, tuple[str, str]] = {
    "softmax": ("softmax", "no loop semantics"),
    "log_softmax": ("log_softmax", "no loop semantics"),
    "channel_shuffle": ("split", "views only"),  # split, the 5-d reshape and the permute
    "grouped_conv_relu": ("conv2d", "no loop semantics"),
    # cuDNN, its bias and residual add in the generated epilogue kernel (epilogue.py)
    "depthwise_residual": ("conv2d", "cuDNN convolution + generated epilogue"),
}
# cases with several values read outside the group: one kernel per output
SPLIT_CASES = ("two_outputs",)
CASES = {k: v for k, v in ALL_CASES.items() if k not in FRAMEWORK_OPS and k not in SPLIT_CASES}

LAYOUTS = ("nchw", "nhwc")


def schedule_of(graph: Graph, names: list[str], hardware: Hardware = FAKE_GPU) -> Schedule:
    """The backend-neutral schedule of a case's group (what the CUDA backend renders)."""
    return schedule_group(graph, names, hardware)


def special_inputs(graph: Graph, seed: int = 0) -> list[torch.Tensor]:
    """:func:`inputs_for` with NaN, +inf and -inf planted at seeded positions (about one
    element in eight), to check PyTorch's NaN and infinity semantics. A graph with an
    erf-GELU gets -inf instead of +inf: erf-GELU(+inf) is NaN in PyTorch's vectorised CPU
    kernel but +inf in its scalar path and mathematically (tests/test_nan_semantics.py)."""
    plus_inf = not any(
        n.op == "gelu" and n.attrs.get("approximate", "none") == "none" for n in graph.nodes()
    )
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    for x in inputs_for(graph, seed):
        flat = x.clone()
        pick = torch.randint(0, 24, x.shape, generator=gen)
        flat[pick == 0] = float("nan")
        flat[pick == 1] = float("inf") if plus_inf else float("-inf")
        flat[pick == 2] = float("-inf")
        out.append(flat)
    return out


def inputs_for(graph: Graph, seed: int = 0, device: str = "cpu") -> list[torch.Tensor]:
    """Seeded random inputs in each input's layout."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for v in graph.inputs:
        t = graph.values[v]
        x = torch.randn(t.shape, generator=gen)
        if t.rank == 4 and t.layout == "nhwc":
            x = x.contiguous(memory_format=torch.channels_last)
        out.append(x.to(device))
    return out


def kernel_args(
    graph: Graph, group_inputs: tuple[str, ...], inputs: list[torch.Tensor], device: str = "cpu"
) -> list[torch.Tensor]:
    """The kernel's input tensors: graph inputs as given, parameters from the graph."""
    env = dict(zip(graph.inputs, inputs, strict=True))
    args = []
    for v in group_inputs:
        if v in env:
            args.append(env[v])
        else:
            args.append(torch.from_numpy(np.ascontiguousarray(graph.params[v])).to(device))
    return args
