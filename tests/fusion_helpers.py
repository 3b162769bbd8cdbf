"""Shared helpers of the fusion tests: build io chains as graphs with explicit layouts,
run a generated kernel, the reference backend (the same schedule interpreted in numpy) and
PyTorch on the same seeded inputs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from middleware.backends.reference import ReferenceBackend
from middleware.backends.x86 import X86Backend
from middleware.graph import Graph, Node, TensorType
from middleware.hardware import Hardware, detect
from middleware.ops import infer_types
from middleware.options import Options
from middleware.passes.schedule import Schedule, schedule_group

# (op, attrs) or (op, attrs, extra operands); an extra operand is ("input", shape) for a
# further graph input, or ("param", shape) for a constant.
Step = tuple[Any, ...]

POOL = dict(dilation=(1, 1), ceil_mode=False)


def maxpool(k: int, s: int, p: int = 0, d: int = 1, ceil: bool = False) -> Step:
    return (
        "max_pool2d",
        dict(kernel_size=(k, k), stride=(s, s), padding=(p, p), dilation=(d, d), ceil_mode=ceil),
    )


def avgpool(
    k: int, s: int, p: int = 0, ceil: bool = False, cip: bool = True, div: int | None = None
) -> Step:
    return (
        "avg_pool2d",
        dict(
            kernel_size=(k, k),
            stride=(s, s),
            padding=(p, p),
            ceil_mode=ceil,
            count_include_pad=cip,
            divisor_override=div,
        ),
    )


def bn() -> Step:
    return ("batch_norm", dict(eps=1e-5))


def build_chain(shape: Sequence[int], layout: str, steps: Sequence[Step], seed: int = 0) -> Graph:
    """A graph ``x -> step0 -> step1 -> ...`` (each node bound "io", group 0)."""
    rng = np.random.default_rng(seed)
    g = Graph()
    cur = g.add_input("x", TensorType(tuple(shape), "float32", layout))
    for i, step in enumerate(steps):
        op, attrs = step[0], dict(step[1])
        extra = step[2] if len(step) > 2 else ()
        name = f"layer{i}_{op}"
        inputs = [cur]
        if op == "batch_norm":
            c = g.values[cur].shape[1]
            inputs.append(g.add_param(f"{name}.mean", rng.standard_normal(c).astype(np.float32)))
            inputs.append(g.add_param(f"{name}.var", rng.uniform(0.5, 2, c).astype(np.float32)))
            inputs.append(g.add_param(f"{name}.weight", rng.standard_normal(c).astype(np.float32)))
            inputs.append(g.add_param(f"{name}.bias", rng.standard_normal(c).astype(np.float32)))
        for j, (kind, eshape) in enumerate(extra):
            ename = f"{name}_arg{j}"
            if kind == "input":
                lay = layout if len(eshape) == 4 else "nchw"
                inputs.append(g.add_input(ename, TensorType(tuple(eshape), "float32", lay)))
            else:
                arr = rng.standard_normal(tuple(eshape)).astype(np.float32)
                inputs.append(g.add_param(ename, arr))
        node = Node(
            name, op, tuple(inputs), (f"v{i}",), attrs, bound="io", group=0, source=f"layers.{i}"
        )
        g.add_node(node, infer_types(g.values, node))
        cur = node.outputs[0]
    g.set_outputs(cur)
    return g


def random_inputs(g: Graph, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for v in g.inputs:
        t = g.values[v]
        x = torch.randn(t.shape, generator=gen)
        if t.layout == "nhwc" and t.rank == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        out.append(x)
    return out


def hardware() -> Hardware:
    return detect("cpu", None, measure=False)


def check_group(
    g: Graph, cache: Path, seed: int = 0, atol: float = 1e-5, rtol: float = 1e-5
) -> Any:
    """Generate the whole graph as one group, run it and PyTorch (``Graph.evaluate``) on
    the same inputs, assert they match; then run the same schedule on the reference backend
    (numpy) against PyTorch with the same tolerance. Returns the kernel.

    Keep the shapes small (a few thousand elements): the reference backend is an
    interpreter."""
    names = [n.name for n in g.nodes()]
    kernel = X86Backend().build(g, names, Options(cache_dir=cache), hardware())
    xs = random_inputs(g, seed)
    ref = g.evaluate(*xs)
    by_name = dict(zip(g.inputs, xs, strict=True))
    by_name.update({p: torch.from_numpy(a) for p, a in g.params.items()})
    got = kernel.fn(*[by_name[v] for v in kernel.inputs])
    assert got.shape == ref.shape
    out_t = g.values[g.output_values()[0]]
    if out_t.layout == "nhwc" and out_t.rank == 4:
        assert got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
    out2 = torch.empty_like(got)
    kernel.out_fn(*[by_name[v] for v in kernel.inputs], out2)
    torch.testing.assert_close(out2, ref, atol=atol, rtol=rtol)
    # the kernel's own schedule (rebuilt when the kernel came from the group index)
    schedule = kernel.schedule or schedule_group(g, names, hardware())
    check_reference(schedule, by_name, ref, atol=atol, rtol=rtol)
    return kernel


def check_reference(
    schedule: Schedule,
    by_name: dict[str, torch.Tensor],
    ref: torch.Tensor,
    atol: float = 1e-5,
    rtol: float = 1e-5,
) -> torch.Tensor:
    """Run ``schedule`` on the reference backend (inputs looked up by value name in
    ``by_name``), in both its readings (the tiled loop nest, and one output element at a
    time as CUDA renders it), and assert each output matches ``ref`` in shape, layout and
    value. Returns the tiled reading's output."""
    outs = []
    for per_point in (False, True):
        kernel = ReferenceBackend().kernel(schedule, per_point=per_point)
        got = kernel.fn(*[by_name[v] for v in kernel.inputs])
        assert got.shape == ref.shape
        out = schedule.buffer(schedule.outputs[0])
        if out.layout == "nhwc" and len(out.torch_shape) == 4:
            assert got.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
        outs.append(got)
    return outs[0]


def add(g: Graph, op: str, inputs: Sequence[str], **attrs: Any) -> str:
    """Append node ``op(inputs; attrs)`` (bound "io", group 0) to ``g``; returns its output."""
    i = len(g)
    name = f"layer{i}_{op}"
    node = Node(
        name, op, tuple(inputs), (f"v{i}",), attrs, bound="io", group=0, source=f"layers.{i}"
    )
    g.add_node(node, infer_types(g.values, node))
    return node.outputs[0]


def add_bn(g: Graph, x: str, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    c = g.values[x].shape[1]
    tag = f"bn{len(g)}"
    ps = [
        g.add_param(f"{tag}.mean", rng.standard_normal(c).astype(np.float32)),
        g.add_param(f"{tag}.var", rng.uniform(0.5, 2, c).astype(np.float32)),
        g.add_param(f"{tag}.weight", rng.standard_normal(c).astype(np.float32)),
        g.add_param(f"{tag}.bias", rng.standard_normal(c).astype(np.float32)),
    ]
    return add(g, "batch_norm", [x, *ps], eps=1e-5)


# a convolution's fused activations with their attrs (vendor post-ops and the primitive's
# eltwise spellings: tests/test_vendor.py, tests/test_onednn_primitives.py)
CONV_ACTIVATIONS = [
    (None, ()),
    ("relu", ()),
    ("hardtanh", (("min_val", 0.0), ("max_val", 6.0))),
    ("hardtanh", (("min_val", -0.5), ("max_val", 0.25))),
    ("leaky_relu", (("negative_slope", 0.1),)),
    ("silu", ()),
    ("hardswish", ()),
    ("hardsigmoid", ()),
    ("sigmoid", ()),
    ("tanh", ()),
    ("gelu", (("approximate", "none"),)),
    ("gelu", (("approximate", "tanh"),)),
]


def close_to_scale(y: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> None:
    """``y`` equals ``ref`` within ``tol`` relative to ``ref``'s largest magnitude."""
    scale = max(1e-12, float(ref.abs().max()))
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol * scale)


def conv_graph(
    x_shape, w_shape, layout, *, stride=1, padding=0, dilation=1, groups=1, bias=True,
    activation=None, activation_attrs=(), residual=False, seed=0,
):  # fmt: skip
    """A graph holding one conv2d node (params from a seeded generator)."""
    rng = np.random.default_rng(seed)
    g = Graph()
    g.add_input("x", TensorType(tuple(x_shape), layout=layout))
    g.add_param("w", (rng.standard_normal(w_shape) * 0.2).astype(np.float32))
    ins = ["x", "w"]
    if bias:
        g.add_param("b", rng.standard_normal(w_shape[0]).astype(np.float32))
        ins.append("b")
    attrs = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    if activation:
        attrs.update(activation=activation, activation_attrs=tuple(activation_attrs))
    if residual:
        probe = Node("c", "conv2d", tuple(ins), ("y",), dict(attrs))
        out_shape = infer_types(g.values, probe)[0].shape
        g.add_input("r", TensorType(out_shape, layout=layout))
        ins.append("r")
        attrs["residual"] = True
    node = Node("c", "conv2d", tuple(ins), ("y",), attrs)
    g.add_node(node, infer_types(g.values, node))
    g.set_outputs("y")
    return g, node


def reinit(m: nn.Module, seed: int) -> nn.Module:
    """Weights that keep the activations' variance (random networks otherwise fade to
    outputs near zero), batch-norm statistics away from the identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, (nn.Conv2d, nn.Linear)):
                fan_in = mod.weight[0].numel()
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) * (2 / fan_in) ** 0.5)
                if mod.bias is not None:
                    mod.bias.copy_(torch.randn(mod.bias.shape, generator=g) * 0.1)
            elif isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.copy_(torch.randn(mod.num_features, generator=g) * 0.1)
                mod.running_var.copy_(torch.rand(mod.num_features, generator=g) + 0.5)
                mod.weight.copy_(torch.rand(mod.num_features, generator=g) + 0.5)
                mod.bias.copy_(torch.randn(mod.num_features, generator=g) * 0.1)
    return m.eval()
