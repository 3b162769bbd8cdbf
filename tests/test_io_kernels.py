"""Issue 18's I/O kernels: the patterns of bench/io_patterns.py through ``optimize()`` in
both layouts against PyTorch (NaN and +-inf inputs included: max-pooling propagates NaN),
the AVX-512 path's masked tails (widths that are not a multiple of 16), non-temporal
stores, the portable ``#else`` loops (compiled without AVX-512) and the hoisting of an
expensive loop-invariant subexpression (the SE gate's sigmoid)."""

from __future__ import annotations

import ctypes
import dataclasses
import platform
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fusion_helpers import avgpool, bn, build_chain, hardware, maxpool
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import middleware
from middleware.backends.x86 import X86Backend
from middleware.backends.x86.compile import build_c
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
@pytest.mark.parametrize("stride", [2, 1])
def test_portable_loops_match(layout: str, stride: int, tmp_path) -> None:  # noqa: ANN001
    """The ``#else`` side of every vector loop (what a machine without AVX-512 runs),
    compiled here with -mno-avx512f, gives PyTorch's values too (stride 1 over rows of
    37: the flat-plane form of the window passes on the AVX-512 side)."""
    shape = (2, 20, 9, 37)
    g = build_chain(shape, layout, [bn(), ("relu", {}), maxpool(3, stride, 1)])
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
    # the group's kernel (g<k>_...), not the oneDNN shim or the native runner the cache
    # also holds
    src = next(tmp_path.glob("kernels/g*/kernel.c")).read_text()
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


# ----------------------------------------------------------- separable window passes
# backends/x86/window.py: pooling as a row pass into an L1 buffer and a column pass, in
# three forms: rows (NCHW, vector along w; channels_last, vector along c, the row pass
# interleaved into the column loop), flat planes (NCHW stride 1, rows as wide as the
# output) and NCHW planes staged for non-temporal stores. Odd shapes (H, W not multiples
# of 16 or of the stride, C not a multiple of 16), batch 1 and 5, NaN and +-inf inputs,
# every kernel/stride/padding/dilation/ceil_mode/count_include_pad the path accepts.


def _pool_graph(
    layout: str,
    shape: tuple[int, int, int, int],
    pool: tuple,
    producer: bool,
):  # noqa: ANN202
    steps = [bn(), ("relu", {})] if producer else []
    return build_chain(shape, layout, [*steps, pool])


def _pool_input(shape: tuple[int, ...], seed: int, specials: str) -> torch.Tensor:
    """``dense``: about 9% NaN and +-inf (every window row has one: the exact forms);
    ``none``: finite values (the fast forms: channels_last's register ring); ``one``: a
    single NaN, an inf and a -inf (one row of each image exact, the rest fast)."""
    if specials == "dense":
        return with_specials(shape, seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    if specials == "one":
        flat = x.view(-1)
        where = torch.randint(0, flat.numel(), (3,), generator=gen)
        flat[where] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    return x


def _run_pool(
    g,  # noqa: ANN001
    layout: str,
    shape,  # noqa: ANN001
    tmp_path,  # noqa: ANN001
    seed: int,
    stream: bool,
    specials: str = "dense",
) -> str:
    """Renders ``g`` as one kernel (``stream``: every output stored non-temporally where
    the loop allows), checks it against PyTorch on inputs with ``specials`` (see
    :func:`_pool_input`), and returns the generated source."""
    s = X86Backend().schedule(g, [n.name for n in g.nodes()], hardware())
    src = render_c(s, stream_min_bytes=0 if stream else float("inf"))
    fn = getattr(ctypes.CDLL(str(build_c(s.name, src, tmp_path).binary)), s.name)
    fn.restype, fn.argtypes = None, [ctypes.c_void_p] * 2
    mf = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    x = _pool_input(shape, seed, specials).contiguous(memory_format=mf)
    ref = g.evaluate(x)
    out = torch.empty(ref.shape).contiguous(memory_format=mf)
    fn(x.data_ptr(), out.data_ptr())
    assert_matches(out, ref, f"{layout} {shape} {list(g.nodes())[-1].attrs} {specials}")
    return src


@st.composite
def _pool_case(draw):  # noqa: ANN001, ANN202
    layout = draw(st.sampled_from(LAYOUTS))
    avg = draw(st.booleans())
    k = draw(st.integers(1, 4))
    s = draw(st.integers(1, 3))
    p = draw(st.integers(0, k // 2))
    d = 1 if avg else draw(st.integers(1, 2))
    ceil = draw(st.booleans())
    span = d * (k - 1) + 1
    h = draw(st.integers(max(span - 2 * p, 1), 40))
    w = draw(st.integers(max(span - 2 * p, 1), 40))
    n = draw(st.sampled_from((1, 5)))
    c = draw(st.sampled_from((3, 16, 17)))
    if avg:
        pool = avgpool(k, s, p, ceil=ceil, cip=draw(st.booleans()))
    else:
        pool = maxpool(k, s, p, d, ceil)
    specials = draw(st.sampled_from(("dense", "none", "one")))
    return layout, (n, c, h, w), pool, draw(st.booleans()), draw(st.booleans()), specials


def _check_pool_case(case, tmp_path) -> None:  # noqa: ANN001
    layout, shape, pool, producer, stream, specials = case
    g = _pool_graph(layout, shape, pool, producer)
    _run_pool(g, layout, shape, tmp_path, seed=sum(shape), stream=stream, specials=specials)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=_pool_case())
def test_window_passes_match_pytorch(case, tmp_path) -> None:  # noqa: ANN001
    """Max/avg pooling (after BN -> ReLU or on the input itself) over random odd shapes
    and window parameters, both layouts, NaN/inf inputs, regular and non-temporal stores:
    PyTorch's values (NaN positions, infinities, finite values)."""
    _check_pool_case(case, tmp_path)


@pytest.mark.slow
@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=_pool_case())
def test_window_passes_match_pytorch_many(case, tmp_path) -> None:  # noqa: ANN001
    _check_pool_case(case, tmp_path)


# (layout, shape, pool, BN -> ReLU before it, what the source must contain): each form of
# window.py taken
WINDOW_FORMS = [
    # NCHW rows, stride 2, staged plane with non-temporal stores; the column pass from
    # whole vectors of the row buffer, taps -1..1 taken apart in registers
    (
        "nchw",
        (5, 17, 23, 37),
        maxpool(3, 2, 1),
        True,
        ("wout0_", "_mm512_stream_ps", "mw_odd), b_", "q_ - 16"),
    ),
    # taps 0..2 (no pad: the tap after the even columns) and 0..1
    ("nchw", (3, 5, 24, 41), maxpool(3, 2, 0, ceil=True), True, ("mw_odd), b_", "q_ + 32")),
    ("nchw", (3, 5, 24, 40), maxpool(2, 2, 0), False, ("mw_odd), b_",)),
    ("nchw", (5, 3, 23, 37), avgpool(3, 2, 1, cip=False), True, ("wrow0_", "wout0_", "wdiv0_")),
    # NCHW flat plane (stride 1, 33 >= 16 columns): both passes in registers, column taps
    # shifted by valignd, lanes from mask tables; non-temporal stores
    ("nchw", (5, 17, 19, 33), maxpool(3, 1, 1), True, ("wrow0_c0_", "alignr", "_mm512_stream_ps")),
    ("nchw", (5, 3, 19, 33), avgpool(3, 1, 1, cip=False), True, ("wrow0_r0_", "alignr", "wdiv0_")),
    # rows of 28 and 24 floats: the whole chunks in a loop unrolled by the column masks'
    # period (7 and 3 chunks), constant masks, the NaN test of one tap as a running sum
    ("nchw", (3, 17, 28, 28), maxpool(3, 1, 1), False, ("F_ += 112", "0xEFFF", "nbv_ = ")),
    ("nchw", (3, 5, 13, 24), avgpool(3, 1, 1, cip=False), True, ("F_ += 48", "wdiv0_")),
    ("nchw", (2, 5, 9, 16), maxpool(5, 1, 2), True, ("F_ += 16", "nbv_ = ")),
    # channels_last register ring (17 channels: a masked last vector; 80: two blocks, the
    # second of one vector), the exact interleaved rows behind ``bad_``
    ("nhwc", (5, 17, 23, 37), maxpool(3, 2, 1), True, ("q2_1_", "wbad0_", "wrow0_", "xd_")),
    ("nhwc", (5, 80, 23, 37), maxpool(3, 2, 1), True, ("q2_3_", "wbad0_", "wrow0_")),
    # stride 1 on the input itself (the inception concat -> max-pool)
    ("nhwc", (2, 80, 19, 23), maxpool(3, 1, 1), False, ("q2_3_", "wbad0_", "wrow0_")),
    ("nhwc", (1, 17, 23, 37), avgpool(3, 2, 1, ceil=True, cip=False), True, ("q2_1_", "wdiv0_")),
    # dilated along w: the interleaved rows only
    ("nhwc", (1, 20, 19, 33), maxpool(2, 1, 1, 2), True, ("wrow0_",)),
]


@pytest.mark.parametrize("caches", ["host", "small"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "pool,producer",
    [(maxpool(3, 1, 1), False), (maxpool(3, 2, 1), True), (maxpool(2, 2, 0), True)],
)
@pytest.mark.parametrize("width", [21, 28])
def test_fast_forms_see_a_nan_in_every_input_row(
    layout, pool, producer, caches, width, tmp_path
) -> None:  # noqa: ANN001
    """The fast forms of a max window (channels_last's register ring, NCHW rows and flat
    planes) test each window row for NaN once, in the first output row that reads it: a
    single NaN in any input row, at the first, a middle or the last column and in varying
    channels, must still reach every output whose window holds it, with finite values
    everywhere else. ``small``: caches of 2 KiB and 16 KiB on one core, so that tiles
    split h into a few rows and the rows after a tile's first test only their fresh
    window rows. Rows of 28 floats: the NCHW flat plane's whole chunks test one window
    row for NaN, the chunks at the plane's top and bottom every row."""
    hw = hardware()
    if caches == "small":
        hw = dataclasses.replace(hw, l1_bytes=2048, l2_bytes=16384, cores=1)
    shape = (2, 32, 13, width)
    mf = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    g = _pool_graph(layout, shape, pool, producer)
    s = X86Backend().schedule(g, [n.name for n in g.nodes()], hw)
    src = render_c(s, stream_min_bytes=0)
    assert "nb_ |=" in src and ("q1_1_" in src) == (layout == "nhwc")
    fn = getattr(ctypes.CDLL(str(build_c(s.name, src, tmp_path).binary)), s.name)
    fn.restype, fn.argtypes = None, [ctypes.c_void_p] * 2
    gen = torch.Generator().manual_seed(3)
    for row in range(shape[2]):
        for k, col in enumerate((0, (row * 7) % shape[3], shape[3] - 1)):
            x = torch.randn(shape, generator=gen)
            x[(row + k) % 2, (row * 5 + k * 11) % shape[1], row, col] = float("nan")
            x = x.contiguous(memory_format=mf)
            ref = g.evaluate(x)
            out = torch.empty(ref.shape).contiguous(memory_format=mf)
            fn(x.data_ptr(), out.data_ptr())
            assert_matches(out, ref, f"NaN in row {row}, column {col}")


@pytest.mark.parametrize("specials", ["dense", "none", "one"])
@pytest.mark.parametrize("layout,shape,pool,producer,marks", WINDOW_FORMS)
def test_window_forms(layout, shape, pool, producer, marks, specials, tmp_path) -> None:  # noqa: ANN001
    """Each form of the separable window is generated where it applies (checked in the
    source) and gives PyTorch's values, on finite inputs, with one NaN and inf, and with
    many."""
    g = _pool_graph(layout, shape, pool, producer)
    src = _run_pool(g, layout, shape, tmp_path, seed=7, stream=True, specials=specials)
    missing = [m for m in marks if m not in src]
    assert not missing, missing


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefetch_hint_follows_the_vendor(layout: str, tmp_path) -> None:  # noqa: ANN001
    """The pooling row passes prefetch into L1 on AMD (T1 left the hardware prefetchers
    behind there: 71% of the streaming kernel against 93%) and into L2 elsewhere; the
    vendor is part of the hardware key, so a kernel cache never hands one to the other,
    and both kernels give PyTorch's values."""
    g = _chain_graph(layout, (2, 16, 40, 40))
    x = with_specials((2, 16, 40, 40), seed=7)
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    hints = {}
    for vendor in ("AuthenticAMD", "GenuineIntel"):
        hw = dataclasses.replace(hardware(), vendor=vendor)
        kernel = X86Backend().build(g, [n.name for n in g.nodes()], Options(cache_dir=tmp_path), hw)
        src = kernel.source_path.read_text()
        hints[vendor] = {h for h in ("_MM_HINT_T0", "_MM_HINT_T1") if h in src}
        assert_matches(kernel.fn(x), g.evaluate(x), f"{vendor} chain {layout}")
    assert hints == {"AuthenticAMD": {"_MM_HINT_T0"}, "GenuineIntel": {"_MM_HINT_T1"}}
    amd = dataclasses.replace(hardware(), vendor="AuthenticAMD")
    assert amd.key() != dataclasses.replace(amd, vendor="GenuineIntel").key()


@pytest.mark.parametrize(
    ("layout", "channels", "stride"), [("nhwc", 64, 2), ("nhwc", 16, 2), ("nchw", 16, 2)]
)
def test_prefetch_distance_per_layout(layout: str, channels: int, stride: int, tmp_path) -> None:  # noqa: ANN001
    """channels_last windows prefetch the rows the current output row reads first,
    ``PREFETCH_NHWC_BYTES`` ahead along the row (a whole output row ahead, the line left L1
    before it was read: 81% of the streaming kernel against 92%); NCHW rows prefetch
    whole output rows ahead. Both give PyTorch's values."""
    import re

    from middleware.backends.x86.window import PREFETCH_NHWC_BYTES

    shape = (2, channels, 24, 40)
    g = build_chain(shape, layout, [bn(), ("relu", {}), maxpool(3, stride, 1)])
    hw = dataclasses.replace(hardware(), vendor="AuthenticAMD")
    kernel = X86Backend().build(g, [n.name for n in g.nodes()], Options(cache_dir=tmp_path), hw)
    lines = [ln for ln in kernel.source_path.read_text().splitlines() if "_mm_prefetch(" in ln]
    assert lines
    ahead = -(-PREFETCH_NHWC_BYTES // (channels * 4))
    for ln in lines:
        if layout == "nhwc":
            assert f"(xw_ + {ahead}) * {channels}" in ln, ln
            based = re.search(r"_p\d+_ .*\* " + str(channels) + r" \+ (\d+)\)", ln)
            if based is None:  # the exact form: from the input buffer
                assert re.search(r"\(h \+ 0\)", ln), ln
            else:  # the ring, from its pointer to window row 0 of this output row: the
                # rows this output row reads (rows 1-2 of the window), not a row ahead
                assert 1 <= int(based.group(1)) // (shape[3] * channels) <= 2, ln
        else:
            assert "(xw_ +" not in ln and re.search(r"\(h \+ [1-9]\d*\)", ln), ln
    x = with_specials(shape, seed=5)
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    assert_matches(kernel.fn(x), g.evaluate(x), f"prefetch {layout} {channels} {stride}")


def test_the_vendor_is_read_from_cpuinfo() -> None:
    from middleware.hardware import _cpuinfo, cpu_static

    vendor = cpu_static()["vendor"]
    info = Path("/proc/cpuinfo")
    if not info.exists():
        assert vendor == "" and _cpuinfo("vendor_id") is None
        return
    lines = [ln for ln in info.read_text().splitlines() if ln.startswith("vendor_id")]
    assert vendor == (lines[0].split(":", 1)[1].strip() if lines else "")
    if platform.machine() == "x86_64":
        assert vendor in ("GenuineIntel", "AuthenticAMD", "HygonGenuine", "CentaurHauls")


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_window_entirely_in_the_padding(channels_last: bool) -> None:
    """A dilated max-pool over a 1x1 image whose every window lies in the padding (taps at
    -1 and +1): the window scans nothing and gives the identity, -inf, as PyTorch does,
    from a generated kernel (its empty loop bounds once made isl fail and the model run
    as the original)."""
    m = nn.Sequential(nn.MaxPool2d(2, stride=1, padding=1, dilation=2)).eval()
    x = torch.randn(2, 3, 1, 1)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the original warns
        opt = middleware.optimize(m, example_inputs=[x], measure_hardware=False)
        with torch.no_grad():
            y, ref = opt(x), m(x)
    assert torch.equal(y, ref) and bool(torch.isneginf(ref).all())
    assert {r.runs_as.value for r in opt.report().rows} == {"generated"}
