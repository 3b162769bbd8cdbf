"""Generated backward of pooling (issue 16): max-pool gradients routed through the
recomputed argmax (``pool_argmax``: PyTorch's first maximum in row-major order, the last
NaN of a window holding one), average pooling's (``count_include_pad``, ``ceil_mode``,
``divisor_override``) and adaptive average pooling's, as the op registry's backward rules
emit them (``op_reductions.py``) and ``passes/autodiff.py`` assembles them.

Each gradient is compared with PyTorch's autograd on the same forward, on random shapes,
strides, paddings, dilations and ``ceil_mode`` in both layouts (hypothesis), with inputs
rounded to a few values (ties in most windows), NaN and infinities; the numpy reference
backend runs the schedule the C kernel runs, and a few cases go through the C compiler.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from net_helpers import nondegenerate
from test_generated_backward import _layout, assert_grads_close, autograd_grads, generated_grads
from test_training import check_training_matches

from middleware.backends.reference import ReferenceBackend
from middleware.backends.x86 import X86Backend
from middleware.enums import RunsAs
from middleware.graph import Graph, Node, TensorType
from middleware.loops import NotFusable
from middleware.ops import get_op, infer_types
from middleware.options import Options
from middleware.passes.autodiff import differentiate


def pool_graph(
    op: str, attrs: dict[str, Any], shape: tuple[int, ...], layout: str, pre: str | None = None
) -> Graph:
    """``x -> [pre] -> op``: one group, the pooling's input computed inside it where
    ``pre`` names an activation (a relu: ties at 0 in the pooled value)."""
    g = Graph()
    g.add_input("x", TensorType(shape, "float32", layout))
    v = "x"
    if pre is not None:
        node = Node("pre", pre, (v,), ("p",), dict(get_op(pre).defaults))
        g.add_node(node, infer_types(g.values, node))
        v = "p"
    node = Node("pool", op, (v,), ("y",), attrs)
    g.add_node(node, infer_types(g.values, node))
    g.set_outputs("y")
    return g


def _valid(op: str, attrs: dict[str, Any], shape: tuple[int, ...]) -> bool:
    """PyTorch accepts the pooling (padding at most half the window, an output)."""
    x = torch.empty(shape, device="meta")
    a = {k: v for k, v in attrs.items() if k not in ("activation", "activation_attrs")}
    try:
        if op in ("max_pool2d", "maxpool_relu"):
            y = F.max_pool2d(x, **a)
        else:
            y = F.avg_pool2d(x, **a)
    except RuntimeError:
        return False
    return y.numel() > 0


def values(kind: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """``ties``: integers in [-2, 2] (most windows tie); ``special``: ties plus NaN and
    infinities spread in; ``random``: normal values."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.randn(shape, generator=gen)
    x = torch.randint(-2, 3, shape, generator=gen).float()
    if kind == "special":
        flat = x.view(-1)
        for i, v in enumerate([math.nan, -math.inf, math.inf, math.nan, -math.inf]):
            flat[(11 * i + seed) % flat.numel()] = v
    return x


# sampled, not drawn as integers: hypothesis shrinks integers towards their least value,
# and most examples would then be 1x1 windows without padding
WINDOW = st.sampled_from([3, 2, 1])
STRIDE = st.sampled_from([2, 1, 3])


def _padding(k: int) -> st.SearchStrategy[int]:
    return st.sampled_from(sorted({k // 2, max(0, k // 2 - 1), 0}, reverse=True))


@st.composite
def max_pools(draw: st.DrawFn) -> tuple[str, dict[str, Any], tuple[int, ...], str | None]:
    k = (draw(WINDOW), draw(WINDOW))
    s = (draw(STRIDE), draw(STRIDE))
    d = (draw(st.sampled_from([1, 1, 2])), draw(st.sampled_from([1, 1, 2])))
    p = (draw(_padding(k[0])), draw(_padding(k[1])))
    attrs: dict[str, Any] = {
        "kernel_size": k,
        "stride": s,
        "padding": p,
        "dilation": d,
        "ceil_mode": draw(st.booleans()),
    }
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)))
    shape += (draw(st.integers(2, 9)), draw(st.integers(2, 9)))
    form = draw(st.sampled_from(["plain", "relu_before", "relu_merged", "relu6_merged"]))
    op, pre = "max_pool2d", "relu" if form == "relu_before" else None
    if form.endswith("merged"):
        op = "maxpool_relu"
        if form == "relu_merged":
            attrs.update(activation="relu", activation_attrs=())
        else:
            attrs.update(
                activation="hardtanh", activation_attrs=(("max_val", 6.0), ("min_val", 0.0))
            )
    return op, attrs, shape, pre


@st.composite
def avg_pools(draw: st.DrawFn) -> tuple[str, dict[str, Any], tuple[int, ...], str | None]:
    k = (draw(st.sampled_from([3, 2, 4, 1])), draw(st.sampled_from([3, 2, 4, 1])))
    attrs: dict[str, Any] = {
        "kernel_size": k,
        "stride": (draw(STRIDE), draw(STRIDE)),
        "padding": (draw(_padding(k[0])), draw(_padding(k[1]))),
        "ceil_mode": draw(st.sampled_from([True, False])),
        "count_include_pad": draw(st.sampled_from([False, True])),
        "divisor_override": draw(st.sampled_from([None, None, None, 1, 7])),
    }
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)))
    shape += (draw(st.integers(2, 9)), draw(st.integers(2, 9)))
    return "avg_pool2d", attrs, shape, draw(st.sampled_from([None, "relu"]))


def check_pool(
    case: tuple[str, dict[str, Any], tuple[int, ...], str | None],
    layout: str,
    kind: str,
    seed: int,
    backend: Any,
    options: Options,
) -> None:
    op, attrs, shape, pre = case
    if not _valid(op, attrs, shape):
        return
    g = pool_graph(op, attrs, shape, layout, pre)
    x = _layout(values(kind, shape, seed), layout)
    gen = torch.Generator().manual_seed(seed + 1)
    gy = _layout(torch.randn(g.values["y"].shape, generator=gen), layout)
    expected = autograd_grads(g, [x], gy)
    try:
        got = generated_grads(g, backend, options, [x], gy)
    except NotFusable as e:  # a dilated window over padding only (PyTorch's index is wrong)
        assert "holds no element of its input" in str(e), e
        return
    if attrs.get("activation") == "hardtanh":
        # ATen's hardtanh backward of a NaN depends on the element's position in its loop
        # (test_generated_backward.NAN_BY_POSITION); the gradient of a window holding a
        # NaN reaches a NaN element, so those elements are not compared
        expected, got = ([t.masked_fill(torch.isnan(x), 0.0) for t in ts] for ts in (expected, got))
    assert_grads_close(got, expected, 1e-5)


LAYOUTS = st.sampled_from(["nchw", "nhwc"])
KINDS = st.sampled_from(["ties", "special", "random"])
SETTINGS = {"deadline": None, "suppress_health_check": list(HealthCheck)}


@settings(max_examples=60, **SETTINGS)
@given(max_pools(), LAYOUTS, KINDS, st.integers(0, 2**16))
def test_max_pool_backward_reference(case, layout: str, kind: str, seed: int) -> None:  # noqa: ANN001
    check_pool(case, layout, kind, seed, ReferenceBackend(), Options())


@settings(max_examples=80, **SETTINGS)
@given(avg_pools(), LAYOUTS, KINDS, st.integers(0, 2**16))
def test_avg_pool_backward_reference(case, layout: str, kind: str, seed: int) -> None:  # noqa: ANN001
    check_pool(case, layout, kind, seed, ReferenceBackend(), Options())


@settings(max_examples=3, **SETTINGS)
@given(st.one_of(max_pools(), avg_pools()), LAYOUTS, KINDS, st.integers(0, 2**16))
def test_pool_backward_c(tmp_path_factory, case, layout: str, kind: str, seed: int) -> None:  # noqa: ANN001
    options = Options(cache_dir=tmp_path_factory.mktemp("kernels"))
    check_pool(case, layout, kind, seed, X86Backend(), options)


@pytest.mark.slow
@settings(max_examples=30, **SETTINGS)
@given(st.one_of(max_pools(), avg_pools()), LAYOUTS, KINDS, st.integers(0, 2**16))
def test_pool_backward_c_more(tmp_path_factory, case, layout: str, kind: str, seed: int) -> None:  # noqa: ANN001
    options = Options(cache_dir=tmp_path_factory.mktemp("kernels"))
    check_pool(case, layout, kind, seed, X86Backend(), options)


TIE_CASES = [
    # (window values, the element PyTorch's gradient reaches)
    ([1.0, 2.0, 0.0, 2.0, 1.0, 0.5, 2.0, 1.0, 1.0], 1),  # first maximum, row-major
    ([1.0, 2.0, math.nan, 2.0, math.nan, 0.5, 2.0, 1.0, 1.0], 4),  # the last NaN
    ([-math.inf] * 9, 0),  # all -inf: the first element
    ([3.0] * 9, 0),
]


@pytest.mark.parametrize(("window", "winner"), TIE_CASES)
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_tie_rule_is_pytorchs(window: list[float], winner: int, layout: str) -> None:
    """One 3x3 window, 16 channels (the vectorised path in channels_last): PyTorch's and
    the generated backward give the whole gradient to the same element."""
    x = torch.tensor(window).view(1, 1, 3, 3).repeat(1, 16, 1, 1)
    x = _layout(x, layout)
    attrs = {"kernel_size": 3, "stride": 1, "padding": 0, "dilation": 1, "ceil_mode": False}
    g = pool_graph("max_pool2d", attrs, (1, 16, 3, 3), layout)
    gy = torch.ones(1, 16, 1, 1)
    (expected,) = autograd_grads(g, [x], gy)
    assert int(expected[0, 0].reshape(-1).argmax()) == winner  # PyTorch's rule, as stated
    (got,) = generated_grads(g, ReferenceBackend(), Options(), [x], gy)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_argmax_reference_is_pytorchs_index() -> None:
    """``pool_argmax``'s reference gives the tap of PyTorch's own index, so its loop
    semantics are compared with PyTorch wherever the reference is."""
    x = torch.randint(-1, 2, (2, 3, 7, 6)).float()
    attrs = {"kernel_size": (3, 2), "stride": 2, "padding": (1, 0), "dilation": (1, 2)}
    attrs["ceil_mode"] = True
    y, idx = F.max_pool2d(x, (3, 2), 2, (1, 0), (1, 2), ceil_mode=True, return_indices=True)
    node = Node("a", "pool_argmax", ("x", "y"), ("t",), attrs)
    taps = get_op("pool_argmax").bind(node)(x, y).long()
    oh = torch.arange(y.shape[2]).view(-1, 1)
    ow = torch.arange(y.shape[3]).view(1, -1)
    ih = oh * 2 - 1 + taps // 2
    iw = ow * 2 + (taps % 2) * 2
    assert torch.equal(ih * 6 + iw, idx)


@pytest.mark.parametrize("act", ["leaky_relu", "elu"])
def test_merged_strictly_monotone_activation_falls_back(act: str) -> None:
    """A max-pool merged with an activation whose float outputs may tie where its inputs
    do not: which came first is not recorded, so no rule (PyTorch recomputes it)."""
    attrs = {"kernel_size": 2, "stride": 2, "padding": 0, "dilation": 1, "ceil_mode": False}
    attrs.update(activation=act, activation_attrs=tuple(sorted(get_op(act).defaults.items())))
    g = pool_graph("maxpool_relu", attrs, (1, 2, 4, 4), "nchw")
    with pytest.raises(NotFusable, match="which came first"):
        differentiate(g, ["pool"], ["x"], "y")


def test_adaptive_avg_pool_to_a_larger_map() -> None:
    """adaptive_avg_pool2d to a map larger than 1x1 (alexnet and vgg16's head on small
    images: 2x2 -> 7x7, 5x3 -> 3x2), both layouts, reference backend."""
    for layout in ("nchw", "nhwc"):
        for shape, size in (((2, 3, 2, 2), (7, 7)), ((1, 2, 5, 3), (3, 2)), ((1, 2, 9, 9), (4, 4))):
            g = pool_graph("adaptive_avg_pool2d", {"output_size": size}, shape, layout, "relu")
            x = _layout(torch.randn(shape), layout)
            gy = _layout(torch.randn(g.values["y"].shape), layout)
            expected = autograd_grads(g, [x], gy)
            got = generated_grads(g, ReferenceBackend(), Options(), [x], gy)
            assert_grads_close(got, expected, 1e-5)


# ------------------------------------------------------------ through optimize()
class Pools(nn.Module):
    """The pooling groups of the torchvision networks: a fire-module concat into a ceil-mode
    max-pool with a ReLU (squeezenet), an inception branch's 3x3/1 average pool and a
    concat into a 3x3/2 max-pool (googlenet, inception_v3), and a head's adaptive pool to
    a larger map (alexnet, vgg16 on small images)."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, c, 3, padding=1)
        self.b = nn.Conv2d(3, c, 1)
        self.c = nn.Conv2d(2 * c, c, 1)
        self.d = nn.Conv2d(3 * c, c, 1)
        self.fc = nn.Linear(c * 16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([F.relu(self.a(x)), F.relu(self.b(x))], 1)
        y = F.max_pool2d(y, 3, 2, ceil_mode=True)
        z = self.c(y)
        z = torch.cat([F.avg_pool2d(z, 3, 1, 1), F.relu(z), torch.sigmoid(z)], 1)
        z = F.max_pool2d(z, 3, 2, 1)
        z = F.adaptive_avg_pool2d(F.relu(self.d(z)), 4)
        return self.fc(z.flatten(1))


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_network_pooling_groups_generate_their_backward(layout: str) -> None:
    model = nondegenerate(Pools()).train()
    x = _layout(torch.randn(2, 3, 11, 13), layout)
    optimized = check_training_matches(model, x, layout=layout)
    rows = [r for r in optimized.report().rows if r.runs_as == RunsAs.GENERATED]
    pooled = [r for r in rows if "pool" in r.node]
    assert pooled, optimized.report().verbose()
    for r in rows:
        assert r.reason.startswith("backward: generated"), (r.node, r.reason)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["squeezenet1_1", "googlenet", "inception_v3", "alexnet"])
def test_torchvision_pooling_networks_gradients(name: str) -> None:
    torchvision = pytest.importorskip("torchvision")
    kw: dict[str, Any] = {"num_classes": 10}
    if name in ("googlenet", "inception_v3"):
        kw.update(aux_logits=False, init_weights=False)
    model = nondegenerate(getattr(torchvision.models, name)(**kw)).train()
    size = 139 if name == "inception_v3" else 64  # 75: 1x1 maps, batch statistics of 2
    optimized = check_training_matches(model, torch.randn(2, 3, size, size))
    (note,) = [n for n in optimized.report().notes if "backward of fused groups" in n]
    assert "PyTorch recompute" not in note, note
