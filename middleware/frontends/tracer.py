"""The fx tracer that also runs the model: every recorded call is evaluated on the example
inputs (fake tensors first), so each fx node carries the value it produced and shape
queries answer with concrete numbers (the graph is specialised to the input signature)."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx._symbolic_trace import _orig_module_call, _orig_module_getattr

from ..errors import TraceError
from ..graph import TensorType
from ..ops import dtype_name
from .decompositions import MODULE_DECOMPOSITIONS, traced_through

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
    """An fx proxy that also holds the concrete value its node produced. ``constant``: the
    value is a parameter or buffer of the model (real, never fake)."""

    value: Any = None
    constant: bool = False

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


class ValueTracer(fx.Tracer):
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
        self._leaf_once: nn.Module | None = None  # a refused decomposition: one call
        self.output_template: Any = None  # forward's return value as the model built it

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ValueProxy(node, self)

    def create_args_for_root(self, root_fn: Any, is_module: bool, concrete_args: Any = None) -> Any:
        fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)

        def recording(*a: Any) -> Any:
            # forward's return value, before fx turns its dict subclasses into dicts
            self.output_template = fn(*a)
            return self.output_template

        return recording, args

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        graph = super().trace(root, concrete_args)
        # fx marks a wrapped function's result "is_wrapped" so that the GraphModule's code
        # calls ``fx.wrap(name)`` when it is built: a global patch, kept for the process,
        # made for every trace (and, on the result of a function traced into, under the
        # name of its last call: ``fx.wrap("torch.cat")`` broke every later trace). The
        # graph is never traced again, so the marks go.
        for node in graph.nodes:
            node.meta.pop("is_wrapped", None)
        return graph

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if type(m) in MODULE_DECOMPOSITIONS:
            return m is self._leaf_once  # call_module decides: decomposed, or one call
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
            # a batch norm updating its statistics (a subclass too, which fx would trace
            # through): one call of the user's module, so that its buffer updates
            # (num_batches_tracked, the running statistics, momentum=None's average) happen
            # in the module at every call instead of being frozen at trace time
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        """A module of ``MODULE_DECOMPOSITIONS`` runs its traceable forward where it accepts
        the call; anything else is fx's (a leaf is recorded as one call)."""
        decomp = MODULE_DECOMPOSITIONS.get(type(m))
        if decomp is None:
            return super().call_module(m, forward, args, kwargs)
        refusal, traceable = decomp
        cargs = fx.node.map_aggregate(args, _concrete)
        ckwargs = fx.node.map_aggregate(kwargs, _concrete)
        if refusal(m, cargs, ckwargs) is None:

            def decomposed(*a: Any, **k: Any) -> Any:
                return traceable(m, *a, **k)

            return super().call_module(m, decomposed, args, kwargs)
        self._leaf_once = m
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self._leaf_once = None

    def create_proxy(
        self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None
    ):  # noqa: ANN001 - fx's signature
        if kind == "call_function" and traced_through(target):
            # a torch.fx.wrap'ed function (see decompositions.py): record its body
            out = target(*args, **kwargs)
            if isinstance(out, torch.Tensor) and not isinstance(out, fx.Proxy):
                out = self._constant_proxy(out)  # its body folded to a constant
            if isinstance(out, fx.Proxy):
                return out
            raise TraceError(f"{target.__qualname__} returned {type(out).__name__}, not a tensor")
        if kind in ("call_function", "call_method"):
            written = _concrete_write_target(kind, target, args, kwargs)
            if written is not None:
                # e.g. m = x.new_zeros(s); m.add_(x): the graph cannot write into a tensor
                # that is a constant of the trace, so the write would be lost
                raise TraceError(
                    f"{written} writes in place into a tensor computed at trace time (a "
                    "constant of the graph); the write cannot be recorded"
                )
            if _foldable(kind, target, args, kwargs) and not (
                self.root.training and _needs_grad(args, kwargs)
            ):
                # (in training mode a parameter that needs a gradient is never folded:
                # the constant would cut its gradient path)
                return self._fold(kind, target, args, kwargs)
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        value = self._run(kind, target, args, kwargs)
        if isinstance(proxy, _ValueProxy):
            proxy.value = value
            proxy.constant = kind == "get_attr" and isinstance(value, torch.Tensor)
        proxy.node.meta["mw_value"] = _describe(value)
        fields = getattr(value, "_fields", None) or getattr(value, "__match_args__", None)
        if isinstance(value, tuple) and fields:  # namedtuple or torch.return_types (.values)
            proxy.node.meta["mw_fields"] = tuple(fields)
        return proxy

    def _fold(self, kind: str, target: Any, args: Any, kwargs: Any) -> Any:
        """Run a call on constants (see ``_foldable``) for real, now: its result is a
        constant (fx records it as a tensor attribute where a traced call reads it). Never
        a view of the model's own tensors (a later in-place write must not reach them)."""
        cargs = fx.node.map_aggregate(args, _concrete)
        ckwargs = fx.node.map_aggregate(kwargs, _concrete)
        patched_call, patched_getattr = nn.Module.__call__, nn.Module.__getattr__
        nn.Module.__call__, nn.Module.__getattr__ = _orig_module_call, _orig_module_getattr
        try:
            with torch.no_grad():
                if kind == "call_method":
                    self_ = cargs[0]
                    if target in FACTORY_METHODS:  # only its dtype and device matter
                        self_ = torch.empty(0, dtype=self_.dtype, device=self_.device)
                    out = getattr(self_, target)(*cargs[1:], **ckwargs)
                else:
                    out = target(*cargs, **ckwargs)
        finally:
            nn.Module.__call__, nn.Module.__getattr__ = patched_call, patched_getattr
        return fx.node.map_aggregate(out, lambda t: t.clone() if isinstance(t, torch.Tensor) else t)

    def _constant_proxy(self, t: torch.Tensor) -> _ValueProxy:
        """A constant tensor as a traced value (a tensor attribute of the traced module)."""
        node = self.create_arg(t)
        proxy = _ValueProxy(node, self)
        proxy.value, proxy.constant = t, True
        node.meta["mw_value"] = _describe(t)
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
                return fetch_attr(self.root, target)
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


# Tensor methods whose result depends on the tensor's dtype and device only
FACTORY_METHODS = frozenset({"new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"})
# Calls never folded: random ones
_RANDOM = ("rand", "dropout", "bernoulli", "normal", "multinomial", "uniform", "exponential")


def _foldable(kind: str, target: Any, args: Any, kwargs: Any) -> bool:
    """A call computed once at trace time (constant folding): a factory method
    (``x.new_zeros(...)``: Swin's attention mask), or a call whose traced arguments are all
    the model's parameters and buffers (a relative-position-bias gather, a class token
    expanded to the batch, a bias cloned and partly zeroed). Not an in-place write (it
    would reach the model's tensor) nor a random call."""
    name = target if kind == "call_method" else getattr(target, "__name__", "")
    if not isinstance(name, str) or target is operator.setitem:
        return False
    if (name.endswith("_") and not name.endswith("__")) or any(r in name for r in _RANDOM):
        return False
    if kind == "call_method" and target in FACTORY_METHODS:
        return True
    proxies: list[Any] = []
    fx.node.map_aggregate(
        (args, kwargs), lambda a: proxies.append(a) if isinstance(a, fx.Proxy) else a
    )
    return bool(proxies) and all(isinstance(p, _ValueProxy) and p.constant for p in proxies)


def _call_name(kind: str, target: Any) -> str:
    name = target if kind == "call_method" else getattr(target, "__name__", "")
    return name if isinstance(name, str) else ""


def _concrete_write_target(kind: str, target: Any, args: Any, kwargs: Any) -> str | None:
    """The call's description where it writes in place (a ``name_`` method, setitem or an
    ``out=`` tensor) into a tensor that is not traced (a trace-time constant), else None."""
    name = _call_name(kind, target)
    out = (kwargs or {}).get("out")
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if any(isinstance(o, torch.Tensor) and not isinstance(o, fx.Proxy) for o in outs):
        return f"{name or target}(..., out=...)"
    inplace = target is operator.setitem or (name.endswith("_") and not name.endswith("__"))
    inplace = inplace or name in ("__iadd__", "__isub__", "__imul__", "__itruediv__")
    first = args[0] if args else None
    if inplace and isinstance(first, torch.Tensor) and not isinstance(first, fx.Proxy):
        return "setitem" if target is operator.setitem else name
    return None


def _needs_grad(args: Any, kwargs: Any) -> bool:
    """A traced argument is a parameter (or buffer) that requires a gradient."""
    found: list[bool] = []
    fx.node.map_aggregate(
        (args, kwargs),
        lambda a: (
            found.append(
                isinstance(a, _ValueProxy)
                and isinstance(a.value, torch.Tensor)
                and a.value.requires_grad
            )
            or a
        ),
    )
    return any(found)


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


def _describe(value: Any) -> Any:
    """What lowering needs of a traced value: tensor types, nested like the value."""
    if isinstance(value, torch.Tensor):
        return TensorType(tuple(value.shape), dtype_name(value.dtype))
    if isinstance(value, (tuple, list)):
        return tuple(_describe(v) for v in value)
    return value if isinstance(value, (int, float, bool, str, type(None))) else _Opaque()


class _Opaque:
    """A traced value that is neither a tensor, a sequence nor a Python scalar."""


def fetch_attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def restore_containers(template: Any, tree: Any) -> Any:
    """``tree`` (a lowered output tree) with the dict types of ``template`` (what forward
    returned: fx records an ``OrderedDict``, a segmentation model's ``{"out", "aux"}``, as a
    plain dict)."""
    if isinstance(template, dict) and isinstance(tree, dict) and template.keys() == tree.keys():
        items = [(k, restore_containers(template[k], v)) for k, v in tree.items()]
        try:
            return type(template)(items)
        except TypeError:  # a dict subclass that cannot be built from pairs
            return dict(items)
    if isinstance(template, (list, tuple)) and isinstance(tree, (list, tuple)):
        if len(template) == len(tree):
            items = [restore_containers(a, b) for a, b in zip(template, tree, strict=True)]
            return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return tree
