"""A window reduction (pooling, global mean) whose input is a fused broadcast op with the
smaller operand first (``scale[c] * x``, ConvNeXt's layer scale): the windows are bounded by
the reduction's input shape, not by the first value the inlined body happens to load (the
broadcast operand's 1x1 map made an adaptive pool read one pixel). Against PyTorch, on the
CPU code generator and on the CUDA kernels through the CPU emulation."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import middleware

POOLS = {
    "adaptive_avg_1": lambda y: F.adaptive_avg_pool2d(y, 1),
    "adaptive_avg_2": lambda y: F.adaptive_avg_pool2d(y, 2),
    "adaptive_max_1": lambda y: F.adaptive_max_pool2d(y, 1),
    "mean_hw": lambda y: y.mean((2, 3), keepdim=True),
    "avg_3_2": lambda y: F.avg_pool2d(y, 3, 2, 1),
    "max_3_2": lambda y: F.max_pool2d(y, 3, 2, 1),
}
PRODUCERS = {
    "s*x": lambda s, x: s * x,
    "s*x+x": lambda s, x: s * x + x,
    "x*s+x": lambda s, x: x * s + x,
    "sigmoid(s)*x": lambda s, x: torch.sigmoid(s) * x,
}


class Net(nn.Module):
    def __init__(self, producer: str, pool: str, c: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(c, 1, 1))
        self.producer, self.pool = PRODUCERS[producer], POOLS[pool]

    def forward(self, x):
        return self.pool(self.producer(self.scale, x))


def _case(producer: str, pool: str, seed: int) -> tuple[nn.Module, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    c, h, w = 3 + seed % 5, 5 + seed % 4, 6 + seed % 3
    torch.manual_seed(seed)
    model = Net(producer, pool, c).eval()
    return model, torch.randn(2, c, h, w, generator=g)


# two producers by default (the broadcast operand first, and a function of it); every
# producer with -m slow
_DEFAULT_PRODUCERS = ("s*x+x", "sigmoid(s)*x")


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize(
    "producer",
    [
        p if p in _DEFAULT_PRODUCERS else pytest.param(p, marks=pytest.mark.slow)
        for p in sorted(PRODUCERS)
    ],
)
@pytest.mark.parametrize("pool", sorted(POOLS))
def test_generated_cpu(pool, producer, layout):
    model, x = _case(producer, pool, len(pool) + len(producer))
    opt = middleware.optimize(model, example_inputs=(x,), layout=layout)
    assert any(r.runs_as == "generated" for r in opt.report().rows)
    with torch.no_grad():
        want = model(x)
        got = opt(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulation")
@pytest.mark.parametrize("producer", ["s*x", "s*x+x"])
@pytest.mark.parametrize("pool", ["adaptive_avg_1", "adaptive_max_1", "mean_hw"])
def test_cuda_kernels_emulated(pool, producer, tmp_path):
    from cuda_cases import FAKE_GPU

    from middleware.backends.cuda.units import cuda_units
    from middleware.options import Options
    from middleware.runtime.plan import build_plan

    model, x = _case(producer, pool, 7)
    graph = middleware.trace(model, x)
    options = Options(device="cuda", cache_dir=tmp_path, measure_hardware=False)
    units = cuda_units(graph, options, FAKE_GPU, torch.device("cpu"), emulate=True)
    assert any(u.runs_as == "generated" for u in units)
    plan = build_plan(graph, torch.device("cpu"), units)
    with torch.no_grad():
        want = model(x)
        got = plan.run([x])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
