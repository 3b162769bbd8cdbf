"""Batch slicing: which prefix of a network runs depth-first over slices of the batch, and
in slices of how many samples (the compile decision; ``runtime/chunked.py`` runs it).

A CNN's largest activations are at its high-resolution first layers (vgg16 at batch 16:
two 205 MB tensors at 224x224; resnet18: 51 MB after its stem convolution), while later
layers are small. Fusion removes the intermediates *inside* an I/O-bound group, but a
convolution's full output must still exist before the next layer reads it. Running the
first layers of the network on one slice of the batch at a time -- all of them, then the
next slice -- holds one slice's intermediates instead of the whole batch's: only the last
values of that prefix (the *cut*, after the resolution has dropped) exist at full batch.
It is depth-first execution across layers in the batch dimension, which needs no halo
because every op of the prefix treats each sample on its own (``OpDef.per_sample``).

:func:`batch_slice` is the pass: the :class:`Cut` record for a passed graph (or None).
:func:`choose_cut` picks the prefix from an estimate of the live bytes at each node (the
values a fused group keeps in cache are not counted); :func:`split_graph` makes the
prefix graph (at the slice's batch) and the suffix graph (whose inputs are the cut
values).
"""

from __future__ import annotations

import dataclasses

from ..graph import Graph, Node, TensorType
from ..hardware import Hardware
from ..ops import get_op
from ..options import Options

# Auto mode chunks only where the estimate saves at least this share of the peak and this
# many bytes: below that the extra plan is not worth its calls.
MIN_SAVING = 0.2
MIN_SAVING_BYTES = 8 << 20
# Among cuts whose estimated peak is within this factor of the least, the shallowest is
# taken: deeper layers have small slices whose extra calls cost more than they save
# (measured at batch 16: densenet121 503 ms cut after transition2, 545 ms after
# transition3; squeezenet1_1 73 against 91 ms).
PEAK_SLACK = 1.3
# What one extra call of a prefix step costs (Python, the OpenMP fork/join, oneDNN's
# primitive lookup): shufflenet_v2 at batch 16 ran 10 ms slower in 16 slices than in 4,
# about 420 more calls.
CALL_SECONDS = 24e-6


@dataclasses.dataclass(frozen=True)
class Cut:
    """The prefix ``nodes`` (graph order) run in ``batch // chunk`` slices of ``chunk``
    samples; ``values`` are the prefix results the rest of the graph reads."""

    nodes: tuple[str, ...]
    values: tuple[str, ...]
    batch: int
    chunk: int
    peak_before: int  # estimated peak I/O bytes without chunking
    peak_after: int  # and with it

    def describe(self) -> str:
        mib = 1 << 20
        return (
            f"the first {len(self.nodes)} nodes ({self.nodes[0]} .. {self.nodes[-1]}) run "
            f"depth-first over the batch: {self.batch // self.chunk} slices of {self.chunk} "
            f"sample(s); estimated peak I/O {self.peak_before / mib:.1f} -> "
            f"{self.peak_after / mib:.1f} MiB"
        )


# ----------------------------------------------------------------------- choosing a cut
def _batch_of(graph: Graph) -> int | None:
    """The batch size shared by the graph's inputs (None without a batched input)."""
    sizes = {graph.values[v].shape[0] for v in graph.inputs if graph.values[v].rank >= 1}
    return sizes.pop() if len(sizes) == 1 else None


# Ops whose inputs after the first are weights: the prefix slices their activation only, so
# the weights must be graph constants (a weight computed from the batch, even one whose
# first dim happens to equal the batch, mixes the samples).
WEIGHTED_OPS = frozenset({"conv2d", "conv2d_dw", "linear"})


def batched_values(graph: Graph, batch: int) -> set[str]:
    """The values whose dimension 0 is the batch: the graph inputs of that leading size,
    and the outputs of every node that computes each sample from that sample alone
    (:func:`_per_sample`), propagated in graph order. The batch dimension is tracked from
    where it enters, never guessed from a size that happens to equal it."""
    batched = _batched_inputs(graph, batch)
    for n in graph.nodes():
        if _per_sample(graph, n, batch, batched):
            batched.update(n.outputs)
    return batched


def _weights(node: Node) -> tuple[str, ...]:
    """The weight and bias inputs of a weighted op (a convolution's fused residual, its last
    input, is an activation), else ()."""
    if node.op not in WEIGHTED_OPS:
        return ()
    end = len(node.inputs) - int(bool(node.attrs.get("residual", False)))
    return tuple(node.inputs[1:end])


def _batched_inputs(graph: Graph, batch: int) -> set[str]:
    return {
        v for v in graph.inputs if graph.values[v].rank >= 1 and graph.values[v].shape[0] == batch
    }


def _per_sample(graph: Graph, node: Node, batch: int, batched: set[str] | None = None) -> bool:
    """``node`` computes each sample of its batch-``batch`` values from that sample alone,
    given the values ``batched`` along dimension 0 so far (default: the graph's inputs of
    that leading size)."""
    if not get_op(node.op).per_sample:
        return False
    if batched is None:
        batched = _batched_inputs(graph, batch)
    acts = [v for v in node.inputs if v not in graph.params]
    if not acts or any(v not in batched for v in acts):
        return False
    if any(v not in graph.params for v in _weights(node)):
        return False  # a weight or bias that is not a parameter
    rank = graph.values[node.outputs[0]].rank
    for v in node.outputs:
        t = graph.values[v]
        if t.rank < 1 or t.shape[0] != batch:
            return False
    if get_op(node.op).elementwise and any(graph.values[v].rank != rank for v in acts):
        return False  # broadcast from the right: a lower-rank operand's dim 0 is not the batch
    return _attrs_per_sample(graph, node, batch, rank)


def _attrs_per_sample(graph: Graph, node: Node, batch: int, rank: int) -> bool:
    """The attribute checks of :func:`_per_sample`: the op does not reduce, concatenate,
    split, move or reshape dimension 0, and a parameter operand broadcasts over it."""
    a = node.attrs
    if node.op in ("add", "sub", "mul", "div"):  # a parameter operand must broadcast over N
        for p in node.inputs:
            if p in graph.params:
                pt = graph.values[p]
                if pt.rank == rank and pt.shape[0] != 1:
                    return False
    if node.op in ("cat", "split", "softmax", "log_softmax"):
        return a["dim"] % graph.values[node.inputs[0]].rank != 0
    if node.op == "flatten":
        return a["start_dim"] % graph.values[node.inputs[0]].rank != 0
    if node.op == "permute":
        return tuple(a["dims"])[0] % rank == 0
    if node.op in ("mean", "sum", "amax"):
        r = graph.values[node.inputs[0]].rank
        return all(d % r != 0 for d in a["dims"])
    if node.op == "reshape":
        return tuple(a["shape"])[0] in (batch, -1)
    return True


def _materialised(graph: Graph) -> dict[str, bool]:
    """Whether each node output exists in memory: a value read only inside the fused
    I/O-bound group that makes it stays in cache (graph outputs always exist)."""
    outputs = set(graph.output_values())
    result: dict[str, bool] = {}
    for n in graph.nodes():
        for v in n.outputs:
            readers = graph.consumers(v)
            inside = (
                n.group is not None
                and n.bound == "io"
                and bool(readers)
                and all(r.group == n.group for r in readers)
            )
            result[v] = v in outputs or not inside
    return result


def _param_bytes(graph: Graph, node: Node) -> int:
    return sum(graph.values[v].nbytes for v in node.inputs if v in graph.params)


def choose_cut(
    graph: Graph, chunk: int | str, cache_bytes: int, bandwidth_gbs: float = 20.0
) -> Cut | None:
    """The prefix to run over slices of the batch, and the slice size, or None.

    ``chunk``: a number of samples per slice (the largest divisor of the batch not above
    it; chunked wherever a prefix exists), "auto", or 0 (never). The prefix ends before the
    first node that mixes samples (:func:`batched_values`: the batch dimension is tracked
    from the inputs; convolution weights must be parameters) or whose weights outweigh both
    its output slice and half
    of ``cache_bytes`` (they would be read once per slice from memory); a cut never splits
    a fused group. The estimated peak of a cut is the larger of (inputs + the cut values
    at full batch + a slice's largest live set) and the rest of the graph's largest live
    set; among cuts within ``PEAK_SLACK`` of the least, the shallowest is taken.

    "auto" weighs each (cut, slice size) by a cost model: the slices' extra calls
    (``CALL_SECONDS`` each) must cost at most half of what keeping the prefix's
    intermediates in cache saves (writing and reading them once at ``bandwidth_gbs``);
    it chunks only where that saves at least ``MIN_SAVING`` of the estimated peak.
    """
    batch = _batch_of(graph)
    if batch is None or batch < 2 or chunk in (0, None, "0"):
        return None
    batched = batched_values(graph, batch)
    nodes = list(graph.nodes())
    index = {n.name: i for i, n in enumerate(nodes)}
    mat = _materialised(graph)
    outputs = set(graph.output_values())
    last: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for v in n.inputs:
            last[v] = i
    for v in outputs:
        last[v] = len(nodes)
    in_bytes = sum(graph.values[v].nbytes for v in graph.inputs)
    # live bytes (inputs included) while each node runs
    live, frees = [], {}
    for v, i in last.items():
        if v in graph.values and v not in graph.params and v not in graph.inputs:
            frees.setdefault(i, []).append(v)
    cur = in_bytes
    for i, n in enumerate(nodes):
        cur += sum(graph.values[v].nbytes for v in n.outputs if mat[v])
        live.append(cur)
        cur -= sum(graph.values[v].nbytes for v in frees.get(i, ()) if mat.get(v, False))
    peak = max(live, default=in_bytes)
    tail_max = [0] * (len(nodes) + 1)  # max(live[k:])
    for k in range(len(nodes) - 1, -1, -1):
        tail_max[k] = max(live[k], tail_max[k + 1])
    group_end: dict[int, int] = {}
    for i, n in enumerate(nodes):
        if n.group is not None:
            group_end[n.group] = i

    if chunk == "auto":
        sizes = [d for d in range(1, batch) if batch % d == 0]
    else:
        d = max(1, min(int(chunk), batch))
        while batch % d:
            d -= 1
        sizes = [d] if d < batch else []

    # (estimate, k, size, cut values) of every allowed cut
    cands: list[tuple[int, int, int, tuple[str, ...]]] = []
    for size in sizes:
        f = size / batch
        open_values: dict[str, int] = {}  # prefix value -> bytes, while read after the prefix
        pre_max, moved, calls = 0, 0, 0
        for k, n in enumerate(nodes):
            if not _per_sample(graph, n, batch, batched) or any(v in outputs for v in n.outputs):
                break
            out_slice = sum(graph.values[v].nbytes for v in n.outputs) * f
            if _param_bytes(graph, n) > max(out_slice, cache_bytes / 2):
                break  # its weights would be read once per slice from beyond the caches
            pre_max = max(pre_max, live[k] - in_bytes)
            written = sum(graph.values[v].nbytes for v in n.outputs if mat[v])
            moved += written
            calls += written > 0
            for v in n.outputs:
                open_values[v] = graph.values[v].nbytes
            for v in [v for v in open_values if last.get(v, -1) <= k]:
                del open_values[v]
            if n.group is not None and group_end[n.group] > k:
                continue  # the cut would split a fused group
            if k + 1 >= len(nodes) or not open_values:
                continue
            if chunk == "auto":
                extra_calls = calls * (batch // size - 1)
                saved = 2 * moved / (bandwidth_gbs * 1e9)
                if extra_calls * CALL_SECONDS > saved / 2:
                    continue
            phase1 = in_bytes + sum(open_values.values()) + f * pre_max
            est = int(max(phase1, tail_max[k + 1]))
            cands.append((est, k, size, tuple(open_values)))
    if not cands:
        return None
    best = min(c[0] for c in cands)
    est, k, size, values = min(
        (c for c in cands if c[0] <= best * PEAK_SLACK), key=lambda c: (c[1], c[2])
    )
    if chunk == "auto" and (peak - est < MIN_SAVING * peak or peak - est < MIN_SAVING_BYTES):
        return None
    order = sorted(values, key=lambda v: index[graph.producer(v).name])
    return Cut(tuple(n.name for n in nodes[: k + 1]), tuple(order), batch, size, peak, est)


# ---------------------------------------------------------------------- splitting
def _rebatch(t: TensorType, size: int) -> TensorType:
    """``t`` (a value batched along dimension 0) at ``size`` samples."""
    return dataclasses.replace(t, shape=(size, *t.shape[1:]))


def split_graph(graph: Graph, cut: Cut) -> tuple[Graph, Graph]:
    """(prefix graph at ``cut.chunk`` samples, whose outputs are the cut values; suffix
    graph at the full batch, whose inputs are the cut values then the graph inputs it
    reads)."""
    in_prefix = set(cut.nodes)
    pre_nodes = [n for n in graph.nodes() if n.name in in_prefix]
    post_nodes = [n for n in graph.nodes() if n.name not in in_prefix]
    batched = batched_values(graph, cut.batch)
    unbatched = sorted(
        v
        for n in pre_nodes
        for v in (*n.inputs, *n.outputs)
        if v not in graph.params and v not in batched
    )
    if unbatched:  # slicing them would cut a dimension that is not the batch
        raise ValueError(f"the cut's prefix reads or makes unbatched values {unbatched}")

    pre = Graph()
    pre.meta = {k: v for k, v in graph.meta.items() if not k.startswith("_")}
    read = {v for n in pre_nodes for v in n.inputs}
    for v in graph.inputs:
        if v in read:
            pre.add_input(v, _rebatch(graph.values[v], cut.chunk))
    for p, arr in graph.params.items():
        if p in read:
            pre.add_param(p, arr, graph.values[p].layout)
    for n in pre_nodes:
        if n.op == "reshape" and tuple(n.attrs["shape"])[0] == cut.batch:
            shape = (cut.chunk, *tuple(n.attrs["shape"])[1:])
            n = n.replace(attrs={**n.attrs, "shape": shape})
        types = [_rebatch(graph.values[v], cut.chunk) for v in n.outputs]
        pre.add_node(n, types)
    pre.set_outputs(tuple(cut.values))

    post = Graph()
    post.meta = {k: v for k, v in graph.meta.items() if not k.startswith("_")}
    read = {v for n in post_nodes for v in n.inputs} | set(graph.output_values())
    for v in cut.values:
        post.add_input(v, graph.values[v])
    for v in graph.inputs:
        if v in read:
            post.add_input(v, graph.values[v])
    for p, arr in graph.params.items():
        if p in read:
            post.add_param(p, arr, graph.values[p].layout)
    for n in post_nodes:
        post.add_node(n, [graph.values[v] for v in n.outputs])
    post.set_outputs(graph.output_tree)
    return pre, post


# ---------------------------------------------------------------------- the pass
def batch_slice(graph: Graph, options: Options, hardware: Hardware, auto: bool) -> Cut | None:
    """The prefix of ``graph`` to run depth-first over the batch, or None.

    ``options.batch_chunk``: "auto", a number of samples per slice, or 0 (never). ``auto``:
    whether "auto" may slice on the plan's device (``Backend.slices_batch``: on CUDA the
    slices' kernels would be too small to fill the GPU). The weights budget is half the
    cores' private caches (weights beyond it are re-read from memory once per slice)."""
    mode = options.batch_chunk
    if mode == "auto" and not auto:
        return None
    cache = hardware.l2_bytes * max(hardware.cores, 1)
    return choose_cut(graph, mode, cache, hardware.bandwidth_gbs)
