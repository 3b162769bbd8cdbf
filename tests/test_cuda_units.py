"""Integration of the CUDA backend without a GPU: the errors ``device="cuda"`` raises here,
and whole networks planned the CUDA way (io groups as generated kernels, the rest through
PyTorch) with the kernels run by the CPU emulation, against the original model."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import torch.nn as nn
from cuda_cases import FAKE_GPU

import middleware
from middleware.backends.cuda import check_cuda_runtime
from middleware.backends.cuda.units import cuda_units
from middleware.errors import DeviceError
from middleware.options import Options
from middleware.passes.group import generated_groups
from middleware.runtime.plan import build_plan


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
    monkeypatch.setattr("middleware.backends.cuda.available_loaders", lambda: [])
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


def test_groups_come_from_the_group_pass_for_the_gpu():
    """A graph the passes did not group is grouped by passes/group.py for the device:
    io runs, a global pool over more than 8 elements per output starting its own group."""
    graph = middleware.trace(SmallNet().eval(), torch.randn(1, 3, 8, 8))
    groups = generated_groups(graph, FAKE_GPU)
    ops = [[graph.node(n).op for n in g] for g in groups]
    assert ops[0] == ["batch_norm", "relu", "max_pool2d"]
    # the 4x4 global pool (16 elements per output) reads the add's result from memory
    assert ["batch_norm", "hardswish", "add"] in ops
    assert ["adaptive_avg_pool2d", "flatten"] in ops
    small = middleware.trace(SmallNet().eval(), torch.randn(1, 3, 4, 4))  # a 2x2 pool
    small_ops = [[small.node(n).op for n in g] for g in generated_groups(small, FAKE_GPU)]
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

    real = units.render_schedule

    def broken(schedule, hardware, emulate=True, name=None):
        r = real(schedule, hardware, emulate, name)
        return dataclasses.replace(r, source=r.source + "\n#error planted failure\n")

    monkeypatch.setattr(units, "render_schedule", broken)


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


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulation")
def test_units_take_the_passes_groups_as_they_are(tmp_path):
    """The backend does not regroup: every generated unit is one io group of the passes
    (here grouped for a CPU, without the GPU's own boundaries), whole."""
    from middleware.passes import DEFAULT_HARDWARE
    from middleware.passes.group import group, io_groups

    graph = group(
        middleware.trace(_randomise_bn(SmallNet()), torch.randn(1, 3, 8, 8)), DEFAULT_HARDWARE
    )
    options = Options(device="cuda", cache_dir=tmp_path, measure_hardware=False)
    units = cuda_units(graph, options, FAKE_GPU, torch.device("cpu"), emulate=True)
    generated = [tuple(u.nodes) for u in units if u.runs_as == "generated"]
    assert generated and set(generated) <= {tuple(g) for g in io_groups(graph)}


def test_long_reductions_are_left_to_the_framework():
    """A global pool over a large map is a group of its own that runs through the
    framework (one thread per output would sum the whole map serially), with the reason;
    a small one is still generated."""
    from middleware.backends.cuda.units import why_unsupported
    from middleware.passes.group import MAX_SERIAL_REDUCTION, reduction_extent

    for hw, fused in ((24, False), (16, True)):  # 12x12 = 144 and 8x8 = 64 per output
        graph = middleware.trace(SmallNet().eval(), torch.randn(1, 3, hw, hw))
        (pool,) = [n for n in graph.nodes() if n.op == "adaptive_avg_pool2d"]
        assert (reduction_extent(graph, pool) <= MAX_SERIAL_REDUCTION) == fused
        (mine,) = [g for g in generated_groups(graph, FAKE_GPU) if pool.name in g]
        reason = why_unsupported(graph, mine, FAKE_GPU)
        assert (reason == "") == fused and (fused or "parallel reduction" in reason)


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


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulation")
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_pipeline_passes_for_a_gpu_then_the_cuda_backend(layout, tmp_path):
    """What optimize(device="cuda") does, with the kernels emulated: the passes for the
    GPU's figures (grouping included), the backend's lowering, its units; every io group
    of the passes that renders is one generated unit, and the plan matches PyTorch."""
    from middleware.backends.cuda.backend import CudaBackend
    from middleware.passes import run_passes
    from middleware.passes.group import io_groups

    model = _randomise_bn(SmallNet())
    x = torch.randn(2, 3, 12, 10)
    options = Options(device="cuda", cache_dir=tmp_path, measure_hardware=False, layout=layout)
    graph = run_passes(middleware.trace(model, x), options, FAKE_GPU)
    graph = CudaBackend().lower(graph, options)
    units = cuda_units(graph, options, FAKE_GPU, torch.device("cpu"), emulate=True)
    generated = {tuple(u.nodes) for u in units if u.runs_as == "generated"}
    assert len(generated) >= 2 and generated <= {tuple(g) for g in io_groups(graph)}
    xin = x.contiguous(memory_format=torch.channels_last) if layout == "nhwc" else x
    with torch.no_grad():
        got = build_plan(graph, torch.device("cpu"), units).run([xin])
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("graph_ms", "steps_ms", "chosen"),
    [(1.0, 2.0, "graph"), (2.0, 1.0, "steps"), (1.0, 1.01, "steps")],
)
def test_cuda_graphs_auto_keeps_the_faster_way(monkeypatch, graph_ms, steps_ms, chosen):
    """cuda_graphs="auto": after the capture, replay and step by step are timed and the
    faster kept (a replay must win by GRAPH_MARGIN); a plan left step by step drops its
    graph and runs the plan itself; the note gives both times. (Timing stubbed: no GPU.)"""
    from middleware.backends.cuda import graphs

    class FakeGraphed:
        def __init__(self, plan, inputs):
            self.plan = plan

        def run(self, inputs):
            return ("replayed", *inputs)

    class FakePlan:
        notes = ()

        def run(self, inputs):
            return ("stepped", *inputs)

    monkeypatch.setattr(graphs, "GraphedPlan", FakeGraphed)
    monkeypatch.setattr(
        graphs, "time_interleaved", lambda fns: {"graph": graph_ms, "steps": steps_ms}
    )
    plan = graphs.CudaGraphPlan(FakePlan(), decide=True)
    assert plan.capture([torch.zeros(1)]) and plan.chosen == chosen
    assert plan.timings == (graph_ms, steps_ms)
    assert (plan.graphed is None) == (chosen == "steps")
    assert plan.run([1])[0] == ("replayed" if chosen == "graph" else "stepped")
    (note,) = plan.notes
    assert f"{graph_ms:.3f} ms" in note and f"{steps_ms:.3f} ms" in note
    assert note.startswith("the plan replays" if chosen == "graph" else "the plan runs step")
    lazy = graphs.CudaGraphPlan(FakePlan(), decide=True)  # captured on its first call
    assert lazy.run([torch.ones(1)])[0] == ("replayed" if chosen == "graph" else "stepped")
    assert lazy.chosen == chosen
    always = graphs.CudaGraphPlan(FakePlan(), decide=False)  # cuda_graphs=True: no timing
    assert always.capture([torch.zeros(1)]) and always.chosen is None
    assert always.run([1])[0] == "replayed"


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulation")
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_shared_weights_keep_no_copy(layout, tmp_path):
    """``cuda_weights="share"``: batch norms stay unfolded (a multiply-add after the
    convolution), every convolution reads the model's own weight storage, and the plan
    still matches PyTorch; "copy" (the default) folds and copies them instead."""

    from middleware.backends.cuda.backend import CudaBackend

    model = _randomise_bn(SmallNet())
    x = torch.randn(2, 3, 12, 10)
    xin = x.contiguous(memory_format=torch.channels_last) if layout == "nhwc" else x
    conv_ptrs = {model.conv1.weight.data_ptr(), model.conv2.weight.data_ptr()}
    backend = CudaBackend()
    for mode in ("share", "copy"):
        options = Options(
            device="cuda",
            cache_dir=tmp_path,
            measure_hardware=False,
            layout=layout,
            cuda_weights=mode,
        )
        shared = ("fold_batchnorm",) if mode == "share" else ()
        assert backend.passes_off(options) == ("decompose_layer_norm", "decompose_softmax", *shared)
        graph, units = _as_optimize_plans_it(model, x, options)
        plan = build_plan(graph, torch.device("cpu"), units)
        held = {t.data_ptr() for t in plan._template if isinstance(t, torch.Tensor)}
        if mode == "share":
            assert conv_ptrs <= held
            assert all(
                graph.values[graph.node(n).inputs[1]].layout == "nchw"
                for n in [m.name for m in graph.nodes() if m.op == "conv2d"]
            )
        else:
            assert not conv_ptrs & held  # folded into new weights
        with torch.no_grad():
            torch.testing.assert_close(plan.run([xin]), model(x), rtol=1e-4, atol=1e-4)


def test_cuda_weights_option_is_checked():
    from middleware.errors import OptionsError

    with pytest.raises(OptionsError, match="cuda_weights='shared'.*\"share\""):
        Options(cuda_weights="shared")


def _as_optimize_plans_it(model: nn.Module, x: torch.Tensor, options: Options) -> tuple:
    """(graph, units) as optimize(device="cuda") makes them, the kernels emulated: the
    passes less the backend's ``passes_off`` (as compile_graph does), its lowering, its
    units."""
    from middleware.backends.cuda.backend import CudaBackend
    from middleware.passes import run_passes

    backend = CudaBackend()
    passes = dataclasses.replace(options, disable_passes=backend.passes_off(options))
    graph = backend.lower(run_passes(middleware.trace(model, x), passes, FAKE_GPU), options)
    return graph, cuda_units(graph, options, FAKE_GPU, torch.device("cpu"), emulate=True)


class ConvMix(nn.Module):
    """Convolutions of several problems: with and without an epilogue (bias, BN, ReLU,
    residual), strided, grouped, depthwise and 1x1 (weights contiguous in both formats),
    and a first one of one input channel (on an NCHW image in an nhwc plan)."""

    def __init__(self) -> None:
        super().__init__()
        self.c0 = nn.Conv2d(1, 3, 3, padding=1)
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2, bias=False)
        self.c3 = nn.Conv2d(8, 12, 1)
        self.c4 = nn.Conv2d(12, 12, (3, 1), padding=(2, 0), dilation=(2, 1), bias=False)
        self.c5 = nn.Conv2d(12, 12, 3, padding=1, groups=12)

    def forward(self, x):
        y = torch.relu(self.bn1(self.c1(self.c0(x))))
        y = self.c3(self.c2(y))
        y = torch.relu(y + self.c4(y))
        return nn.functional.max_pool2d(self.c5(y), 2)


def _problem_key(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, geometry: tuple) -> tuple:
    """A convolution as cuDNN's cache tells it apart: the operands' sizes, the geometry and
    the one memory format of the call, which both cuDNN and oneDNN take as channels_last
    where the input's or the weight's strides suggest it: read here off the output ``y``
    ("either" where its strides fit both)."""
    cl = y.is_contiguous(memory_format=torch.channels_last)
    fmt = "either" if cl and y.is_contiguous() else "nhwc" if cl else "nchw"
    return (tuple(x.shape), tuple(w.shape), geometry, fmt)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulation")
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("weights", ["copy", "share"])
def test_searched_conv_problems_are_the_ones_the_plan_runs(layout, weights, tmp_path, monkeypatch):
    """cuDNN's algorithm search runs while the plan is built (trials.py), so the problems
    searched, on the scratch tensors the search makes, must be exactly those the plan's
    convolution steps hand torch.conv2d (sizes, geometry, the call's memory format): a
    problem missed is searched on the first run, beside the plan's buffers, and one
    searched in vain costs a search."""
    from middleware.backends.cuda import trials
    from middleware.backends.cuda import units as cuda_units_module

    searched = []
    monkeypatch.setattr(
        cuda_units_module,
        "search_conv_algorithms",
        lambda problems, device: searched.extend(problems) or 0,
    )
    model = _randomise_bn(ConvMix())
    x = torch.randn(2, 1, 13, 10)  # an image read as NCHW by an nhwc plan too
    options = Options(
        device="cuda",
        cache_dir=tmp_path,
        measure_hardware=False,
        layout=layout,
        cuda_weights=weights,
    )
    graph, units = _as_optimize_plans_it(model, x, options)
    ran = []
    real_conv = torch.conv2d
    pair = nn.modules.utils._pair

    def recording_conv(inp, w, b=None, stride=1, padding=0, dilation=1, groups=1):
        y = real_conv(inp, w, b, stride, padding, dilation, groups)
        geometry = (tuple(pair(stride)), tuple(pair(padding)), tuple(pair(dilation)), groups)
        ran.append(_problem_key(inp, w, y, geometry))
        return y

    monkeypatch.setattr(torch, "conv2d", recording_conv)
    xin = (
        x.contiguous(memory_format=torch.channels_last)
        if graph.values[graph.inputs[0]].layout == "nhwc"
        else x
    )
    with torch.no_grad():
        got = build_plan(graph, torch.device("cpu"), units).run([xin])
    monkeypatch.undo()
    torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-4)
    assert len(ran) >= 5
    searched_keys = set()
    for p in searched:
        xs, ws = trials.scratch_operands(p, torch.device("cpu"))
        ys = torch.conv2d(
            xs.normal_(), ws.normal_(), None, p.stride, p.padding, p.dilation, p.groups
        )
        searched_keys.add(_problem_key(xs, ws, ys, (p.stride, p.padding, p.dilation, p.groups)))
    assert searched_keys == set(ran)
    assert len(searched) == len(searched_keys)  # each problem once


def test_conv_search_runs_only_where_cudnn_benchmarks(monkeypatch):
    """No search off a CUDA device, with cuDNN off or out of benchmark mode, or with
    ``PRETRIAL`` off: cuDNN's heuristics choose there, and nothing is timed."""
    from middleware.backends.cuda import trials

    problem = trials.ConvProblem(
        (1, 3, 5, 5), "nchw", (4, 3, 3, 3), "nchw", "float32", (1, 1), (1, 1), (1, 1), 1
    )
    calls = []
    monkeypatch.setattr(torch, "conv2d", lambda *a: calls.append(a))
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    assert trials.search_conv_algorithms([problem], torch.device("cpu")) == 0
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    assert trials.search_conv_algorithms([problem], torch.device("cuda")) == 0
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    monkeypatch.setattr(trials, "PRETRIAL", False)
    assert trials.search_conv_algorithms([problem], torch.device("cuda")) == 0
    assert calls == []
