"""Issue 18's I/O kernels: the patterns of bench/io_patterns.py through ``optimize()`` in
both layouts against PyTorch (NaN and +-inf inputs included: max-pooling propagates NaN),
the AVX-512 path's masked tails (widths that are not a multiple of 16), non-temporal
stores, the portable ``#else`` loops (compiled without AVX-512) and the hoisting of an
expensive loop-invariant subexpression (the SE gate's sigmoid)."""

from __future__ import annotations

import ctypes
import dataclasses
import shutil
import subprocess

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fusion_helpers import bn, build_chain, hardware, maxpool

import middleware
from middleware.backends.x86 import X86Backend
from middleware.backends.x86.render import render_c
from middleware.options import Options

LAYOUTS = ("nchw", "nhwc")


def with_specials(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Seeded normal values with about 3% NaN, +inf and -inf each."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    u = torch.rand(shape, generator=gen)
    x[u < 0.03] = float("nan")
    x[(u >= 0.03) & (u < 0.06)] = float("inf")
    x[(u >= 0.06) & (u < 0.09)] = float("-inf")
    return x


def assert_matches(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Same shape, NaN where PyTorch has NaN, the same infinities, and the finite values
    within 1e-5 of the output's scale."""
    assert got.shape == ref.shape, what
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"{what}: NaN positions differ"
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(got), inf), f"{what}: infinities differ"
    assert torch.equal(got[inf], ref[inf]), f"{what}: infinities differ in sign"
    fin = torch.isfinite(ref)
    scale = ref[fin].abs().max().item() if fin.any() else 1.0
    err = (got[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= 1e-5 * max(scale, 1.0), f"{what}: max error {err} at scale {scale}"


def _bn(c: int) -> nn.BatchNorm2d:
    m = nn.BatchNorm2d(c)
    with torch.no_grad():
        m.running_mean.uniform_(-1, 1)
        m.running_var.uniform_(0.5, 2)
        m.weight.uniform_(0.5, 1.5)
        m.bias.uniform_(-0.5, 0.5)
    return m


class Residual(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.relu(x + y)


class ConcatMaxPool(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(torch.cat([a, b], 1), 3, 1, 1)


class SEGate(nn.Module):
    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(s)


# The five patterns, small: 37 columns in (19 out at stride 2), 20 or 18 channels, so
# the vector loops end in a masked chunk in both layouts.
PATTERNS = {
    "chain": (lambda: nn.Sequential(_bn(20), nn.ReLU(), nn.MaxPool2d(3, 2, 1)), [(2, 20, 9, 37)]),
    # count_include_pad=False: the divisor varies at the borders
    "avgpool": (
        lambda: nn.Sequential(_bn(20), nn.ReLU(), nn.AvgPool2d(3, 2, 1, count_include_pad=False)),
        [(2, 20, 9, 37)],
    ),
    "residual": (Residual, [(2, 20, 5, 37), (2, 20, 5, 37)]),
    "concat_maxpool": (ConcatMaxPool, [(2, 12, 7, 37), (2, 6, 7, 37)]),
    "se_gate": (SEGate, [(2, 20, 5, 37), (2, 20, 1, 1)]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern_matches_pytorch(name: str, layout: str, tmp_path) -> None:  # noqa: ANN001
    factory, shapes = PATTERNS[name]
    torch.manual_seed(0)
    model = factory().eval()
    xs = [with_specials(s, seed=i + len(name)) for i, s in enumerate(shapes)]
    if layout == "nhwc":
        xs = [x.contiguous(memory_format=torch.channels_last) for x in xs]
    opt = middleware.optimize(
        model,
        device="cpu",
        example_inputs=xs,
        cache_dir=tmp_path,
        strict=True,
        measure_hardware=False,
    )
    with torch.no_grad():
        got, ref = opt(*xs), model(*xs)
    assert_matches(got, ref, f"{name} {layout}")
    rows = [r for r in opt.report().rows if r.bound == "io"]
    assert rows and all(r.runs_as == "generated" for r in rows), rows


def _chain_graph(layout: str, shape: tuple[int, int, int, int]):  # noqa: ANN202
    return build_chain(shape, layout, [bn(), ("relu", {}), maxpool(3, 2, 1)])


def test_non_temporal_stores(tmp_path) -> None:  # noqa: ANN001
    """An output larger than the L2 of all cores is stored non-temporally where the vector
    loop covers whole lines (NHWC, 32 channels); the values are those of PyTorch."""
    g = _chain_graph("nhwc", (2, 32, 9, 13))
    hw = dataclasses.replace(hardware(), l2_bytes=64)
    kernel = X86Backend().build(g, [n.name for n in g.nodes()], Options(cache_dir=tmp_path), hw)
    src = kernel.source_path.read_text()
    assert "_mm512_stream_ps" in src and "_mm_sfence" in src
    x = with_specials((2, 32, 9, 13), seed=3).contiguous(memory_format=torch.channels_last)
    assert_matches(kernel.fn(x), g.evaluate(x), "non-temporal chain")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_portable_loops_match(layout: str, tmp_path) -> None:  # noqa: ANN001
    """The ``#else`` side of every vector loop (what a machine without AVX-512 runs),
    compiled here with -mno-avx512f, gives PyTorch's values too."""
    shape = (2, 20, 9, 37)
    g = _chain_graph(layout, shape)
    s = X86Backend().schedule(g, [n.name for n in g.nodes()], hardware())
    src = render_c(s, stream_min_bytes=0)
    assert "#ifdef __AVX512F__" in src
    c, so = tmp_path / "k.c", tmp_path / "k.so"
    c.write_text(src)
    subprocess.run(
        ["gcc", "-O2", "-march=native", "-mno-avx512f", "-fopenmp", "-shared", "-fPIC"]
        + ["-o", str(so), str(c), "-lm"],
        check=True,
    )
    fn = getattr(ctypes.CDLL(str(so)), s.name)
    fn.restype, fn.argtypes = None, [ctypes.c_void_p] * 2
    x = with_specials(shape, seed=5)
    mf = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    x = x.contiguous(memory_format=mf)
    ref = g.evaluate(x)
    out = torch.empty(ref.shape).contiguous(memory_format=mf)
    fn(x.data_ptr(), out.data_ptr())
    assert_matches(out, ref, f"portable {layout}")


def test_se_gate_sigmoid_is_hoisted(tmp_path) -> None:  # noqa: ANN001
    """sigmoid(s) of an (N, C, 1, 1) gate is computed once per channel row, outside the
    loops over the image, not once per element."""
    xs = [torch.randn(2, 20, 5, 37), torch.randn(2, 20, 1, 1)]
    opt = middleware.optimize(
        SEGate().eval(),
        device="cpu",
        example_inputs=xs,
        cache_dir=tmp_path,
        strict=True,
        measure_hardware=False,
    )
    src = next(tmp_path.glob("kernels/*/kernel.c")).read_text()
    body = src.split("void ", 1)[1] if "static inline float mw_sigmoid" in src else src
    calls = [ln for ln in body.splitlines() if "mw_sigmoid(" in ln and "static" not in ln]
    assert len(calls) == 1 and "hoist" in calls[0], calls
    assert_matches(opt(*xs), SEGate()(*xs), "se gate")


def test_vector_stride_refuses_an_index_only_sampled_as_affine():
    """A channel shuffle's index ``(c mod G) * 2 + c // G`` matches stride 2 at sampled
    points away from c = G; the AVX-512 path must not take it as affine (a 16-lane block
    crossing c = G would read the wrong channels)."""
    from middleware.backends.x86.vec512 import Unsupported, stride_of
    from middleware.index_expr import Int, Var, op

    c = Var("c")
    shuffle = op("add", op("mul", op("mod", c, Int(100)), Int(2)), op("floordiv", c, Int(100)))
    with pytest.raises(Unsupported):
        stride_of([shuffle], "c", [1], [200])
    assert stride_of([op("add", op("mul", c, Int(3)), Int(1))], "c", [1], [200]) == 3
