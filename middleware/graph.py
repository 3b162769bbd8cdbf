"""The framework-neutral graph: values with types, nodes holding one op each, named constants.

A :class:`Graph` is a directed acyclic graph whose vertices are node names and whose
edges run from a producer node to each consumer node (kept in plain dicts: networkx, 10 MiB
of a process's memory once imported, is loaded only where ``Graph.nx`` is asked for). Each vertex holds one frozen
:class:`Node` record. Values (graph inputs, parameters and node outputs) are named by
strings and typed by :class:`TensorType`. Parameters are numpy arrays: no framework object
lives in a graph except the opaque callable of a fallback node.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .enums import Bound

LAYOUTS = ("nchw", "nhwc")


@dataclasses.dataclass(frozen=True)
class TensorType:
    """Shape, element type and memory layout of one value.

    ``layout`` is the memory order of a 4-d value: "nchw" (contiguous) or "nhwc"
    (channels_last); other ranks are always "nchw" (row-major).
    """

    shape: tuple[int, ...]
    dtype: str = "float32"
    layout: str = "nchw"

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize if self.dtype != "bfloat16" else 2

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def __str__(self) -> str:
        dims = "x".join(str(s) for s in self.shape) or "scalar"
        lay = f",{self.layout}" if self.rank == 4 and self.layout != "nchw" else ""
        return f"{self.dtype}[{dims}{lay}]"


@dataclasses.dataclass(frozen=True)
class Node:
    """One operation: a catalogue op applied to input values, producing output values.

    ``attrs`` holds plain Python values (ints, floats, tuples, strings). ``bound`` (a
    :class:`~middleware.enums.Bound`; a string such as "io" is converted) and ``group`` are
    filled in by the classify and group passes. ``source`` names the layer
    of the original model the node came from (for reports and generated code).
    ``payload`` is only used by fallback nodes: the original framework callable.
    """

    name: str
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    bound: Bound | None = None
    group: int | None = None
    source: str = ""
    payload: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.bound is not None and not isinstance(self.bound, Bound):
            object.__setattr__(self, "bound", Bound(self.bound))

    def replace(self, **changes: Any) -> Node:
        return dataclasses.replace(self, **changes)


# ``graph.meta[PARAM_SOURCES]``: parameter name -> (the array the frontend stored, the user's
# tensor it came from). A plan may use the user's tensor itself for a constant the passes left
# as it was (``backends.interface.constant_tensor``): one copy of unchanged weights.
PARAM_SOURCES = "param_sources"
# ``graph.meta[RELEASED_PARAMS]``: parameter name -> why its array left ``graph.params``
# (``Graph.release_params``): a built plan holds the only copy it needs (a prepacked or
# transformed weight), so the graph stops holding a second one. The value keeps its type;
# ``Graph.evaluate`` refuses to run a node that reads it.
RELEASED_PARAMS = "released_params"
# ``graph.meta[RELEASE_AS_BUILT]``: set by the pipeline on a graph whose units it is
# building: a vendor call that holds its own copy of a weight read by no other node then
# swaps the graph's array for a stand-in right away (``Graph.stand_in_params``), so that
# the folded and the prepacked copy of every layer are not alive at once.
RELEASE_AS_BUILT = "release_as_built"
# ``graph.meta[TRAINING]``: True for a graph traced for a training plan; the passes then
# never fold a parameter that needs a gradient into a derived constant.
TRAINING = "training"


class Graph:
    """A dataflow graph of :class:`Node` records over named, typed values.

    Nodes are kept in a topological order (the order they were added in, which the
    frontend and every pass keep topological). ``output_tree`` is the structure the
    original model returned (a value name, or nested tuples/lists/dicts of them).
    """

    def __init__(self) -> None:
        self._nodes: dict[str, Node] = {}
        self._succ: dict[str, dict[str, None]] = {}  # consumers of a node, insertion-ordered
        self._order: list[str] = []
        self.values: dict[str, TensorType] = {}
        self.params: dict[str, np.ndarray] = {}
        self.inputs: list[str] = []
        self.output_tree: Any = None
        self._producer: dict[str, str] = {}
        self.meta: dict[str, Any] = {}

    # ----------------------------------------------------------------- building
    def add_input(self, name: str, ttype: TensorType) -> str:
        self._check_new_value(name)
        self.values[name] = ttype
        self.inputs.append(name)
        return name

    def add_param(self, name: str, array: np.ndarray, layout: str = "nchw") -> str:
        self._check_new_value(name)
        array = np.asarray(array)
        self.params[name] = array
        self.values[name] = TensorType(tuple(array.shape), str(array.dtype), layout)
        return name

    def add_node(self, node: Node, out_types: Sequence[TensorType]) -> Node:
        if node.name in self._nodes:
            raise ValueError(f"duplicate node name {node.name!r}")
        if len(out_types) != len(node.outputs):
            raise ValueError(
                f"node {node.name}: {len(node.outputs)} outputs, {len(out_types)} types"
            )
        for v in node.inputs:
            if v not in self.values:
                raise ValueError(f"node {node.name} reads unknown value {v!r}")
        for v, t in zip(node.outputs, out_types, strict=True):
            self._check_new_value(v)
            self.values[v] = t
            self._producer[v] = node.name
        self._nodes[node.name] = node
        self._succ[node.name] = {}
        self._order.append(node.name)
        for v in node.inputs:
            p = self._producer.get(v)
            if p is not None:
                self._succ[p][node.name] = None
        return node

    def set_outputs(self, tree: Any) -> None:
        for v in flatten_tree(tree):
            if v not in self.values:
                raise ValueError(f"output {v!r} is not a value of the graph")
        self.output_tree = tree

    def _check_new_value(self, name: str) -> None:
        if name in self.values:
            raise ValueError(f"value {name!r} defined twice")

    def fresh_name(self, base: str) -> str:
        """A value or node name not used yet, derived from ``base``."""
        if base not in self.values and base not in self._nodes:
            return base
        i = 1
        while f"{base}_{i}" in self.values or f"{base}_{i}" in self._nodes:
            i += 1
        return f"{base}_{i}"

    # ------------------------------------------------------------------ queries
    @property
    def nx(self) -> Any:
        """The graph as a new ``networkx.DiGraph`` (vertices: node names, each with its
        ``node`` record; edges producer -> consumer), for networkx's algorithms."""
        import networkx as nx

        g = nx.DiGraph()
        for name in self._order:
            g.add_node(name, node=self._nodes[name])
        for p, consumers in self._succ.items():
            for c in consumers:
                g.add_edge(p, c)
        return g

    def successors(self, name: str) -> list[str]:
        """The names of the nodes that read an output of node ``name``."""
        return list(self._succ[name])

    def nodes(self) -> Iterator[Node]:
        nodes = self._nodes
        for name in self._order:
            yield nodes[name]

    def node(self, name: str) -> Node:
        return self._nodes[name]

    def __len__(self) -> int:
        return len(self._order)

    def producer(self, value: str) -> Node | None:
        name = self._producer.get(value)
        return None if name is None else self.node(name)

    def consumers(self, value: str) -> list[Node]:
        p = self._producer.get(value)
        if p is None:  # graph input or parameter: scan
            return [n for n in self.nodes() if value in n.inputs]
        return [
            self.node(s)
            for s in self._order_of(iter(self._succ[p]))
            if value in self.node(s).inputs
        ]

    def _order_of(self, names: Iterator[str]) -> list[str]:
        pos = {n: i for i, n in enumerate(self._order)} if len(self._order) < 64 else None
        names = list(names)
        if pos is None:
            index = self._index()
            return sorted(names, key=index.__getitem__)
        return sorted(names, key=pos.__getitem__)

    def _index(self) -> dict[str, int]:
        cached = self.meta.get("_index")
        if cached is None or cached[0] != len(self._order):
            cached = (len(self._order), {n: i for i, n in enumerate(self._order)})
            self.meta["_index"] = cached
        return cached[1]

    def output_values(self) -> list[str]:
        return list(flatten_tree(self.output_tree))

    def is_param(self, value: str) -> bool:
        """``value`` is a parameter (its array held in ``params``, or released)."""
        return value in self.params or value in self.meta.get(RELEASED_PARAMS, {})

    def release_params(self, names: Sequence[str], why: str) -> None:
        """Drop the arrays of parameters ``names`` from ``params`` (their types stay), each
        recorded in ``meta[RELEASED_PARAMS]`` with ``why``. For a graph whose plan is built
        and holds its own copy of these weights: the graph then no longer keeps a second
        one alive. :meth:`evaluate` raises on a node that reads a released parameter."""
        gone = {n: why for n in names if n in self.params}
        if not gone:
            return
        for n in gone:
            del self.params[n]
        self._record_released(gone)
        return_freed_memory()

    def stand_in_params(self, names: Sequence[str], why: str) -> None:
        """Swap the arrays of parameters ``names`` for stand-ins that hold no memory (a
        zero-stride view of one NaN, same shape and dtype), recorded in
        ``meta[RELEASED_PARAMS]`` with ``why``: while a plan builds (``RELEASE_AS_BUILT``)
        the buffer planner still sees a parameter, but no copy of its weight; the plan
        builder refuses to make a constant of a stand-in and the pipeline removes them
        (:meth:`release_params`) once the plan is built."""
        gone = {n: why for n in names if n in self.params}
        for n in gone:
            a = self.params[n]
            self.params[n] = np.lib.stride_tricks.as_strided(
                np.full(1, np.nan, a.dtype), a.shape, (0,) * a.ndim, writeable=False
            )
        if gone:
            self._record_released(gone)
            return_freed_memory()

    def released(self) -> Mapping[str, str]:
        """Parameters released (or stood in for) and why (``meta[RELEASED_PARAMS]``)."""
        return self.meta.get(RELEASED_PARAMS, {})

    def _record_released(self, gone: Mapping[str, str]) -> None:
        # a new mapping, never changed in place: copies of the graph share meta's values
        self.meta[RELEASED_PARAMS] = {**self.meta.get(RELEASED_PARAMS, {}), **gone}

    def uses(self, value: str) -> int:
        """How many times ``value`` is read: by nodes, plus once per appearance in the outputs."""
        n = sum(node.inputs.count(value) for node in self.consumers(value))
        return n + self.output_values().count(value)

    # ----------------------------------------------------------------- copying
    def copy(self) -> Graph:
        """A new graph with the same records (records are frozen; arrays are shared, never written)."""
        g = Graph()
        g._nodes = dict(self._nodes)
        g._succ = {k: dict(v) for k, v in self._succ.items()}
        g._order = list(self._order)
        g.values = dict(self.values)
        g.params = dict(self.params)
        g.inputs = list(self.inputs)
        g.output_tree = self.output_tree
        g._producer = dict(self._producer)
        g.meta = {k: v for k, v in self.meta.items() if not k.startswith("_")}
        return g

    def replace_node(self, name: str, node: Node) -> None:
        """Swap the record of node ``name`` for ``node`` (same inputs and outputs)."""
        old = self.node(name)
        if old.inputs != node.inputs or old.outputs != node.outputs or old.name != node.name:
            raise ValueError(
                "replace_node keeps names, inputs and outputs; rebuild the graph instead"
            )
        self._nodes[name] = node

    def rebuild(
        self, nodes: Sequence[tuple[Node, Sequence[TensorType]]], keep_values: bool = True
    ) -> Graph:
        """A new graph with the same inputs, params and outputs but the given nodes.

        Params that no node or output reads any longer are dropped.
        """
        g = Graph()
        g.meta = {k: v for k, v in self.meta.items() if not k.startswith("_")}
        for v in self.inputs:
            g.add_input(v, self.values[v])
        read = {v for n, _ in nodes for v in n.inputs} | set(flatten_tree(self.output_tree))
        for p, arr in self.params.items():
            if p in read:
                g.add_param(p, arr, self.values[p].layout)
        for n, types in nodes:
            g.add_node(n, types)
        g.set_outputs(self.output_tree)
        return g

    # --------------------------------------------------------------- printing
    def text(self) -> str:
        """The graph as readable text, one line per input, parameter summary and node."""
        lines = []
        for v in self.inputs:
            lines.append(f"input  {v}: {self.values[v]}")
        nparam = sum(a.size for a in self.params.values())
        lines.append(f"params {len(self.params)} tensors, {nparam} elements")
        for n in self.nodes():
            outs = ", ".join(f"{v}: {self.values[v]}" for v in n.outputs)
            ins = ", ".join(n.inputs)
            attrs = ", ".join(f"{k}={_fmt(v)}" for k, v in n.attrs.items())
            tag = ""
            if n.bound is not None:
                tag += f"  [{n.bound}"
                tag += f" g{n.group}]" if n.group is not None else "]"
            lines.append(f"{outs} = {n.op}({ins}{'; ' + attrs if attrs else ''}){tag}")
        lines.append(f"return {_fmt_tree(self.output_tree)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return f"<Graph {len(self)} nodes, {len(self.inputs)} inputs, {len(self.params)} params>"

    # ------------------------------------------------------------- evaluating
    def evaluate(self, *inputs: Any) -> Any:
        """Run every node with its catalogue reference implementation (torch tensors in and out).

        This is the reference interpreter used to test passes and kernels.
        """
        import torch  # the graph itself holds no framework object

        if _reference is None:
            raise RuntimeError("no op catalogue installed: import middleware.ops first")
        if len(inputs) != len(self.inputs):
            raise ValueError(f"graph takes {len(self.inputs)} inputs, got {len(inputs)}")
        released = self.meta.get(RELEASED_PARAMS, {})
        read = [v for n in self.nodes() for v in n.inputs if v in released]
        if read:
            raise RuntimeError(
                f"graph.evaluate: parameter {read[0]!r} was released from this graph "
                f"({released[read[0]]}); trace the model again (middleware.trace) for a "
                "graph that holds every weight"
            )
        device = inputs[0].device if inputs else torch.device("cpu")
        env: dict[str, Any] = dict(zip(self.inputs, inputs, strict=True))
        for p, arr in self.params.items():
            env[p] = torch.from_numpy(np.ascontiguousarray(arr)).to(device)
        for n in self.nodes():
            fn = _reference(n)
            out = fn(*[env[v] for v in n.inputs])
            if len(n.outputs) == 1:
                env[n.outputs[0]] = out
            else:
                for v, o in zip(n.outputs, out, strict=True):
                    env[v] = o
        return map_tree(self.output_tree, env.__getitem__)


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the kernel (glibc's ``malloc_trim``; nothing
    elsewhere; about 0.3 ms). Released parameter arrays, and what tracing and the passes
    freed, are mostly below glibc's mmap threshold (which rises to 32 MiB once the
    framework has freed large tensors): they stay in the heap, resident, until trimmed.
    Measured at batch 16 (resident memory, MiB): resnet50 after optimize() 1052 without
    the trims, 968 with them; resnet18's peak while its plan builds 920 with one trim at
    the end, 859 with one after each layer's release (``RELEASE_AS_BUILT``)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


# How a node's reference implementation is bound (``ops.OpDef.bind``). The op catalogue
# sits above this module (its shape and loop rules read graphs) and installs it when it is
# imported, so that :meth:`Graph.evaluate` needs no import of the catalogue here.
_reference: Callable[[Node], Callable[..., Any]] | None = None


def install_reference(bind: Callable[[Node], Callable[..., Any]]) -> None:
    """Set how :meth:`Graph.evaluate` binds a node to its reference implementation (the op
    catalogue calls this once, on import)."""
    global _reference
    _reference = bind


def flatten_tree(tree: Any) -> Iterator[str]:
    """The value names in a nested output structure, in order."""
    if isinstance(tree, str):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for t in tree:
            yield from flatten_tree(t)
    elif isinstance(tree, dict):
        for t in tree.values():
            yield from flatten_tree(t)


def map_tree(tree: Any, fn: Any) -> Any:
    """Rebuild a nested output structure with every value name replaced by ``fn(name)``."""
    if isinstance(tree, str):
        return fn(tree)
    if isinstance(tree, tuple):
        items = [map_tree(t, fn) for t in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    if isinstance(tree, list):
        return [map_tree(t, fn) for t in tree]
    if isinstance(tree, dict):
        return type(tree)((k, map_tree(v, fn)) for k, v in tree.items())
    return tree


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, tuple):
        return "(" + ",".join(_fmt(x) for x in v) + ")"
    return str(v)


def _fmt_tree(tree: Any) -> str:
    if isinstance(tree, str):
        return tree
    if isinstance(tree, (tuple, list)):
        return "(" + ", ".join(_fmt_tree(t) for t in tree) + ")"
    if isinstance(tree, dict):
        return "{" + ", ".join(f"{k}: {_fmt_tree(v)}" for k, v in tree.items()) + "}"
    return repr(tree)
