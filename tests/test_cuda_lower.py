"""The CUDA backend's lowering of inference batch-norms to a per-channel multiply-add."""

from __future__ import annotations

import torch
import torch.nn as nn

import middleware
from middleware.backends.cuda.lower import affine_batch_norms


def _net() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 6, 1), nn.BatchNorm2d(6))
    for bn in (m[0], m[3]):
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.data.normal_()
        bn.bias.data.normal_()
    return m.eval()


def test_batch_norms_become_a_multiply_add_with_the_same_values():
    model = _net()
    x = torch.randn(2, 6, 5, 7)
    graph = middleware.trace(model, x)
    lowered = affine_batch_norms(graph)
    ops = [n.op for n in lowered.nodes()]
    assert "batch_norm" not in ops and ops.count("mul") == ops.count("add") == 2
    names = {n.name for n in graph.nodes() if n.op == "batch_norm"}
    assert names <= {n.name for n in lowered.nodes() if n.op == "add"}  # names kept
    assert [n.op for n in graph.nodes()].count("batch_norm") == 2  # input unchanged
    with torch.no_grad():
        ref = model(x)
        got = lowered.evaluate(x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_graph_without_batch_norms_is_returned_as_is():
    graph = middleware.trace(nn.Sequential(nn.ReLU()).eval(), torch.randn(1, 2, 3, 3))
    assert affine_batch_norms(graph) is graph


def test_lowered_graph_runs_as_generated_cuda_kernels(tmp_path):
    """The lowered multiply-adds join the io groups (kernels run by the CPU emulation)."""
    import shutil

    import pytest
    from cuda_cases import FAKE_GPU

    from middleware.backends.cuda.units import cuda_units
    from middleware.options import Options
    from middleware.runtime.plan import build_plan

    if shutil.which("g++") is None:
        pytest.skip("no g++ for the emulation")
    model = _net()
    x = torch.randn(2, 6, 9, 5)
    graph = affine_batch_norms(middleware.trace(model, x))
    options = Options(device="cuda", cache_dir=tmp_path, measure_hardware=False)
    units = cuda_units(graph, options, FAKE_GPU, torch.device("cpu"), emulate=True)
    generated = {graph.node(n).op for u in units if u.runs_as == "generated" for n in u.nodes}
    assert {"mul", "add", "relu"} <= generated
    with torch.no_grad():
        ref = model(x)
        got = build_plan(graph, torch.device("cpu"), units).run([x])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_channels_last_convolutions_keep_one_weight_copy(tmp_path):
    """The weight of a convolution writing channels_last is made channels_last once, as the
    plan's constant; the convolution uses that constant (no second copy of its own)."""
    import shutil

    import pytest
    from cuda_cases import FAKE_GPU
    from test_cuda_units import _as_channels_last

    from middleware.backends.cuda.lower import channels_last_weights
    from middleware.backends.cuda.units import cuda_units
    from middleware.options import Options
    from middleware.runtime.plan import build_plan

    if shutil.which("g++") is None:
        pytest.skip("no g++ for the emulation")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU()).eval()
    x = torch.randn(2, 4, 6, 6)
    graph = _as_channels_last(middleware.trace(model, x))
    lowered = channels_last_weights(graph)
    (conv,) = [n for n in lowered.nodes() if n.op == "conv2d"]
    assert lowered.values[conv.inputs[1]].layout == "nhwc"
    assert graph.values[conv.inputs[1]].layout == "nchw"  # input unchanged
    options = Options(device="cuda", cache_dir=tmp_path, measure_hardware=False)
    units = cuda_units(lowered, options, FAKE_GPU, torch.device("cpu"), emulate=True)
    (unit,) = [u for u in units if conv.name in u.nodes]
    assert "epilogue" in unit.reason and unit.fn.weight is None
    plan = build_plan(lowered, torch.device("cpu"), units)
    w = plan._template[plan.slot_of[conv.inputs[1]]]
    assert w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()
    xin = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(plan.run([xin]), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())
