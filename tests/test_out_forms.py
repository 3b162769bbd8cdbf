"""Every op's ATen ``out=`` form (the buffer planner's destination writes) against the op's
reference, with the input and the destination in every pair of memory formats: the planner
hands a form an arena view in the value's declared layout while a framework result (a
permute, a view) may be strided otherwise, and some ATen kernels assume the two agree."""

from __future__ import annotations

import itertools

import pytest
import torch

from middleware.graph import Graph, Node, TensorType
from middleware.ops import CATALOGUE, get_op, torch_dtype

# attrs for the ops whose out form takes some; ops missing here are covered by the check
# that every out form is listed
ATTRS = {
    "batch_norm": {"eps": 1e-5},
    "hardtanh": {"min_val": -0.5, "max_val": 0.5},
    "leaky_relu": {"negative_slope": 0.1},
    "gelu": {"approximate": "none"},
    "max_pool2d": {
        "kernel_size": (3, 3),
        "stride": (2, 2),
        "padding": (1, 1),
        "dilation": (1, 1),
        "ceil_mode": False,
    },
    "maxpool_relu": {
        "kernel_size": (3, 3),
        "stride": (2, 2),
        "padding": (1, 1),
        "dilation": (1, 1),
        "ceil_mode": False,
        "activation": "relu",
        "activation_attrs": (),
    },
    "avg_pool2d": {
        "kernel_size": (3, 3),
        "stride": (2, 2),
        "padding": (1, 1),
        "ceil_mode": False,
        "count_include_pad": True,
        "divisor_override": None,
    },
    "adaptive_avg_pool2d": {"output_size": (2, 3)},
    "adaptive_max_pool2d": {"output_size": (2, 3)},
    "mean": {"dims": (2, 3), "keepdim": True},
    "sum": {"dims": (3,), "keepdim": True},
    "amax": {"dims": (2, 3), "keepdim": True},
    "cat": {"dim": 1},
    "softmax": {"dim": 1},
    "log_softmax": {"dim": 1},
    "to_layout": {"layout": "nchw"},
}
SHAPE = (2, 6, 7, 9)


def _with_out_forms() -> list[str]:
    return sorted(name for name, op in CATALOGUE.items() if op.out is not None)


def _strided(t: torch.Tensor, fmt: str) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last) if fmt == "nhwc" else t.contiguous()


def _case(name: str) -> tuple[Graph, Node, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SHAPE, generator=g)
    if name in ("sqrt", "rsqrt"):
        x = x.abs() + 0.1  # their domain (NaN below 0 would leave no scale to compare to)
    ins: list[tuple[str, torch.Tensor]] = [("x", x)]
    attrs = {**get_op(name).defaults, **ATTRS.get(name, {})}
    if name == "batch_norm":
        c = SHAPE[1]
        ins += [
            ("mean", torch.randn(c, generator=g)),
            ("var", torch.rand(c, generator=g) + 0.5),
            ("w", torch.randn(c, generator=g)),
            ("b", torch.randn(c, generator=g)),
        ]
    elif name in ("add", "sub", "mul", "div", "cat"):
        ins.append(("y", torch.randn(SHAPE, generator=g) + (3.0 if name == "div" else 0.0)))
    node = Node("n", name, tuple(v for v, _ in ins), ("out",), attrs)
    graph = Graph()
    for v, t in ins:
        graph.add_input(v, TensorType(tuple(t.shape), "float32"))
    out = get_op(name).bind(node)(*[t for _, t in ins])
    graph.add_node(node, [TensorType(tuple(out.shape), "float32")])
    graph.set_outputs("out")
    return graph, graph.node("n"), [t for _, t in ins]


@pytest.mark.parametrize("name", _with_out_forms())
@pytest.mark.parametrize("fin,fout", list(itertools.product(("nchw", "nhwc"), repeat=2)))
def test_out_form_matches_reference_across_memory_formats(name: str, fin: str, fout: str) -> None:
    graph, node, ins = _case(name)
    op = get_op(name)
    made = op.out.make(node, graph)
    if made is None:
        pytest.skip(f"{name} has no out form for these attrs")
    form, scratch_types = made
    ref = op.bind(node)(*ins)
    xs = [_strided(t, fin) if t.dim() == 4 else t for t in ins]
    out = _strided(torch.full_like(ref, float("nan")), fout)
    scratch = [torch.empty(t.shape, dtype=torch_dtype(t.dtype)) for t in scratch_types]
    form(*xs, out, *scratch)
    scale = ref.abs().max().item() or 1.0
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * scale), (
        f"{name} out form, input {fin}, destination {fout}: "
        f"max error {(out - ref).abs().max().item():.3g}"
    )
