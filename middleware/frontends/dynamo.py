"""TorchDynamo's graphs as the frontend's input.

Where ``torch.fx`` cannot trace a model (data-dependent Python control flow, ``.item()``,
calls fx refuses), TorchDynamo still can: it splits the model at each *graph break* into
subgraphs it hands a backend as ``fx.GraphModule``s, and runs the Python between them
itself. This module prepares such a subgraph for the fx frontend (``torch_fx.trace``):

- ``placeholders``: what each graph input is. Dynamo lifts the model's parameters and
  buffers into graph inputs (``L['self']._modules['conv']._parameters['weight']``); they
  are constants to the middleware (weights it may fold and prepack), the rest are tensors
  the caller passes, or Python scalars (dynamic shapes). Read when dynamo hands the graph
  over: dynamo drops the graph arguments' metadata after compiling.
- ``freeze``: the subgraph as a module whose only inputs are the tensors the caller
  passes, the constants attributes of it (shared, never copied), the scalars inlined, and
  each call returning a tuple with non-tensor items (``F.multi_head_attention_forward``:
  ``(out, None)``) wrapped to return its tensors only (``mixed_results``, ``TensorItems``)
  so the frontend can lower it as a fallback node.
- ``refusal``: why a subgraph must run as dynamo gave it (writes to its inputs or to the
  model's buffers, training-mode calls), or None.
- ``break_of``: the graph break that ended a subgraph, with where in the user's code.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

CONSTANT, TENSOR, SCALAR, OTHER = "constant", "tensor", "scalar", "other"

# Sources of lifted module state in dynamo's graph arguments.
_STATE_MARKS = ("._parameters[", "._buffers[")

# Calls whose result may share memory with their first argument.
_VIEW_METHODS = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "flatten",
        "unflatten",
        "transpose",
        "permute",
        "squeeze",
        "unsqueeze",
        "expand",
        "expand_as",
        "t",
        "narrow",
        "select",
        "detach",
        "contiguous",
        "as_strided",
        "split",
        "chunk",
        "unbind",
        "movedim",
        "__getitem__",
        "diagonal",
        "unfold",
        "data",
        "T",
        "mT",
        "H",
        "mH",
        "swapaxes",
        "swapdims",
        "adjoint",
        "real",
        "imag",
        "view_as_real",
        "view_as_complex",
        "tensor_split",
        "hsplit",
        "vsplit",
        "split_with_sizes",
        "unsafe_split",
        "indices",
        "values",
        "alias",
    }
)
_VIEW_FUNCTIONS = {
    operator.getitem,
    torch.flatten,
    torch.reshape,
    torch.transpose,
    torch.permute,
    torch.squeeze,
    torch.unsqueeze,
    torch.narrow,
    torch.select,
    torch.split,
    torch.chunk,
    torch.unbind,
    torch.t,
    torch.detach,
    torch.movedim,
    torch.as_strided,
    torch.diagonal,
    torch.swapaxes,
    torch.swapdims,
    torch.adjoint,
    torch.real,
    torch.imag,
    torch.view_as_real,
    torch.view_as_complex,
    torch.tensor_split,
    torch.hsplit,
    torch.vsplit,
    torch.split_with_sizes,
    torch.unflatten,
}
_INPLACE_OPERATORS = {
    operator.setitem,
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.imod,
    operator.ipow,
    operator.iand,
    operator.ior,
    operator.ixor,
    operator.ilshift,
    operator.irshift,
    operator.imatmul,
}


@dataclasses.dataclass(frozen=True)
class Placeholder:
    """One input of a dynamo subgraph: its fx name, what it is (``CONSTANT``: a parameter
    or buffer of the model; ``TENSOR``: passed by the caller; ``SCALAR``: a Python number,
    under dynamic shapes; ``OTHER``) and dynamo's name of where it comes from."""

    name: str
    kind: str
    source: str = ""


@dataclasses.dataclass(frozen=True)
class GraphBreak:
    """A graph break: dynamo's reason (its first line, and the full text) and where in the
    user's code (``file:line in function``, "" when dynamo did not say)."""

    reason: str
    detail: str = ""
    where: str = ""


def placeholders(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[Placeholder, ...]:
    """What each input of dynamo's ``gm`` is (see the module docstring)."""
    out = []
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, n in enumerate(nodes):
        example = example_inputs[i] if i < len(example_inputs) else n.meta.get("example_value")
        arg = n.meta.get("grapharg")
        source = getattr(getattr(arg, "source", None), "name", "")
        source = source if isinstance(source, str) else ""
        if getattr(arg, "pass_arg_as_tensor", False):
            kind = SCALAR  # a Python number dynamo passes as a 0-d tensor (dynamic=True)
        elif isinstance(example, torch.Tensor):
            state = isinstance(example, nn.Parameter) or any(m in source for m in _STATE_MARKS)
            kind = CONSTANT if state else TENSOR
        elif isinstance(example, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
            kind = SCALAR
        else:
            kind = OTHER
        out.append(Placeholder(n.name, kind, source))
    return tuple(out)


def mixed_results(gm: fx.GraphModule) -> dict[str, tuple[int, ...]]:
    """Calls of ``gm`` returning a tuple with non-tensor items (``F.multi_head_attention_
    forward`` returns ``(out, None)``) whose users only take tensor items by a constant
    index: call name -> the indices taken. Read from dynamo's example values, which it
    keeps until the graph is compiled."""
    out: dict[str, tuple[int, ...]] = {}
    for n in gm.graph.nodes:
        value = n.meta.get("example_value")
        if n.op != "call_function" or not isinstance(value, (tuple, list)):
            continue
        if all(isinstance(v, torch.Tensor) for v in value) or not n.users:
            continue
        taken = set()
        for u in n.users:
            if u.op != "call_function" or u.target is not operator.getitem or u.args[0] is not n:
                break
            i = u.args[1]
            if not isinstance(i, int) or not isinstance(value[i], torch.Tensor):
                break
            taken.add(i)
        else:
            out[n.name] = tuple(sorted(taken))
    return out


class TensorItems:
    """``fn(*args, **kwargs)`` keeping only the tensor items ``indices`` of its tuple
    result (one item: the tensor itself), so a fallback node can run it."""

    def __init__(self, fn: Any, indices: tuple[int, ...]) -> None:
        self.fn, self.indices = fn, indices
        # named for reports; not under torch's module, or fx's code generator would spell
        # it as a torch function
        self.__name__ = f"{getattr(fn, '__name__', 'call')}_items_{'_'.join(map(str, indices))}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        relevant = (*args, *kwargs.values())
        if torch.overrides.has_torch_function(relevant):  # fx records one call, a leaf
            return torch.overrides.handle_torch_function(self, relevant, *args, **kwargs)
        result = self.fn(*args, **kwargs)
        if len(self.indices) == 1:
            return result[self.indices[0]]
        return tuple(result[i] for i in self.indices)


def freeze(
    gm: fx.GraphModule,
    inputs: Sequence[Placeholder],
    args: Sequence[Any],
    mixed: dict[str, tuple[int, ...]] | None = None,
    name: str = "GraphModule",
) -> tuple[fx.GraphModule, tuple[int, ...]]:
    """``gm`` as a module of the caller's tensors only, for one call's ``args``: constants
    become its parameters and buffers (the same tensor objects), scalars Python constants,
    the ``mixed`` calls (``mixed_results``) ``TensorItems`` of them. Returns the module
    (in eval mode, its class called ``name``: warnings and reports name it) and the
    positions in ``args`` of its inputs."""
    mixed = mixed or {}
    root = nn.Module()
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    tensors: list[int] = []
    i = 0
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            p, a = inputs[i], args[i]
            if p.kind == CONSTANT:
                name = f"_mw_const{i}"
                if isinstance(a, nn.Parameter):
                    root.register_parameter(name, a)
                else:
                    root.register_buffer(name, a, persistent=False)
                env[n] = graph.get_attr(name)
            elif p.kind == SCALAR:
                env[n] = scalar_value(a)
            else:
                env[n] = graph.placeholder(n.name)
                tensors.append(i)
            i += 1
            continue
        if n.op in ("get_attr", "call_module"):
            _copy_attr(gm, root, n.target)
        if n.name in mixed:
            env[n] = graph.call_function(
                TensorItems(n.target, mixed[n.name]),
                fx.node.map_arg(n.args, lambda m: env[m]),
                fx.node.map_arg(n.kwargs, lambda m: env[m]),
            )
            continue
        source = n.args[0] if n.op == "call_function" and n.args else None
        if n.target is operator.getitem and isinstance(source, fx.Node) and source.name in mixed:
            taken = mixed[source.name]
            env[n] = (
                env[source]
                if len(taken) == 1
                else graph.call_function(operator.getitem, (env[source], taken.index(n.args[1])))
            )
            continue
        folded = _fold_scalar(n, env)
        env[n] = folded if folded is not _NOT_FOLDED else graph.node_copy(n, lambda m: env[m])
    frozen = fx.GraphModule(root, graph, class_name=name)
    frozen.eval()
    return frozen, tuple(tensors)


def scalar_value(a: Any) -> Any:
    """A scalar input's Python value (dynamo passes some numbers as 0-d tensors)."""
    return a.item() if isinstance(a, torch.Tensor) else a


_NOT_FOLDED = object()
_SCALAR_MODULES = ("_operator", "operator", "math", "builtins")


def _fold_scalar(n: fx.Node, env: dict[fx.Node, Any]) -> Any:
    """The value of a call on scalars only (``s0 * 2``, ``momentum.item()``), computed
    now; ``_NOT_FOLDED`` for anything else (a tensor call is never computed here)."""
    if n.op not in ("call_function", "call_method"):
        return _NOT_FOLDED
    args = fx.node.map_arg(n.args, lambda m: env[m])
    kwargs = fx.node.map_arg(n.kwargs, lambda m: env[m])
    values = [*args, *kwargs.values()]
    if not all(isinstance(v, (int, float, bool)) for v in values):
        return _NOT_FOLDED
    if n.op == "call_method":
        return args[0] if n.target == "item" and not kwargs and len(args) == 1 else _NOT_FOLDED
    if getattr(n.target, "__module__", None) not in _SCALAR_MODULES:
        return _NOT_FOLDED
    return n.target(*args, **kwargs)


def _copy_attr(src: nn.Module, dst: nn.Module, target: str) -> None:
    *path, field = target.split(".")
    for part in path:
        src = getattr(src, part)
        if not hasattr(dst, part):
            dst.add_module(part, nn.Module())
        dst = getattr(dst, part)
    if hasattr(dst, field):
        return
    obj = getattr(src, field)
    if isinstance(obj, nn.Parameter):
        dst.register_parameter(field, obj)
    elif isinstance(obj, torch.Tensor):
        dst.register_buffer(field, obj, persistent=False)
    else:
        setattr(dst, field, obj)


def refusal(gm: fx.GraphModule, inputs: Sequence[Placeholder]) -> str | None:
    """Why ``gm`` must run as dynamo gave it, or None: an input the caller holds is written
    in place (a plan computes functionally, so the write would be lost), a call runs in
    training mode (batch statistics, dropout), or an input is neither a tensor nor a
    number."""
    kinds = {p.name: p for p in inputs}
    other = [p.name for p in inputs if p.kind == OTHER]
    if other:
        return f"graph input(s) {', '.join(other)} are neither tensors nor numbers"
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        training = [k for k in ("training", "train") if _bound_kwargs(n).get(k) is True]
        if training:
            return (
                f"{_describe(n)} runs in training mode ({training[0]}=True); training is not "
                "supported, so this subgraph runs as captured (call model.eval() to optimize it)"
            )
    aliased: set[fx.Node] = set()  # inputs, and views of them
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if kinds.get(n.name, Placeholder(n.name, TENSOR)).kind != SCALAR:
                aliased.add(n)
            continue
        if n.op not in ("call_function", "call_method"):
            continue
        kwargs = _bound_kwargs(n)
        first = n.args[0] if n.args else None
        if isinstance(first, fx.Node) and first in aliased:
            if _writes_first(n, kwargs):
                p = kinds.get(first.name)
                what = (
                    "the model's parameter or buffer " + p.source
                    if p is not None and p.kind == CONSTANT
                    else "a tensor it does not own (an input, or a view of one)"
                )
                return (
                    f"{_describe(n)} writes {what} in place; a plan computes without writing "
                    "its inputs, so this subgraph runs as captured"
                )
            if _is_view(n):
                aliased.add(n)
        out = kwargs.get("out")
        if isinstance(out, fx.Node) and out in aliased:
            return f"{_describe(n)} writes its out= tensor, an input; runs as captured"
    return None


def _bound_kwargs(n: fx.Node) -> dict[str, Any]:
    """The call's arguments by name where its signature is known, else its keywords."""
    kwargs = dict(n.kwargs)
    if n.op != "call_function":
        return kwargs
    try:
        from torch.fx.operator_schemas import normalize_function

        bound = normalize_function(
            n.target, tuple(n.args), dict(n.kwargs), normalize_to_only_use_kwargs=True
        )
    except Exception:  # noqa: BLE001 - an unknown signature: the keywords are all we know
        bound = None
    if bound is not None:
        kwargs.update(bound.kwargs)
    return kwargs


def _writes_first(n: fx.Node, kwargs: dict[str, Any]) -> bool:
    if kwargs.get("inplace") is True:
        return True
    if n.op == "call_method":
        name = str(n.target)
        return name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))
    if n.target in _INPLACE_OPERATORS:
        return True
    name = getattr(n.target, "__name__", "")
    return name.endswith("_") and not name.startswith("_")


def _is_view(n: fx.Node) -> bool:
    if n.op == "call_method":
        return str(n.target) in _VIEW_METHODS
    try:
        return n.target in _VIEW_FUNCTIONS
    except TypeError:  # unhashable target
        return False


def _describe(n: fx.Node) -> str:
    if n.op == "call_method":
        return f"Tensor.{n.target}"
    t = n.target
    return f"{getattr(t, '__module__', '') or ''}.{getattr(t, '__name__', repr(t))}".lstrip(".")


def break_of(gm: fx.GraphModule) -> GraphBreak | None:
    """The graph break that ended ``gm`` (dynamo's ``compile_subgraph_reason``), or None
    when the subgraph ended with the function's return."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    return describe_break(str(getattr(reason, "reason", "")), getattr(reason, "user_stack", ()))


def describe_break(text: str, stack: Sequence[Any] = ()) -> GraphBreak:
    """A ``GraphBreak`` from dynamo's reason text and user stack."""
    first = text.strip().splitlines()[0] if text.strip() else "unknown reason"
    if first.startswith("generic_jump"):
        first = f"data-dependent Python control flow (a branch on a tensor: {first})"
    where = ""
    if stack:
        frame = stack[-1]
        where = f"{frame.filename}:{frame.lineno} in {frame.name}"
    return GraphBreak(first, text.strip(), where)
