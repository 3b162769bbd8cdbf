"""PyTorch frontend: ``torch.fx`` tracing with concrete shapes, lowered to the middleware graph.

The tracer runs the model on the example inputs while it records it, so every fx node
carries the real value it produced. Shape queries (``x.size()``, ``x.shape``, ``x.dim()``,
``len(x)``) answer with concrete numbers instead of recording nodes: the graph is
specialised to the input signature, exactly like the plan that runs it. Data-dependent
control flow still fails to trace (fx refuses ``bool()`` of a traced value) and the model
then runs unchanged.

Lowering maps modules, functionals and tensor methods alike (``nn.ReLU``, ``F.relu``,
``torch.relu``, ``x.relu()``, in-place variants) onto one catalogue op each. In-place ops
become functional: later readers of the mutated value read the op's result instead.
Anything not understood becomes a ``fallback`` node that calls the original callable.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx._symbolic_trace import _orig_module_call, _orig_module_getattr

from ..errors import TraceError, UnsupportedError
from ..graph import Graph, Node, TensorType
from ..ops import ValueRef, dtype_name

_CONCRETE_ATTRS = frozenset(
    {
        "shape",
        "dtype",
        "device",
        "ndim",
        "is_cuda",
        "requires_grad",
        "layout",
        "is_sparse",
        "size",
        "dim",
        "numel",
        "nelement",
        "get_device",
        "is_contiguous",
        "stride",
        "is_floating_point",
        "element_size",
    }
)


class _ValueProxy(fx.Proxy):
    """An fx proxy that also holds the concrete value its node produced."""

    value: Any = None

    def __getattr__(self, k: str) -> Any:
        if k in _CONCRETE_ATTRS and isinstance(self.value, torch.Tensor):
            return getattr(self.value, k)
        return super().__getattr__(k)

    def __len__(self) -> int:
        return len(self.value)

    def __iter__(self) -> Any:
        if isinstance(self.value, (tuple, list)):
            return iter([self[i] for i in range(len(self.value))])
        if isinstance(self.value, torch.Tensor):
            return iter([self[i] for i in range(self.value.shape[0])])
        return super().__iter__()


def _concrete(a: Any) -> Any:
    if isinstance(a, _ValueProxy):
        return a.value
    if isinstance(a, fx.proxy.Attribute):  # ``y.indices`` of a traced value, not yet a node
        return getattr(_concrete(a.root), a.attr)
    return a


class _ValueTracer(fx.Tracer):
    """Symbolic tracing that evaluates every recorded call on the example inputs.

    With ``fake=True`` the calls run on fake tensors (shapes and dtypes, no data), which
    costs milliseconds where running the network on real data costs seconds.
    """

    def __init__(self, example_inputs: Sequence[Any], fake: bool = False) -> None:
        super().__init__()
        self._fake_mode = None
        if fake:
            from torch._subclasses.fake_tensor import FakeTensorMode

            self._fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            example_inputs = [
                self._fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x
                for x in example_inputs
            ]
        self._examples = list(example_inputs)
        self._next_input = 0

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ValueProxy(node, self)

    def create_proxy(
        self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None
    ):  # noqa: ANN001 - fx's signature
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        value = self._run(kind, target, args, kwargs)
        if isinstance(proxy, _ValueProxy):
            proxy.value = value
        proxy.node.meta["mw_value"] = _describe(value)
        fields = getattr(value, "_fields", None) or getattr(value, "__match_args__", None)
        if isinstance(value, tuple) and fields:  # namedtuple or torch.return_types (.values)
            proxy.node.meta["mw_fields"] = tuple(fields)
        return proxy

    def _run(self, kind: str, target: Any, args: Any, kwargs: Any) -> Any:
        if kind == "placeholder":
            if self._next_input >= len(self._examples):
                raise TraceError(
                    f"forward() takes more inputs than the {len(self._examples)} example inputs given"
                )
            v = self._examples[self._next_input]
            self._next_input += 1
            return v
        if kind == "output":
            return None
        cargs = fx.node.map_aggregate(args, _concrete)
        ckwargs = fx.node.map_aggregate(kwargs, _concrete)
        # fx patches Module.__call__ and Module.__getattr__ while it traces; computing the
        # concrete value needs the originals back for the duration of the call.
        patched_call, patched_getattr = nn.Module.__call__, nn.Module.__getattr__
        nn.Module.__call__, nn.Module.__getattr__ = _orig_module_call, _orig_module_getattr
        try:
            if kind == "get_attr":
                return _fetch_attr(self.root, target)
            with torch.no_grad(), self._fake_mode or contextlib.nullcontext():
                if kind == "call_module":
                    module = self.root.get_submodule(target)
                    if self._fake_mode is not None and _eval_batch_norm(module, cargs, ckwargs):
                        # Shape, dtype and memory order of the input: skip the fake-tensor
                        # decomposition of batch_norm (~12 ms a call, most of a trace).
                        return torch.empty_like(cargs[0])
                    return module(*cargs, **ckwargs)
                if kind == "call_method":
                    return getattr(cargs[0], target)(*cargs[1:], **ckwargs)
                return target(*cargs, **ckwargs)
        finally:
            nn.Module.__call__, nn.Module.__getattr__ = patched_call, patched_getattr


_BN_RANKS = {nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}


def _eval_batch_norm(module: nn.Module, args: Any, kwargs: Any) -> bool:
    """``module(*args)`` is an eval-mode batch norm on one well-formed tensor, whose result
    has the input's shape, dtype and memory order (anything else runs the real call)."""
    ranks = _BN_RANKS.get(type(module))
    if ranks is None or module.training or kwargs or len(args) != 1:
        return False
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.dim() not in ranks or not x.is_floating_point():
        return False
    if x.shape[1] != module.num_features or module.running_mean is None:
        return False
    tensors = [module.running_mean, module.running_var, module.weight, module.bias]
    return all(t is None or t.dtype == x.dtype for t in tensors)


def _is_channels_last(x: Any) -> bool:
    """A 4-d tensor stored channels_last (and not also plainly contiguous)."""
    return (
        isinstance(x, torch.Tensor)
        and x.dim() == 4
        and x.is_contiguous(memory_format=torch.channels_last)
        and not x.is_contiguous()
    )


def _describe(value: Any) -> Any:
    """What lowering needs of a traced value: tensor types, nested like the value."""
    if isinstance(value, torch.Tensor):
        return TensorType(tuple(value.shape), dtype_name(value.dtype))
    if isinstance(value, (tuple, list)):
        return tuple(_describe(v) for v in value)
    return value if isinstance(value, (int, float, bool, str, type(None))) else _Opaque()


class _Opaque:
    """A traced value that is neither a tensor, a sequence nor a Python scalar."""


def _fetch_attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# ============================================================================ lowering
class _V:
    """A lowered tensor value (its name in the middleware graph)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"%{self.name}"


class _Unsupported(Exception):
    """A call the catalogue cannot express; the node becomes a fallback."""


_REQUIRED = object()


def _bind(
    args: Sequence[Any], kwargs: dict[str, Any], spec: Sequence[tuple[str, Any]], what: str
) -> dict[str, Any]:
    """Bind positional and keyword arguments to a signature given as (name, default) pairs."""
    out: dict[str, Any] = {}
    if len(args) > len(spec):
        raise _Unsupported(
            f"{what}: {len(args)} positional arguments, expected at most {len(spec)}"
        )
    for (name, _), a in zip(spec, args, strict=False):
        out[name] = a
    for k, v in kwargs.items():
        if k not in {n for n, _ in spec}:
            raise _Unsupported(f"{what}: unknown keyword argument {k!r}")
        out[k] = v
    for name, default in spec:
        if name not in out:
            if default is _REQUIRED:
                raise _Unsupported(f"{what}: missing argument {name!r}")
            out[name] = default
    return out


def _pair(v: Any) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    if len(v) == 1:
        return (int(v[0]), int(v[0]))
    return (int(v[0]), int(v[1]))


def _norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


class _Lowering:
    def __init__(self, gm: fx.GraphModule, fx_graph: fx.Graph, examples: Sequence[Any]) -> None:
        self.gm = gm
        self.fx_graph = fx_graph
        self.examples = list(examples)  # the user's example inputs (their memory formats)
        self.g = Graph()
        self.env: dict[fx.Node, Any] = {}
        self.param_of: dict[int, tuple[str, torch.Tensor]] = {}  # id(tensor) -> (name, tensor)

    # -- values -------------------------------------------------------------
    def param(self, tensor: torch.Tensor, name: str) -> _V:
        key = id(tensor)
        if key in self.param_of:
            return _V(self.param_of[key][0])
        name = self.g.fresh_name(name)
        self.g.add_param(name, tensor.detach().cpu().numpy())
        self.param_of[key] = (name, tensor)  # keeps the tensor alive so its id stays unique
        return _V(name)

    def lower_arg(self, a: Any) -> Any:
        if isinstance(a, fx.Node):
            return self.env[a]
        if isinstance(a, (tuple, list)):
            return type(a)(self.lower_arg(x) for x in a)
        if isinstance(a, dict):
            return {k: self.lower_arg(v) for k, v in a.items()}
        if isinstance(a, slice):
            return slice(self.lower_arg(a.start), self.lower_arg(a.stop), self.lower_arg(a.step))
        return a

    def emit(
        self, fxn: fx.Node, op: str, inputs: Sequence[_V], attrs: dict[str, Any], source: str = ""
    ) -> Any:
        meta = fxn.meta.get("mw_value")
        if isinstance(meta, TensorType):
            types, outs = [meta], (fxn.name,)
        elif isinstance(meta, tuple) and meta and all(isinstance(t, TensorType) for t in meta):
            types = list(meta)
            outs = tuple(f"{fxn.name}.{i}" for i in range(len(meta)))
        else:
            raise _Unsupported(f"{fxn.name}: produces a non-tensor value")
        node = Node(
            fxn.name, op, tuple(v.name for v in inputs), outs, attrs, source=source or fxn.name
        )
        self.g.add_node(node, types)
        if len(outs) == 1 and isinstance(meta, TensorType):
            return _V(outs[0])
        return tuple(_V(o) for o in outs)

    def emit_fallback(
        self, fxn: fx.Node, fn: Callable[..., Any], args: Any, kwargs: Any, reason: str
    ) -> Any:
        inputs: list[_V] = []

        def template(a: Any) -> Any:
            if isinstance(a, _V):
                inputs.append(a)
                return ValueRef(len(inputs) - 1)
            if isinstance(a, tuple) and not hasattr(a, "_fields"):
                return tuple(template(x) for x in a)
            if isinstance(a, list):
                return [template(x) for x in a]
            if isinstance(a, dict):
                return {k: template(v) for k, v in a.items()}
            if isinstance(a, slice):
                return slice(template(a.start), template(a.stop), template(a.step))
            return a

        targs, tkwargs = template(tuple(args)), template(dict(kwargs))
        meta = fxn.meta.get("mw_value")
        if isinstance(meta, TensorType):
            types, outs = [meta], (fxn.name,)
        elif isinstance(meta, tuple) and meta and all(isinstance(t, TensorType) for t in meta):
            types, outs = list(meta), tuple(f"{fxn.name}.{i}" for i in range(len(meta)))
        else:
            raise UnsupportedError(
                f"{fxn.format_node()}: an unsupported call that returns a non-tensor value "
                "cannot run as a fallback node"
            )
        node = Node(
            fxn.name,
            "fallback",
            tuple(v.name for v in inputs),
            outs,
            {"args": targs, "kwargs": tkwargs, "reason": reason, "target": _target_name(fxn)},
            source=str(fxn.target) if fxn.op == "call_module" else fxn.name,
            payload=fn,
        )
        self.g.add_node(node, types)
        return (
            _V(outs[0])
            if len(outs) == 1 and isinstance(meta, TensorType)
            else tuple(_V(o) for o in outs)
        )

    # -- the walk ---------------------------------------------------------------
    def run(self) -> Graph:
        for fxn in self.fx_graph.nodes:
            if fxn.op == "placeholder":
                meta = fxn.meta.get("mw_value")
                if not isinstance(meta, TensorType):
                    raise UnsupportedError(
                        f"input {fxn.name!r} is not a tensor ({type(meta).__name__})"
                    )
                if meta.rank == 4 and _is_channels_last(self.examples[len(self.g.inputs)]):
                    meta = TensorType(meta.shape, meta.dtype, "nhwc")
                self.env[fxn] = _V(self.g.add_input(fxn.name, meta))
            elif fxn.op == "get_attr":
                obj = _fetch_attr(self.gm, fxn.target)
                if isinstance(obj, torch.Tensor):
                    self.env[fxn] = self.param(obj, fxn.target)
                else:
                    self.env[fxn] = obj
            elif fxn.op == "output":
                self.g.set_outputs(_output_tree(self.lower_arg(fxn.args[0])))
            else:
                self.lower_call(fxn)
        return self.g

    def lower_call(self, fxn: fx.Node) -> None:
        args = self.lower_arg(fxn.args)
        kwargs = self.lower_arg(dict(fxn.kwargs))
        if (
            fxn.op == "call_function"
            and fxn.target is operator.getitem
            and isinstance(args[0], tuple)
            and isinstance(args[1], int)
        ):
            self.env[fxn] = args[0][args[1]]
            return
        if fxn.op == "call_function" and fxn.target is getattr and isinstance(args[0], tuple):
            fields = (
                fxn.args[0].meta.get("mw_fields", ()) if isinstance(fxn.args[0], fx.Node) else ()
            )
            if args[1] in fields:  # a field of a namedtuple result
                self.env[fxn] = args[0][fields.index(args[1])]
                return
        if fxn.op == "call_function" and _is_namedtuple_class(fxn.target):
            # building the model's own namedtuple output: structure, not computation
            self.env[fxn] = fxn.target(*args, **kwargs)
            return
        if fxn.op == "call_function" and fxn.target in _NOOP_FUNCTIONS:
            self.env[fxn] = None
            return
        rule, fn = self.rule_for(fxn)
        reason = ""
        if rule is not None:
            try:
                op, inputs, attrs, inplace = rule(self, fxn, fn, args, kwargs)
                self.env[fxn] = self.emit(fxn, op, inputs, attrs, _source(fxn))
                if inplace and isinstance(args[0], _V):
                    self.redirect(args[0], self.env[fxn], fxn)
                return
            except _Unsupported as e:
                reason = str(e)
        else:
            reason = f"{_target_name(fxn)} is not in the op catalogue"
        self.env[fxn] = self.emit_fallback(fxn, fn, args, kwargs, reason)

    def redirect(self, old: _V, new: Any, at: fx.Node) -> None:
        """An in-place op mutated ``old``: later readers of ``old`` read ``new`` instead."""
        for k, v in list(self.env.items()):
            if isinstance(v, _V) and v.name == old.name:
                self.env[k] = new

    def rule_for(self, fxn: fx.Node) -> tuple[Any, Callable[..., Any]]:
        if fxn.op == "call_module":
            mod = self.gm.get_submodule(fxn.target)
            return _MODULE_RULES.get(type(mod)), mod
        if fxn.op == "call_method":
            name = fxn.target

            def method(self_, *a: Any, **k: Any) -> Any:
                return getattr(self_, name)(*a, **k)

            method.__name__ = name
            return _METHOD_RULES.get(name), method
        try:
            return _FUNCTION_RULES.get(fxn.target), fxn.target
        except TypeError:  # unhashable target
            return None, fxn.target


def _is_namedtuple_class(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, tuple) and hasattr(t, "_fields")


def _target_name(fxn: fx.Node) -> str:
    if fxn.op == "call_module":
        return f"module {fxn.target!r}"
    if fxn.op == "call_method":
        return f"method Tensor.{fxn.target}"
    t = fxn.target
    return f"function {getattr(t, '__module__', '') or ''}.{getattr(t, '__name__', repr(t))}"


def _source(fxn: fx.Node) -> str:
    return str(fxn.target) if fxn.op == "call_module" else fxn.name


def _output_tree(a: Any) -> Any:
    if isinstance(a, _V):
        return a.name
    if isinstance(a, tuple):
        items = [_output_tree(x) for x in a]
        return type(a)(*items) if hasattr(a, "_fields") else tuple(items)
    if isinstance(a, list):
        return [_output_tree(x) for x in a]
    if isinstance(a, dict):
        return type(a)((k, _output_tree(v)) for k, v in a.items())
    if isinstance(a, str):
        raise UnsupportedError("a model that returns strings is not supported")
    return a


# ================================================================== lowering rules
# A rule gets (lowering, fx node, callable, lowered args, lowered kwargs) and returns
# (op name, tensor inputs, attrs, in-place?) or raises _Unsupported.


def _meta(fxn: fx.Node) -> TensorType:
    return fxn.meta["mw_value"]


def _tensor(a: Any, what: str) -> _V:
    if not isinstance(a, _V):
        raise _Unsupported(f"{what} is not a tensor")
    return a


def _rank_of(low: _Lowering, v: _V) -> int:
    return low.g.values[v.name].rank


# -- modules -----------------------------------------------------------------
def _m_conv2d(low, fxn, mod: nn.Conv2d, args, kwargs):
    if mod.padding_mode != "zeros":
        raise _Unsupported(f"conv padding_mode={mod.padding_mode!r}")
    x = _tensor(args[0], "conv input")
    w = low.param(mod.weight, f"{fxn.target}.weight")
    ins = [x, w] + ([low.param(mod.bias, f"{fxn.target}.bias")] if mod.bias is not None else [])
    return (
        "conv2d",
        ins,
        _conv_attrs(mod.stride, mod.padding, mod.dilation, mod.groups, tuple(mod.weight.shape[2:])),
        False,
    )


def _conv_attrs(stride, padding, dilation, groups, ksize) -> dict[str, Any]:
    dilation = _pair(dilation)
    if isinstance(padding, str):
        if padding == "valid":
            padding = (0, 0)
        elif padding == "same":
            pads = []
            for k, d in zip(ksize, dilation, strict=True):
                total = d * (k - 1)
                if total % 2:
                    raise _Unsupported("padding='same' with an even effective kernel")
                pads.append(total // 2)
            padding = tuple(pads)
        else:
            raise _Unsupported(f"conv padding={padding!r}")
    return {
        "stride": _pair(stride),
        "padding": _pair(padding),
        "dilation": dilation,
        "groups": int(groups),
    }


def _m_linear(low, fxn, mod: nn.Linear, args, kwargs):
    x = _tensor(args[0], "linear input")
    ins = [x, low.param(mod.weight, f"{fxn.target}.weight")]
    if mod.bias is not None:
        ins.append(low.param(mod.bias, f"{fxn.target}.bias"))
    return "linear", ins, {}, False


def _m_batch_norm(low, fxn, mod: nn.modules.batchnorm._BatchNorm, args, kwargs):
    if mod.running_mean is None or mod.running_var is None:
        raise _Unsupported("batch-norm without running statistics")
    if mod.training:
        raise _Unsupported("batch-norm in training mode")
    x = _tensor(args[0], "batch-norm input")
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


def _simple_module(op: str, attrs_of: Callable[[nn.Module], dict[str, Any]] | None = None):
    def rule(low, fxn, mod, args, kwargs):
        x = _tensor(args[0], f"{op} input")
        attrs = attrs_of(mod) if attrs_of else {}
        return op, [x], attrs, bool(getattr(mod, "inplace", False))

    return rule


def _softmax_dim(mod: nn.Module) -> dict[str, Any]:
    if mod.dim is None:
        raise _Unsupported("softmax without dim")
    return {"dim": mod.dim}


def _max_pool_attrs(kernel_size, stride, padding, dilation, ceil_mode) -> dict[str, Any]:
    k = _pair(kernel_size)
    s = (
        k
        if stride is None or (isinstance(stride, (list, tuple)) and len(stride) == 0)
        else _pair(stride)
    )
    return {
        "kernel_size": k,
        "stride": s,
        "padding": _pair(padding),
        "dilation": _pair(dilation),
        "ceil_mode": bool(ceil_mode),
    }


def _avg_pool_attrs(
    kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
) -> dict[str, Any]:
    k = _pair(kernel_size)
    s = (
        k
        if stride is None or (isinstance(stride, (list, tuple)) and len(stride) == 0)
        else _pair(stride)
    )
    return {
        "kernel_size": k,
        "stride": s,
        "padding": _pair(padding),
        "ceil_mode": bool(ceil_mode),
        "count_include_pad": bool(count_include_pad),
        "divisor_override": None if divisor_override is None else int(divisor_override),
    }


def _m_max_pool(low, fxn, mod: nn.MaxPool2d, args, kwargs):
    if mod.return_indices:
        raise _Unsupported("max-pool with return_indices")
    x = _tensor(args[0], "max-pool input")
    return (
        "max_pool2d",
        [x],
        _max_pool_attrs(mod.kernel_size, mod.stride, mod.padding, mod.dilation, mod.ceil_mode),
        False,
    )


def _m_avg_pool(low, fxn, mod: nn.AvgPool2d, args, kwargs):
    x = _tensor(args[0], "avg-pool input")
    return (
        "avg_pool2d",
        [x],
        _avg_pool_attrs(
            mod.kernel_size,
            mod.stride,
            mod.padding,
            mod.ceil_mode,
            mod.count_include_pad,
            mod.divisor_override,
        ),
        False,
    )


def _adaptive_size(low: _Lowering, x: _V, size: Any) -> tuple[int, int]:
    h, w = low.g.values[x.name].shape[-2:]
    if isinstance(size, int):
        return (size, size)
    size = tuple(size)
    if len(size) == 1:
        size = (size[0], size[0])
    return (h if size[0] is None else int(size[0]), w if size[1] is None else int(size[1]))


def _m_adaptive(op: str):
    def rule(low, fxn, mod, args, kwargs):
        if getattr(mod, "return_indices", False):
            raise _Unsupported("adaptive pooling with return_indices")
        x = _tensor(args[0], f"{op} input")
        return op, [x], {"output_size": _adaptive_size(low, x, mod.output_size)}, False

    return rule


def _m_flatten(low, fxn, mod: nn.Flatten, args, kwargs):
    x = _tensor(args[0], "flatten input")
    r = _rank_of(low, x)
    return (
        "flatten",
        [x],
        {"start_dim": _norm_dim(mod.start_dim, r), "end_dim": _norm_dim(mod.end_dim, r)},
        False,
    )


def _m_dropout(low, fxn, mod, args, kwargs):
    if mod.training:
        raise _Unsupported("dropout in training mode")
    return "dropout", [_tensor(args[0], "dropout input")], {}, False


_MODULE_RULES: dict[type, Any] = {
    nn.Conv2d: _m_conv2d,
    nn.Linear: _m_linear,
    nn.BatchNorm2d: _m_batch_norm,
    nn.BatchNorm1d: _m_batch_norm,
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


# -- functions and methods ------------------------------------------------------
def _f(op: str, spec: Sequence[tuple[str, Any]], attrs_of=None, inplace_name: bool = False):
    """A rule for a one-tensor call: bind ``spec``, take ``input``, compute attrs."""

    def rule(low, fxn, fn, args, kwargs):
        b = _bind(args, kwargs, spec, op)
        x = _tensor(b[spec[0][0]], f"{op} input")
        attrs = attrs_of(low, x, b) if attrs_of else {}
        inplace = bool(b.get("inplace", False)) or inplace_name
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


def _gelu_attrs(low, x, b):
    return {"approximate": b["approximate"]}


def _softmax_attrs(low, x, b):
    if b.get("dtype") is not None or b["dim"] is None:
        raise _Unsupported("softmax with a dtype or without dim")
    return {"dim": _norm_dim(b["dim"], _rank_of(low, x))}


def _max_pool_fn_attrs(low, x, b):
    if b["return_indices"]:
        raise _Unsupported("max-pool with return_indices")
    return _max_pool_attrs(
        b["kernel_size"], b["stride"], b["padding"], b["dilation"], b["ceil_mode"]
    )


def _avg_pool_fn_attrs(low, x, b):
    return _avg_pool_attrs(
        b["kernel_size"],
        b["stride"],
        b["padding"],
        b["ceil_mode"],
        b["count_include_pad"],
        b["divisor_override"],
    )


def _adaptive_fn_attrs(low, x, b):
    if b.get("return_indices"):
        raise _Unsupported("adaptive pooling with return_indices")
    return {"output_size": _adaptive_size(low, x, b["output_size"])}


def _flatten_attrs(low, x, b):
    r = _rank_of(low, x)
    return {"start_dim": _norm_dim(b["start_dim"], r), "end_dim": _norm_dim(b["end_dim"], r)}


def _dropout_attrs(low, x, b):
    if b.get("training", False):
        raise _Unsupported("dropout with training=True")
    return {}


def _r_conv2d(low, fxn, fn, args, kwargs):
    b = _bind(
        args,
        kwargs,
        [
            ("input", _REQUIRED),
            ("weight", _REQUIRED),
            ("bias", None),
            ("stride", 1),
            ("padding", 0),
            ("dilation", 1),
            ("groups", 1),
        ],
        "conv2d",
    )
    x, w = _tensor(b["input"], "conv input"), _tensor(b["weight"], "conv weight")
    ins = [x, w] + ([_tensor(b["bias"], "conv bias")] if b["bias"] is not None else [])
    ksize = low.g.values[w.name].shape[2:]
    return (
        "conv2d",
        ins,
        _conv_attrs(b["stride"], b["padding"], b["dilation"], b["groups"], ksize),
        False,
    )


def _r_linear(low, fxn, fn, args, kwargs):
    b = _bind(args, kwargs, [("input", _REQUIRED), ("weight", _REQUIRED), ("bias", None)], "linear")
    ins = [_tensor(b["input"], "linear input"), _tensor(b["weight"], "linear weight")]
    if b["bias"] is not None:
        ins.append(_tensor(b["bias"], "linear bias"))
    return "linear", ins, {}, False


def _r_batch_norm(low, fxn, fn, args, kwargs):
    b = _bind(
        args,
        kwargs,
        [
            ("input", _REQUIRED),
            ("running_mean", _REQUIRED),
            ("running_var", _REQUIRED),
            ("weight", None),
            ("bias", None),
            ("training", False),
            ("momentum", 0.1),
            ("eps", 1e-5),
        ],
        "batch_norm",
    )
    if b["training"]:
        raise _Unsupported("batch_norm with training=True")
    x = _tensor(b["input"], "batch-norm input")
    mean, var = _tensor(b["running_mean"], "running_mean"), _tensor(b["running_var"], "running_var")
    c = low.g.values[mean.name].shape[0]
    w = b["weight"] if b["weight"] is not None else low.param(torch.ones(c), f"{fxn.name}.weight")
    bias = b["bias"] if b["bias"] is not None else low.param(torch.zeros(c), f"{fxn.name}.bias")
    return (
        "batch_norm",
        [x, mean, var, _tensor(w, "weight"), _tensor(bias, "bias")],
        {"eps": float(b["eps"])},
        False,
    )


def _r_binary(op: str, inplace_default: bool = False):
    def rule(low, fxn, fn, args, kwargs):
        spec = [("input", _REQUIRED), ("other", _REQUIRED)]
        if op in ("add", "sub"):
            spec.append(("alpha", 1))
        if op == "div":
            spec.append(("rounding_mode", None))
        b = _bind(args, kwargs, spec, op)
        if b.get("rounding_mode") is not None:
            raise _Unsupported("div with a rounding_mode")
        a, o = b["input"], b["other"]
        attrs: dict[str, Any] = {}
        if b.get("alpha", 1) != 1:
            attrs["alpha"] = b["alpha"]
        if isinstance(a, _V) and isinstance(o, _V):
            return op, [a, o], attrs, inplace_default
        if isinstance(a, _V) and isinstance(o, (int, float)) and not isinstance(o, bool):
            return op, [a], {**attrs, "scalar": float(o)}, inplace_default
        if isinstance(o, _V) and isinstance(a, (int, float)) and not isinstance(a, bool):
            return op, [o], {**attrs, "scalar": float(a), "reverse": True}, False
        raise _Unsupported(f"{op} of {type(a).__name__} and {type(o).__name__}")

    return rule


def _r_matmul(low, fxn, fn, args, kwargs):
    """``torch.matmul``/``@``/``mm``/``bmm``: mm and bmm are matmul on their legal ranks."""
    b = _bind(args, kwargs, [("input", _REQUIRED), ("other", _REQUIRED)], "matmul")
    return (
        "matmul",
        [_tensor(b["input"], "matmul input"), _tensor(b["other"], "matmul other")],
        {},
        False,
    )


def _r_cat(low, fxn, fn, args, kwargs):
    kw = dict(kwargs)
    if "axis" in kw:
        kw["dim"] = kw.pop("axis")
    b = _bind(args, kw, [("tensors", _REQUIRED), ("dim", 0)], "cat")
    xs = [_tensor(t, "cat input") for t in b["tensors"]]
    return "cat", xs, {"dim": _norm_dim(b["dim"], _meta(fxn).rank)}, False


def _r_reshape(low, fxn, fn, args, kwargs):
    x = _tensor(args[0], "reshape input")
    return "reshape", [x], {"shape": _meta(fxn).shape}, False


def _r_permute(low, fxn, fn, args, kwargs):
    x = _tensor(args[0], "permute input")
    dims = args[1:] if fxn.op == "call_method" else args[1:2]
    dims = kwargs.get("dims", dims)
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = dims[0]
    r = _rank_of(low, x)
    return "permute", [x], {"dims": tuple(_norm_dim(d, r) for d in dims)}, False


def _r_transpose(low, fxn, fn, args, kwargs):
    b = _bind(
        args, kwargs, [("input", _REQUIRED), ("dim0", _REQUIRED), ("dim1", _REQUIRED)], "transpose"
    )
    x = _tensor(b["input"], "transpose input")
    r = _rank_of(low, x)
    d0, d1 = _norm_dim(b["dim0"], r), _norm_dim(b["dim1"], r)
    dims = list(range(r))
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return "permute", [x], {"dims": tuple(dims)}, False


def _r_split(low, fxn, fn, args, kwargs):
    x = _tensor(args[0], "split input")
    spec = [("input", _REQUIRED), ("n", _REQUIRED), ("dim", 0)]
    b = _bind(
        args,
        {
            k if k != "split_size_or_sections" and k != "chunks" and k != "split_size" else "n": v
            for k, v in kwargs.items()
        },
        spec,
        "split",
    )
    dim = _norm_dim(b["dim"], _rank_of(low, x))
    sizes = tuple(t.shape[dim] for t in fxn.meta["mw_value"])
    return "split", [x], {"split_sizes": sizes, "dim": dim}, False


def _r_mean(low, fxn, fn, args, kwargs):
    b = _bind(
        args,
        kwargs,
        [("input", _REQUIRED), ("dim", None), ("keepdim", False), ("dtype", None)],
        "mean",
    )
    if b["dtype"] is not None:
        raise _Unsupported("mean with a dtype")
    x = _tensor(b["input"], "mean input")
    r = _rank_of(low, x)
    dim = b["dim"]
    dims = tuple(range(r)) if dim is None else ((dim,) if isinstance(dim, int) else tuple(dim))
    return (
        "mean",
        [x],
        {"dims": tuple(sorted(_norm_dim(d, r) for d in dims)), "keepdim": bool(b["keepdim"])},
        False,
    )


def _r_identity(low, fxn, fn, args, kwargs):
    if kwargs.get("memory_format") not in (None, torch.contiguous_format, torch.preserve_format):
        raise _Unsupported("memory_format other than contiguous")
    return "identity", [_tensor(args[0], "input")], {}, False


def _r_contiguous(low, fxn, fn, args, kwargs):
    if kwargs.get("memory_format") not in (None, torch.contiguous_format):
        raise _Unsupported("contiguous(memory_format=...)")
    return "contiguous", [_tensor(args[0], "input")], {}, False


_X = ("input", _REQUIRED)
_INPLACE = ("inplace", False)
_RELU6 = _fixed({"min_val": 0.0, "max_val": 6.0})
_MAXPOOL_SPEC = [
    _X,
    ("kernel_size", _REQUIRED),
    ("stride", None),
    ("padding", 0),
    ("dilation", 1),
    ("ceil_mode", False),
    ("return_indices", False),
]
_AVGPOOL_SPEC = [
    _X,
    ("kernel_size", _REQUIRED),
    ("stride", None),
    ("padding", 0),
    ("ceil_mode", False),
    ("count_include_pad", True),
    ("divisor_override", None),
]
_SOFTMAX_SPEC = [_X, ("dim", None), ("_stacklevel", 3), ("dtype", None)]
_FLATTEN_SPEC = [_X, ("start_dim", 0), ("end_dim", -1)]
_MEAN_SPEC = None  # mean uses _r_mean

_FUNCTION_RULES: dict[Any, Any] = {
    F.conv2d: _r_conv2d,
    torch.conv2d: _r_conv2d,
    F.linear: _r_linear,
    F.batch_norm: _r_batch_norm,
    torch.relu: _f("relu", [_X]),
    torch.relu_: _f("relu", [_X], inplace_name=True),
    F.relu: _f("relu", [_X, _INPLACE]),
    F.relu_: _f("relu", [_X], inplace_name=True),
    F.relu6: _f("hardtanh", [_X, _INPLACE], _RELU6),
    F.hardtanh: _f(
        "hardtanh", [_X, ("min_val", -1.0), ("max_val", 1.0), _INPLACE], _hardtanh_attrs
    ),
    F.leaky_relu: _f("leaky_relu", [_X, ("negative_slope", 0.01), _INPLACE], _leaky_attrs),
    torch.sigmoid: _f("sigmoid", [_X]),
    F.sigmoid: _f("sigmoid", [_X]),
    torch.tanh: _f("tanh", [_X]),
    F.tanh: _f("tanh", [_X]),
    F.silu: _f("silu", [_X, _INPLACE]),
    F.hardswish: _f("hardswish", [_X, _INPLACE]),
    F.hardsigmoid: _f("hardsigmoid", [_X, _INPLACE]),
    F.gelu: _f("gelu", [_X, ("approximate", "none")], _gelu_attrs),
    F.softmax: _f("softmax", _SOFTMAX_SPEC, _softmax_attrs),
    torch.softmax: _f("softmax", [_X, ("dim", None), ("dtype", None)], _softmax_attrs),
    F.log_softmax: _f("log_softmax", _SOFTMAX_SPEC, _softmax_attrs),
    F.max_pool2d: _f("max_pool2d", _MAXPOOL_SPEC, _max_pool_fn_attrs),
    torch.max_pool2d: _f(
        "max_pool2d", _MAXPOOL_SPEC[:-1] + [("return_indices", False)], _max_pool_fn_attrs
    ),
    F.avg_pool2d: _f("avg_pool2d", _AVGPOOL_SPEC, _avg_pool_fn_attrs),
    F.adaptive_avg_pool2d: _f(
        "adaptive_avg_pool2d", [_X, ("output_size", _REQUIRED)], _adaptive_fn_attrs
    ),
    F.adaptive_max_pool2d: _f(
        "adaptive_max_pool2d",
        [_X, ("output_size", _REQUIRED), ("return_indices", False)],
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

_METHOD_RULES: dict[str, Any] = {
    "relu": _f("relu", [_X]),
    "relu_": _f("relu", [_X], inplace_name=True),
    "sigmoid": _f("sigmoid", [_X]),
    "sigmoid_": _f("sigmoid", [_X], inplace_name=True),
    "tanh": _f("tanh", [_X]),
    "tanh_": _f("tanh", [_X], inplace_name=True),
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
    "add": _r_binary("add"),
    "sub": _r_binary("sub"),
    "mul": _r_binary("mul"),
    "div": _r_binary("div"),
    "add_": _r_binary("add", True),
    "sub_": _r_binary("sub", True),
    "mul_": _r_binary("mul", True),
    "div_": _r_binary("div", True),
}

_NOOP_FUNCTIONS = {torch._assert}


# ========================================================================== entry
def trace(model: nn.Module, example_inputs: Sequence[torch.Tensor]) -> Graph:
    """Lower ``model`` called on ``example_inputs`` into a middleware :class:`Graph`.

    The graph is specialised to the inputs' shapes. Raises :class:`TraceError` when
    ``torch.fx`` cannot capture the model (the message names fx's error).
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    examples = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in example_inputs]
    # First on fake tensors (fast, no data); a model that needs real data to trace (an op
    # without a fake implementation, a value read back to Python) is traced on the real
    # example inputs instead.
    try:
        tracer = _ValueTracer(examples, fake=True)
        fx_graph = tracer.trace(model)
    except Exception:  # noqa: BLE001 - retried on real data just below
        tracer = _ValueTracer(examples)
        try:
            fx_graph = tracer.trace(model)
        except Exception as e:  # noqa: BLE001 - any tracing failure means "run the original"
            raise TraceError(
                f"torch.fx could not trace {type(model).__name__}: {type(e).__name__}: {e}"
            ) from e
    if tracer._next_input != len(examples):
        raise TraceError(
            f"forward() takes {tracer._next_input} inputs but "
            f"{len(examples)} example inputs were given"
        )
    gm = fx.GraphModule(tracer.root, fx_graph)
    g = _Lowering(gm, fx_graph, example_inputs).run()
    g.meta["model"] = type(model).__name__
    return g
