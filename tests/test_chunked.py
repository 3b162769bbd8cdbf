"""Depth-first over the batch (passes/batch_slice.py chooses the cut, runtime/chunked.py
runs it): a network's first layers run on slices of the batch. Every test compares against PyTorch (or the graph's reference interpreter)
on seeded random inputs: rtol/atol 1e-4 of the output's scale for networks, 1e-5 for
graphs of io ops."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from test_memory_planner import _flat, _input, random_graphs

import middleware
from middleware.passes.batch_slice import choose_cut, split_graph
from middleware.profiler import PLAN_TOLERANCE
from middleware.runtime.chunked import ChunkedPlan
from middleware.runtime.plan import build_plan

OPTS = dict(measure_hardware=False)


class Stem(nn.Module):
    """A high-resolution stem, a residual block, a channel shuffle, then a head."""

    def __init__(self, shuffle: bool = False, mix: bool = False, width: int = 16) -> None:
        super().__init__()
        self.shuffle, self.mix = shuffle, mix
        self.conv1 = nn.Conv2d(3, width, 3, 2, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, 32, 3, 2, 1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(F.relu(self.bn1(self.conv1(x))))
        y = F.relu(self.bn2(self.conv2(y)) + y)
        if self.mix:  # mixes the samples of the batch: a prefix must stop before it
            y = y - y.mean(0, keepdim=True)
        if self.shuffle:
            n, c, h, w = y.shape
            y = y.view(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)
        y = F.relu(self.conv3(y))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


def _model(**kw) -> nn.Module:  # noqa: ANN003
    torch.manual_seed(0)
    m = Stem(**kw).eval()
    with torch.no_grad():
        for bn in (m.bn1, m.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 1.5)
            bn.weight.uniform_(0.5, 1.5)
    return m


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    scale = max(ref.abs().max().item(), 1.0)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("kw", [{}, {"shuffle": True}], ids=["plain", "shuffle"])
def test_chunked_network_matches_pytorch(fmt, kw) -> None:  # noqa: ANN001
    m = _model(**kw)
    x = torch.randn(4, 3, 32, 32).contiguous(memory_format=fmt)
    om = middleware.optimize(m, example_inputs=(x,), batch_chunk=1, **OPTS)
    assert isinstance(om.plan, ChunkedPlan)
    assert om.plan.cut.chunk == 1 and len(om.plan.cut.nodes) >= 3
    assert any("depth-first over the batch" in n for n in om.report().notes)
    with torch.no_grad():
        _close(om(x), m(x))
        x2 = torch.randn_like(x)
        _close(om(x2), m(x2))


def test_chunk_size_divides_the_batch() -> None:
    m = _model()
    x = torch.randn(4, 3, 32, 32)
    om = middleware.optimize(m, example_inputs=(x,), batch_chunk=3, **OPTS)
    assert om.plan.cut.chunk == 2  # the largest divisor of 4 not above 3
    with torch.no_grad():
        _close(om(x), m(x))


def test_prefix_stops_before_an_op_that_mixes_the_batch() -> None:
    m = _model(mix=True)
    x = torch.randn(4, 3, 32, 32)
    om = middleware.optimize(m, example_inputs=(x,), batch_chunk=1, **OPTS)
    graph = om.plan.graph
    mean = [n.name for n in graph.nodes() if n.op == "mean"]
    assert mean and isinstance(om.plan, ChunkedPlan)
    assert not set(mean) & set(om.plan.cut.nodes)
    with torch.no_grad():
        _close(om(x), m(x))


def test_no_chunking_at_batch_one_or_when_off_or_small() -> None:
    m = _model()
    for x, kw in (
        (torch.randn(1, 3, 32, 32), {"batch_chunk": 1}),
        (torch.randn(4, 3, 32, 32), {"batch_chunk": 0}),
        (torch.randn(4, 3, 32, 32), {}),  # auto: saves far less than MIN_SAVING_BYTES
    ):
        om = middleware.optimize(m, example_inputs=(x,), **kw, **OPTS)
        assert not isinstance(om.plan, ChunkedPlan)
        with torch.no_grad():
            _close(om(x), m(x))


def test_auto_chunks_a_large_stem_and_lowers_measured_peak() -> None:
    m = _model(width=64)
    x = torch.randn(8, 3, 256, 256)
    om = middleware.optimize(m, example_inputs=(x,), **OPTS)
    assert isinstance(om.plan, ChunkedPlan)
    off = middleware.optimize(m, example_inputs=(x,), batch_chunk=0, **OPTS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # measured peak must match the plan's prediction
        r = om.profile(x, repeats=1)
    r_off = off.profile(x, repeats=1)
    predicted = om.plan.predicted_peak_io()
    assert abs(r.optimized.peak_io_bytes - predicted) <= PLAN_TOLERANCE * predicted
    assert r.optimized.peak_io_bytes < 0.6 * r_off.optimized.peak_io_bytes
    assert r.optimized.peak_io_bytes < 0.6 * r.original.peak_io_bytes
    assert len(r.groups) == len(om.plan.steps)


def test_held_output_survives_the_next_call() -> None:
    m = _model()
    x = torch.randn(4, 3, 32, 32)
    om = middleware.optimize(m, example_inputs=(x,), batch_chunk=1, **OPTS)
    with torch.no_grad():
        y1 = om(x)
        kept = y1.clone()
        om(torch.randn_like(x))
    torch.testing.assert_close(y1, kept, rtol=0, atol=0)


def test_cut_tensors_are_released_after_their_last_read() -> None:
    m = _model()
    x = torch.randn(4, 3, 32, 32)
    om = middleware.optimize(m, example_inputs=(x,), batch_chunk=1, **OPTS)
    mem = om.plan.suffix.memory
    kinds = {mem.placements[v].kind for v in om.plan.cut.values}
    assert kinds == {"owned"}
    suffix = om.plan.suffix
    for v in om.plan.cut.values:
        assert mem.intervals[mem.placements[v].storage][1] < mem.n_units
        # and the run drops its reference at that last read
        assert any(suffix.slot_of[v] in st.frees for st in suffix.steps)


@pytest.mark.parametrize(
    "op, attrs, out_shape, ok",
    [
        ("softmax", {"dim": 1}, (4, 4, 3, 3), True),
        ("softmax", {"dim": 0}, (4, 4, 3, 3), False),
        ("mean", {"dims": (2, 3), "keepdim": False}, (4, 4), True),
        ("mean", {"dims": (0,), "keepdim": False}, (4, 3, 3), False),  # C == N: same shape
        ("permute", {"dims": (0, 2, 3, 1)}, (4, 3, 3, 4), True),
        ("permute", {"dims": (1, 0, 2, 3)}, (4, 4, 3, 3), False),
        ("flatten", {"start_dim": 1, "end_dim": -1}, (4, 36), True),
        ("reshape", {"shape": (4, 36)}, (4, 36), True),
        ("reshape", {"shape": (-1, 36)}, (4, 36), True),
        ("fallback", {}, (4, 4, 3, 3), False),
    ],
)
def test_per_sample_checks_attributes_not_only_shapes(op, attrs, out_shape, ok) -> None:  # noqa: ANN001
    """Each op's attributes decide whether it keeps the samples apart, also where the
    output's shape alone would not tell (channels == batch)."""
    from middleware.graph import Graph, Node, TensorType
    from middleware.passes.batch_slice import _per_sample

    g = Graph()
    x = g.add_input("x", TensorType((4, 4, 3, 3)))
    node = Node("n", op, (x,), ("y",), attrs)
    g.add_node(node, [TensorType(out_shape)])
    assert _per_sample(g, node, 4) is ok


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs())
def test_random_graphs_chunked_equal_reference(case) -> None:  # noqa: ANN001
    g, seed = case
    cut = choose_cut(g, 1, 1 << 20)
    x = _input(g, seed)
    with torch.no_grad():
        ref = _flat(g.evaluate(x))
    if cut is None:  # e.g. a prefix value is also a graph output
        return
    pre, post = split_graph(g, cut)
    dev = torch.device("cpu")
    plan = ChunkedPlan(
        g,
        cut,
        build_plan(pre, dev, plan_memory=True),
        build_plan(post, dev, plan_memory=True, owned=cut.values),
        dev,
    )
    with torch.no_grad():
        got = _flat(plan.run([x]))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    gc.collect()
