"""Weights held once: a built plan keeps no second copy of a weight its steps hold in their
own form (issue 13's memory half).

A convolution with batch-norm folded into it runs from a prepacked or transformed weight
built from the folded array; once the plan is built, neither the plan's constants nor the
graph hold that folded array (``Plan.held_params``, ``pipeline.release_held_params``). The
user's own tensors are never copied for a constant. Each case compares with eager PyTorch
after the released memory has been handed out again and overwritten, and after weight
updates, new input shapes and a switch to training, which rebuild from the user's model.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import OPT_ATOL, OPT_RTOL, assert_tree_close

import middleware
from middleware.graph import RELEASED_PARAMS

# every conv2d algorithm of backends/vendor/algorithms.py; Winograd's bound (1e-4 of the
# output's scale, tests/test_algorithms.py) is the suite's optimized-module tolerance
# (the two whose C compiles cost most on a cold cache run with the slow tests)
ALGORITHMS = [
    "vendor",
    "winograd_f4x4",
    "im2col_gemm",
    pytest.param("winograd_f2x2", marks=pytest.mark.slow),
    pytest.param("direct", marks=pytest.mark.slow),
]


class _Block(nn.Module):
    """conv-BN-ReLU, a 3x3 residual pair with batch-norms, a 1x1 conv, pool and a linear
    head: folded weights and biases on every kind of convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.c1 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(16)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(16)
        self.proj = nn.Sequential(nn.Conv2d(16, 24, 1), nn.BatchNorm2d(24), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(24, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = torch.relu(y + self.b2(self.c2(torch.relu(self.b1(self.c1(y))))))
        return self.head(self.proj(y))


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = _Block().eval()
    with torch.no_grad():
        for bn in m.modules():
            if isinstance(bn, nn.BatchNorm2d):
                bn.running_mean.normal_()
                bn.running_var.uniform_(0.5, 2.0)
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.normal_()
    return m


def _user_ptrs(model: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}


def _array_ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _scribble() -> list[np.ndarray]:
    """Hand the freed heap memory out again and fill it: a step still reading a released
    array then reads garbage (NaN), not the weight."""
    gc.collect()
    return [np.full(n, np.nan, np.float32) for n in (16, 24, 144, 384, 2304, 2304, 2304) * 40]


def _check(opt: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    with torch.inference_mode():
        assert_tree_close(opt(x), model(x), OPT_RTOL, OPT_ATOL)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_folded_weights_are_held_once(algorithm: str) -> None:
    model = _model()
    torch.manual_seed(1)
    x = torch.randn(2, 3, 12, 12)
    opt = middleware.optimize(
        model,
        example_inputs=[x],
        measure_hardware=False,
        fuse=False,
        algorithms={"conv2d": algorithm},
    )
    rows = [r for r in opt.report().rows if r.op == "conv2d"]
    assert algorithm in {r.algorithm for r in rows}, [(r.algorithm, r.reason) for r in rows]
    users = _user_ptrs(model)
    graph = opt.graph
    # the graph holds no array of its own: what is left is the user's memory
    assert all(_array_ptr(a) in users for a in graph.params.values())
    assert graph.meta.get(RELEASED_PARAMS), "the folded weights left the graph"
    # the plan's constants are the user's tensors only (the folded ones live in the steps)
    consts = opt.plan.param_tensors()
    assert all(t.untyped_storage().data_ptr() in users for t in consts)
    junk = _scribble()
    _check(opt, model, x)
    del junk


def test_a_released_graph_refuses_to_evaluate() -> None:
    model = _model()
    x = torch.randn(1, 3, 8, 8)
    opt = middleware.optimize(model, example_inputs=[x], measure_hardware=False, fuse=False)
    released = opt.graph.meta[RELEASED_PARAMS]
    assert all(opt.graph.is_param(v) for v in released)
    with pytest.raises(RuntimeError, match="released"):
        opt.graph.evaluate(x)
    # a fresh trace holds every weight and evaluates as before
    g = middleware.trace(model, x)
    with torch.no_grad():
        assert_tree_close(g.evaluate(x), model(x), OPT_RTOL, OPT_ATOL)


def test_rebuilds_read_the_users_weights_not_the_released_ones() -> None:
    """Weight updates, a new input shape and training mode all rebuild from the model."""
    model = _model()
    x = torch.randn(2, 3, 12, 12)
    opt = middleware.optimize(model, example_inputs=[x], measure_hardware=False, fuse=False)
    _check(opt, model, x)
    with torch.no_grad():  # folded into the stem's weight: only a rebuild sees it
        model.stem[1].running_var.mul_(3.0)
        model.c1.weight.mul_(-0.5)
    junk = _scribble()
    _check(opt, model, x)
    _check(opt, model, torch.randn(3, 3, 10, 10))  # a new signature traces again
    model.load_state_dict(_model().state_dict())
    _check(opt, model, x)
    opt.train()
    y = opt(x)
    y.sum().backward()
    assert model.c1.weight.grad is not None
    opt.eval()
    with torch.no_grad():
        model.b2.running_mean.add_(0.25)
    _check(opt, model, x)
    del junk


def test_linear_at_many_rows_runs_on_the_users_weight() -> None:
    """From 8 rows a linear layer runs oneDNN's call on the user's own weight (no packed
    copy: calls.LINEAR_RULES; above 16 rows, where the generated product does not run);
    below, the packed copy is the step's own. The generated product (5-16 rows) reads the
    user's own weight too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 5)).eval()
    x = torch.randn(16, 3, 4, 4)
    opt = middleware.optimize(model, example_inputs=[x], measure_hardware=False, fuse=False)
    kept = [t for st in opt.plan.steps if st.fn.__name__ == "linear_gemv" for t in st.fn.keep]
    assert {model[1].weight.data_ptr(), model[3].weight.data_ptr()} <= {
        t.data_ptr() for t in kept if t is not None
    }
    _check(opt, model, x)
    for batch, packed in ((17, False), (4, True)):
        x = torch.randn(batch, 3, 4, 4)
        opt = middleware.optimize(model, example_inputs=[x], measure_hardware=False, fuse=False)
        held = [
            c.cell_contents
            for st in opt.plan.steps
            if st.fn.__name__ == "linear_onednn"
            for c in st.fn.__closure__ or ()
            if isinstance(c.cell_contents, torch.Tensor) and c.cell_contents.dim() == 2
        ]
        assert len(held) == 2
        assert all(t.is_mkldnn for t in held) == packed
        if not packed:
            assert {t.data_ptr() for t in held} == {
                model[1].weight.data_ptr(),
                model[3].weight.data_ptr(),
            }
        _check(opt, model, x)


def test_a_weight_is_released_as_its_call_is_built() -> None:
    """While the pipeline builds a plan (``RELEASE_AS_BUILT``), a folded weight read by one
    layer only is swapped for a stand-in without memory as soon as that layer's call holds
    its own copy; the user's own tensors and weights another node reads stay."""
    from middleware.backends.vendor.algorithms import choose
    from middleware.graph import RELEASE_AS_BUILT
    from middleware.hardware import for_options
    from middleware.options import Options
    from middleware.passes import run_passes

    model = _model()
    x = torch.randn(2, 3, 12, 12)
    options = Options(measure_hardware=False)
    hw = for_options(options)
    g = run_passes(middleware.trace(model, x), options, hw)
    users = _user_ptrs(model)
    derived = {v for v, a in g.params.items() if _array_ptr(a) not in users}
    assert derived, "batch-norm folded into the convolutions"
    g.meta[RELEASE_AS_BUILT] = True
    for n in list(g.nodes()):
        if n.op in ("conv2d", "linear"):
            choose(g, n, torch.device("cpu"), options, hw)
    stood = set(g.released())
    assert stood == derived
    assert all(g.params[v].strides == (0,) * g.params[v].ndim for v in stood)
    assert all(_array_ptr(a) in users for v, a in g.params.items() if v not in stood)
    with pytest.raises(RuntimeError, match="released"):
        g.evaluate(x)


@pytest.mark.parametrize(
    "algorithm", ["winograd_f4x4", pytest.param("winograd_f2x2", marks=pytest.mark.slow)]
)
def test_a_nan_tile_runs_from_the_recovered_folded_weight(algorithm: str) -> None:
    """Winograd does not hold a folded weight beside its transform: a tile whose input
    holds a NaN or an infinity runs the direct convolution from the weight recovered from
    the transform (winograd.DirectWeight), with PyTorch's NaNs and values around them."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16),
        nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),
    ).eval()  # fmt: skip
    with torch.no_grad():
        for bn in (model[1], model[3]):
            bn.running_var.uniform_(0.5, 2.0)
            bn.running_mean.normal_()
    x = torch.randn(2, 16, 12, 12)
    opt = middleware.optimize(
        model, example_inputs=[x], measure_hardware=False, fuse=False,
        algorithms={"conv2d": algorithm},
    )  # fmt: skip
    rows = [r for r in opt.report().rows if r.op == "conv2d"]
    assert algorithm in {r.algorithm for r in rows}, [(r.algorithm, r.reason) for r in rows]
    x[0, 3, 5, 6] = float("nan")
    x[1, 7, 2, 9] = float("nan")
    with torch.inference_mode():
        got, ref = opt(x), model(x)
    assert ref.isnan().any() and ref.isfinite().any()
    torch.testing.assert_close(
        got, ref, rtol=OPT_RTOL, atol=OPT_ATOL * float(ref[ref.isfinite()].abs().max()),
        equal_nan=True,
    )  # fmt: skip
