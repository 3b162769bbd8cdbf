"""NaN and +-inf go through every generated op as through PyTorch (issue 11).

The generated ``max``/``min`` were ``a > b ? a : b``: relu(NaN) gave 0, hardtanh(NaN) the
lower bound, and a max-pooling window kept a NaN only when it was its last element. PyTorch
propagates NaN through relu, hardtanh/relu6/clamp, max_pool2d, adaptive_max_pool2d and
torch.maximum. Checked on the x86 C kernels through ``optimize`` (both layouts), on the
ISPC source text (no ispc binary needed), and on the CUDA kernels run on the CPU through
the emulation header.

One PyTorch quirk is left out: erf-GELU(+inf) is NaN in PyTorch's vectorised CPU kernel
but +inf in its scalar path (a one-element tensor) and mathematically; the generated
kernels give +inf, so +inf is not fed to erf-GELU.
"""

from __future__ import annotations

import math
import shutil
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from cuda_cases import CASES, FAKE_GPU, inputs_for, kernel_args, schedule_of
from fusion_helpers import bn, build_chain, hardware, maxpool
from hypothesis import given, settings
from test_fusion_hypothesis import chains
from torch import nn

import middleware
from middleware.backends.cuda.build import build, emulation_request
from middleware.backends.cuda.emulate import EmulatedLauncher
from middleware.backends.cuda.kernel import GeneratedKernel
from middleware.backends.cuda.render import render_schedule
from middleware.backends.x86 import IspcBackend, X86Backend
from middleware.options import Options

NAN, INF = math.nan, math.inf
SPECIALS = (NAN, INF, -INF)


def with_specials(shape: tuple[int, ...], seed: int, specials: tuple[float, ...] = SPECIALS):
    """Random values with about one element in five replaced by a NaN or an infinity."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 3
    mask = torch.rand(shape, generator=gen) < 0.2
    picks = torch.randint(len(specials), shape, generator=gen)
    table = torch.tensor(specials)
    return torch.where(mask, table[picks], x)


def assert_same(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal NaN positions, equal infinities, finite values within 1e-5 of the finite
    scale."""
    finite = expected[torch.isfinite(expected)]
    scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    torch.testing.assert_close(
        got, expected, rtol=1e-5, atol=1e-5 * scale, equal_nan=True, msg=lambda m: f"{what}: {m}"
    )


class Unary(nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class Binary(nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.fn(x, y)


def bn_relu_pool(act: nn.Module, pool: nn.Module) -> nn.Module:
    m = nn.Sequential(nn.BatchNorm2d(6), act, pool)
    with torch.no_grad():
        m[0].running_mean.uniform_(-1, 1)
        m[0].running_var.uniform_(0.5, 2)
        m[0].weight.uniform_(0.5, 1.5)  # positive: max-pool and ReLU commute, merged
    return m.eval()


def check_generated(model: nn.Module, layout: str, *inputs: torch.Tensor) -> None:
    """``model`` through ``optimize`` matches eager PyTorch on ``inputs`` (NaNs included)
    and at least one of its nodes ran as a generated kernel with no fallback."""
    model = model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = middleware.optimize(model, device="cpu", example_inputs=list(inputs), layout=layout)
        with torch.no_grad():
            got = opt(*inputs)
    rows = opt.report().rows
    assert any(r.runs_as == "generated" for r in rows), str(opt.report())
    assert not opt.report().fallbacks, str(opt.report())
    with torch.no_grad():
        assert_same(got, model(*inputs), type(model).__name__)


# ---------------------------------------------------------------------- x86 C
LAYOUTS = ("nchw", "nhwc")

POOLED = {
    "bn_relu_maxpool": lambda: bn_relu_pool(nn.ReLU(), nn.MaxPool2d(3, 2, 1)),
    "bn_relu6_maxpool_ceil": lambda: bn_relu_pool(
        nn.ReLU6(), nn.MaxPool2d(3, 2, 0, ceil_mode=True)
    ),
    "bn_relu_maxpool_2x2": lambda: bn_relu_pool(nn.ReLU(), nn.MaxPool2d(2, 2)),
    "maxpool_dilated": lambda: nn.MaxPool2d(3, 1, 1, dilation=2),
    "adaptive_max": lambda: nn.AdaptiveMaxPool2d((2, 3)),
    "avgpool": lambda: nn.AvgPool2d(3, 2, 1, count_include_pad=False),
    "adaptive_avg": lambda: nn.AdaptiveAvgPool2d(1),
    "mean": lambda: Unary(lambda x: x.mean((2, 3), keepdim=True)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(POOLED))
def test_fused_pooling_groups(case: str, layout: str) -> None:
    check_generated(POOLED[case](), layout, with_specials((2, 6, 9, 11), seed=len(case)))


ACTIVATIONS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], tuple[float, ...]]] = {
    "relu": (torch.relu, SPECIALS),
    "relu6": (F.relu6, SPECIALS),
    "hardtanh": (lambda x: F.hardtanh(x, -0.5, 2.0), SPECIALS),
    "leaky_relu": (lambda x: F.leaky_relu(x, 0.2), SPECIALS),
    "leaky_relu_0": (lambda x: F.leaky_relu(x, 0.0), SPECIALS),  # -inf * 0 = NaN
    "sigmoid": (torch.sigmoid, SPECIALS),
    "tanh": (torch.tanh, SPECIALS),
    "silu": (F.silu, SPECIALS),
    "hardswish": (F.hardswish, SPECIALS),
    "hardsigmoid": (F.hardsigmoid, SPECIALS),
    "elu": (lambda x: F.elu(x, 0.5), SPECIALS),
    "mish": (F.mish, SPECIALS),
    "hardshrink": (lambda x: F.hardshrink(x, 0.3), SPECIALS),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), SPECIALS),
    "gelu": (F.gelu, (NAN, -INF)),  # see the module docstring
    "scalar_ops": (lambda x: (2.0 - x * 3.0) / 0.5 + 1.0, SPECIALS),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_activations(act: str, layout: str) -> None:
    fn, specials = ACTIVATIONS[act]
    # followed by a max-pool: the activation is computed inside a generated group
    model = Unary(lambda x: F.max_pool2d(fn(x), 2, 1))
    check_generated(model, layout, with_specials((2, 5, 7, 9), seed=len(act), specials=specials))


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_binary_with_specials_on_both_sides(op: str) -> None:
    fn = getattr(torch, op)
    x, y = with_specials((2, 5, 6, 7), seed=1), with_specials((1, 5, 1, 7), seed=2)
    check_generated(Binary(lambda a, b: torch.relu(fn(a, b))), "nhwc", x, y)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_max_pool_keeps_a_nan_wherever_it_sits_in_the_window(layout: str) -> None:
    """Channel ``k`` has its NaN at window position ``k`` (2x2 windows, stride 2): the
    first, middle or last element a window reads."""
    x = torch.randn(1, 4, 4, 6)
    for k in range(4):
        x[0, k, k // 2 :: 2, k % 2 :: 2] = NAN
    model = bn_relu_pool(nn.ReLU(), nn.MaxPool2d(2, 2))
    model[0] = nn.BatchNorm2d(4).eval()
    check_generated(model, layout, x)
    check_generated(nn.MaxPool2d(2, 2), layout, x)


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(chain=chains())
def test_random_io_chains_with_specials(chain, tmp_path_factory) -> None:  # noqa: ANN001
    """The random io chains of test_fusion_hypothesis (every pointwise op and pooling the
    generator fuses, both layouts) as one generated kernel, on inputs with NaN and +-inf,
    against the reference interpreter."""
    shape, layout, steps = chain
    g = build_chain(shape, layout, steps, seed=len(steps))
    kernel = X86Backend().build(
        g,
        [n.name for n in g.nodes()],
        Options(cache_dir=tmp_path_factory.getbasetemp() / "nan-chains"),
        hardware(),
    )
    x = with_specials(tuple(shape), seed=sum(shape))
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    env = {g.inputs[0]: x, **{p: torch.from_numpy(a) for p, a in g.params.items()}}
    got = kernel.fn(*[env[v] for v in kernel.inputs])
    assert_same(got, g.evaluate(x), " -> ".join(step[0] for step in steps))


# ------------------------------------------------------------------------ ISPC
def test_ispc_source_uses_nan_propagating_max() -> None:
    """ISPC's builtin max/min drop a NaN (maxps): the kernels use mw_max/mw_min."""
    g = build_chain((2, 5, 9, 7), "nhwc", [bn(), ("relu", {}), maxpool(3, 2, 1)])
    be = IspcBackend()
    ispc, _ = be.render(be.schedule(g, [n.name for n in g.nodes()], hardware()))
    assert "mw_max(" in ispc and "a != a" in ispc
    code = "\n".join(ln for ln in ispc.splitlines() if "mw_max(float" not in ln)
    assert " max(" not in code.replace("mw_max(", "")


# ------------------------------------------------------------------------ CUDA
CUDA_CASES = {
    "bn_relu_maxpool": SPECIALS,
    "bn_relu_maxpool_ceil": SPECIALS,
    "relu": SPECIALS,
    "relu6": SPECIALS,
    "leaky_relu": SPECIALS,
    "sigmoid": SPECIALS,
    "tanh": SPECIALS,
    "silu": SPECIALS,
    "hardswish": SPECIALS,
    "hardsigmoid": SPECIALS,
    "registry_elu": SPECIALS,
    "registry_mish": SPECIALS,
    "registry_hardshrink": SPECIALS,
    "gelu_tanh": SPECIALS,
    "gelu": (NAN, -INF),
    "add": SPECIALS,
    "sub_alpha": SPECIALS,
    "mul_channel": SPECIALS,
    "div_row": SPECIALS,
    "maxpool_2x2": SPECIALS,
    "maxpool_dilated": SPECIALS,
    "maxpool_relu": SPECIALS,
    "maxpool_relu6": SPECIALS,
    "adaptive_max_2x3": SPECIALS,
    "avgpool_pad_exclude": SPECIALS,
    "mean_hw": SPECIALS,
    # (softmax and log_softmax have no loop semantics: the CUDA backend runs them in ATen)
    "depthwise_relu6": SPECIALS,
}


@pytest.fixture(scope="module")
def cuda_library(tmp_path_factory: pytest.TempPathFactory):
    """All cases' emulated kernels in one library (one g++ run)."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ for the CUDA emulation")
    parts = []
    for i, case in enumerate(sorted(CUDA_CASES)):
        graph, names = CASES[case]("nhwc")
        source = render_schedule(schedule_of(graph, names), FAKE_GPU, name=f"nan_{case}").source
        parts.append(f"namespace nan{i} {{\n{source}}}\n")
    request = emulation_request("nan_cases", "\n".join(parts))
    return build(request, tmp_path_factory.mktemp("cuda-nan"))


@pytest.mark.parametrize("case", sorted(CUDA_CASES))
def test_cuda_emulated_kernels(case: str, cuda_library) -> None:
    graph, names = CASES[case]("nhwc")
    rendered = render_schedule(schedule_of(graph, names), FAKE_GPU, name=f"nan_{case}")
    kernel = GeneratedKernel(rendered, EmulatedLauncher(cuda_library, rendered.name))
    inputs = []
    for i, x in enumerate(inputs_for(graph, seed=len(case))):
        y = with_specials(tuple(x.shape), seed=i + len(case), specials=CUDA_CASES[case])
        inputs.append(y.contiguous(memory_format=torch.channels_last) if y.dim() == 4 else y)
    expected = graph.evaluate(*inputs)
    got = kernel(*kernel_args(graph, rendered.inputs, inputs))
    assert_same(got, expected, case)
