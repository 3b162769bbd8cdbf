"""Generated backward kernels (issue 16, item 3): the op registry's backward rules
(``OpDef.grad``, ``OpDef.pointwise_grad``), the backward graphs built from them
(``passes/autodiff.py``) and the training plans that run them (``runtime/training.py``).

Every gradient is checked against PyTorch's autograd on the same forward: per activation
on values that include NaN, +-inf, zeros and each formula's break points (the numpy
reference backend runs the same schedule the C kernel runs, so the C compiler is called
only where the x86 code itself is under test); on random elementwise programs over
broadcast shapes in both layouts (hypothesis); and through ``optimize()`` on small
networks, parameters included, with ``report()`` saying which backward each group runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fusion_helpers import hardware
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from net_helpers import nondegenerate
from test_training import check_training_matches

import middleware
from middleware.backends.reference import ReferenceBackend
from middleware.backends.x86 import X86Backend
from middleware.enums import RunsAs
from middleware.graph import Graph, Node, TensorType
from middleware.loops import NotFusable
from middleware.ops import CATALOGUE, get_op, infer_types
from middleware.options import Options
from middleware.passes.autodiff import differentiate, fit
from middleware.runtime.training import RELU_OF_SUM_NOTE, FusedGroup, TrainingPlan

# (op, attrs): every activation with a generated backward, some with two attr sets
ACTIVATIONS: list[tuple[str, dict[str, Any]]] = [
    ("relu", {}),
    ("hardtanh", {"min_val": 0.0, "max_val": 6.0}),
    ("hardtanh", {"min_val": -1.0, "max_val": 0.5}),
    ("leaky_relu", {"negative_slope": 0.1}),
    ("sigmoid", {}),
    ("tanh", {}),
    ("silu", {}),
    ("hardswish", {}),
    ("hardsigmoid", {}),
    ("gelu", {"approximate": "none"}),
    ("gelu", {"approximate": "tanh"}),
    ("elu", {"alpha": 1.3}),
    ("mish", {}),
    ("hardshrink", {"lambd": 0.5}),
    ("sqrt", {}),
    ("rsqrt", {}),
    ("exp", {}),
]
IDS = [f"{op}-{'-'.join(str(v) for v in a.values())}" if a else op for op, a in ACTIVATIONS]
SPECIAL = [math.nan, math.inf, -math.inf, 0.0, -0.0, 3.0, -3.0, 6.0, 0.5, -0.5, 1.0, -1.0]
SPECIAL += [20.0, -20.0, 1e-30, 100.0, -100.0]
# For a NaN input ATen's backward of these gives one value in its vectorised loop and
# another in the scalar loop over a tensor's last elements (op_activations.py): no
# defined semantics to test, so those elements are not compared.
NAN_BY_POSITION = {"hardtanh", "hardswish", "elu", "hardshrink"}


def _defined(op: str, grads: Sequence[torch.Tensor | None], x: torch.Tensor) -> list:
    if op not in NAN_BY_POSITION:
        return list(grads)
    return [None if g is None else g.masked_fill(torch.isnan(x), 0.0) for g in grads]


def special_values(shape: Sequence[int], seed: int = 0, offset: int = 0) -> torch.Tensor:
    """Random values with the special ones (NaN, infinities, break points) spread in,
    from element ``offset`` on."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 3
    flat = x.view(-1)
    for i, v in enumerate(SPECIAL):
        flat[(7 * i + offset) % flat.numel()] = v
    return x


def autograd_grads(
    graph: Graph, xs: Sequence[torch.Tensor], gy: torch.Tensor
) -> list[torch.Tensor | None]:
    """PyTorch's gradients of ``graph``'s inputs (its reference implementations run under
    autograd) for the output gradient ``gy``."""
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    (out,) = [graph.evaluate(*leaves)]
    return list(torch.autograd.grad(out, leaves, gy, allow_unused=True))


def generated_grads(
    graph: Graph,
    backend: Any,
    options: Options,
    xs: Sequence[torch.Tensor],
    gy: torch.Tensor,
) -> list[torch.Tensor | None]:
    """The gradients of ``graph``'s inputs through ``differentiate`` and ``backend``'s
    kernels (the whole graph as one group), as a training plan computes them."""
    names = [n.name for n in graph.nodes()]
    (out,) = graph.output_values()
    b = differentiate(graph, names, graph.inputs, out)
    env = dict(zip(graph.inputs, xs, strict=True))
    env[b.grad_output] = gy
    got: list[torch.Tensor | None] = []
    for g in b.gradients:
        if g is None:
            got.append(None)
            continue
        if not g.nodes:
            r = env[g.value]
        else:
            kernel = backend.build(g.graph, g.nodes, options, hardware())
            assert kernel.outputs == (g.value,)
            r = kernel.fn(*[env[v] for v in kernel.inputs])
        got.append(fit(r, g.fit_to))
    return got


def assert_grads_close(
    got: Sequence[torch.Tensor | None],
    expected: Sequence[torch.Tensor | None],
    rel: float,
    floor: float = 1e-6,
) -> None:
    """Each gradient within ``rel`` of its finite scale (at least ``floor``: a gradient
    that is zero in exact arithmetic, ``x / x``'s, is a difference of rounded terms); NaN
    where PyTorch has NaN, the same infinities."""
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        what = f"input {i}"
        if e is None:
            assert g is None or not g.any(), f"input {i}: PyTorch has no gradient"
            continue
        assert g is not None, f"input {i}: no gradient"
        assert g.shape == e.shape, f"input {i}: shape {tuple(g.shape)} != {tuple(e.shape)}"
        finite = e[torch.isfinite(e)]
        scale = max(float(finite.abs().max()), floor) if finite.numel() else 1.0
        torch.testing.assert_close(
            g,
            e,
            rtol=rel,
            atol=rel * scale,
            equal_nan=True,
            msg=lambda m, what=what: f"{what}: {m}",
        )


def one_op_graph(op: str, attrs: dict[str, Any], shape: Sequence[int], layout: str) -> Graph:
    g = Graph()
    g.add_input("x", TensorType(tuple(shape), "float32", layout))
    node = Node("act", op, ("x",), ("y",), {**get_op(op).defaults, **attrs})
    g.add_node(node, infer_types(g.values, node))
    g.set_outputs("y")
    return g


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "nhwc" and t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    return t


# ------------------------------------------------------------------ the registry's rules
def test_every_pointwise_backward_is_tested() -> None:
    have = {name for name, op in CATALOGUE.items() if op.pointwise_grad is not None}
    assert have == {op for op, _ in ACTIVATIONS}


@pytest.mark.parametrize(("op", "attrs"), ACTIVATIONS, ids=IDS)
def test_reference_is_pytorchs_backward(op: str, attrs: dict[str, Any]) -> None:
    """``pointwise_grad``'s reference (ATen's backward call) is what autograd computes,
    NaN and infinities included."""
    g = one_op_graph(op, attrs, (2, 3, 4, 5), "nchw")
    x = special_values((2, 3, 4, 5))
    gy = torch.randn(2, 3, 4, 5)
    (expected,) = autograd_grads(g, [x], gy)
    node = Node(
        "d", "pointwise_grad", ("x", "gy"), ("dx",), {"of": op, "of_attrs": tuple(attrs.items())}
    )
    got = get_op("pointwise_grad").bind(node)(x, gy)
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(("op", "attrs"), ACTIVATIONS, ids=IDS)
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_backward_formula_matches_autograd(op: str, attrs: dict[str, Any], layout: str) -> None:
    """The loop semantics of ``pointwise_grad`` (the schedule the C kernel runs,
    interpreted in numpy) against autograd, on NaN, infinities and break points; the
    output gradient has NaNs too (a select passes or drops them as PyTorch does)."""
    g = one_op_graph(op, attrs, (2, 3, 4, 5), layout)
    x = _layout(special_values((2, 3, 4, 5)), layout)
    gy = _layout(special_values((2, 3, 4, 5), seed=1, offset=3).clamp(-5, 5), layout)
    expected = _defined(op, autograd_grads(g, [x], gy), x)
    got = _defined(op, generated_grads(g, ReferenceBackend(), Options(), [x], gy), x)
    assert_grads_close(got, expected, 2e-5)


X86_DEFAULT = {"relu", "hardswish", "gelu-tanh"}


@pytest.mark.parametrize(
    ("op", "attrs"),
    [
        pytest.param(op, a, marks=() if i in X86_DEFAULT else pytest.mark.slow, id=i)
        for (op, a), i in zip(ACTIVATIONS, IDS, strict=True)
    ],
)
def test_generated_c_backward_matches_autograd(
    op: str, attrs: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The same through the x86 code generator and the C compiler (NaN included)."""
    g = one_op_graph(op, attrs, (2, 3, 5, 7), "nchw")
    x = special_values((2, 3, 5, 7))
    gy = special_values((2, 3, 5, 7), seed=1, offset=3).clamp(-5, 5)
    options = Options(cache_dir=tmp_path_factory.mktemp("kernels"))
    got = _defined(op, generated_grads(g, X86Backend(), options, [x], gy), x)
    assert_grads_close(got, _defined(op, autograd_grads(g, [x], gy), x), 2e-5)


# ------------------------------------------------------- random elementwise programs
UNARY = [a for a in ACTIVATIONS if a[0] not in ("mish", "elu")] + [
    ("mish", {}),
    ("elu", {"alpha": 1.0}),
]
BINARY = ["add", "sub", "mul", "div"]


@st.composite
def programs(draw: st.DrawFn) -> tuple[Graph, str]:
    """A random elementwise DAG over two or three inputs whose shapes broadcast (some
    lack dims, some have size-1 dims), with scalar operands, alpha and reversed scalars,
    and spatial means (keepdim) that later ops broadcast back (squeeze-excitation)."""
    layout = draw(st.sampled_from(["nchw", "nhwc"]))
    full = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 4)), 3)
    g = Graph()
    values = []
    for i in range(draw(st.integers(2, 3))):
        kind = draw(st.sampled_from(["full", "channel", "trailing", "batch1"]))
        shape = {
            "full": full,
            "channel": (full[0], full[1], 1, 1),
            "trailing": full[2:],
            "batch1": (1, *full[1:]),
        }[kind]
        values.append(
            g.add_input(
                f"x{i}", TensorType(shape, "float32", layout if len(shape) == 4 else "nchw")
            )
        )
    for j in range(draw(st.integers(2, 6))):
        kind = draw(st.sampled_from(["unary", "binary", "scalar", "mean"]))
        attrs: dict[str, Any]
        four_d = [v for v in values if g.values[v].rank == 4]
        if kind == "mean" and four_d:  # a spatial mean, read back by broadcasting ops
            op = draw(st.sampled_from(["mean", "adaptive_avg_pool2d"]))
            ins = (draw(st.sampled_from(four_d)),)
            attrs = {"dims": (2, 3), "keepdim": True} if op == "mean" else {"output_size": (1, 1)}
        elif kind in ("unary", "mean"):
            op, a = draw(st.sampled_from(UNARY))
            ins, attrs = (draw(st.sampled_from(values)),), {**get_op(op).defaults, **a}
        elif kind == "binary":
            op = draw(st.sampled_from(BINARY))
            ins = (draw(st.sampled_from(values)), draw(st.sampled_from(values)))
            attrs = {"alpha": draw(st.sampled_from([1, 2.0, -0.5]))} if op in ("add", "sub") else {}
        else:
            op = draw(st.sampled_from(BINARY))
            ins = (draw(st.sampled_from(values)),)
            attrs = {
                "scalar": draw(st.sampled_from([0.5, -2.0, 3.0])),
                "reverse": draw(st.booleans()),
            }
        node = Node(f"n{j}", op, ins, (f"v{j}",), attrs)
        g.add_node(node, infer_types(g.values, node))
        values.append(f"v{j}")
    # the last value, broadcast to every input's shape by an add of all values read once
    out = values[-1]
    for v in values[:-1]:
        if not g.consumers(v):
            node = Node(f"join_{v}", "add", (out, v), (f"join_{v}_out",), {})
            g.add_node(node, infer_types(g.values, node))
            out = node.outputs[0]
    g.set_outputs(out)
    return g, layout


def _run_program(g: Graph, layout: str, backend: Any, options: Options, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    # inputs away from 0 (div) and gradients non-degenerate
    xs = []
    for v in g.inputs:
        x = torch.randn(g.values[v].shape, generator=gen)
        xs.append(_layout(x.sign() * (x.abs() + 0.5), layout))
    gy = _layout(torch.randn(g.values[g.output_values()[0]].shape, generator=gen), layout)
    try:
        got = generated_grads(g, backend, options, xs, gy)
    except NotFusable as e:  # a gradient that needs a reduction inside the group
        assert "broadcast form" in str(e) or "different broadcast shapes" in str(e), e
        return
    # the floor: the terms of a gradient are the output gradient times local derivatives
    # of order 1 on these inputs (|x| >= 0.5), so a gradient that cancels to near zero
    # carries the rounding of terms of |gy|'s size: with 1e-3 the tolerance came out at
    # 1e-7 |gy|, below one float rounding of |gy| (a CI run: 2.4e-7 against 1.8e-7 allowed
    # on a gradient of scale 1.8e-3, where PyTorch's was 0)
    floor = 1e-2 * float(gy.abs().max())
    assert_grads_close(got, autograd_grads(g, xs, gy), 1e-4, floor)


@pytest.mark.parametrize("backend", [ReferenceBackend(), X86Backend()], ids=["reference", "c"])
@pytest.mark.parametrize(
    "x1_shape,op",
    [((1, 1, 1, 1), "add"), ((2, 3, 1, 1), "add"), ((2, 3, 1, 1), "sub"), ((1, 3, 4, 1), "mul")],
)
def test_an_operand_broadcast_over_a_reduced_dim_sums_its_gradient(
    backend, x1_shape, op, tmp_path
) -> None:  # noqa: ANN001
    """``mean(x0 op x1)`` over the spatial dims with ``x1`` broadcast along them: the
    output gradient reaches ``x1`` once per element it was broadcast to (``x1`` of an add
    gets ``gy``, not ``gy / HW``). Found by the random programs: the gradient's broadcast
    form fitted to ``x1``'s shape summed nothing."""
    g = Graph()
    g.add_input("x0", TensorType((2, 3, 4, 5), "float32", "nchw"))
    g.add_input("x1", TensorType(x1_shape, "float32", "nchw"))
    attrs = {"alpha": -0.5} if op == "sub" else {}
    for node in (
        Node("n0", op, ("x0", "x1"), ("v0",), attrs),
        Node("n1", "mean", ("v0",), ("v1",), {"dims": (2, 3), "keepdim": True}),
        Node("n2", "tanh", ("v1",), ("v2",), {}),
    ):
        g.add_node(node, infer_types(g.values, node))
    g.set_outputs("v2")
    _run_program(g, "nchw", backend, Options(cache_dir=tmp_path), seed=1)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(programs(), st.integers(0, 2**16))
def test_random_programs_backward_reference(case: tuple[Graph, str], seed: int) -> None:
    g, layout = case
    _run_program(g, layout, ReferenceBackend(), Options(), seed)


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(programs(), st.integers(0, 2**16))
def test_random_programs_backward_c(
    tmp_path_factory: pytest.TempPathFactory, case: tuple[Graph, str], seed: int
) -> None:
    g, layout = case
    options = Options(cache_dir=tmp_path_factory.mktemp("kernels"))
    _run_program(g, layout, X86Backend(), options, seed)


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(programs(), st.integers(0, 2**16))
def test_random_programs_backward_c_more(
    tmp_path_factory: pytest.TempPathFactory, case: tuple[Graph, str], seed: int
) -> None:
    g, layout = case
    options = Options(cache_dir=tmp_path_factory.mktemp("kernels"))
    _run_program(g, layout, X86Backend(), options, seed)


# ------------------------------------------------------------ through optimize()
class Residual(nn.Module):
    """conv-BN, a residual add and a ReLU (one group: add -> relu), then a gated chain
    (sigmoid * y + 0.5 -> hardswish, silu) and a per-channel gate from a convolution
    (broadcast input of a group: its gradient is summed down)."""

    def __init__(self, c: int = 6) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.mid = nn.Conv2d(c, c, 1)
        self.gate = nn.Conv2d(c, c, 1)
        self.out = nn.Conv2d(c, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn(self.conv(x)) + x)
        y = self.mid(y)
        y = F.hardswish(torch.sigmoid(y) * y + 0.5) - F.silu(y)
        s = self.gate(F.adaptive_avg_pool2d(y, 1))
        return self.out(F.relu(y * s))


def _backward_rows(optimized: Any) -> dict[str, str]:
    return {r.node: r.reason for r in optimized.report().rows if r.runs_as == RunsAs.GENERATED}


@pytest.mark.parametrize("layout", [pytest.param("nchw", marks=pytest.mark.slow), "nhwc"])
def test_network_gradients_through_generated_backward(layout: str) -> None:
    model = nondegenerate(Residual()).train()
    x = _layout(torch.randn(2, 6, 7, 9), layout)
    optimized = check_training_matches(model, x, layout=layout)
    rows = _backward_rows(optimized)
    for node in ("add", "relu", "sigmoid", "hardswish", "silu", "mul", "relu_1"):
        # a residual add > ReLU group may instead save its output and run ReLU's own
        # backward from it (runtime/training.py, RELU_OF_SUM_NOTE)
        ok = rows[node].startswith("backward: generated") or rows[node] == RELU_OF_SUM_NOTE
        assert ok, (node, optimized.report().verbose())
    plan = optimized.plan
    assert isinstance(plan, TrainingPlan)
    groups = [st.fn for st in plan.steps if isinstance(st.fn, FusedGroup)]
    assert groups and all(g.backward is not None or g.relu_of_sum for g in groups)


class Inputs(nn.Module):
    """Groups over the model's inputs themselves (no convolution to spread a NaN)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.relu(x + y) * y) + F.hardsigmoid(x) * 0.5


def test_nan_and_infinity_inputs_through_optimize() -> None:
    """NaN, infinities and break points in the inputs: the generated backward gives
    PyTorch's gradients element by element (NaN where PyTorch has NaN)."""
    model = Inputs().train()
    optimized = middleware.optimize(model, layout="nchw")
    x, y = special_values((2, 3, 4, 5)), special_values((2, 3, 4, 5), seed=3, offset=2)
    grads = []
    for m in (optimized, model):
        xs = [x.clone().requires_grad_(), y.clone().requires_grad_()]
        out = m(*xs)
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
        grads.append([t.grad for t in xs])
    assert_grads_close(grads[0], grads[1], 1e-5)
    rows = _backward_rows(optimized)
    assert rows and all(r.startswith("backward: generated") for r in rows.values()), rows


class SqueezeExcite(nn.Module):
    """sigmoid of a per-channel value times a map (a squeeze-excitation gate)."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.fc = nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        s = self.fc(F.adaptive_avg_pool2d(y, 1))
        return self.conv(torch.sigmoid(s) * y)


def test_broadcast_intermediate_gradient_is_summed_at_the_end() -> None:
    """A per-channel sigmoid times a map: the sigmoid's input gradient is a sum over the
    map, taken after the generated kernel (the gradient stays expanded through it)."""
    model = nondegenerate(SqueezeExcite()).train()
    optimized = check_training_matches(model, torch.randn(2, 4, 6, 6), layout="nchw")
    rows = _backward_rows(optimized)
    assert rows, optimized.report().verbose()
    assert all(r.startswith("backward: generated") for r in rows.values()), rows


class Head(nn.Module):
    """A classifier head: gated ReLU, global average pooling, flatten (one group whose
    input gradient is (N, C, 1, 1) broadcast over the map), and a spatial mean."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.fc = nn.Linear(c, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        pooled = torch.flatten(F.adaptive_avg_pool2d(F.relu(y) * 2.0, 1), 1)
        return self.fc(pooled) + self.fc(F.silu(y).mean((2, 3)))


def test_pooling_head_gradients_through_generated_backward() -> None:
    model = nondegenerate(Head()).train()
    optimized = check_training_matches(model, torch.randn(2, 4, 5, 6), layout="nchw")
    rows = _backward_rows(optimized)
    assert {"adaptive_avg_pool2d", "flatten", "mean"} <= set(rows), optimized.report().verbose()
    assert all(r.startswith("backward: generated") for r in rows.values()), rows


class Fire(nn.Module):
    """squeezenet's fire module: two activations concatenated along the channels (the
    concat's gradient: each input's channels of the output gradient, ``narrow``)."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.a = nn.Conv2d(c, 3, 1)
        self.b = nn.Conv2d(c, 5, 3, padding=1)
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([F.relu(self.a(x)), F.silu(self.b(x)) * 1.5], 1))


@pytest.mark.parametrize("layout", ["nhwc", pytest.param("nchw", marks=pytest.mark.slow)])
def test_concat_gradients_through_generated_backward(layout: str) -> None:
    model = nondegenerate(Fire()).train()
    x = _layout(torch.randn(2, 4, 5, 7), layout)
    optimized = check_training_matches(model, x, layout=layout)
    rows = _backward_rows(optimized)
    assert "cat" in rows, optimized.report().verbose()
    assert all(r.startswith("backward: generated") for r in rows.values()), rows


class PoolAfterRelu(nn.Module):
    """ReLU then adaptive max-pooling in one group: adaptive max-pooling has no backward
    rule, so the group's backward recomputes through PyTorch (max-pooling's rule:
    tests/test_backward_pooling.py)."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.conv(F.adaptive_max_pool2d(F.relu(y) * y, 3))


def test_a_group_without_backward_rules_keeps_the_pytorch_backward() -> None:
    model = nondegenerate(PoolAfterRelu()).train()
    optimized = check_training_matches(model, torch.randn(2, 4, 6, 6), layout="nchw")
    rows = _backward_rows(optimized)
    assert rows, optimized.report().verbose()
    for r in rows.values():
        assert "PyTorch recompute" in r and "adaptive_max_pool2d has no backward rule" in r, rows
