"""The fx tracer that also runs the model: every recorded call is evaluated on the example
inputs (fake tensors first), so each fx node carries the value it produced and shape
queries answer with concrete numbers (the graph is specialised to the input signature)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx._symbolic_trace import _orig_module_call, _orig_module_getattr

from ..errors import TraceError
from ..graph import TensorType
from ..ops import dtype_name

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
