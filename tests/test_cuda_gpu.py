"""The CUDA backend on a real GPU: every case's kernel against PyTorch on the device, a
launch on a side stream, and whole networks through ``optimize(model, device="cuda")``.

Skipped, with the reason, where there is no CUDA device, no kernel loader (pycuda or
cuda-python) or no CUDA compiler (nvcc or NVRTC).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from cuda_cases import CASES, LAYOUTS, gpu_skip_reason, inputs_for, kernel_args, special_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(gpu_skip_reason()), reason=gpu_skip_reason()),
]


@pytest.fixture(scope="module")
def hardware():
    from middleware.hardware import detect_cuda

    return detect_cuda(None, measure=False)


@pytest.fixture(autouse=True, scope="module")
def _exact_fp32():
    """PyTorch's references in plain fp32 (no TF32 in cuDNN convolutions or matmuls)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, hardware):
    """A kernel cache with every case compiled up front, in parallel (build_many)."""
    from cuda_cases import schedule_of

    from middleware.backends.cuda.build import build_many, cubin_request
    from middleware.backends.cuda.render import render_schedule

    root = tmp_path_factory.mktemp("cuda-gpu-cache")
    reqs = []
    for case in sorted(CASES):
        for layout in LAYOUTS:
            graph, names = CASES[case](layout)
            r = render_schedule(schedule_of(graph, names, hardware), hardware, emulate=False)
            reqs.append(cubin_request(r.name, r.source, hardware.arch, ()))
    for result in build_many(reqs, root):
        assert not isinstance(result, Exception), str(result)
    return root


def _kernel(case, layout, hardware, cache_dir):
    """(graph, the kernel's input values, the kernel) of a case, rendered from its schedule."""
    from cuda_cases import schedule_of

    from middleware.backends.cuda.kernel import compile_schedule

    graph, names = CASES[case](layout)
    schedule = schedule_of(graph, names, hardware)
    kernel = compile_schedule(schedule, hardware, cache_dir, torch.cuda.current_device())
    return graph, kernel.rendered.inputs, kernel


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_kernel_matches_pytorch(case, layout, hardware, cache_dir):
    graph, ins, kernel = _kernel(case, layout, hardware, cache_dir)
    inputs = inputs_for(graph, seed=7, device="cuda")
    expected = graph.evaluate(*inputs)
    got = kernel(*kernel_args(graph, ins, inputs, device="cuda"))
    assert got.device.type == "cuda"
    # NaN where PyTorch gives NaN (sqrt and rsqrt of the negative random inputs)
    torch.testing.assert_close(
        got, expected, rtol=1e-5, atol=1e-5, equal_nan=True, msg=f"{case}/{layout}"
    )
    # NaN and infinities as PyTorch on the device (erf-GELU: no +inf, see special_inputs)
    inputs = [x.to("cuda") for x in special_inputs(graph, seed=7)]
    expected = graph.evaluate(*inputs)
    got = kernel(*kernel_args(graph, ins, inputs, device="cuda"))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_gpu_kernel_runs_on_the_current_stream(hardware, cache_dir):
    """Launched inside ``torch.cuda.stream(s)``, the kernel is ordered with PyTorch's work
    on ``s``: a producer just before it and a reader just after it see consistent data."""
    graph, ins, kernel = _kernel("bn_relu_maxpool", "nhwc", hardware, cache_dir)
    (x,) = inputs_for(graph, seed=1, device="cuda")
    args = kernel_args(graph, ins, [x], device="cuda")
    expected = graph.evaluate(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        big = torch.randn(64, 1024, 1024, device="cuda")  # keep the stream busy first
        big.mul_(2.0)
        xs = args[0] * 1.0  # produced on s just before the launch
        out = kernel(xs, *args[1:])
        total = out.sum()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(total, expected.sum(), rtol=1e-4, atol=1e-3)


class SmallNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        y = self.pool(torch.relu(self.bn1(self.conv1(x))))
        z = nn.functional.hardswish(self.bn2(y)) + y
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(z, 1), 1))


def _randomised(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
    return model.eval()


def test_optimize_on_cuda_runs_generated_kernels(tmp_path):
    import middleware

    model = _randomised(SmallNet()).cuda()
    x = torch.randn(4, 3, 33, 31, device="cuda")
    opt = middleware.optimize(model, device="cuda", cache_dir=tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-4)
    rows = opt.report().rows
    assert any(r.runs_as == "generated" for r in rows), str(opt.report())


@pytest.mark.slow
@pytest.mark.parametrize("net", ["resnet18", "mobilenet_v3_small", "shufflenet_v2_x1_0"])
def test_torchvision_network_on_cuda(net, tmp_path):
    tvm = pytest.importorskip("torchvision.models")
    import middleware

    model = _randomised(getattr(tvm, net)()).cuda()
    x = torch.randn(2, 3, 224, 224, device="cuda")
    opt = middleware.optimize(model, device="cuda", cache_dir=tmp_path)
    with torch.no_grad():
        expected = model(x)
        got = opt(x)
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * max(1.0, scale))
    assert any(r.runs_as == "generated" for r in opt.report().rows)


def test_plan_replays_as_a_cuda_graph(tmp_path):
    """optimize(cuda_graphs=True) captures the plan as one CUDA graph: later inputs give the
    model's outputs, and outputs a caller keeps are not overwritten by the next replay;
    cuda_graphs=False runs the same plan step by step."""
    import middleware
    from middleware.backends.cuda.graphs import CudaGraphPlan

    model = _randomised(SmallNet()).cuda()
    x = torch.randn(4, 3, 33, 31, device="cuda")
    opt = middleware.optimize(
        model, device="cuda", example_inputs=(x,), cache_dir=tmp_path, cuda_graphs=True
    )
    assert isinstance(opt.plan, CudaGraphPlan) and opt.plan.graphed is not None
    assert any("one CUDA graph" in n for n in opt.report().notes), opt.report().notes
    with torch.no_grad():
        x2, x3 = torch.randn_like(x), torch.randn_like(x)
        y2 = opt(x2)
        y3 = opt(x3)
        torch.testing.assert_close(y2, model(x2), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(y3, model(x3), rtol=1e-4, atol=1e-4)
        plain = middleware.optimize(
            model, device="cuda", example_inputs=(x,), cache_dir=tmp_path, cuda_graphs=False
        )
        assert not isinstance(plain.plan, CudaGraphPlan)
        torch.testing.assert_close(plain(x2), y2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(4, 3, 33, 31), (16, 3, 112, 112)])
def test_default_graph_or_steps_is_measured(shape, tmp_path):
    """The default (cuda_graphs="auto") times replay against step by step after the capture
    and keeps the faster: the report gives both times and the choice; either way the
    outputs equal the model's, call after call."""
    import middleware
    from middleware.backends.cuda.graphs import CudaGraphPlan

    model = _randomised(SmallNet()).cuda()
    x = torch.randn(*shape, device="cuda")
    opt = middleware.optimize(model, device="cuda", example_inputs=(x,), cache_dir=tmp_path)
    plan = opt.plan
    assert isinstance(plan, CudaGraphPlan) and plan.chosen in ("graph", "steps")
    assert plan.timings is not None and all(t > 0 for t in plan.timings)
    assert (plan.graphed is not None) == (plan.chosen == "graph")
    note = [n for n in opt.report().notes if "measured" in n]
    assert note and ("one CUDA graph" if plan.chosen == "graph" else "step by step") in note[0]
    with torch.no_grad():
        for _ in range(2):
            x2 = torch.randn_like(x)
            y = opt(x2)
            torch.testing.assert_close(y, model(x2), rtol=1e-4, atol=1e-4)


def test_conv_epilogue_on_the_gpu(tmp_path):
    """Convolutions with bias, residual and activations (cuDNN + the generated epilogue)
    in both layouts, against PyTorch on the device."""
    import middleware

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1 = nn.Conv2d(16, 16, 3, padding=1)
            self.c2 = nn.Conv2d(16, 16, 3, padding=1)
            self.c3 = nn.Conv2d(16, 6, 1)

        def forward(self, x):
            y = nn.functional.hardswish(self.c1(x))
            y = torch.relu(self.c2(y) + x)
            return torch.sigmoid(self.c3(y))

    model = Block().eval().cuda()
    for layout in ("nchw", "nhwc"):
        x = torch.randn(3, 16, 17, 19, device="cuda")
        opt = middleware.optimize(model, device="cuda", cache_dir=tmp_path, layout=layout)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-4)
        reasons = [r.reason for r in opt.report().rows if r.op == "conv2d"]
        assert len(reasons) == 3 and all("epilogue" in r for r in reasons), reasons


def _kernels_per_call(fn, x: torch.Tensor, calls: int = 2) -> list[int]:
    """The CUDA kernels each of ``calls`` calls of ``fn(x)`` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    counts = []
    for _ in range(calls):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(x)
            torch.cuda.synchronize()
        counts.append(sum(1 for ev in prof.events() if getattr(ev, "device_time", 0) > 0))
    return counts


def test_cudnn_search_runs_while_the_plan_is_built(tmp_path, monkeypatch):
    """With cudnn.benchmark on, optimize() searches every convolution problem of the plan
    on scratch tensors (backends/cuda/trials.py) before the plan holds memory: the plan's
    first call then launches no more kernels than its second (a search times several
    algorithms, each a kernel launch). Control: with the search off (trials.PRETRIAL),
    on problems no call has searched yet, the first call launches more."""
    import middleware
    from middleware.backends.cuda import trials

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    searched = []
    real = trials.search_conv_algorithms

    def spy(problems, device):
        searched.append(real(problems, device))
        return searched[-1]

    monkeypatch.setattr("middleware.backends.cuda.units.search_conv_algorithms", spy)

    class Convs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c0 = nn.Conv2d(1, 8, 3, padding=1)  # one input channel: either layout
            self.c1 = nn.Conv2d(8, 40, 3, padding=1)
            self.c2 = nn.Conv2d(40, 40, 3, stride=2, padding=1, groups=4)
            self.c3 = nn.Conv2d(40, 24, 1, bias=False)

        def forward(self, x):
            y = torch.relu(self.c1(self.c0(x)))
            return self.c3(torch.relu(self.c2(y)))

    model = Convs().eval().cuda()
    with torch.no_grad():
        for searched_first, hw in ((True, (45, 47)), (False, (39, 41))):  # unsearched shapes
            monkeypatch.setattr(trials, "PRETRIAL", searched_first)
            x = torch.randn(8, 1, *hw, device="cuda")
            opt = middleware.optimize(
                model, device="cuda", example_inputs=(x,), cache_dir=tmp_path, cuda_graphs=False
            )  # built here, on x
            first, second = _kernels_per_call(opt, x)
            torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-4)
            if searched_first:
                assert searched[-1] == 4, searched
                assert first == second, (first, second)
            else:
                assert searched[-1] == 0, searched
                assert first > second, (first, second)


def test_ops_without_loop_semantics_run_through_the_framework_on_the_gpu(tmp_path):
    """softmax has no loop semantics: it runs through ATen with the reason in the report,
    while the io ops around it run in generated kernels."""
    import middleware

    model = nn.Sequential(nn.ReLU(), nn.Softmax(dim=1), nn.Sigmoid()).eval().cuda()
    x = torch.randn(4, 10, 7, 5, device="cuda")
    opt = middleware.optimize(model, device="cuda", cache_dir=tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
    rows = opt.report().rows
    (soft,) = [r for r in rows if r.op == "softmax"]
    assert soft.runs_as != "generated" and "no loop semantics" in soft.reason
    assert any(r.runs_as == "generated" for r in rows if r.op in ("relu", "sigmoid"))
