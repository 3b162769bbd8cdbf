"""Lowering a traced fx graph into the middleware graph: each call maps, through the rule
tables it is given (per module type, function and tensor method), onto one registry op;
in-place ops become functional (later readers of the mutated value read the op's result);
anything no rule understands becomes a ``fallback`` node calling the original callable."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from ..errors import TraceError, UnsupportedError
from ..graph import PARAM_SOURCES, Graph, Node, TensorType
from ..ops import ValueRef, get_op
from .rule_helpers import Unsupported, V
from .tracer import fetch_attr

# (lowering, fx node, callable, lowered args, lowered kwargs) ->
# (op name, tensor inputs, attrs, in-place?), or raises Unsupported
Rule = Callable[..., tuple[str, Sequence[V], dict[str, Any], bool]]


@dataclasses.dataclass(frozen=True)
class Rules:
    """The rule tables of a frontend: by module type, by function, by tensor method; and
    the functions that compute nothing (asserts)."""

    modules: Mapping[type, Rule]
    # by the function object, or by "module.qualname" for a package that need not be
    # installed (torchvision's)
    functions: Mapping[Any, Rule]
    methods: Mapping[str, Rule]
    noops: Collection[Any] = ()


def _is_channels_last(x: Any) -> bool:
    """A 4-d tensor stored channels_last (and not also plainly contiguous)."""
    return (
        isinstance(x, torch.Tensor)
        and x.dim() == 4
        and x.is_contiguous(memory_format=torch.channels_last)
        and not x.is_contiguous()
    )


class Lowering:
    """One lowering run over a traced fx graph (``run`` returns the middleware graph)."""

    def __init__(
        self, gm: fx.GraphModule, fx_graph: fx.Graph, examples: Sequence[Any], rules: Rules
    ) -> None:
        self.gm = gm
        self.rules = rules
        self.fx_graph = fx_graph
        self.examples = list(examples)  # the user's example inputs (their memory formats)
        self.g = Graph()
        self.env: dict[fx.Node, Any] = {}
        self.param_of: dict[int, tuple[str, torch.Tensor]] = {}  # id(tensor) -> (name, tensor)
        # values an in-place write went through an alias of: reading one raises (why)
        self.stale: dict[str, str] = {}

    # -- values -------------------------------------------------------------
    def param(self, tensor: torch.Tensor, name: str) -> V:
        key = id(tensor)
        if key in self.param_of:
            return V(self.param_of[key][0])
        name = self.g.fresh_name(name)
        array = tensor.detach().cpu().numpy()
        self.g.add_param(name, array)
        self.param_of[key] = (name, tensor)  # keeps the tensor alive so its id stays unique
        # the user's own tensor behind the constant: a plan on its device may use it as it
        # is (interface.constant_tensor) while the graph still holds this very array
        self.g.meta.setdefault(PARAM_SOURCES, {})[name] = (array, tensor.detach())
        return V(name)

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
        self, fxn: fx.Node, op: str, inputs: Sequence[V], attrs: dict[str, Any], source: str = ""
    ) -> Any:
        meta = fxn.meta.get("mw_value")
        if isinstance(meta, TensorType):
            types, outs = [meta], (fxn.name,)
        elif isinstance(meta, tuple) and meta and all(isinstance(t, TensorType) for t in meta):
            types = list(meta)
            outs = tuple(f"{fxn.name}.{i}" for i in range(len(meta)))
        else:
            raise Unsupported(f"{fxn.name}: produces a non-tensor value")
        self.check_fresh(inputs)
        node = Node(
            fxn.name, op, tuple(v.name for v in inputs), outs, attrs, source=source or fxn.name
        )
        self.g.add_node(node, types)
        if len(outs) == 1 and isinstance(meta, TensorType):
            return V(outs[0])
        return tuple(V(o) for o in outs)

    def emit_fallback(
        self, fxn: fx.Node, fn: Callable[..., Any], args: Any, kwargs: Any, reason: str
    ) -> Any:
        inputs: list[V] = []

        def template(a: Any) -> Any:
            if isinstance(a, V):
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

        if _writes_in_place(fxn, kwargs) and args and isinstance(args[0], V):
            # a write the graph cannot follow: its other readers (and the tensors sharing
            # its memory) would not see it, and a plan may run them in another order
            raise TraceError(
                f"{_target_name(fxn)} writes in place into {args[0].name} and is not in the "
                "op catalogue"
            )
        targs, tkwargs = template(tuple(args)), template(dict(kwargs))
        self.check_fresh(inputs)
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
            V(outs[0])
            if len(outs) == 1 and isinstance(meta, TensorType)
            else tuple(V(o) for o in outs)
        )

    # -- the walk ---------------------------------------------------------------
    def run(self) -> Graph:
        for fxn in self.fx_graph.nodes:
            if fxn.op == "placeholder":
                meta = fxn.meta.get("mw_value")
                if not isinstance(meta, TensorType):
                    # a TraceError: optimize() captures such a model through TorchDynamo,
                    # whose subgraphs take the tensors inside the structure
                    raise TraceError(f"input {fxn.name!r} is not a tensor ({type(meta).__name__})")
                if meta.rank == 4 and _is_channels_last(self.examples[len(self.g.inputs)]):
                    meta = TensorType(meta.shape, meta.dtype, "nhwc")
                self.env[fxn] = V(self.g.add_input(fxn.name, meta))
            elif fxn.op == "get_attr":
                obj = fetch_attr(self.gm, fxn.target)
                if isinstance(obj, torch.Tensor):
                    self.env[fxn] = self.param(obj, fxn.target)
                else:
                    self.env[fxn] = obj
            elif fxn.op == "output":
                out = self.lower_arg(fxn.args[0])
                self.check_fresh(out)
                self.g.set_outputs(_output_tree(out))
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
        if fxn.op == "call_function" and fxn.target in self.rules.noops:
            self.env[fxn] = None
            return
        rule, fn = self.rule_for(fxn)
        reason = ""
        if rule is not None:
            try:
                op, inputs, attrs, inplace = rule(self, fxn, fn, args, kwargs)
                self.env[fxn] = self.emit(fxn, op, inputs, attrs, _source(fxn))
                if inplace and isinstance(args[0], V):
                    self.check_inplace_aliasing(args[0], fxn)
                    self.redirect(args[0], self.env[fxn], fxn)
                return
            except Unsupported as e:
                reason = str(e)
        else:
            reason = f"{_target_name(fxn)} is not in the op catalogue"
        self.env[fxn] = self.emit_fallback(fxn, fn, args, kwargs, reason)

    def check_inplace_aliasing(self, target: V, at: fx.Node) -> None:
        """An in-place op writes into ``target``: in PyTorch the write also reaches every
        tensor sharing its memory (the values it is a view of, views taken of them or of
        it), while in the graph each value is its own. Those aliases are marked: a node
        (or the output) reading one later raises TraceError, and the model is captured
        otherwise (TorchDynamo) or runs as the original. Later readers of ``target``
        itself read the op's result (``redirect``)."""
        bases = {target.name}
        todo = [target.name]
        while todo:  # up: the values target is (transitively) a view of
            producer = self.g.producer(todo.pop())
            if producer is not None and _may_alias(producer.op):
                for v in producer.inputs:
                    if v not in bases and v in self.g.values and v not in self.g.params:
                        bases.add(v)
                        todo.append(v)
        aliases = set(bases)
        todo = list(bases)
        while todo:  # down: every view taken of any of them
            for consumer in self.g.consumers(todo.pop()):
                if _may_alias(consumer.op):
                    for v in consumer.outputs:
                        if v not in aliases:
                            aliases.add(v)
                            todo.append(v)
        for v in aliases - {target.name}:
            self.stale[v] = (
                f"{_target_name(at)} writes in place into {target.name}, which shares memory "
                f"with {v}; {v} is read afterwards (in-place writes through views are not "
                "supported)"
            )

    def check_fresh(self, values: Any) -> None:
        """Raise TraceError where ``values`` holds a value an in-place write has made stale."""
        for v in _values_in(values):
            if v.name in self.stale:
                raise TraceError(self.stale[v.name])

    def redirect(self, old: V, new: Any, at: fx.Node) -> None:
        """An in-place op mutated ``old``: later readers of ``old`` read ``new`` instead."""
        for k, v in list(self.env.items()):
            if isinstance(v, V) and v.name == old.name:
                self.env[k] = new

    def rule_for(self, fxn: fx.Node) -> tuple[Any, Callable[..., Any]]:
        if fxn.op == "call_module":
            mod = self.gm.get_submodule(fxn.target)
            return self.rules.modules.get(type(mod)), mod
        if fxn.op == "call_method":
            name = fxn.target

            def method(self_, *a: Any, **k: Any) -> Any:
                return getattr(self_, name)(*a, **k)

            method.__name__ = name
            return self.rules.methods.get(name), method
        try:
            rule = self.rules.functions.get(fxn.target)
        except TypeError:  # unhashable target
            return None, fxn.target
        if rule is None:  # a function of an optional package, keyed by its dotted name
            name = getattr(fxn.target, "__qualname__", None)
            module = getattr(fxn.target, "__module__", None)
            if isinstance(name, str) and isinstance(module, str):
                rule = self.rules.functions.get(f"{module}.{name}")
        return rule, fxn.target


def _values_in(tree: Any) -> list[V]:
    if isinstance(tree, V):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [v for x in tree for v in _values_in(x)]
    if isinstance(tree, dict):
        return [v for x in tree.values() for v in _values_in(x)]
    return []


def _writes_in_place(fxn: fx.Node, kwargs: Mapping[str, Any]) -> bool:
    """A call that mutates its first argument: ``inplace=True``, or a name with PyTorch's
    trailing underscore (``zero_``, ``masked_fill_``; not dunders)."""
    if kwargs.get("inplace") is True:
        return True
    if fxn.op == "call_module":
        return False
    name = fxn.target if fxn.op == "call_method" else getattr(fxn.target, "__name__", "")
    if not isinstance(name, str):
        return False
    if name.startswith("__i") and name.endswith("__"):  # x.__iadd__(y), operator.imul, ...
        return name[3:-2] in _INPLACE_OPERATORS
    return name.endswith("_") and not name.endswith("__")


_INPLACE_OPERATORS = frozenset(
    "add sub mul truediv floordiv mod pow matmul and or xor lshift rshift".split()
)


def _may_alias(op: str) -> bool:
    """Whether ``op``'s result may share memory with its input in PyTorch (a view, a
    fallback call of unknown semantics, a split's pieces)."""
    d = get_op(op)
    return op in ("fallback", "split") or d.view_like or d.strided_view


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
    if isinstance(a, V):
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
