"""layout: choose the memory layout of every 4-d value for the whole network, converting
only where the graph meets the user (its inputs and outputs) and around the few ops that
need one memory order.

The network layout is data (``LAYOUT_RULES``: device kind -> layout for ``layout="auto"``).
Measured on the 2-core Sapphire Rapids host (torch 2.14.1, interleaved in one process, see
shared/MEASURED.md and backends/vendor/calls.py): channels_last ("nhwc") is as fast or faster
for every oneDNN convolution shape tried (16x64x56x56 3x3: 17 vs 19-26 ms; 1x1 256->64:
9.8 vs 31 ms; depthwise 144ch: 4.6 vs 19 ms; 7x7/2 stem: 35 vs 37-57 ms), and the
pooling and batch-norm kernels of ATen are 3-8x faster in channels_last (BN -> ReLU ->
MaxPool on 16x64x112x112: 13-42 ms vs 100-135 ms).

On CUDA it depends on whether cuDNN may use TF32 tensor cores for fp32 convolutions
(``torch.backends.cudnn.allow_tf32``, True by default). Measured on one H200 (torch 2.11,
eager torchvision networks, CUDA events, median of 15 interleaved rounds, batch 16 / 64):
with TF32 channels_last is faster (resnet50 4.6 vs 4.8 / 7.9 vs 9.5 ms, resnet18 1.3 vs
1.6 / 2.6 vs 3.5, mobilenet_v2 2.6 vs 2.6 / 3.9 vs 5.1, densenet121 8.0 vs 8.4 / 12.4 vs
14.0; batch 1 within 5%); in strict fp32 NCHW is faster (resnet50 6.8 vs 8.3 / 20.3 vs 24.0,
densenet121 9.0 vs 11.2 / 22.1 vs 26.7, googlenet 4.1 vs 5.1 / 9.7 vs 10.9 ms).

The contract this pass guarantees (the fused-kernel generator and the vendor calls read
``TensorType.layout``): running any node's reference implementation on inputs stored in
their declared layouts gives outputs stored in their declared layouts (a value whose two
memory orders coincide, C == 1 or H*W == 1, satisfies either). Outputs of the view ops
(``OpDef.strided_view``: split, permute, reshape, flatten) may be strided views of their input that
are dense in neither order (a channel slice, a transpose); where one is dense, it is dense
in its declared layout.
"""

from __future__ import annotations

from typing import Any

import torch

from ..graph import Graph, Node, TensorType, flatten_tree, map_tree
from ..hardware import Hardware
from ..ops import get_op

# layout="auto": the network layout per device kind ("cuda_fp32": cuDNN without TF32)
LAYOUT_RULES: dict[str, str] = {"cpu": "nhwc", "cuda": "nhwc", "cuda_fp32": "nchw"}

# Which ops keep the memory order of their inputs (``OpDef.keeps_layout``), need their
# inputs' declared strides (``stride_strict``), may answer with a strided view dense in
# neither order (``strided_view``) and read weights that keep their layout
# (``weight_inputs``) are facts of the op registry's entries.


def network_layout(device_kind: str, option: str = "auto", tf32: bool | None = None) -> str:
    """The layout for every 4-d value: ``option`` if "nchw"/"nhwc", else ``LAYOUT_RULES``
    for the device kind; on CUDA ``tf32`` (default: ``torch.backends.cudnn.allow_tf32`` at
    the time of the call, i.e. at optimize time) picks the rule."""
    if option in ("nchw", "nhwc"):
        return option
    if option != "auto":
        raise ValueError(f"layout option {option!r}; choose 'auto', 'nchw' or 'nhwc'")
    if device_kind == "cuda":
        tf32 = torch.backends.cudnn.allow_tf32 if tf32 is None else tf32
        return LAYOUT_RULES["cuda" if tf32 else "cuda_fp32"]
    return LAYOUT_RULES.get(device_kind, "nchw")


def orders_coincide(t: TensorType) -> bool:
    """Whether a 4-d value is stored identically in both layouts (C == 1 or H*W == 1)."""
    return t.rank != 4 or t.shape[1] == 1 or t.shape[2] * t.shape[3] == 1


def assign_layout(graph: Graph, hardware: Hardware | None = None, layout: str = "auto") -> Graph:
    """Give every 4-d activation the network layout and insert ``to_layout`` conversions.

    Expects: a graph whose 4-d values are all declared "nchw" or already passed through this
    pass (then it changes nothing). ``hardware.kind`` picks the "auto" layout (cpu when
    None); ``layout`` is ``Options.layout``.
    Guarantees: same outputs; every 4-d graph input not already stored in the network layout
    is converted once, right at the start; every 4-d graph output comes back as PyTorch
    gives it: "nhwc" when a 4-d input is declared "nhwc" (channels_last in, channels_last
    out), else "nchw" (contiguous); layout-sensitive ops read and write
    "nchw", with one conversion per value that needs it (shared by all its readers);
    parameters keep their layout; the contract of the module docstring holds.
    """
    if graph.meta.get("layout") is not None:
        return graph
    mode = network_layout(hardware.kind if hardware is not None else "cpu", layout)
    if layout == "auto" and not any(get_op(n.op).image_op for n in graph.nodes()):
        # no op the network layout was measured for: 4-d values that may not be images (an
        # attention's batch x heads x tokens x dims) keep the order they come in, no copies
        given = {graph.values[v].layout for v in graph.inputs if graph.values[v].rank == 4}
        mode = given.pop() if len(given) == 1 else "nchw"
    out = _Builder(graph)
    for v in graph.inputs:
        t = graph.values[v]
        if t.rank == 4 and t.layout != mode:
            if _only_conv_reads(graph, v, hardware, mode):
                out.direct.add(v)  # the convolutions read it as it is (no copy)
            else:
                out.alias[v] = out.convert(v, mode, declared=t.layout, base=v)
    # 4-d outputs come back in the memory format PyTorch would give them: channels_last
    # when a 4-d input came channels_last, else contiguous
    user = "nhwc" if any(graph.values[v].layout == "nhwc" for v in graph.inputs) else "nchw"
    done: set[str] = set()
    for n in graph.nodes():
        if n.name in done:
            continue
        chain = channel_shuffle_chain(graph, n) if mode == "nhwc" else None
        if chain is not None and out.values[out.current(n.inputs[0])].layout == "nhwc":
            out.channel_shuffle_nhwc(chain)
            done.update(c.name for c in chain)
        else:
            out.add(n, mode)
    tree = map_tree(graph.output_tree, out.current)
    final: dict[str, str] = {}
    for v in flatten_tree(tree):
        if out.values[v].rank == 4 and out.values[v].layout != user and v not in final:
            final[v] = out.convert(v, user, base=_strip(v))
    g = graph.rebuild(out.nodes)
    g.set_outputs(map_tree(tree, lambda v: final.get(v, v)))
    g.meta["layout"] = mode
    return g


def _only_conv_reads(graph: Graph, v: str, hardware: Hardware | None, mode: str) -> bool:
    """On the CPU, a graph input read only as the data input of convolutions with constant
    weights needs no conversion: oneDNN with a prepacked weight reads NCHW and writes
    channels_last (conv2d's ``output_layout`` attr), which saves a full copy of the input
    in time and in peak memory. Unless the input fits the cores' L2 caches (with
    ``hardware``): then the conversion's copy is still there when the convolution reads it,
    and oneDNN's channels_last path beats its NCHW-reading one (batch 1 on the AMD host, the
    input converted first, against read as NCHW, one process: mobilenet_v3_small 1.08x,
    mobilenet_v2 1.07x, shufflenet_v2 1.08x, squeezenet 1.02x, resnet18 1.02x; at batch 16,
    9.6 MB past the 2 MiB of L2, 0.93-1.02x and a copy of the input in peak memory)."""
    if mode != "nhwc" or (hardware is not None and hardware.kind != "cpu"):
        return False
    if hardware is not None and graph.values[v].nbytes <= hardware.l2_bytes * max(
        1, hardware.cores
    ):
        return False
    readers = graph.consumers(v)
    return (
        bool(readers)
        and all(
            r.op == "conv2d"
            and r.inputs[0] == v
            and v not in r.inputs[1:]
            and r.inputs[1] in graph.params
            for r in readers
        )
        and v not in graph.output_values()
    )


def channel_shuffle_chain(graph: Graph, first: Node) -> list[Node] | None:
    """The nodes of a channel shuffle starting at ``first``, or None: reshape (N,C,H,W) ->
    (N,g,C/g,H,W), permute (0,2,1,3,4), optionally contiguous, reshape back to (N,C,H,W),
    each the sole reader of the one before (as torchvision's ShuffleNet writes it)."""
    if first.op != "reshape" or graph.values[first.inputs[0]].rank != 4:
        return None
    n, c, h, w = graph.values[first.inputs[0]].shape
    s5 = graph.values[first.outputs[0]].shape
    if len(s5) != 5 or s5[0] != n or s5[3:] != (h, w) or s5[1] * s5[2] != c:
        return None
    chain = [first]
    for want in ("permute", "contiguous", "reshape"):
        value = chain[-1].outputs[0]
        readers = graph.consumers(value)
        if len(readers) != 1 or graph.uses(value) != 1 or readers[0].op != want:
            if want == "contiguous" and len(readers) == 1 and readers[0].op == "reshape":
                continue
            return None
        chain.append(readers[0])
    permute, last = chain[1], chain[-1]
    if tuple(permute.attrs["dims"]) != (0, 2, 1, 3, 4):
        return None
    if graph.values[last.outputs[0]].shape != (n, c, h, w):
        return None
    return chain


def _strip(name: str) -> str:
    for suffix in ("_nhwc", "_nchw"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


class _Builder:
    """The new node list: nodes with re-declared output layouts and conversion nodes."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.nodes: list[tuple[Node, list[TensorType]]] = []
        self.values: dict[str, TensorType] = dict(graph.values)
        self.alias: dict[str, str] = {}  # original value -> the value its readers read
        self.direct: set[str] = set()  # inputs convolutions read without a conversion
        self._converted: dict[tuple[str, str], str] = {}
        self._taken: set[str] = set(graph.values) | {n.name for n in graph.nodes()}

    def current(self, v: str) -> str:
        return self.alias.get(v, v)

    def _fresh(self, base: str) -> str:
        name, i = base, 1
        while name in self._taken:
            name, i = f"{base}_{i}", i + 1
        self._taken.add(name)
        return name

    def convert(self, v: str, layout: str, declared: str | None = None, base: str = "") -> str:
        """A value equal to ``v`` stored in ``layout`` (one ``to_layout`` node per value and
        layout)."""
        key = (v, layout)
        if key in self._converted:
            return self._converted[key]
        t = self.values[v]
        if declared is not None:
            t = TensorType(t.shape, t.dtype, declared)
        new = self._fresh(f"{base or v}_{layout}")
        node = Node(
            self._fresh(f"to_{layout}_{base or v}"),
            "to_layout",
            (v,),
            (new,),
            {"layout": layout},
            source=f"layout conversion of {base or v}",
        )
        self.values[new] = TensorType(t.shape, t.dtype, layout)
        self.nodes.append((node, [self.values[new]]))
        self._converted[key] = new
        return new

    def _emit(self, name: str, op: str, ins: tuple[str, ...], out: str, ty: TensorType,
              source: str, **attrs: Any) -> str:  # fmt: skip
        self.values[out] = ty
        self.nodes.append((Node(name, op, ins, (out,), attrs, source=source), [ty]))
        return out

    def channel_shuffle_nhwc(self, chain: list[Node]) -> None:
        """A channel shuffle of an "nhwc" value as one ``channel_shuffle`` node, its output
        channels_last too: a gather over channels with loop semantics (it fuses with the
        concat before it) instead of the chain's rank-5 views, which need the value in
        NCHW order. The chain's last output keeps its name."""
        first, last = chain[0], chain[-1]
        x = self.current(first.inputs[0])
        t = self.values[x]
        g = self.graph.values[first.outputs[0]].shape[1]
        self._emit(last.name, "channel_shuffle", (x,), last.outputs[0],
                   TensorType(t.shape, t.dtype, "nhwc"), first.source, groups=g)  # fmt: skip

    def _free_permute(self, n: Node) -> str | None:
        """The layout of a 4-d permute's output where it is a dense view of its input as
        declared: (0, 2, 3, 1) of a channels_last map is its row-major (N, H, W, C) (Swin's
        and ConvNeXt's token maps), (0, 3, 1, 2) of a row-major value a channels_last map.
        None: any other permute (it reads "nchw")."""
        if n.op != "permute":
            return None
        t = self.values[self.current(n.inputs[0])]
        dims = tuple(int(d) for d in n.attrs["dims"])
        if t.rank != 4 or orders_coincide(t):
            return None
        if dims == (0, 2, 3, 1) and t.layout == "nhwc":
            return "nchw"
        if dims == (0, 3, 1, 2) and t.layout == "nchw":
            return "nhwc"
        return None

    def _inputs_layout(self, n: Node, mode: str) -> str:
        """An op that keeps its inputs' memory order and is not an image op (elementwise
        ops, a mean): "nchw" where every 4-d data input it reads is declared "nchw" (the
        permuted token maps above and what reads them), else the network layout."""
        op = get_op(n.op)
        if op.image_op or mode == "nchw":
            return mode
        data = [
            self.values[self.current(v)]
            for i, v in enumerate(n.inputs)
            if i not in op.weight_inputs
        ]
        seen = {t.layout for t in data if t.rank == 4 and not orders_coincide(t)}
        return "nchw" if seen == {"nchw"} else mode

    def add(self, n: Node, mode: str) -> None:
        free = self._free_permute(n)
        if n.op == "to_layout":
            want_in: str | None = None
            want_out = str(n.attrs["layout"])
        elif free is not None:
            want_in, want_out = None, free
        elif get_op(n.op).keeps_layout(n.attrs):
            want_in = want_out = self._inputs_layout(n, mode)
        else:
            want_in = want_out = "nchw"
        weights = get_op(n.op).weight_inputs
        if n.op == "conv2d" and n.inputs[0] in self.direct and want_out == "nhwc":
            n = n.replace(attrs={**n.attrs, "output_layout": "nhwc"})
        ins = []
        for i, v in enumerate(n.inputs):
            v = self.current(v)
            t = self.values[v]
            if i == 0 and v in self.direct:
                ins.append(v)
                continue
            if t.rank == 4 and want_in is not None and i not in weights and t.layout != want_in:
                if not orders_coincide(t) or get_op(n.op).stride_strict:
                    v = self.convert(v, want_in)
            ins.append(v)
        types = []
        for v in n.outputs:
            t = self.values[v]
            layout = want_out if t.rank == 4 else "nchw"
            if n.op == "split":  # views of its input, in the input's order
                layout = self.values[ins[0]].layout if t.rank == 4 else "nchw"
            types.append(TensorType(t.shape, t.dtype, layout))
            self.values[v] = types[-1]
        self.nodes.append((n.replace(inputs=tuple(ins)), types))


def layout_mismatches(graph: Graph, *inputs: torch.Tensor) -> list[str]:
    """Run ``graph`` with the reference interpreter and list the values whose tensors are
    not stored in their declared layout (for tests and debugging; empty when the contract
    holds)."""
    bad: list[str] = []
    env: dict[str, Any] = dict(zip(graph.inputs, inputs, strict=True))
    for p, arr in graph.params.items():
        env[p] = torch.from_numpy(arr.copy())
    for n in graph.nodes():
        res = get_op(n.op).bind(n)(*[env[v] for v in n.inputs])
        res = (res,) if len(n.outputs) == 1 else tuple(res)
        for v, t in zip(n.outputs, res, strict=True):
            env[v] = t
            _check(graph, n, v, t, bad)
    return bad


def _check(graph: Graph, node: Node, v: str, t: Any, bad: list[str]) -> None:
    ty = graph.values[v]
    if not isinstance(t, torch.Tensor) or ty.rank != 4:
        return
    dense = {"nchw": t.is_contiguous(), "nhwc": t.is_contiguous(memory_format=torch.channels_last)}
    if get_op(node.op).strided_view and not any(dense.values()):
        return  # a strided view, allowed for view ops
    if not dense[ty.layout]:
        bad.append(f"{v} ({node.op}): declared {ty.layout}, strides {tuple(t.stride())}")
