"""Every catalogue op against PyTorch, lowered from every spelling the frontend supports.

Each case is a tiny model that calls one op one way (module, ``F.*``, ``torch.*``, tensor
method, in-place variant) on seeded random inputs with odd shapes. For each case:
- ``middleware.trace`` lowers it to the expected catalogue op with no fallback node;
- ``infer_types`` (the catalogue's shape rule) gives exactly the types the real run produced;
- the reference interpreter (``Graph.evaluate``) matches eager PyTorch
  (rtol 1e-5, atol 1e-6 times the output's scale);
- ``middleware.optimize`` run on *fresh* inputs of the same shape matches eager PyTorch
  (rtol 1e-4, atol 1e-4 times the output's scale).
Ops that no frontend spelling produces (``maxpool_relu``, the fused post-op attributes of
``conv2d`` and ``linear``) are checked on hand-built graphs at the end.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import middleware
from middleware.graph import Graph, Node, TensorType
from middleware.ops import CATALOGUE, infer_types
from middleware.options import Options
from middleware.pipeline import compile_graph

EVAL_RTOL, EVAL_ATOL = 1e-5, 1e-6
OPT_RTOL, OPT_ATOL = 1e-4, 1e-4


class _Fn1(nn.Module):
    """A one-input model whose forward is ``fn(self, x)``."""

    def __init__(self, fn: Callable[..., Any], **tensors: torch.Tensor) -> None:
        super().__init__()
        self.fn = fn
        for k, v in tensors.items():
            self.register_parameter(k, nn.Parameter(v, requires_grad=False))

    def forward(self, x):  # noqa: ANN001, ANN201 - fx-traced test model
        return self.fn(self, x)


class _Fn2(_Fn1):
    """A two-input model whose forward is ``fn(self, x, y)``."""

    def forward(self, x, y):  # noqa: ANN001, ANN201 - fx-traced test model
        return self.fn(self, x, y)


def Fn(fn: Callable[..., Any], n_inputs: int = 1, **tensors: torch.Tensor) -> nn.Module:  # noqa: N802
    """A model calling ``fn(model, *inputs)``; keyword tensors become its parameters."""
    return (_Fn1 if n_inputs == 1 else _Fn2)(fn, **tensors)


def seq(*mods: nn.Module) -> nn.Module:
    """Module spellings go through ``nn.Sequential`` so that fx sees a ``call_module``."""
    return nn.Sequential(*mods)


def f1(fn: Callable[..., Any], **tensors: torch.Tensor) -> Fn:
    """A one-input model calling ``fn(x)``."""
    return Fn(lambda m, x: fn(x), 1, **tensors)


def f2(fn: Callable[..., Any]) -> Fn:
    """A two-input model calling ``fn(x, y)``."""
    return Fn(lambda m, x, y: fn(x, y), 2)


def inplace(method: str, *args: Any, **kwargs: Any) -> Fn:
    """``y = x.clone(); y.<method>(*args); return y``: an in-place spelling on an
    intermediate value (so the eager reference never mutates the test's input)."""

    def fn(m, x):
        y = x.clone()
        getattr(y, method)(*args, **kwargs)
        return y

    return Fn(fn, 1)


def inplace2(method: str, **kwargs: Any) -> Fn:
    def fn(m, x, y):
        a = x.clone()
        getattr(a, method)(y, **kwargs)
        return a

    return Fn(fn, 2)


def augmented(op: Callable[[Any, Any], Any]) -> Fn:
    """``a = x.clone(); a op= y; return a`` (operator.iadd & co)."""

    def fn(m, x, y):
        a = x.clone()
        a = op(a, y)
        return a

    return Fn(fn, 2)


def bn2d(c: int, affine: bool = True) -> nn.BatchNorm2d:
    m = nn.BatchNorm2d(c, eps=1e-3, affine=affine)
    m.running_mean.uniform_(-1, 1)
    m.running_var.uniform_(0.5, 2)
    if affine:
        nn.init.uniform_(m.weight, 0.5, 1.5)
        nn.init.uniform_(m.bias, -0.5, 0.5)
    return m.eval()


def bn1d(c: int) -> nn.BatchNorm1d:
    m = nn.BatchNorm1d(c)
    m.running_mean.uniform_(-1, 1)
    m.running_var.uniform_(0.5, 2)
    nn.init.uniform_(m.weight, 0.5, 1.5)
    return m.eval()


# (test id, expected op, model factory, input shapes; a trailing "pos" asks for positive values)
Case = tuple[str, str, Callable[[], nn.Module], Sequence[tuple[int, ...]]]

X = (3, 5, 7, 9)
C = (1, 5, 1, 1)  # per-channel broadcast operand for X
P = (3, 5, 7, 9, "pos")  # X with values in [0.5, 2] (divisors)

CASES: list[Case] = [
    # ------------------------------------------------------------------ conv2d
    ("conv-module-odd", "conv2d", lambda: seq(nn.Conv2d(5, 7, 3)), [X]),
    ("conv-module-stride-pad", "conv2d", lambda: seq(nn.Conv2d(5, 7, 3, 2, 1)), [X]),
    ("conv-module-asym", "conv2d", lambda: seq(nn.Conv2d(5, 3, (3, 1), (2, 1), (0, 2))), [X]),
    ("conv-module-dilation", "conv2d", lambda: seq(nn.Conv2d(5, 7, 3, padding=2, dilation=2)), [X]),
    (
        "conv-module-groups",
        "conv2d",
        lambda: seq(nn.Conv2d(6, 9, 3, padding=1, groups=3)),
        [(2, 6, 5, 7)],
    ),
    ("conv-module-depthwise", "conv2d", lambda: seq(nn.Conv2d(5, 5, 3, 2, 1, groups=5)), [X]),
    (
        "conv-module-depthwise-mult",
        "conv2d",
        lambda: seq(nn.Conv2d(5, 10, 5, 1, 2, groups=5, bias=False)),
        [X],
    ),
    (
        "conv-module-1x1-spatial",
        "conv2d",
        lambda: seq(nn.Conv2d(5, 7, 3, padding=1)),
        [(2, 5, 1, 1)],
    ),
    (
        "conv-module-2x2-spatial",
        "conv2d",
        lambda: seq(nn.Conv2d(5, 7, 1, bias=False)),
        [(2, 5, 2, 2)],
    ),
    (
        "conv-module-same",
        "conv2d",
        lambda: seq(nn.Conv2d(5, 7, 5, padding="same", dilation=2)),
        [X],
    ),
    ("conv-module-valid", "conv2d", lambda: seq(nn.Conv2d(5, 7, 3, padding="valid")), [X]),
    (
        "conv-F",
        "conv2d",
        lambda: Fn(
            lambda m, x: F.conv2d(x, m.w, m.b, stride=2, padding=1, dilation=1),
            w=torch.randn(7, 5, 3, 3),
            b=torch.randn(7),
        ),
        [X],
    ),
    (
        "conv-F-same-groups",
        "conv2d",
        lambda: Fn(lambda m, x: F.conv2d(x, m.w, None, 1, "same", 1, 5), w=torch.randn(5, 1, 3, 3)),
        [X],
    ),
    (
        "conv-torch",
        "conv2d",
        lambda: Fn(
            lambda m, x: torch.conv2d(x, m.w, m.b, 1, 2, 2),
            w=torch.randn(4, 5, 3, 3),
            b=torch.randn(4),
        ),
        [X],
    ),
    # ------------------------------------------------------------------ linear
    ("linear-module", "linear", lambda: seq(nn.Linear(9, 13)), [(3, 9)]),
    ("linear-module-3d-nobias", "linear", lambda: seq(nn.Linear(9, 5, bias=False)), [(3, 7, 9)]),
    (
        "linear-F",
        "linear",
        lambda: Fn(lambda m, x: F.linear(x, m.w, m.b), w=torch.randn(6, 9), b=torch.randn(6)),
        [(1, 9)],
    ),
    ("linear-F-4d", "linear", lambda: Fn(lambda m, x: F.linear(x, m.w), w=torch.randn(6, 9)), [X]),
    # ------------------------------------------------------------------ matmul
    ("matmul-torch", "matmul", lambda: f2(torch.matmul), [(3, 5, 7), (3, 7, 2)]),
    ("matmul-operator", "matmul", lambda: f2(operator.matmul), [(5, 7), (7, 3)]),
    (
        "matmul-method-broadcast",
        "matmul",
        lambda: Fn(lambda m, x, y: x.matmul(y), 2),
        [(2, 3, 5, 7), (7, 4)],
    ),
    ("matmul-mm", "matmul", lambda: f2(torch.mm), [(5, 7), (7, 3)]),
    ("matmul-bmm", "matmul", lambda: f2(torch.bmm), [(3, 5, 7), (3, 7, 2)]),
    ("matmul-mm-method", "matmul", lambda: Fn(lambda m, x, y: x.mm(y), 2), [(5, 7), (7, 3)]),
    (
        "matmul-bmm-method",
        "matmul",
        lambda: Fn(lambda m, x, y: x.bmm(y), 2),
        [(3, 5, 7), (3, 7, 2)],
    ),
    ("matmul-param", "matmul", lambda: Fn(lambda m, x: x @ m.w, w=torch.randn(9, 4)), [X]),
    # -------------------------------------------------------------- batch_norm
    ("bn-module", "batch_norm", lambda: seq(bn2d(5)), [X]),
    ("bn-module-noaffine", "batch_norm", lambda: seq(bn2d(5, affine=False)), [(1, 5, 1, 1)]),
    ("bn1d-module-2d", "batch_norm", lambda: seq(bn1d(9)), [(3, 9)]),
    ("bn1d-module-3d", "batch_norm", lambda: seq(bn1d(5)), [(3, 5, 7)]),
    (
        "bn-F",
        "batch_norm",
        lambda: Fn(
            lambda m, x: F.batch_norm(x, m.mu, m.var, m.w, m.b, False, 0.1, 1e-4),
            mu=torch.randn(5),
            var=torch.rand(5) + 0.5,
            w=torch.randn(5),
            b=torch.randn(5),
        ),
        [X],
    ),
    (
        "bn-F-noweight",
        "batch_norm",
        lambda: Fn(
            lambda m, x: F.batch_norm(x, m.mu, m.var), mu=torch.randn(5), var=torch.rand(5) + 0.5
        ),
        [X],
    ),
    # -------------------------------------------------------------------- relu
    ("relu-module", "relu", lambda: seq(nn.ReLU()), [X]),
    ("relu-module-inplace", "relu", lambda: seq(nn.Identity(), nn.ReLU(inplace=True)), [X]),
    ("relu-F", "relu", lambda: f1(F.relu), [X]),
    ("relu-F-inplace", "relu", lambda: Fn(lambda m, x: F.relu(x.clone(), inplace=True)), [X]),
    ("relu-F_", "relu", lambda: Fn(lambda m, x: F.relu_(x.clone())), [X]),
    ("relu-torch", "relu", lambda: f1(torch.relu), [X]),
    ("relu-torch_", "relu", lambda: Fn(lambda m, x: torch.relu_(x.clone())), [X]),
    ("relu-method", "relu", lambda: Fn(lambda m, x: x.relu()), [X]),
    ("relu-method_", "relu", lambda: inplace("relu_"), [X]),
    # ---------------------------------------------------------------- hardtanh
    ("relu6-module", "hardtanh", lambda: seq(nn.ReLU6()), [X]),
    ("relu6-module-inplace", "hardtanh", lambda: seq(nn.Identity(), nn.ReLU6(inplace=True)), [X]),
    ("relu6-F", "hardtanh", lambda: Fn(lambda m, x: F.relu6(x * 4)), [X]),
    ("relu6-F-inplace", "hardtanh", lambda: Fn(lambda m, x: F.relu6(x * 4, inplace=True)), [X]),
    ("hardtanh-module", "hardtanh", lambda: seq(nn.Hardtanh(-2.0, 0.5)), [X]),
    ("hardtanh-F", "hardtanh", lambda: Fn(lambda m, x: F.hardtanh(x, -0.5, 0.7)), [X]),
    (
        "hardtanh-F-inplace",
        "hardtanh",
        lambda: Fn(lambda m, x: F.hardtanh(x.clone(), inplace=True)),
        [X],
    ),
    # -------------------------------------------------------------- leaky_relu
    ("leaky-module", "leaky_relu", lambda: seq(nn.LeakyReLU(0.2)), [X]),
    (
        "leaky-module-inplace",
        "leaky_relu",
        lambda: seq(nn.Identity(), nn.LeakyReLU(inplace=True)),
        [X],
    ),
    (
        "leaky-F-inplace",
        "leaky_relu",
        lambda: Fn(lambda m, x: F.leaky_relu(x.clone(), 0.3, True)),
        [X],
    ),
    ("leaky-F-default", "leaky_relu", lambda: f1(F.leaky_relu), [X]),
    (
        "leaky-F-slope",
        "leaky_relu",
        lambda: Fn(lambda m, x: F.leaky_relu(x, negative_slope=1.5)),
        [X],
    ),
    # --------------------------------------------------------- other activations
    ("sigmoid-module", "sigmoid", lambda: seq(nn.Sigmoid()), [X]),
    ("sigmoid-torch", "sigmoid", lambda: f1(torch.sigmoid), [X]),
    ("sigmoid-F", "sigmoid", lambda: f1(F.sigmoid), [X]),
    ("sigmoid-method", "sigmoid", lambda: Fn(lambda m, x: x.sigmoid()), [X]),
    ("sigmoid-method_", "sigmoid", lambda: inplace("sigmoid_"), [X]),
    ("tanh-module", "tanh", lambda: seq(nn.Tanh()), [X]),
    ("tanh-torch", "tanh", lambda: f1(torch.tanh), [X]),
    ("tanh-F", "tanh", lambda: f1(F.tanh), [X]),
    ("tanh-method", "tanh", lambda: Fn(lambda m, x: x.tanh()), [X]),
    ("tanh-method_", "tanh", lambda: inplace("tanh_"), [X]),
    # on positive values (x * x + 0.5); NaN below 0 is tests/test_layer_norm_fusion.py's
    ("sqrt-torch", "sqrt", lambda: Fn(lambda m, x: torch.sqrt(x * x + 0.5)), [X]),
    ("sqrt-method", "sqrt", lambda: Fn(lambda m, x: (x * x + 0.5).sqrt()), [X]),
    ("sqrt-method_", "sqrt", lambda: Fn(lambda m, x: (x * x + 0.5).sqrt_()), [X]),
    ("rsqrt-torch", "rsqrt", lambda: Fn(lambda m, x: torch.rsqrt(x * x + 0.5)), [X]),
    ("rsqrt-method", "rsqrt", lambda: Fn(lambda m, x: (x * x + 0.5).rsqrt()), [X]),
    ("rsqrt-method_", "rsqrt", lambda: Fn(lambda m, x: (x * x + 0.5).rsqrt_()), [X]),
    ("exp-torch", "exp", lambda: Fn(lambda m, x: torch.exp(x)), [X]),
    ("exp-method", "exp", lambda: Fn(lambda m, x: x.exp()), [X]),
    ("exp-method_", "exp", lambda: Fn(lambda m, x: (x * 1.0).exp_()), [X]),
    ("silu-module", "silu", lambda: seq(nn.SiLU()), [X]),
    ("silu-module-inplace", "silu", lambda: seq(nn.Identity(), nn.SiLU(inplace=True)), [X]),
    ("silu-F", "silu", lambda: f1(F.silu), [X]),
    ("silu-F-inplace", "silu", lambda: Fn(lambda m, x: F.silu(x.clone(), inplace=True)), [X]),
    ("hardswish-module", "hardswish", lambda: seq(nn.Hardswish()), [X]),
    ("hardswish-F", "hardswish", lambda: Fn(lambda m, x: F.hardswish(x * 4)), [X]),
    (
        "hardswish-F-inplace",
        "hardswish",
        lambda: Fn(lambda m, x: F.hardswish(x * 4, inplace=True)),
        [X],
    ),
    ("hardsigmoid-module", "hardsigmoid", lambda: seq(nn.Hardsigmoid(inplace=True)), [X]),
    ("hardsigmoid-F", "hardsigmoid", lambda: Fn(lambda m, x: F.hardsigmoid(x * 4)), [X]),
    (
        "hardsigmoid-F-inplace",
        "hardsigmoid",
        lambda: Fn(lambda m, x: F.hardsigmoid(x * 4, True)),
        [X],
    ),
    # -------------------------------------------------------------- hardshrink
    ("hardshrink-module", "hardshrink", lambda: seq(nn.Hardshrink()), [X]),
    ("hardshrink-module-lambd", "hardshrink", lambda: seq(nn.Hardshrink(1.2)), [X]),
    ("hardshrink-F", "hardshrink", lambda: f1(F.hardshrink), [X]),
    ("hardshrink-F-lambd", "hardshrink", lambda: Fn(lambda m, x: F.hardshrink(x, 0.2)), [X]),
    # -------------------------------------------------------------------- mish
    ("mish-module", "mish", lambda: seq(nn.Mish()), [X]),
    ("mish-module-inplace", "mish", lambda: seq(nn.Conv2d(5, 4, 3), nn.Mish(inplace=True)), [X]),
    ("mish-F", "mish", lambda: Fn(lambda m, x: F.mish(x * 4)), [X]),
    # --------------------------------------------------------------------- elu
    ("elu-module", "elu", lambda: seq(nn.ELU()), [X]),
    ("elu-module-alpha", "elu", lambda: seq(nn.ELU(alpha=0.3)), [X]),
    ("elu-module-inplace", "elu", lambda: seq(nn.Conv2d(5, 4, 3), nn.ELU(inplace=True)), [X]),
    ("elu-F", "elu", lambda: f1(F.elu), [X]),
    ("elu-F-alpha", "elu", lambda: Fn(lambda m, x: F.elu(x * 3, alpha=2.5)), [X]),
    ("gelu-module", "gelu", lambda: seq(nn.GELU()), [X]),
    ("gelu-module-tanh", "gelu", lambda: seq(nn.GELU(approximate="tanh")), [X]),
    ("gelu-F", "gelu", lambda: f1(F.gelu), [X]),
    ("gelu-F-tanh", "gelu", lambda: Fn(lambda m, x: F.gelu(x, approximate="tanh")), [X]),
    # ---------------------------------------------------------------- softmax
    ("softmax-module", "softmax", lambda: seq(nn.Softmax(dim=1)), [X]),
    ("softmax-module-neg", "softmax", lambda: seq(nn.Softmax(-1)), [(3, 7)]),
    ("softmax-F", "softmax", lambda: Fn(lambda m, x: F.softmax(x, 1)), [X]),
    ("softmax-F-kw", "softmax", lambda: Fn(lambda m, x: F.softmax(x, dim=-1)), [X]),
    ("softmax-torch", "softmax", lambda: Fn(lambda m, x: torch.softmax(x, 2)), [X]),
    ("softmax-method", "softmax", lambda: Fn(lambda m, x: x.softmax(dim=-2)), [X]),
    ("log_softmax-module", "log_softmax", lambda: seq(nn.LogSoftmax(dim=1)), [(3, 7)]),
    ("log_softmax-F", "log_softmax", lambda: Fn(lambda m, x: F.log_softmax(x, dim=-1)), [X]),
    ("log_softmax-torch", "log_softmax", lambda: Fn(lambda m, x: torch.log_softmax(x, 1)), [X]),
    ("log_softmax-method", "log_softmax", lambda: Fn(lambda m, x: x.log_softmax(1)), [X]),
    # ------------------------------------------------------------- max_pool2d
    ("maxpool-module", "max_pool2d", lambda: seq(nn.MaxPool2d(3, 2, 1)), [X]),
    ("maxpool-module-ceil", "max_pool2d", lambda: seq(nn.MaxPool2d(3, 2, ceil_mode=True)), [X]),
    (
        "maxpool-module-ceil-pad",
        "max_pool2d",
        lambda: seq(nn.MaxPool2d(2, 2, 1, ceil_mode=True)),
        [X],
    ),
    ("maxpool-module-dilation", "max_pool2d", lambda: seq(nn.MaxPool2d(3, 1, 1, dilation=2)), [X]),
    ("maxpool-module-asym", "max_pool2d", lambda: seq(nn.MaxPool2d((3, 1), (1, 2), (1, 0))), [X]),
    ("maxpool-module-1x1-input", "max_pool2d", lambda: seq(nn.MaxPool2d(3, 2, 1)), [(2, 5, 1, 1)]),
    (
        "maxpool-module-2x2-ceil",
        "max_pool2d",
        lambda: seq(nn.MaxPool2d(3, 2, ceil_mode=True)),
        [(2, 5, 2, 2)],
    ),
    ("maxpool-module-window-eq-input", "max_pool2d", lambda: seq(nn.MaxPool2d((7, 9))), [X]),
    ("maxpool-F", "max_pool2d", lambda: Fn(lambda m, x: F.max_pool2d(x, 2)), [X]),
    (
        "maxpool-F-kw",
        "max_pool2d",
        lambda: Fn(
            lambda m, x: F.max_pool2d(x, kernel_size=3, stride=2, padding=1, ceil_mode=True)
        ),
        [X],
    ),
    (
        "maxpool-torch",
        "max_pool2d",
        lambda: Fn(lambda m, x: torch.max_pool2d(x, 3, 1, 1, 1, True)),
        [X],
    ),
    # ------------------------------------------------------------- avg_pool2d
    ("avgpool-module", "avg_pool2d", lambda: seq(nn.AvgPool2d(3, 2, 1)), [X]),
    (
        "avgpool-module-nopadcount",
        "avg_pool2d",
        lambda: seq(nn.AvgPool2d(3, 2, 1, count_include_pad=False)),
        [X],
    ),
    (
        "avgpool-module-ceil-pad",
        "avg_pool2d",
        lambda: seq(nn.AvgPool2d(2, 2, 1, ceil_mode=True)),
        [X],
    ),
    (
        "avgpool-module-ceil-nopadcount",
        "avg_pool2d",
        lambda: seq(nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False)),
        [X],
    ),
    (
        "avgpool-module-divisor",
        "avg_pool2d",
        lambda: seq(nn.AvgPool2d(3, 1, 1, divisor_override=2)),
        [X],
    ),
    ("avgpool-module-1x1-input", "avg_pool2d", lambda: seq(nn.AvgPool2d(3, 1, 1)), [(2, 5, 1, 1)]),
    (
        "avgpool-module-2x2-ceil",
        "avg_pool2d",
        lambda: seq(nn.AvgPool2d(3, 2, ceil_mode=True)),
        [(2, 5, 2, 2)],
    ),
    ("avgpool-F", "avg_pool2d", lambda: Fn(lambda m, x: F.avg_pool2d(x, (2, 3))), [X]),
    (
        "avgpool-F-kw",
        "avg_pool2d",
        lambda: Fn(
            lambda m, x: F.avg_pool2d(
                x,
                3,
                stride=2,
                padding=1,
                ceil_mode=True,
                count_include_pad=True,
                divisor_override=5,
            )
        ),
        [X],
    ),
    # ------------------------------------------------------------ adaptive pools
    (
        "adaptive-avg-module-1",
        "adaptive_avg_pool2d",
        lambda: seq(nn.AdaptiveAvgPool2d((1, 1))),
        [X],
    ),
    ("adaptive-avg-module-int", "adaptive_avg_pool2d", lambda: seq(nn.AdaptiveAvgPool2d(3)), [X]),
    (
        "adaptive-avg-module-none",
        "adaptive_avg_pool2d",
        lambda: seq(nn.AdaptiveAvgPool2d((4, None))),
        [X],
    ),
    (
        "adaptive-avg-module-grow",
        "adaptive_avg_pool2d",
        lambda: seq(nn.AdaptiveAvgPool2d((5, 7))),
        [(2, 5, 2, 3)],
    ),
    (
        "adaptive-avg-F",
        "adaptive_avg_pool2d",
        lambda: Fn(lambda m, x: F.adaptive_avg_pool2d(x, 1)),
        [X],
    ),
    ("adaptive-max-module", "adaptive_max_pool2d", lambda: seq(nn.AdaptiveMaxPool2d((2, 3))), [X]),
    (
        "adaptive-max-F",
        "adaptive_max_pool2d",
        lambda: Fn(lambda m, x: F.adaptive_max_pool2d(x, (1, 1))),
        [X],
    ),
    # ------------------------------------------------------------------- mean
    ("mean-method-spatial", "mean", lambda: Fn(lambda m, x: x.mean((2, 3))), [X]),
    ("mean-method-keepdim", "mean", lambda: Fn(lambda m, x: x.mean([2, 3], keepdim=True)), [X]),
    ("mean-torch-neg", "mean", lambda: Fn(lambda m, x: torch.mean(x, dim=(-1, -2))), [X]),
    ("mean-method-all", "mean", lambda: Fn(lambda m, x: x.mean()), [X]),
    ("mean-method-one", "mean", lambda: Fn(lambda m, x: x.mean(1)), [X]),
    # ----------------------------------------------------------------- sum/amax
    ("sum-method-last", "sum", lambda: Fn(lambda m, x: x.sum(-1, keepdim=True)), [X]),
    ("sum-torch-spatial", "sum", lambda: Fn(lambda m, x: torch.sum(x, (2, 3))), [X]),
    ("sum-method-all", "sum", lambda: Fn(lambda m, x: x.sum()), [X]),
    ("sum-method-one", "sum", lambda: Fn(lambda m, x: x.sum(dim=1)), [X]),
    ("amax-method-last", "amax", lambda: Fn(lambda m, x: x.amax(-1, keepdim=True)), [X]),
    ("amax-torch-spatial", "amax", lambda: Fn(lambda m, x: torch.amax(x, dim=(2, 3))), [X]),
    ("amax-method-all", "amax", lambda: Fn(lambda m, x: x.amax()), [X]),
    # ------------------------------------------------------------ add/sub/mul/div
    ("add-operator", "add", lambda: f2(operator.add), [X, X]),
    ("add-operator-channel", "add", lambda: f2(operator.add), [X, C]),
    ("add-operator-channel-left", "add", lambda: f2(operator.add), [C, X]),
    ("add-param-channel", "add", lambda: Fn(lambda m, x: x + m.b, b=torch.randn(1, 5, 1, 1)), [X]),
    ("add-scalar-right", "add", lambda: Fn(lambda m, x: x + 2), [X]),
    ("add-scalar-left", "add", lambda: Fn(lambda m, x: 2.5 + x), [X]),
    ("add-torch-alpha", "add", lambda: Fn(lambda m, x, y: torch.add(x, y, alpha=2), 2), [X, C]),
    ("add-torch-scalar-alpha", "add", lambda: Fn(lambda m, x: torch.add(x, 3, alpha=-0.5)), [X]),
    ("add-method", "add", lambda: Fn(lambda m, x, y: x.add(y), 2), [X, X]),
    ("add-method-alpha", "add", lambda: Fn(lambda m, x, y: x.add(y, alpha=0.25), 2), [X, C]),
    ("add-method_", "add", lambda: inplace2("add_", alpha=3), [X, C]),
    ("add-iadd", "add", lambda: augmented(operator.iadd), [X, X]),
    ("sub-operator", "sub", lambda: f2(operator.sub), [X, C]),
    ("sub-operator-channel-left", "sub", lambda: f2(operator.sub), [C, X]),
    ("sub-scalar-right", "sub", lambda: Fn(lambda m, x: x - 1), [X]),
    ("sub-scalar-left", "sub", lambda: Fn(lambda m, x: 1.5 - x), [X]),
    ("sub-torch-alpha", "sub", lambda: Fn(lambda m, x, y: torch.sub(x, y, alpha=3), 2), [X, X]),
    ("sub-method", "sub", lambda: Fn(lambda m, x, y: x.sub(y), 2), [X, C]),
    ("sub-method_", "sub", lambda: inplace2("sub_"), [X, X]),
    ("sub-isub", "sub", lambda: augmented(operator.isub), [X, C]),
    ("mul-operator", "mul", lambda: f2(operator.mul), [X, X]),
    ("mul-operator-channel", "mul", lambda: f2(operator.mul), [X, C]),
    ("mul-operator-channel-left", "mul", lambda: f2(operator.mul), [C, X]),
    ("mul-scalar-right", "mul", lambda: Fn(lambda m, x: x * 0.5), [X]),
    ("mul-scalar-left", "mul", lambda: Fn(lambda m, x: 3 * x), [X]),
    ("mul-torch", "mul", lambda: f2(torch.mul), [X, C]),
    ("mul-method", "mul", lambda: Fn(lambda m, x: x.mul(-2)), [X]),
    ("mul-method_", "mul", lambda: inplace2("mul_"), [X, C]),
    ("mul-imul", "mul", lambda: augmented(operator.imul), [X, X]),
    ("div-operator", "div", lambda: f2(operator.truediv), [X, P]),
    ("div-operator-channel", "div", lambda: f2(operator.truediv), [X, (1, 5, 1, 1, "pos")]),
    ("div-scalar-right", "div", lambda: Fn(lambda m, x: x / 3), [X]),
    ("div-scalar-left", "div", lambda: Fn(lambda m, x: 1 / x), [P]),
    ("div-torch", "div", lambda: f2(torch.div), [X, P]),
    ("div-method", "div", lambda: Fn(lambda m, x: x.div(7)), [X]),
    ("div-method_", "div", lambda: inplace2("div_"), [X, P]),
    ("div-itruediv", "div", lambda: augmented(operator.itruediv), [X, P]),
    # -------------------------------------------------------------------- cat
    ("cat-torch", "cat", lambda: Fn(lambda m, x, y: torch.cat([x, y], 1), 2), [X, (3, 2, 7, 9)]),
    (
        "cat-torch-negdim",
        "cat",
        lambda: Fn(lambda m, x, y: torch.cat((x, y), dim=-1), 2),
        [X, (3, 5, 7, 1)],
    ),
    (
        "cat-concat",
        "cat",
        lambda: Fn(lambda m, x, y: torch.concat([x, y, x], dim=0), 2),
        [X, (1, 5, 7, 9)],
    ),
    (
        "cat-concatenate",
        "cat",
        lambda: Fn(lambda m, x, y: torch.concatenate([x, y], axis=2), 2),
        [X, (3, 5, 2, 9)],
    ),
    # ---------------------------------------------------------------- flatten
    ("flatten-torch", "flatten", lambda: Fn(lambda m, x: torch.flatten(x, 1)), [X]),
    ("flatten-module", "flatten", lambda: seq(nn.Flatten()), [X]),
    ("flatten-module-range", "flatten", lambda: seq(nn.Flatten(0, -2)), [X]),
    ("flatten-method", "flatten", lambda: Fn(lambda m, x: x.flatten()), [X]),
    ("flatten-method-range", "flatten", lambda: Fn(lambda m, x: x.flatten(1, 2)), [X]),
    # ---------------------------------------------------------------- reshape
    ("reshape-view", "reshape", lambda: Fn(lambda m, x: x.view(x.size(0), -1)), [X]),
    ("reshape-view-shape", "reshape", lambda: Fn(lambda m, x: x.view(x.shape[0], 5, -1)), [X]),
    ("reshape-method", "reshape", lambda: Fn(lambda m, x: x.reshape(-1, 9)), [X]),
    ("reshape-method-tuple", "reshape", lambda: Fn(lambda m, x: x.reshape((3, 35, 9))), [X]),
    ("reshape-torch", "reshape", lambda: Fn(lambda m, x: torch.reshape(x, (15, 63))), [X]),
    # ---------------------------------------------------------------- permute
    ("permute-method", "permute", lambda: Fn(lambda m, x: x.permute(0, 2, 3, 1)), [X]),
    ("permute-method-tuple", "permute", lambda: Fn(lambda m, x: x.permute((0, 3, 1, 2))), [X]),
    ("permute-torch", "permute", lambda: Fn(lambda m, x: torch.permute(x, (1, 0, 3, 2))), [X]),
    ("transpose-method", "permute", lambda: Fn(lambda m, x: x.transpose(1, 2)), [X]),
    ("transpose-torch", "permute", lambda: Fn(lambda m, x: torch.transpose(x, -1, -2)), [X]),
    (
        "contiguous-method",
        "contiguous",
        lambda: Fn(lambda m, x: x.transpose(1, 2).contiguous()),
        [X],
    ),
    # ------------------------------------------------------------------ split
    ("chunk-torch-uneven", "split", lambda: Fn(lambda m, x: torch.chunk(x, 3, 1)), [(3, 7, 5, 5)]),
    ("chunk-method", "split", lambda: Fn(lambda m, x: x.chunk(2, dim=1)), [(3, 6, 5, 5)]),
    ("chunk-method-lastdim", "split", lambda: Fn(lambda m, x: x.chunk(4, -1)), [X]),
    ("split-torch-size", "split", lambda: Fn(lambda m, x: torch.split(x, 2, dim=1)), [X]),
    ("split-torch-sections", "split", lambda: Fn(lambda m, x: torch.split(x, [2, 3], 1)), [X]),
    ("split-method", "split", lambda: Fn(lambda m, x: x.split(3, 1)), [X]),
    ("split-method-sections", "split", lambda: Fn(lambda m, x: x.split([1, 4], dim=1)), [X]),
    ("split-unpacked", "split", lambda: Fn(lambda m, x: _split_then_add(x)), [(3, 6, 5, 5)]),
    # ---------------------------------------------------------- identity / dropout
    ("identity-module", "identity", lambda: seq(nn.Identity()), [X]),
    ("identity-clone", "identity", lambda: Fn(lambda m, x: x.clone()), [X]),
    ("identity-detach", "identity", lambda: Fn(lambda m, x: x.detach()), [X]),
    ("dropout-module", "dropout", lambda: seq(nn.Dropout(0.3)), [X]),
    ("dropout2d-module", "dropout", lambda: seq(nn.Dropout2d()), [X]),
    ("dropout-F-eval", "dropout", lambda: Fn(lambda m, x: F.dropout(x, 0.5, training=False)), [X]),
    (
        "dropout-F-self-training",
        "dropout",
        lambda: Fn(lambda m, x: F.dropout(x, 0.2, m.training)),
        [X],
    ),
    ("stochastic-depth-module", "stochastic_depth", lambda: seq(_stochastic_depth()), [X]),
    # ---------------------------------------------------------- layer_norm
    ("layer-norm-module", "layer_norm", lambda: seq(nn.LayerNorm(X[-1])), [X]),
    ("layer-norm-module-2d", "layer_norm", lambda: seq(nn.LayerNorm(X[-2:])), [X]),
    (
        "layer-norm-F",
        "layer_norm",
        lambda: Fn(lambda m, x: F.layer_norm(x, (x.shape[-1],), eps=1e-3)),
        [(3, 7)],
    ),
    ("layer-norm-torch", "layer_norm", lambda: Fn(lambda m, x: torch.layer_norm(x, [9])), [X]),
    # ------------------------------------- indexing, repeating, resampling (op_shapes)
    ("slice-getitem", "slice", lambda: Fn(lambda m, x: x[:, 1:4, ::2, 3]), [X]),
    ("slice-ellipsis-new", "slice", lambda: Fn(lambda m, x: x[..., None, 1::3]), [X]),
    ("slice-narrow", "slice", lambda: Fn(lambda m, x: x.narrow(2, 1, 4)), [X]),
    ("slice-select", "slice", lambda: Fn(lambda m, x: torch.select(x, -1, 2)), [X]),
    ("expand-method", "expand", lambda: Fn(lambda m, x: x.expand(3, 4, -1, -1)), [(3, 1, 7, 9)]),
    ("repeat-method", "repeat", lambda: Fn(lambda m, x: x.repeat(1, 2, 1, 3)), [X]),
    ("roll-torch", "roll", lambda: Fn(lambda m, x: torch.roll(x, (2, -3), (1, 2))), [X]),
    ("pad-F", "pad", lambda: Fn(lambda m, x: F.pad(x, (1, 2, 0, 3), value=0.5)), [X]),
    ("pad-F-reflect", "pad", lambda: Fn(lambda m, x: F.pad(x, (2, 1, 1, 2), "reflect")), [X]),
    ("take-param-index", "take", lambda: Fn(lambda m, x: x[m.i], i=torch.tensor([2, 0, 2])), [X]),
    (
        "interpolate-bilinear",
        "interpolate",
        lambda: Fn(lambda m, x: F.interpolate(x, (11, 4), mode="bilinear")),
        [X],
    ),
    (
        "interpolate-nearest-scale",
        "interpolate",
        lambda: Fn(lambda m, x: F.interpolate(x, scale_factor=1.7)),
        [X],
    ),
    ("group-norm-module", "group_norm", lambda: seq(nn.GroupNorm(5, 5)), [X]),
    (
        "group-norm-F",
        "group_norm",
        lambda: Fn(lambda m, x: F.group_norm(x, 2, m.w), w=torch.randn(4)),
        [(3, 4, 5)],
    ),
    ("transpose-swapaxes", "permute", lambda: Fn(lambda m, x: torch.swapaxes(x, 1, 3)), [X]),
    ("transpose-swapdims-method", "permute", lambda: Fn(lambda m, x: x.swapdims(0, 2)), [X]),
    ("normalize-F", "normalize", lambda: Fn(lambda m, x: F.normalize(x, dim=-1)), [X]),
    (
        "einsum-attention",
        "einsum",
        lambda: Fn(lambda m, x, y: torch.einsum("b h i d, b h j d -> b h i j", x, y), 2),
        [(2, 3, 5, 8), (2, 3, 7, 8)],
    ),
    (
        "sdpa-F",
        "scaled_dot_product_attention",
        lambda: Fn(
            lambda m, q, k: F.scaled_dot_product_attention(q, k, m.v),
            2,
            v=torch.randn(2, 3, 7, 4),
        ),
        [(2, 3, 5, 8), (2, 3, 7, 8)],
    ),
]


def _stochastic_depth() -> nn.Module:
    import torchvision

    return torchvision.ops.StochasticDepth(0.3, "row")


def _split_then_add(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, 1)
    return a * b


def _random(shape: tuple[Any, ...]) -> torch.Tensor:
    """A seeded random input: standard normal, or in [0.5, 2] when the shape ends in "pos"."""
    if shape[-1] == "pos":
        return torch.rand(shape[:-1]) * 1.5 + 0.5
    return torch.randn(shape)


def _inputs(shapes: Sequence[tuple[Any, ...]]) -> list[torch.Tensor]:
    return [_random(s) for s in shapes]


def _clone_all(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [x.clone() for x in xs]


@pytest.mark.parametrize(("op", "make", "shapes"), [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_spelling_lowers_to_op(op: str, make, shapes, tree_close) -> None:
    model = make().eval()
    inputs = _inputs(shapes)
    with torch.no_grad():
        expected = model(*_clone_all(inputs))

    graph = middleware.trace(model, _clone_all(inputs))
    ops = [n.op for n in graph.nodes()]
    assert op in ops, graph.text()
    assert "fallback" not in ops, graph.text()
    for n in graph.nodes():
        assert infer_types(graph.values, n) == [graph.values[v] for v in n.outputs], n
    tree_close(graph.evaluate(*_clone_all(inputs)), expected, EVAL_RTOL, EVAL_ATOL)

    optimized = middleware.optimize(model, example_inputs=_clone_all(inputs))
    assert not optimized.report().fallbacks, str(optimized.report())
    fresh = _inputs(shapes)  # new values: nothing may be baked in from the trace
    with torch.no_grad():
        expected_fresh = model(*_clone_all(fresh))
    given = _clone_all(fresh)
    tree_close(optimized(*given), expected_fresh, OPT_RTOL, OPT_ATOL)
    for a, b in zip(given, fresh, strict=True):
        assert torch.equal(a, b), "the optimized model changed its input"


def test_every_catalogue_op_is_covered() -> None:
    """Every op of the catalogue is exercised by a frontend spelling above or a hand-built
    graph below (``fallback`` is covered by tests/test_frontend.py, ``to_layout`` — which
    only the layout pass inserts — by tests/test_layout.py (``channel_shuffle`` too, and by
    tests/test_fusion_ops.py), ``pointwise_grad`` and
    ``narrow`` — which only the backward rules emit — by tests/test_generated_backward.py,
    the pooling backward ops by tests/test_backward_pooling.py, ``conv2d_dw`` — which only
    the fuse_depthwise pass writes — by tests/test_fuse_depthwise.py)."""
    by_spelling = {c[1] for c in CASES}
    by_hand = {"maxpool_relu", "conv2d", "linear"}
    elsewhere = {"fallback", "to_layout", "pointwise_grad", "narrow", "channel_shuffle"}
    elsewhere |= {"pool_argmax", "max_pool2d_backward", "avg_pool2d_backward"}
    elsewhere |= {"adaptive_avg_pool2d_backward", "conv2d_dw"}
    missing = set(CATALOGUE) - by_spelling - by_hand - elsewhere
    assert not missing, f"catalogue ops without a test: {sorted(missing)}"


# ------------------------------------------------------------------ hand-built graphs
def _graph_of(
    op: str, attrs: dict[str, Any], shapes: Sequence[tuple[int, ...]], n_params: int = 0
) -> Graph:
    """One node ``op`` over graph inputs (the first ``len(shapes) - n_params``) and params."""
    g = Graph()
    names = []
    for i, s in enumerate(shapes):
        if i < len(shapes) - n_params:
            names.append(g.add_input(f"in{i}", TensorType(tuple(s))))
        else:
            names.append(g.add_param(f"p{i}", torch.randn(s).numpy()))
    node = Node("n", op, tuple(names), ("y",), attrs)
    out = infer_types(g.values, node)
    g.add_node(node, out)
    g.set_outputs("y")
    return g


def _run_compiled(g: Graph, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    compiled = compile_graph(g, Options(measure_hardware=False))
    return compiled.plan.run(list(inputs))


MAXPOOL = {"kernel_size": (3, 3), "stride": (2, 2), "padding": (1, 1), "dilation": (1, 1)}


@pytest.mark.parametrize(
    ("activation", "act_attrs", "ceil_mode", "reference"),
    [
        ("relu", (), False, torch.relu),
        ("relu", (), True, torch.relu),
        ("hardtanh", (("min_val", 0.0), ("max_val", 6.0)), True, lambda t: F.hardtanh(t, 0.0, 6.0)),
        ("leaky_relu", (("negative_slope", 0.1),), False, lambda t: F.leaky_relu(t, 0.1)),
    ],
)
def test_maxpool_relu(activation, act_attrs, ceil_mode, reference, tree_close) -> None:
    attrs = {
        **MAXPOOL,
        "ceil_mode": ceil_mode,
        "activation": activation,
        "activation_attrs": act_attrs,
    }
    g = _graph_of("maxpool_relu", attrs, [X])
    x = torch.randn(X) * 4
    expected = reference(F.max_pool2d(x, 3, 2, 1, ceil_mode=ceil_mode))
    assert g.values["y"].shape == tuple(expected.shape)
    tree_close(g.evaluate(x), expected, EVAL_RTOL, EVAL_ATOL)
    tree_close(_run_compiled(g, [x]), expected, OPT_RTOL, OPT_ATOL)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("activation", [None, "relu", "hardswish"])
def test_conv2d_post_ops(bias, residual, activation, tree_close) -> None:
    """conv2d's fused epilogue: ``act(conv(x, w) + b + residual)``."""
    attrs: dict[str, Any] = {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 1}
    if activation:
        attrs.update(activation=activation, activation_attrs=())
    if residual:
        attrs["residual"] = True
    out_shape = (3, 7, 7, 9)
    shapes: list[tuple[int, ...]] = [X]
    if residual:
        shapes.append(out_shape)
    params = [(7, 5, 3, 3)] + ([(7,)] if bias else [])
    g = Graph()
    x_in = g.add_input("x", TensorType(X))
    w = g.add_param("w", torch.randn(params[0]).numpy())
    ins = [x_in, w]
    if bias:
        ins.append(g.add_param("b", torch.randn(7).numpy()))
    if residual:
        ins.append(g.add_input("r", TensorType(out_shape)))
    node = Node("conv", "conv2d", tuple(ins), ("y",), attrs)
    g.add_node(node, infer_types(g.values, node))
    g.set_outputs("y")

    x, r = torch.randn(X), torch.randn(out_shape)
    wt = torch.from_numpy(g.params["w"])
    bt = torch.from_numpy(g.params["b"]) if bias else None
    expected = F.conv2d(x, wt, bt, 1, 1)
    if residual:
        expected = expected + r
    if activation == "relu":
        expected = torch.relu(expected)
    elif activation == "hardswish":
        expected = F.hardswish(expected)
    inputs = [x, r] if residual else [x]
    assert g.values["y"].shape == out_shape
    tree_close(g.evaluate(*inputs), expected, EVAL_RTOL, EVAL_ATOL)
    tree_close(_run_compiled(g, inputs), expected, OPT_RTOL, OPT_ATOL)


@pytest.mark.parametrize("activation", [None, "relu", "sigmoid"])
def test_linear_post_op(activation, tree_close) -> None:
    attrs = {"activation": activation, "activation_attrs": ()} if activation else {}
    g = _graph_of("linear", attrs, [(3, 9), (13, 9), (13,)], n_params=2)
    x = torch.randn(3, 9)
    expected = F.linear(x, torch.from_numpy(g.params["p1"]), torch.from_numpy(g.params["p2"]))
    if activation:
        expected = getattr(torch, activation)(expected)
    assert g.values["y"].shape == (3, 13)
    tree_close(g.evaluate(x), expected, EVAL_RTOL, EVAL_ATOL)
    tree_close(_run_compiled(g, [x]), expected, OPT_RTOL, OPT_ATOL)
