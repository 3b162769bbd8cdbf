"""Bad input, tried as a user would (issue 11): every case either gives PyTorch's output or
raises one ``MiddlewareError`` whose message names the problem and the fix, and a rejected
call leaves the optimized module as fast as it was.

Outputs are compared with eager PyTorch within rtol 1e-4 and atol 1e-4 times the output's
scale.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import middleware
from middleware.errors import (
    InputMismatchError,
    InputTypeError,
    MiddlewareError,
    UnsupportedError,
)

OPT_RTOL, OPT_ATOL = 1e-4, 1e-4
X = (2, 3, 5, 5)


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.bn.running_mean.uniform_(-1, 1)
        self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x):  # noqa: ANN001, ANN201
        return torch.relu(self.bn(self.conv(x)))


def _same(optimized: nn.Module, model: nn.Module, x: torch.Tensor, tree_close) -> None:
    got = optimized(x)
    with torch.no_grad():
        tree_close(got, model(x), OPT_RTOL, OPT_ATOL)


def _runs_a_plan(optimized: nn.Module, model: nn.Module, tree_close) -> None:
    """After a rejected call the module still compiles and runs plans (no fallback)."""
    _same(optimized, model, torch.randn(*X), tree_close)
    assert optimized.plan is not None
    assert "runs as the original" not in str(optimized.report())


# ------------------------------------------------------------------ rank
def test_wrong_rank_after_first_call_names_the_fix() -> None:
    optimized = middleware.optimize(Small().eval(), example_inputs=torch.randn(*X))
    with pytest.raises(InputMismatchError, match=r"got rank 3 .*x\.unsqueeze\(0\)"):
        optimized(torch.randn(3, 5, 5))


def test_wrong_rank_on_first_call_is_one_clear_error(tree_close) -> None:
    model = Small().eval()
    optimized = middleware.optimize(model)
    with pytest.raises(
        InputMismatchError,
        match=r"Small rejects the input\(s\) \(float32\[3, 5, 5\] on cpu\) in eager PyTorch too: "
        r"ValueError: expected 4D input \(got 3D input\); pass inputs the original model accepts",
    ):
        optimized(torch.randn(3, 5, 5))
    _runs_a_plan(optimized, model, tree_close)  # was: the whole model fell back for good


# ------------------------------------------------------------------ dtype
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.bool])
def test_wrong_dtype_on_first_call(dtype: torch.dtype, tree_close) -> None:
    model = Small().eval()
    optimized = middleware.optimize(model)
    x = torch.randn(*X).to(dtype)
    with pytest.raises(
        InputTypeError,
        match=rf"input 0 is {dtype} but Small's parameters are torch.float32: convert the "
        r"input with x.to\(torch.float32\)",
    ):
        optimized(x)
    _runs_a_plan(optimized, model, tree_close)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.bool])
def test_wrong_dtype_after_first_call_names_the_fix(dtype: torch.dtype) -> None:
    optimized = middleware.optimize(Small().eval(), example_inputs=torch.randn(*X))
    with pytest.raises(
        InputTypeError, match=rf"got {dtype}; .*convert the input with x.to\(torch.float32\)"
    ):
        optimized(torch.randn(*X).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_model_in_another_float_dtype_works(dtype: torch.dtype, tree_close) -> None:
    # bfloat16 has no numpy type: the frontend raised TypeError("Got unsupported ScalarType
    # BFloat16") out of optimize()'s first call; it now runs as the original with the reason
    model = Small().eval().to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _same(middleware.optimize(model), model, torch.randn(*X, dtype=dtype), tree_close)


# ------------------------------------------------------------------ device, layout, size
def test_wrong_device_names_the_fix() -> None:
    lazy = middleware.optimize(Small().eval())
    with pytest.raises(InputTypeError, match=r"on meta .* move the input with \.to\('cpu'\)"):
        lazy(torch.randn(*X, device="meta"))
    compiled = middleware.optimize(Small().eval(), example_inputs=torch.randn(*X))
    with pytest.raises(InputTypeError, match=r"got meta; move the input with \.to\('cpu'\)"):
        compiled(torch.randn(*X, device="meta"))


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(2, 3, 5, 5).transpose(2, 3),
        lambda: torch.randn(2, 3, 5, 10)[..., ::2],
        lambda: torch.randn(*X).contiguous(memory_format=torch.channels_last),
    ],
    ids=["transposed", "strided", "channels_last"],
)
def test_non_contiguous_and_channels_last_inputs_work(make, tree_close) -> None:
    model = Small().eval()
    optimized = middleware.optimize(model, example_inputs=torch.randn(*X))
    _same(optimized, model, make(), tree_close)


def test_zero_size_batch_works(tree_close) -> None:
    model = Small().eval()
    optimized = middleware.optimize(model)
    _same(optimized, model, torch.randn(0, 3, 5, 5), tree_close)
    assert "has no elements" in str(optimized.report())
    _runs_a_plan(optimized, model, tree_close)


# ------------------------------------------------------------------ training mode
def test_model_in_train_mode_gets_a_training_plan() -> None:
    # training plans (runtime/training.py, tests/test_training.py): outputs with autograd
    model = Small().train()
    out = middleware.optimize(model)(torch.randn(*X))
    assert out.requires_grad and model.training


def test_train_after_optimize_switches_to_the_training_plan() -> None:
    # the eval plan computes eval-mode batch-norm: it must not serve a train-mode call
    model = Small().eval()
    x = torch.randn(*X)
    optimized = middleware.optimize(model, example_inputs=x)
    optimized(x)
    model.train()
    assert optimized(x).requires_grad
    model.eval()
    with torch.no_grad():
        assert not optimized(x).requires_grad


class TrainBN(nn.Module):
    """An eval-mode model with one batch-norm left in training mode: forward() updates its
    running statistics and num_batches_tracked."""

    def __init__(self, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4, momentum=momentum)

    def forward(self, x):  # noqa: ANN001, ANN201
        return torch.relu(self.bn(self.conv(x)))


def _three_calls_match(optimized, eager, tree_close) -> None:  # noqa: ANN001
    """Three calls on fresh inputs, each against the eager copy (whose buffers move as the
    model's own do); the fall-back warning is expected and silenced."""
    for _ in range(3):
        x = torch.randn(*X)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = optimized(x)
        with torch.no_grad():
            tree_close(got, eager(x), OPT_RTOL, OPT_ATOL)


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_batch_norm_in_train_mode_inside_an_eval_model_works(momentum, tree_close) -> None:
    model = TrainBN(momentum).eval()
    model.bn.train()
    eager = copy.deepcopy(model)
    optimized = middleware.optimize(model)
    _three_calls_match(optimized, eager, tree_close)
    for name, t in eager.state_dict().items():  # tracing must not move the statistics
        torch.testing.assert_close(model.state_dict()[name], t, msg=name)
    # a submodule in training mode makes the call a training one (batch statistics on the
    # model's own module, as in eager)
    bn_rows = [r for r in optimized.report().rows if r.node == "bn"]
    assert bn_rows and "running statistics updated on its buffers" in bn_rows[0].reason


# ------------------------------------------------------------------ state and outputs
class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):  # noqa: ANN001, ANN201
        self.calls += 1
        return self.conv(x) * self.calls


def test_a_buffer_mutated_in_forward_works(tree_close) -> None:
    model = Counter().eval()
    eager = copy.deepcopy(model)
    optimized = middleware.optimize(model)
    with pytest.warns(UserWarning, match=r"forward\(\) updates calls in place"):
        _same(optimized, eager, torch.randn(*X), tree_close)  # was: conv(x) * 1 forever
    for _ in range(2):
        x = torch.randn(*X)
        with torch.no_grad():
            expected = eager(x)
        tree_close(optimized(x), expected, OPT_RTOL, OPT_ATOL)
    assert float(model.calls) == float(eager.calls) == 3.0
    assert "move the update out of forward()" in str(optimized.report())


def test_a_buffer_mutated_in_forward_raises_under_strict() -> None:
    model = Counter().eval()
    optimized = middleware.optimize(model, strict=True)
    with pytest.raises(UnsupportedError, match=r"forward\(\) updates calls in place"):
        optimized(torch.randn(*X))
    assert float(model.calls) == 0.0, "the trace's own update was undone"


class EMA(nn.Module):
    """A submodule the op catalogue does not know that keeps a running mean in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(()))

    def forward(self, x):  # noqa: ANN001, ANN201
        self.ema.mul_(0.9).add_(0.1 * x.mean())
        return x - self.ema


class WithEMA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = EMA()

    def forward(self, x):  # noqa: ANN001, ANN201
        return torch.relu(self.norm(self.conv(x)))


def test_a_running_mean_buffer_in_an_unknown_submodule_works(tree_close) -> None:
    # it was frozen at 0 in the plan: every output differed from PyTorch's
    model = WithEMA().eval()
    eager = copy.deepcopy(model)
    optimized = middleware.optimize(model)
    _three_calls_match(optimized, eager, tree_close)
    torch.testing.assert_close(model.norm.ema, eager.norm.ema)
    assert "norm.ema" in str(optimized.report())


class Scalar(nn.Module):
    def __init__(self, item: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.item = item

    def forward(self, x):  # noqa: ANN001, ANN201
        s = torch.relu(self.conv(x)).mean()
        return s.item() if self.item else s


@pytest.mark.parametrize("item", [False, True], ids=["0-d tensor", "python float"])
def test_a_model_that_returns_a_scalar_works(item: bool, tree_close) -> None:
    model = Scalar(item).eval()
    optimized = middleware.optimize(model)
    x = torch.randn(*X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = optimized(x)
    with torch.no_grad():
        expected = model(x)
    if item:
        assert isinstance(got, float) and got == pytest.approx(expected, rel=1e-4)
    else:
        tree_close(got, expected, OPT_RTOL, OPT_ATOL)


def test_every_refusal_is_a_middleware_error() -> None:
    optimized = middleware.optimize(Small().eval())
    for bad in (torch.randn(3, 5, 5), torch.randn(*X).double(), torch.randn(*X) > 0):
        with pytest.raises(MiddlewareError):
            optimized(bad)
