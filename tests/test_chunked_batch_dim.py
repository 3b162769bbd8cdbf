"""Batch slicing (passes/batch_slice.py) tracks the batch dimension from the graph inputs
through per-sample ops; a size that merely equals the batch (a convolution weight computed
from the activations with K == batch, a lower-rank operand broadcast from the right) is
never sliced."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import middleware
from middleware.graph import Graph, Node, TensorType
from middleware.ops import infer_types
from middleware.passes import batch_slice as chunked

BATCH = 4


class ActivationWeight(nn.Module):
    """A convolution whose weight is a global pool of the activations: (N, 16, 3, 3), so its
    K equals the batch. Each output channel k filters with sample k: it mixes samples."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(x))
        w = F.adaptive_avg_pool2d(y, 3)
        z = F.conv2d(y, w, stride=2, padding=1)
        return torch.sigmoid(z).mean((2, 3))


class RightBroadcast(nn.Module):
    """``x + x.mean(1)``: the (N, H, W) operand broadcasts against (N, C, H, W) from the
    right, so with C == N channel c adds sample c's mean."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, BATCH, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(x))
        z = F.avg_pool2d(torch.sigmoid(y + y.mean(1)), 4)  # a small cut value after it
        return z.mean((2, 3))


class SumOverBatch(nn.Module):
    """``y.sum(0)`` / ``y.amax(0)`` of an (N, N, H, W) map: (N, H, W), whose leading size
    is the batch's but which mixes every sample."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, BATCH, 3, padding=1)
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(x))
        s = y.sum(0) if self.op == "sum" else y.amax(0)
        z = F.avg_pool2d(torch.sigmoid(s.reshape(BATCH, 1, 32, 32)), 4)
        return z.mean((2, 3))


def _check(model: nn.Module, **kw) -> middleware.OptimizedModule:  # noqa: ANN003
    torch.manual_seed(0)
    m = model.eval()
    x = torch.randn(BATCH, 3, 32, 32)
    # batch_chunk=1 forces slicing wherever a prefix exists; without groups every node is
    # a possible cut
    om = middleware.optimize(
        m,
        example_inputs=(x,),
        measure_hardware=False,
        batch_chunk=1,
        disable_passes=["group"],
        **kw,
    )
    with torch.no_grad():
        ref = m(x)
        torch.testing.assert_close(om(x), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    return om


def test_conv_with_an_activation_weight_is_not_sliced() -> None:
    om = _check(ActivationWeight())
    cut = getattr(om.plan, "cut", None)
    assert cut is None or "conv2d" not in cut.nodes


def test_lower_rank_operand_broadcast_from_the_right_is_not_sliced() -> None:
    om = _check(RightBroadcast(), fuse=False)
    cut = getattr(om.plan, "cut", None)
    assert cut is None or not any(om.graph.node(n).op == "add" for n in cut.nodes)


@pytest.mark.parametrize("op", ["sum", "amax"])
def test_a_reduction_over_the_batch_dim_is_not_sliced(op: str) -> None:
    om = _check(SumOverBatch(op), fuse=False)
    cut = getattr(om.plan, "cut", None)
    assert cut is None or not any(om.graph.node(n).op == op for n in cut.nodes)
    # its (N, H, W) output has the batch's size in front but is no per-sample value
    g = Graph()
    x = g.add_input("x", TensorType((BATCH, BATCH, 8, 8)))
    s = _node(g, "s", op, (_node(g, "y", "relu", (x,)),), dims=(0,), keepdim=False)
    g.set_outputs(_node(g, "out", "sigmoid", (s,)))
    batched = chunked.batched_values(g, BATCH)
    assert "y" in batched and "s" not in batched and "out" not in batched


def _node(g: Graph, name: str, op: str, ins: tuple[str, ...], **attrs) -> str:  # noqa: ANN003
    node = Node(name, op, ins, (name,), attrs)
    g.add_node(node, infer_types(g.values, node))
    return name


def _activation_weight_graph() -> Graph:
    g = Graph()
    x = g.add_input("x", TensorType((BATCH, 16, 8, 8)))
    y = _node(g, "y", "relu", (x,))
    w = _node(g, "w", "adaptive_avg_pool2d", (y,), output_size=(3, 3))
    b = g.add_param("b", np.zeros(BATCH, np.float32))
    conv = dict(stride=(2, 2), padding=(1, 1), dilation=(1, 1), groups=1)
    z = _node(g, "z", "conv2d", (y, w, b), **conv)
    g.set_outputs(_node(g, "out", "sigmoid", (z,)))
    return g


def test_batched_values_follow_the_inputs_through_per_sample_ops() -> None:
    g = _activation_weight_graph()
    batched = chunked.batched_values(g, BATCH)
    assert {"x", "y", "w"} <= batched  # w's dim 0 is the batch (it is a per-sample pool)
    assert "z" not in batched and "out" not in batched  # the conv mixes samples
    cut = chunked.choose_cut(g, 1, cache_bytes=1 << 30)
    assert cut is None or "z" not in cut.nodes


def test_split_graph_refuses_to_slice_an_unbatched_value() -> None:
    g = _activation_weight_graph()
    bad = chunked.Cut(("y", "w", "z"), ("z",), BATCH, 1, 0, 0)
    try:
        chunked.split_graph(g, bad)
    except ValueError as e:
        assert "z" in str(e)
    else:
        raise AssertionError("split_graph sliced the conv's output as if it were batched")
