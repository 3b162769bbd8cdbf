"""The frontend's rules for ``nn.Module`` calls, by module type: one rule per module, mapping
it onto one registry op and its attrs (``nn.ReLU6`` is ``hardtanh(0, 6)``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .rule_helpers import (
    Unsupported,
    adaptive_size,
    avg_pool_attrs,
    conv_attrs,
    layer_norm_node,
    max_pool_attrs,
    norm_dim,
    rank_of,
    tensor_arg,
)


def _m_conv2d(low, fxn, mod: nn.Conv2d, args, kwargs):
    if mod.padding_mode != "zeros":
        raise Unsupported(f"conv padding_mode={mod.padding_mode!r}")
    x = tensor_arg(args[0], "conv input")
    w = low.param(mod.weight, f"{fxn.target}.weight")
    ins = [x, w] + ([low.param(mod.bias, f"{fxn.target}.bias")] if mod.bias is not None else [])
    return (
        "conv2d",
        ins,
        conv_attrs(mod.stride, mod.padding, mod.dilation, mod.groups, tuple(mod.weight.shape[2:])),
        False,
    )


def _m_linear(low, fxn, mod: nn.Linear, args, kwargs):
    x = tensor_arg(args[0], "linear input")
    ins = [x, low.param(mod.weight, f"{fxn.target}.weight")]
    if mod.bias is not None:
        ins.append(low.param(mod.bias, f"{fxn.target}.bias"))
    return "linear", ins, {}, False


def _m_batch_norm(low, fxn, mod: nn.modules.batchnorm._BatchNorm, args, kwargs):
    if mod.running_mean is None or mod.running_var is None:
        raise Unsupported("batch-norm without running statistics")
    if mod.training:
        raise Unsupported("batch-norm in training mode")
    x = tensor_arg(args[0], "batch-norm input")
    c = mod.running_mean.shape[0]
    weight = mod.weight if mod.weight is not None else torch.ones(c)
    bias = mod.bias if mod.bias is not None else torch.zeros(c)
    ins = [
        x,
        low.param(mod.running_mean, f"{fxn.target}.running_mean"),
        low.param(mod.running_var, f"{fxn.target}.running_var"),
        low.param(weight, f"{fxn.target}.weight"),
        low.param(bias, f"{fxn.target}.bias"),
    ]
    return "batch_norm", ins, {"eps": float(mod.eps)}, False


def _m_layer_norm(low, fxn, mod: nn.LayerNorm, args, kwargs):
    x = tensor_arg(args[0], "layer_norm input")
    w = low.param(mod.weight, f"{fxn.target}.weight") if mod.weight is not None else None
    b = low.param(mod.bias, f"{fxn.target}.bias") if mod.bias is not None else None
    return layer_norm_node(low, x, mod.normalized_shape, w, b, mod.eps)


def _simple_module(op: str, attrs_of: Callable[[nn.Module], dict[str, Any]] | None = None):
    def rule(low, fxn, mod, args, kwargs):
        x = tensor_arg(args[0], f"{op} input")
        attrs = attrs_of(mod) if attrs_of else {}
        return op, [x], attrs, bool(getattr(mod, "inplace", False))

    return rule


def _softmax_dim(mod: nn.Module) -> dict[str, Any]:
    if mod.dim is None:
        raise Unsupported("softmax without dim")
    return {"dim": mod.dim}


def _m_max_pool(low, fxn, mod: nn.MaxPool2d, args, kwargs):
    if mod.return_indices:
        raise Unsupported("max-pool with return_indices")
    x = tensor_arg(args[0], "max-pool input")
    return (
        "max_pool2d",
        [x],
        max_pool_attrs(mod.kernel_size, mod.stride, mod.padding, mod.dilation, mod.ceil_mode),
        False,
    )


def _m_avg_pool(low, fxn, mod: nn.AvgPool2d, args, kwargs):
    x = tensor_arg(args[0], "avg-pool input")
    return (
        "avg_pool2d",
        [x],
        avg_pool_attrs(
            mod.kernel_size,
            mod.stride,
            mod.padding,
            mod.ceil_mode,
            mod.count_include_pad,
            mod.divisor_override,
        ),
        False,
    )


def _m_adaptive(op: str):
    def rule(low, fxn, mod, args, kwargs):
        if getattr(mod, "return_indices", False):
            raise Unsupported("adaptive pooling with return_indices")
        x = tensor_arg(args[0], f"{op} input")
        return op, [x], {"output_size": adaptive_size(low, x, mod.output_size)}, False

    return rule


def _m_flatten(low, fxn, mod: nn.Flatten, args, kwargs):
    x = tensor_arg(args[0], "flatten input")
    r = rank_of(low, x)
    return (
        "flatten",
        [x],
        {"start_dim": norm_dim(mod.start_dim, r), "end_dim": norm_dim(mod.end_dim, r)},
        False,
    )


def _m_dropout(low, fxn, mod, args, kwargs):
    if mod.training:
        raise Unsupported("dropout in training mode")
    return "dropout", [tensor_arg(args[0], "dropout input")], {}, False


MODULE_RULES: dict[type, Any] = {
    nn.Conv2d: _m_conv2d,
    nn.Linear: _m_linear,
    nn.BatchNorm2d: _m_batch_norm,
    nn.BatchNorm1d: _m_batch_norm,
    nn.LayerNorm: _m_layer_norm,
    nn.ReLU: _simple_module("relu"),
    nn.ReLU6: _simple_module("hardtanh", lambda m: {"min_val": 0.0, "max_val": 6.0}),
    nn.Hardtanh: _simple_module(
        "hardtanh", lambda m: {"min_val": float(m.min_val), "max_val": float(m.max_val)}
    ),
    nn.LeakyReLU: _simple_module(
        "leaky_relu", lambda m: {"negative_slope": float(m.negative_slope)}
    ),
    nn.Sigmoid: _simple_module("sigmoid"),
    nn.Tanh: _simple_module("tanh"),
    nn.SiLU: _simple_module("silu"),
    nn.Hardswish: _simple_module("hardswish"),
    nn.Hardsigmoid: _simple_module("hardsigmoid"),
    nn.GELU: _simple_module("gelu", lambda m: {"approximate": m.approximate}),
    nn.ELU: _simple_module("elu", lambda m: {"alpha": float(m.alpha)}),
    nn.Mish: _simple_module("mish"),
    nn.Hardshrink: _simple_module("hardshrink", lambda m: {"lambd": float(m.lambd)}),
    nn.Softmax: _simple_module("softmax", _softmax_dim),
    nn.LogSoftmax: _simple_module("log_softmax", _softmax_dim),
    nn.MaxPool2d: _m_max_pool,
    nn.AvgPool2d: _m_avg_pool,
    nn.AdaptiveAvgPool2d: _m_adaptive("adaptive_avg_pool2d"),
    nn.AdaptiveMaxPool2d: _m_adaptive("adaptive_max_pool2d"),
    nn.Flatten: _m_flatten,
    nn.Dropout: _m_dropout,
    nn.Dropout2d: _m_dropout,
    nn.Identity: _simple_module("identity"),
}
