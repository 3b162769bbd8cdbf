"""Integration of the CUDA backend without a GPU: the errors ``device="cuda"`` raises here,
and whole networks planned the CUDA way (io groups as generated kernels, the rest through
PyTorch) with the kernels run by the CPU emulation, against the original model."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn as nn
from cuda_cases import FAKE_GPU
from middleware.backends.cuda import check_cuda_runtime
from middleware.backends.cuda.units import cuda_units, io_groups
from middleware.runtime.plan import build_plan

import middleware
from middleware.errors import DeviceError
from middleware.options import Options


class SmallNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = self.pool(torch.relu(self.bn1(self.conv1(x))))
        z = nn.functional.hardswish(self.bn2(self.conv2(y))) + y
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(z, 1), 1))


def _randomise_bn(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.normal_()
            m.bias.data.normal_()
    return model.eval()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a GPU")
def test_optimize_cuda_without_gpu_names_the_missing_device():
    with pytest.raises(DeviceError, match="no CUDA device"):
        middleware.optimize(SmallNet().eval(), device="cuda")


def test_missing_loader_says_how_to_install(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("middleware.backends.cuda.loader.available_loaders", lambda: [])
    with pytest.raises(DeviceError) as info:
        check_cuda_runtime()
    msg = str(info.value)
    assert "pip install 'middleware[cuda]'" in msg and "cuda-python" in msg
    assert "pycuda" in msg


def test_unknown_or_missing_loader_is_an_error(monkeypatch):
    from middleware.backends.cuda.loader import get_loader

    monkeypatch.setattr("middleware.backends.cuda.loader.available_loaders", lambda: [])
    with pytest.raises(DeviceError, match="install"):
        get_loader()
    with pytest.raises(DeviceError, match="unknown CUDA loader"):
        get_loader("nope")


def _emulated_plan(model: nn.Module, x: torch.Tensor, tmp_path, layout: str = "nchw"):
    graph = middleware.trace(model, x)
    if layout == "nhwc":
        graph = _as_channels_last(graph)
    options = Options(device="cuda", cache_dir=tmp_path, measure_hardware=False)
    units = cuda_units(graph, options, FAKE_GPU, torch.device("cpu"), emulate=True)
    return graph, units, build_plan(graph, torch.device("cpu"), units)


def _as_channels_last(graph):
    """The same graph with every 4-d activation in channels_last (what a layout pass does)."""
    from middleware.graph import Graph

    g = Graph()
    g.meta = dict(graph.meta)
    for v in graph.inputs:
        t = graph.values[v]
        g.add_input(v, t if t.rank != 4 else type(t)(t.shape, t.dtype, "nhwc"))
    for p, arr in graph.params.items():
        g.add_param(p, arr, graph.values[p].layout)
    for n in graph.nodes():
        types = [graph.values[v] for v in n.outputs]
        g.add_node(n, [t if t.rank != 4 else type(t)(t.shape, t.dtype, "nhwc") for t in types])
    g.set_outputs(graph.output_tree)
    return g


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulation")
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_small_net_planned_for_cuda_matches_pytorch(layout, tmp_path):
    model = _randomise_bn(SmallNet())
    x = torch.randn(2, 3, 11, 9)
    graph, units, plan = _emulated_plan(model, x, tmp_path, layout)
    generated = [u for u in units if u.runs_as == "generated"]
    assert len(generated) >= 2
    ops = {graph.node(n).op for u in generated for n in u.nodes}
    assert {"batch_norm", "relu", "max_pool2d", "hardswish", "add"} <= ops
    assert all(graph.node(n).op not in ("conv2d", "linear") for u in generated for n in u.nodes)
    xin = x.contiguous(memory_format=torch.channels_last) if layout == "nhwc" else x
    with torch.no_grad():
        torch.testing.assert_close(plan.run([xin]), model(x), rtol=1e-4, atol=1e-4)


def test_io_groups_are_runs_of_supported_io_nodes():
    graph = middleware.trace(SmallNet().eval(), torch.randn(1, 3, 8, 8))
    groups = io_groups(graph)
    ops = [[graph.node(n).op for n in g] for g in groups]
    assert ops[0] == ["batch_norm", "relu", "max_pool2d"]
    # the 4x4 global pool (16 elements per output) reads the add's result from memory
    assert ["batch_norm", "hardswish", "add"] in ops
    assert ["adaptive_avg_pool2d", "flatten"] in ops
    small = middleware.trace(SmallNet().eval(), torch.randn(1, 3, 4, 4))  # a 2x2 pool
    small_ops = [[small.node(n).op for n in g] for g in io_groups(small)]
    assert ["batch_norm", "hardswish", "add", "adaptive_avg_pool2d", "flatten"] in small_ops


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulation")
def test_mobilenet_v3_small_planned_for_cuda_matches_pytorch(tmp_path):
    torchvision = pytest.importorskip("torchvision")
    model = _randomise_bn(torchvision.models.mobilenet_v3_small())
    x = torch.randn(1, 3, 64, 64)
    graph, units, plan = _emulated_plan(model, x, tmp_path)
    assert sum(u.runs_as == "generated" for u in units) >= 10
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(plan.run([x]), expected, rtol=1e-4, atol=1e-4)


def _broken_renderer(monkeypatch):
    import dataclasses

    from middleware.backends.cuda import units

    real = units.render_kernel

    def broken(group, hardware, emulate=True, tiled=True):
        r = real(group, hardware, emulate, tiled)
        return dataclasses.replace(r, source=r.source + "\n#error planted failure\n")

    monkeypatch.setattr(units, "render_kernel", broken)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulation")
def test_compile_failure_falls_back_with_the_reason(monkeypatch, tmp_path):
    _broken_renderer(monkeypatch)
    model = _randomise_bn(SmallNet())
    x = torch.randn(1, 3, 8, 8)
    with pytest.warns(RuntimeWarning, match="failed to compile"):
        graph, units, plan = _emulated_plan(model, x, tmp_path)
    assert not any(u.runs_as == "generated" for u in units)
    # (convolutions name their epilogue kernel, which the planted failure does not reach)
    reasons = [u.reason for u in units if u.reason and "epilogue" not in u.reason]
    assert reasons and all("planted failure" in r for r in reasons)
    with torch.no_grad():
        torch.testing.assert_close(plan.run([x]), model(x), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulation")
def test_compile_failure_raises_when_strict(monkeypatch, tmp_path):
    from middleware.errors import CompileError

    _broken_renderer(monkeypatch)
    graph = middleware.trace(SmallNet().eval(), torch.randn(1, 3, 8, 8))
    options = Options(device="cuda", cache_dir=tmp_path, measure_hardware=False, strict=True)
    with pytest.raises(CompileError) as info:
        cuda_units(graph, options, FAKE_GPU, torch.device("cpu"), emulate=True)
    assert "planted failure" in info.value.stderr and info.value.command


def test_io_groups_follow_the_passes_groups():
    """With group ids from the passes, a kernel never spans two groups."""
    graph = middleware.trace(SmallNet().eval(), torch.randn(1, 3, 8, 8))
    for i, n in enumerate(list(graph.nodes())):
        graph.replace_node(n.name, n.replace(group=0 if i < 3 else 1))
    groups = io_groups(graph)
    for g in groups:
        assert len({graph.node(n).group for n in g}) == 1
    assert [graph.node(n).op for n in groups[0]] == ["batch_norm", "relu"]
    assert [graph.node(n).op for n in groups[1]] == ["max_pool2d"]


def test_long_reductions_are_left_to_the_framework():
    """A global pool over a large map is not pulled into a generated group (one thread per
    output would sum the whole map serially), a small one still is."""
    from middleware.backends.cuda.units import MAX_SERIAL_REDUCTION, reduction_extent

    for hw, fused in ((24, False), (16, True)):  # 12x12 = 144 and 8x8 = 64 per output
        graph = middleware.trace(SmallNet().eval(), torch.randn(1, 3, hw, hw))
        (pool,) = [n for n in graph.nodes() if n.op == "adaptive_avg_pool2d"]
        assert (reduction_extent(graph, pool) <= MAX_SERIAL_REDUCTION) == fused
        grouped = {n for g in io_groups(graph) for n in g}
        assert (pool.name in grouped) == fused


def test_cuda_graph_capture_failure_runs_the_plan_step_by_step(monkeypatch):
    """A plan that cannot be captured warns once, says why in its notes and runs uncaptured."""
    from middleware.backends.cuda import graphs

    class Plan:
        notes = ("planned",)

        def run(self, inputs):
            return [x * 2 for x in inputs]

    def refuse(plan, inputs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "GraphedPlan", refuse)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    wrapped = graphs.CudaGraphPlan(Plan())
    x = torch.randn(3)
    with pytest.warns(RuntimeWarning, match="cannot be captured"):
        assert not wrapped.capture([x])
    torch.testing.assert_close(wrapped.run([x])[0], x * 2)
    assert wrapped.notes[0] == "planned" and "not permitted" in wrapped.notes[-1]


def test_fastest_variant_is_measured_on_the_group_shapes(monkeypatch):
    """The faster of two kernel variants is kept, timed on inputs of the group's shapes
    (CUDA events stood in for by the host clock here)."""
    import time

    from middleware.backends.cuda.group import group_from_nodes
    from middleware.backends.cuda.units import fastest

    class Event:
        def __init__(self, enable_timing=False):
            self.t = 0.0

        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    class Kernel:
        def __init__(self, seconds):
            self.seconds, self.shapes = seconds, []

        def out(self, *tensors):
            self.shapes.append(tuple(tuple(t.shape) for t in tensors))
            time.sleep(self.seconds)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    graph = middleware.trace(SmallNet().eval(), torch.randn(1, 3, 8, 8))
    names = io_groups(graph)[0]
    group = group_from_nodes(graph, names)
    slow, quick = Kernel(0.004), Kernel(0.0005)
    best, line = fastest({"slow": slow, "quick": quick}, graph, group, torch.device("cpu"))
    assert best == "quick" and line.startswith("quick (measured: quick")
    expected = tuple(tuple(group.types[v].shape) for v in (*group.inputs, *group.outputs))
    assert set(quick.shapes) == {expected}
