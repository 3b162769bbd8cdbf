"""The frontend's rules for indexing, repeating, moving and resampling calls and for the
normalizations and attention of transformer and segmentation models: ``x[...]``,
``narrow``, ``select``, ``unsqueeze``/``squeeze``, ``expand``, ``repeat``, ``roll``,
``F.pad``, ``F.interpolate``, ``group_norm``, ``F.scaled_dot_product_attention``. Each maps
the call onto one registry op (``op_shapes``, ``op_reductions``, ``op_attention``); a call
that needs none (a full slice, a zero pad, an expand to the same shape) is ``identity``.
``torch_fx.RULES`` merges these tables with those of ``function_rules``/``module_rules``."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .function_rules import _r_transpose
from .rule_helpers import (
    REQUIRED,
    Unsupported,
    V,
    bind,
    meta_of,
    norm_dim,
    rank_of,
    tensor_arg,
)


def _shape(low, x: V) -> tuple[int, ...]:
    return tuple(low.g.values[x.name].shape)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def index_items(shape: Sequence[int], index: Any) -> list[tuple[Any, ...]]:
    """The ``slice`` op's ``index`` attr for ``x[index]`` on a value of ``shape`` (ints,
    slices, None and one Ellipsis; resolved against the sizes, see ``op_shapes``)."""
    items = list(index) if isinstance(index, tuple) else [index]
    for it in items:
        if not (it is None or it is Ellipsis or isinstance(it, slice) or _is_int(it)):
            raise Unsupported(f"indexing with {type(it).__name__}")
        if isinstance(it, slice) and not all(
            s is None or _is_int(s) for s in (it.start, it.stop, it.step)
        ):
            raise Unsupported("a slice bound that is not an int")
    if sum(1 for it in items if it is Ellipsis) > 1:
        raise Unsupported("indexing with several Ellipses")
    consumed = sum(1 for it in items if it is not None and it is not Ellipsis)
    if consumed > len(shape):
        raise Unsupported(f"{consumed} indices into a rank {len(shape)} value")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at : at + 1] = [slice(None)] * (len(shape) - consumed)
    out: list[tuple[Any, ...]] = []
    d = 0
    for it in items:
        if it is None:
            out.append(("new",))
            continue
        size = shape[d]
        if isinstance(it, slice):
            if it.step is not None and it.step <= 0:
                raise Unsupported("a slice step that is not positive")
            start, stop, step = it.indices(size)
            out.append(("slice", start, max(start, stop), step))
        else:
            i = it + size if it < 0 else it
            if not 0 <= i < size:
                raise Unsupported(f"index {it} out of range for a dim of size {size}")
            out.append(("int", i))
        d += 1
    return out


def _slice_node(low, x: V, items: list[tuple[Any, ...]]):
    shape = _shape(low, x)
    full = [("slice", 0, s, 1) for s in shape[: len(items)]]
    if items == full:
        return "identity", [x], {}, False
    return "slice", [x], {"index": tuple(items)}, False


def _r_getitem(low, fxn, fn, args, kwargs):
    x, index = args[0], args[1]
    if not isinstance(x, V):
        raise Unsupported(f"indexing a {type(x).__name__}")
    if isinstance(index, V):
        dtype = low.g.values[index.name].dtype
        if dtype not in ("int64", "int32"):
            raise Unsupported(f"indexing with a {dtype} tensor")
        return "take", [x, index], {}, False
    if isinstance(index, (list, tuple)) and any(isinstance(i, (V, list)) for i in index):
        raise Unsupported("advanced indexing with tensors or lists inside a tuple")
    if isinstance(index, list):
        raise Unsupported("indexing with a list")
    return _slice_node(low, x, index_items(_shape(low, x), index))


def _r_narrow(low, fxn, fn, args, kwargs):
    b = bind(
        args,
        kwargs,
        [("input", REQUIRED), ("dim", REQUIRED), ("start", REQUIRED), ("length", REQUIRED)],
        "narrow",
    )
    x = tensor_arg(b["input"], "narrow input")
    shape = _shape(low, x)
    d = norm_dim(b["dim"], len(shape))
    start, length = b["start"], b["length"]
    if not (_is_int(start) and _is_int(length)):
        raise Unsupported("narrow with a tensor start or length")
    start = start + shape[d] if start < 0 else start
    return _slice_node(
        low, x, index_items(shape, (slice(None),) * d + (slice(start, start + length),))
    )


def _r_select(low, fxn, fn, args, kwargs):
    b = bind(args, kwargs, [("input", REQUIRED), ("dim", REQUIRED), ("index", REQUIRED)], "select")
    x = tensor_arg(b["input"], "select input")
    shape = _shape(low, x)
    if not _is_int(b["index"]):
        raise Unsupported("select with a tensor index")
    d = norm_dim(b["dim"], len(shape))
    return _slice_node(low, x, index_items(shape, (slice(None),) * d + (b["index"],)))


def _r_to_shape(low, fxn, fn, args, kwargs):
    """unsqueeze/squeeze: a reshape to the traced result's shape."""
    x = tensor_arg(args[0], "input")
    out = tuple(meta_of(fxn).shape)
    if out == _shape(low, x):
        return "identity", [x], {}, False
    return "reshape", [x], {"shape": out}, False


def _r_expand(low, fxn, fn, args, kwargs):
    x = tensor_arg(args[0], "expand input")
    out = tuple(meta_of(fxn).shape)
    if out == _shape(low, x):
        return "identity", [x], {}, False
    return "expand", [x], {"shape": out}, False


def _r_repeat(low, fxn, fn, args, kwargs):
    x = tensor_arg(args[0], "repeat input")
    reps = args[1:] or kwargs.get("repeats", ())
    if len(reps) == 1 and isinstance(reps[0], (tuple, list, torch.Size)):
        reps = reps[0]
    if not all(_is_int(r) for r in reps):
        raise Unsupported("repeat with sizes that are not ints")
    if all(r == 1 for r in reps) and len(reps) == rank_of(low, x):
        return "identity", [x], {}, False
    return "repeat", [x], {"repeats": tuple(int(r) for r in reps)}, False


def _r_roll(low, fxn, fn, args, kwargs):
    b = bind(args, kwargs, [("input", REQUIRED), ("shifts", REQUIRED), ("dims", None)], "roll")
    x = tensor_arg(b["input"], "roll input")
    shifts, dims = b["shifts"], b["dims"]
    if dims is None:
        raise Unsupported("roll of the flattened value (no dims)")
    shifts = (shifts,) if _is_int(shifts) else tuple(shifts)
    dims = (dims,) if _is_int(dims) else tuple(dims)
    if len(shifts) != len(dims) or not all(_is_int(s) for s in shifts):
        raise Unsupported("roll with shifts and dims of different lengths")
    shape = _shape(low, x)
    dims = tuple(norm_dim(d, len(shape)) for d in dims)
    if all(s % shape[d] == 0 for s, d in zip(shifts, dims, strict=True)):
        return "identity", [x], {}, False
    return "roll", [x], {"shifts": shifts, "dims": dims}, False


def _r_pad(low, fxn, fn, args, kwargs):
    b = bind(
        args,
        kwargs,
        [("input", REQUIRED), ("pad", REQUIRED), ("mode", "constant"), ("value", None)],
        "pad",
    )
    x = tensor_arg(b["input"], "pad input")
    pad = tuple(b["pad"])
    if not all(_is_int(p) for p in pad):
        raise Unsupported("pad widths that are not ints")
    mode = b["mode"]
    if mode not in ("constant", "reflect", "replicate", "circular"):
        raise Unsupported(f"pad mode {mode!r}")
    if all(p == 0 for p in pad):
        return "identity", [x], {}, False
    value = 0.0 if b["value"] is None else float(b["value"])
    return "pad", [x], {"pad": pad, "mode": mode, "value": value}, False


_INTERPOLATE_MODES = ("nearest", "nearest-exact", "bilinear", "bicubic")


def _r_interpolate(low, fxn, fn, args, kwargs):
    b = bind(
        args,
        kwargs,
        [
            ("input", REQUIRED),
            ("size", None),
            ("scale_factor", None),
            ("mode", "nearest"),
            ("align_corners", None),
            ("recompute_scale_factor", None),
            ("antialias", False),
        ],
        "interpolate",
    )
    x = tensor_arg(b["input"], "interpolate input")
    if rank_of(low, x) != 4:
        raise Unsupported("interpolate of a value that is not 4-d")
    if b["mode"] not in _INTERPOLATE_MODES or b["antialias"]:
        raise Unsupported(f"interpolate mode {b['mode']!r} (antialias {b['antialias']})")

    def frozen(v: Any) -> Any:
        return tuple(v) if isinstance(v, (list, tuple, torch.Size)) else v

    attrs = {
        "size": frozen(b["size"]),
        "scale_factor": frozen(b["scale_factor"]),
        "mode": b["mode"],
        "align_corners": b["align_corners"],
        "recompute_scale_factor": b["recompute_scale_factor"],
    }
    return "interpolate", [x], attrs, False


def _group_norm_node(low, x: V, groups: Any, weight: Any, bias: Any, eps: Any):
    if not _is_int(groups):
        raise Unsupported("group_norm with a number of groups that is not an int")
    if rank_of(low, x) < 2:
        raise Unsupported("group_norm of a value with no channel dim")
    ins, affine = [x], []
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            ins.append(tensor_arg(t, f"group_norm {name}"))
            affine.append(name)
    attrs = {"num_groups": int(groups), "eps": float(eps), "affine": "_".join(affine)}
    return "group_norm", ins, attrs, False


def _r_group_norm(low, fxn, fn, args, kwargs):
    b = bind(
        args,
        kwargs,
        [
            ("input", REQUIRED),
            ("num_groups", REQUIRED),
            ("weight", None),
            ("bias", None),
            ("eps", 1e-5),
        ],
        "group_norm",
    )
    x = tensor_arg(b["input"], "group_norm input")
    return _group_norm_node(low, x, b["num_groups"], b["weight"], b["bias"], b["eps"])


def _m_group_norm(low, fxn, mod: nn.GroupNorm, args, kwargs):
    x = tensor_arg(args[0], "group_norm input")
    w = low.param(mod.weight, f"{fxn.target}.weight") if mod.weight is not None else None
    b = low.param(mod.bias, f"{fxn.target}.bias") if mod.bias is not None else None
    return _group_norm_node(low, x, mod.num_groups, w, b, mod.eps)


def _r_normalize(low, fxn, fn, args, kwargs):
    b = bind(
        args,
        kwargs,
        [("input", REQUIRED), ("p", 2.0), ("dim", 1), ("eps", 1e-12), ("out", None)],
        "normalize",
    )
    if b["out"] is not None:
        raise Unsupported("normalize with out=")
    x = tensor_arg(b["input"], "normalize input")
    if not _is_int(b["dim"]):
        raise Unsupported("normalize over several dims")
    attrs = {"p": float(b["p"]), "dim": norm_dim(b["dim"], rank_of(low, x)), "eps": float(b["eps"])}
    return "normalize", [x], attrs, False


def _r_einsum(low, fxn, fn, args, kwargs):
    if kwargs or not args or not isinstance(args[0], str):
        raise Unsupported("einsum without an equation string first")
    operands = args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    ins = [tensor_arg(t, "einsum operand") for t in operands]
    return "einsum", ins, {"equation": args[0]}, False


def _r_sdpa(low, fxn, fn, args, kwargs):
    b = bind(
        args,
        kwargs,
        [
            ("query", REQUIRED),
            ("key", REQUIRED),
            ("value", REQUIRED),
            ("attn_mask", None),
            ("dropout_p", 0.0),
            ("is_causal", False),
            ("scale", None),
            ("enable_gqa", False),
        ],
        "scaled_dot_product_attention",
    )
    if b["dropout_p"] != 0.0:
        raise Unsupported("scaled_dot_product_attention with dropout")
    if b["enable_gqa"]:
        raise Unsupported("scaled_dot_product_attention with enable_gqa")
    ins = [tensor_arg(b[k], f"attention {k}") for k in ("query", "key", "value")]
    if b["attn_mask"] is not None:
        ins.append(tensor_arg(b["attn_mask"], "attention mask"))
    scale = None if b["scale"] is None else float(b["scale"])
    attrs = {"is_causal": bool(b["is_causal"]), "scale": scale, "has_mask": len(ins) == 4}
    return "scaled_dot_product_attention", ins, attrs, False


SHAPE_FUNCTION_RULES: dict[Any, Any] = {
    operator.getitem: _r_getitem,
    torch.narrow: _r_narrow,
    torch.select: _r_select,
    torch.unsqueeze: _r_to_shape,
    torch.squeeze: _r_to_shape,
    torch.roll: _r_roll,
    F.pad: _r_pad,
    F.interpolate: _r_interpolate,
    F.group_norm: _r_group_norm,
    F.scaled_dot_product_attention: _r_sdpa,
    F.normalize: _r_normalize,
    torch.einsum: _r_einsum,
    torch.swapaxes: _r_transpose,
    torch.swapdims: _r_transpose,
}

SHAPE_METHOD_RULES: dict[str, Any] = {
    "__getitem__": _r_getitem,
    "narrow": _r_narrow,
    "select": _r_select,
    "unsqueeze": _r_to_shape,
    "squeeze": _r_to_shape,
    "expand": _r_expand,
    "expand_as": _r_expand,
    "repeat": _r_repeat,
    "roll": _r_roll,
    "swapaxes": _r_transpose,
    "swapdims": _r_transpose,
}

SHAPE_MODULE_RULES: dict[type, Any] = {nn.GroupNorm: _m_group_norm}
