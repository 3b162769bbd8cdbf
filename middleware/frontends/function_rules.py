"""The frontend's rules for functions (``F.relu``, ``torch.cat``, ``operator.add``, ...) and
tensor methods (``x.relu()``, ``x.view(...)``, ...): each binds the call's arguments
against the framework's signature and maps it onto one registry op and its attrs."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..ops import get_op
from .rule_helpers import (
    REQUIRED,
    Unsupported,
    V,
    adaptive_size,
    avg_pool_attrs,
    bind,
    conv_attrs,
    layer_norm_node,
    max_pool_attrs,
    meta_of,
    norm_dim,
    rank_of,
    tensor_arg,
)


def _f(op: str, spec: Sequence[tuple[str, Any]], attrs_of=None, inplace_name: bool = False):
    """A rule for a one-tensor call: bind ``spec``, take ``input``, compute attrs."""

    def rule(low, fxn, fn, args, kwargs):
        b = bind(args, kwargs, spec, op)
        x = tensor_arg(b[spec[0][0]], f"{op} input")
        attrs = attrs_of(low, x, b) if attrs_of else {}
        # a dropout reaching here is an inference one (_dropout_attrs refuses training):
        # the identity, so its in-place form writes nothing that aliases could see
        inplace = (bool(b.get("inplace", False)) or inplace_name) and op != "dropout"
        return op, [x], attrs, inplace

    return rule


def _fixed(attrs: dict[str, Any]):
    def attrs_of(low, x, b):
        return dict(attrs)

    return attrs_of


def _hardtanh_attrs(low, x, b):
    return {"min_val": float(b["min_val"]), "max_val": float(b["max_val"])}


def _leaky_attrs(low, x, b):
    return {"negative_slope": float(b["negative_slope"])}


def _elu_attrs(low, x, b):
    return {"alpha": float(b["alpha"])}


def _hardshrink_attrs(low, x, b):
    return {"lambd": float(b["lambd"])}


def _gelu_attrs(low, x, b):
    return {"approximate": b["approximate"]}


def _softmax_attrs(low, x, b):
    if b.get("dtype") is not None or b["dim"] is None:
        raise Unsupported("softmax with a dtype or without dim")
    return {"dim": norm_dim(b["dim"], rank_of(low, x))}


def _max_pool_fn_attrs(low, x, b):
    if b["return_indices"]:
        raise Unsupported("max-pool with return_indices")
    return max_pool_attrs(
        b["kernel_size"], b["stride"], b["padding"], b["dilation"], b["ceil_mode"]
    )


def _avg_pool_fn_attrs(low, x, b):
    return avg_pool_attrs(
        b["kernel_size"],
        b["stride"],
        b["padding"],
        b["ceil_mode"],
        b["count_include_pad"],
        b["divisor_override"],
    )


def _adaptive_fn_attrs(low, x, b):
    if b.get("return_indices"):
        raise Unsupported("adaptive pooling with return_indices")
    return {"output_size": adaptive_size(low, x, b["output_size"])}


def _flatten_attrs(low, x, b):
    r = rank_of(low, x)
    return {"start_dim": norm_dim(b["start_dim"], r), "end_dim": norm_dim(b["end_dim"], r)}


def _dropout_attrs(low, x, b):
    if b.get("training", False):
        raise Unsupported("dropout with training=True")
    return {}


def _r_layer_norm(low, fxn, fn, args, kwargs):
    b = bind(
        args,
        kwargs,
        [
            ("input", REQUIRED),
            ("normalized_shape", REQUIRED),
            ("weight", None),
            ("bias", None),
            ("eps", 1e-5),
        ],
        "layer_norm",
    )
    x = tensor_arg(b["input"], "layer_norm input")
    return layer_norm_node(low, x, b["normalized_shape"], b["weight"], b["bias"], b["eps"])


def _r_stochastic_depth(low, fxn, fn, args, kwargs):
    b = bind(
        args,
        kwargs,
        [("input", REQUIRED), ("p", REQUIRED), ("mode", REQUIRED), ("training", True)],
        "stochastic_depth",
    )
    if b["training"] and float(b["p"]) > 0.0:
        raise Unsupported("stochastic_depth with training=True (random per sample or row)")
    return "stochastic_depth", [tensor_arg(b["input"], "stochastic_depth input")], {}, False


def _r_conv2d(low, fxn, fn, args, kwargs):
    b = bind(
        args,
        kwargs,
        [
            ("input", REQUIRED),
            ("weight", REQUIRED),
            ("bias", None),
            ("stride", 1),
            ("padding", 0),
            ("dilation", 1),
            ("groups", 1),
        ],
        "conv2d",
    )
    x, w = tensor_arg(b["input"], "conv input"), tensor_arg(b["weight"], "conv weight")
    ins = [x, w] + ([tensor_arg(b["bias"], "conv bias")] if b["bias"] is not None else [])
    ksize = low.g.values[w.name].shape[2:]
    return (
        "conv2d",
        ins,
        conv_attrs(b["stride"], b["padding"], b["dilation"], b["groups"], ksize),
        False,
    )


def _r_linear(low, fxn, fn, args, kwargs):
    b = bind(args, kwargs, [("input", REQUIRED), ("weight", REQUIRED), ("bias", None)], "linear")
    ins = [tensor_arg(b["input"], "linear input"), tensor_arg(b["weight"], "linear weight")]
    if b["bias"] is not None:
        ins.append(tensor_arg(b["bias"], "linear bias"))
    return "linear", ins, {}, False


def _r_batch_norm(low, fxn, fn, args, kwargs):
    b = bind(
        args,
        kwargs,
        [
            ("input", REQUIRED),
            ("running_mean", REQUIRED),
            ("running_var", REQUIRED),
            ("weight", None),
            ("bias", None),
            ("training", False),
            ("momentum", 0.1),
            ("eps", 1e-5),
        ],
        "batch_norm",
    )
    if b["training"]:
        raise Unsupported("batch_norm with training=True")
    x = tensor_arg(b["input"], "batch-norm input")
    mean, var = (
        tensor_arg(b["running_mean"], "running_mean"),
        tensor_arg(b["running_var"], "running_var"),
    )
    c = low.g.values[mean.name].shape[0]
    w = b["weight"] if b["weight"] is not None else low.param(torch.ones(c), f"{fxn.name}.weight")
    bias = b["bias"] if b["bias"] is not None else low.param(torch.zeros(c), f"{fxn.name}.bias")
    return (
        "batch_norm",
        [x, mean, var, tensor_arg(w, "weight"), tensor_arg(bias, "bias")],
        {"eps": float(b["eps"])},
        False,
    )


def _r_binary(op: str, inplace_default: bool = False):
    def rule(low, fxn, fn, args, kwargs):
        spec = [("input", REQUIRED), ("other", REQUIRED)]
        if op in ("add", "sub"):
            spec.append(("alpha", 1))
        if op == "div":
            spec.append(("rounding_mode", None))
        b = bind(args, kwargs, spec, op)
        if b.get("rounding_mode") is not None:
            raise Unsupported("div with a rounding_mode")
        a, o = b["input"], b["other"]
        attrs: dict[str, Any] = {}
        if b.get("alpha", 1) != 1:
            attrs["alpha"] = b["alpha"]
        if isinstance(a, V) and isinstance(o, V):
            return op, [a, o], attrs, inplace_default
        if isinstance(a, V) and isinstance(o, (int, float)) and not isinstance(o, bool):
            return op, [a], {**attrs, "scalar": float(o)}, inplace_default
        if isinstance(o, V) and isinstance(a, (int, float)) and not isinstance(a, bool):
            return op, [o], {**attrs, "scalar": float(a), "reverse": True}, False
        raise Unsupported(f"{op} of {type(a).__name__} and {type(o).__name__}")

    return rule


def _r_matmul(low, fxn, fn, args, kwargs):
    """``torch.matmul``/``@``/``mm``/``bmm``: mm and bmm are matmul on their legal ranks."""
    b = bind(args, kwargs, [("input", REQUIRED), ("other", REQUIRED)], "matmul")
    return (
        "matmul",
        [tensor_arg(b["input"], "matmul input"), tensor_arg(b["other"], "matmul other")],
        {},
        False,
    )


def _r_cat(low, fxn, fn, args, kwargs):
    kw = dict(kwargs)
    if "axis" in kw:
        kw["dim"] = kw.pop("axis")
    b = bind(args, kw, [("tensors", REQUIRED), ("dim", 0)], "cat")
    xs = [tensor_arg(t, "cat input") for t in b["tensors"]]
    return "cat", xs, {"dim": norm_dim(b["dim"], meta_of(fxn).rank)}, False


def _r_reshape(low, fxn, fn, args, kwargs):
    x = tensor_arg(args[0], "reshape input")
    return "reshape", [x], {"shape": meta_of(fxn).shape}, False


def _r_permute(low, fxn, fn, args, kwargs):
    x = tensor_arg(args[0], "permute input")
    dims = args[1:] if fxn.op == "call_method" else args[1:2]
    dims = kwargs.get("dims", dims)
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = dims[0]
    r = rank_of(low, x)
    return "permute", [x], {"dims": tuple(norm_dim(d, r) for d in dims)}, False


def _r_transpose(low, fxn, fn, args, kwargs):
    b = bind(
        args, kwargs, [("input", REQUIRED), ("dim0", REQUIRED), ("dim1", REQUIRED)], "transpose"
    )
    x = tensor_arg(b["input"], "transpose input")
    r = rank_of(low, x)
    d0, d1 = norm_dim(b["dim0"], r), norm_dim(b["dim1"], r)
    dims = list(range(r))
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return "permute", [x], {"dims": tuple(dims)}, False


def _r_split(low, fxn, fn, args, kwargs):
    x = tensor_arg(args[0], "split input")
    spec = [("input", REQUIRED), ("n", REQUIRED), ("dim", 0)]
    b = bind(
        args,
        {
            k if k != "split_size_or_sections" and k != "chunks" and k != "split_size" else "n": v
            for k, v in kwargs.items()
        },
        spec,
        "split",
    )
    dim = norm_dim(b["dim"], rank_of(low, x))
    sizes = tuple(t.shape[dim] for t in fxn.meta["mw_value"])
    return "split", [x], {"split_sizes": sizes, "dim": dim}, False


def _r_dims(op: str, all_dims: object):
    """torch.mean / torch.sum / torch.amax and their methods: ``dim`` (``all_dims``, None
    or (), for every dim), ``keepdim`` and no ``dtype``."""

    def rule(low, fxn, fn, args, kwargs):
        spec = [("input", REQUIRED), ("dim", all_dims), ("keepdim", False)]
        if op != "amax":
            spec.append(("dtype", None))
        b = bind(args, kwargs, spec, op)
        if b.get("dtype") is not None:
            raise Unsupported(f"{op} with a dtype")
        x = tensor_arg(b["input"], f"{op} input")
        r = rank_of(low, x)
        dim = b["dim"]
        dims = (
            tuple(range(r))
            if dim is None or dim == ()
            else ((dim,) if isinstance(dim, int) else tuple(dim))
        )
        return (
            op,
            [x],
            {"dims": tuple(sorted(norm_dim(d, r) for d in dims)), "keepdim": bool(b["keepdim"])},
            False,
        )

    return rule


_r_mean = _r_dims("mean", None)
_r_sum = _r_dims("sum", None)
_r_amax = _r_dims("amax", ())


def _r_identity(low, fxn, fn, args, kwargs):
    if kwargs.get("memory_format") not in (None, torch.contiguous_format, torch.preserve_format):
        raise Unsupported("memory_format other than contiguous")
    return "identity", [tensor_arg(args[0], "input")], {}, False


def _r_contiguous(low, fxn, fn, args, kwargs):
    if kwargs.get("memory_format") not in (None, torch.contiguous_format):
        raise Unsupported("contiguous(memory_format=...)")
    return "contiguous", [tensor_arg(args[0], "input")], {}, False


def _default(op: str, attr: str) -> Any:
    """The registry's default for ``op``'s ``attr`` (the framework's own default)."""
    return get_op(op).defaults[attr]


_X = ("input", REQUIRED)
_INPLACE = ("inplace", False)
_RELU6 = _fixed({"min_val": 0.0, "max_val": 6.0})
_MAXPOOL_SPEC = [
    _X,
    ("kernel_size", REQUIRED),
    ("stride", None),
    ("padding", 0),
    ("dilation", 1),
    ("ceil_mode", False),
    ("return_indices", False),
]
_AVGPOOL_SPEC = [
    _X,
    ("kernel_size", REQUIRED),
    ("stride", None),
    ("padding", 0),
    ("ceil_mode", False),
    ("count_include_pad", True),
    ("divisor_override", None),
]
_SOFTMAX_SPEC = [_X, ("dim", None), ("_stacklevel", 3), ("dtype", None)]
_FLATTEN_SPEC = [_X, ("start_dim", 0), ("end_dim", -1)]
_MEAN_SPEC = None  # mean uses _r_mean

FUNCTION_RULES: dict[Any, Any] = {
    F.conv2d: _r_conv2d,
    torch.conv2d: _r_conv2d,
    F.linear: _r_linear,
    F.batch_norm: _r_batch_norm,
    F.layer_norm: _r_layer_norm,
    torch.layer_norm: _r_layer_norm,
    "torchvision.ops.stochastic_depth.stochastic_depth": _r_stochastic_depth,
    torch.relu: _f("relu", [_X]),
    torch.relu_: _f("relu", [_X], inplace_name=True),
    F.relu: _f("relu", [_X, _INPLACE]),
    F.relu_: _f("relu", [_X], inplace_name=True),
    F.relu6: _f("hardtanh", [_X, _INPLACE], _RELU6),
    F.hardtanh: _f(
        "hardtanh",
        [
            _X,
            ("min_val", _default("hardtanh", "min_val")),
            ("max_val", _default("hardtanh", "max_val")),
            _INPLACE,
        ],
        _hardtanh_attrs,
    ),
    F.leaky_relu: _f(
        "leaky_relu",
        [_X, ("negative_slope", _default("leaky_relu", "negative_slope")), _INPLACE],
        _leaky_attrs,
    ),
    torch.sigmoid: _f("sigmoid", [_X]),
    F.sigmoid: _f("sigmoid", [_X]),
    torch.tanh: _f("tanh", [_X]),
    torch.sqrt: _f("sqrt", [_X]),
    torch.rsqrt: _f("rsqrt", [_X]),
    torch.exp: _f("exp", [_X]),
    F.tanh: _f("tanh", [_X]),
    F.silu: _f("silu", [_X, _INPLACE]),
    F.hardswish: _f("hardswish", [_X, _INPLACE]),
    F.hardsigmoid: _f("hardsigmoid", [_X, _INPLACE]),
    F.gelu: _f("gelu", [_X, ("approximate", _default("gelu", "approximate"))], _gelu_attrs),
    F.elu: _f("elu", [_X, ("alpha", _default("elu", "alpha")), _INPLACE], _elu_attrs),
    F.mish: _f("mish", [_X, _INPLACE]),
    F.hardshrink: _f(
        "hardshrink", [_X, ("lambd", _default("hardshrink", "lambd"))], _hardshrink_attrs
    ),
    F.softmax: _f("softmax", _SOFTMAX_SPEC, _softmax_attrs),
    torch.softmax: _f("softmax", [_X, ("dim", None), ("dtype", None)], _softmax_attrs),
    F.log_softmax: _f("log_softmax", _SOFTMAX_SPEC, _softmax_attrs),
    F.max_pool2d: _f("max_pool2d", _MAXPOOL_SPEC, _max_pool_fn_attrs),
    torch.max_pool2d: _f(
        "max_pool2d", _MAXPOOL_SPEC[:-1] + [("return_indices", False)], _max_pool_fn_attrs
    ),
    F.avg_pool2d: _f("avg_pool2d", _AVGPOOL_SPEC, _avg_pool_fn_attrs),
    F.adaptive_avg_pool2d: _f(
        "adaptive_avg_pool2d", [_X, ("output_size", REQUIRED)], _adaptive_fn_attrs
    ),
    F.adaptive_max_pool2d: _f(
        "adaptive_max_pool2d",
        [_X, ("output_size", REQUIRED), ("return_indices", False)],
        _adaptive_fn_attrs,
    ),
    F.dropout: _f("dropout", [_X, ("p", 0.5), ("training", True), _INPLACE], _dropout_attrs),
    torch.flatten: _f("flatten", _FLATTEN_SPEC, _flatten_attrs),
    torch.log_softmax: _f("log_softmax", [_X, ("dim", None), ("dtype", None)], _softmax_attrs),
    torch.matmul: _r_matmul,
    torch.mm: _r_matmul,
    torch.bmm: _r_matmul,
    operator.matmul: _r_matmul,
    torch.cat: _r_cat,
    torch.concat: _r_cat,
    torch.concatenate: _r_cat,
    torch.reshape: _r_reshape,
    torch.permute: _r_permute,
    torch.transpose: _r_transpose,
    torch.chunk: _r_split,
    torch.split: _r_split,
    torch.mean: _r_mean,
    torch.sum: _r_sum,
    torch.amax: _r_amax,
    torch.add: _r_binary("add"),
    torch.sub: _r_binary("sub"),
    torch.mul: _r_binary("mul"),
    torch.div: _r_binary("div"),
    operator.add: _r_binary("add"),
    operator.sub: _r_binary("sub"),
    operator.mul: _r_binary("mul"),
    operator.truediv: _r_binary("div"),
    operator.iadd: _r_binary("add", True),
    operator.isub: _r_binary("sub", True),
    operator.imul: _r_binary("mul", True),
    operator.itruediv: _r_binary("div", True),
}

METHOD_RULES: dict[str, Any] = {
    "relu": _f("relu", [_X]),
    "relu_": _f("relu", [_X], inplace_name=True),
    "sigmoid": _f("sigmoid", [_X]),
    "sigmoid_": _f("sigmoid", [_X], inplace_name=True),
    "tanh": _f("tanh", [_X]),
    "tanh_": _f("tanh", [_X], inplace_name=True),
    "sqrt": _f("sqrt", [_X]),
    "sqrt_": _f("sqrt", [_X], inplace_name=True),
    "rsqrt": _f("rsqrt", [_X]),
    "rsqrt_": _f("rsqrt", [_X], inplace_name=True),
    "exp": _f("exp", [_X]),
    "exp_": _f("exp", [_X], inplace_name=True),
    "softmax": _f("softmax", [_X, ("dim", None), ("dtype", None)], _softmax_attrs),
    "log_softmax": _f("log_softmax", [_X, ("dim", None), ("dtype", None)], _softmax_attrs),
    "matmul": _r_matmul,
    "mm": _r_matmul,
    "bmm": _r_matmul,
    "view": _r_reshape,
    "reshape": _r_reshape,
    "flatten": _f("flatten", _FLATTEN_SPEC, _flatten_attrs),
    "permute": _r_permute,
    "transpose": _r_transpose,
    "contiguous": _r_contiguous,
    "clone": _r_identity,
    "detach": _r_identity,
    "chunk": _r_split,
    "split": _r_split,
    "mean": _r_mean,
    "sum": _r_sum,
    "amax": _r_amax,
    "add": _r_binary("add"),
    "sub": _r_binary("sub"),
    "mul": _r_binary("mul"),
    "div": _r_binary("div"),
    "add_": _r_binary("add", True),
    "sub_": _r_binary("sub", True),
    "mul_": _r_binary("mul", True),
    "div_": _r_binary("div", True),
}

NOOP_FUNCTIONS = {torch._assert}
