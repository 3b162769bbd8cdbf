"""Winograd F(4x4, 3x3) convolutions (backends/vendor/winograd.py) against PyTorch.

Each case builds a one-node conv graph (seeded weights), runs the Winograd call and the
catalogue reference (``F.conv2d`` + epilogue) on seeded random inputs. Tolerance: F(4x4,
3x3) in float32 rounds its transforms (points up to +-2, divisors up to 24), measured about
1e-5 of the output's scale; the tests allow atol = rtol = 1e-4 of the output scale, the
tolerance of the network tests.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from fusion_helpers import conv_graph, hardware

import middleware
from middleware.backends.vendor import ALGORITHMS, vendor_call
from middleware.backends.vendor import winograd as wg
from middleware.errors import CompileError
from middleware.graph import Node
from middleware.ops import get_op
from middleware.options import Options
from middleware.pipeline import compile_graph

# the default's Winograd rule of a non-AMD CPU whatever the host (conftest.py)
pytestmark = pytest.mark.usefixtures("winograd_generic_rule")

CL = torch.channels_last


def _close(y: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> None:
    scale = max(1e-12, float(ref.abs().max()))
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol * scale)


def _inputs(g, seed: int = 1) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    args = [torch.randn(g.values["x"].shape).contiguous(memory_format=CL)]
    args.append(torch.from_numpy(g.params["w"]))
    if "b" in g.params:
        args.append(torch.from_numpy(g.params["b"]))
    if "r" in g.values:
        args.append(torch.randn(g.values["r"].shape).contiguous(memory_format=CL))
    return args


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    """One kernel cache for the numerical cases: the transforms depend on the epilogue only
    (shapes are runtime arguments), so each variant compiles once per module, not per case."""
    return tmp_path_factory.mktemp("winograd-kernels")


def _kernel(g, node, tmp_path, **opts):
    fn = wg.winograd_kernel(g, node, Options(cache_dir=tmp_path, **opts), hardware())
    assert fn is not None, wg.why_not(g, node)
    return fn


def _check(g, node, tmp_path) -> None:
    args = _inputs(g)
    ref = get_op("conv2d").bind(node)(*args)
    before = [a.clone() for a in args]
    y = _kernel(g, node, tmp_path)(*args)
    for a, b in zip(args, before, strict=True):
        assert torch.equal(a, b), "the Winograd call wrote into an input"
    assert y.is_contiguous(memory_format=CL)
    _close(y, ref)


# (x shape, out channels, padding): sizes not a multiple of the 4x4 tile, every padding
# the rule admits (0, 1, 2, rectangular), channels a multiple of 16 but not of 64
SHAPES = [
    ((1, 64, 16, 16), 64, 1),
    ((3, 64, 13, 10), 80, 1),
    ((2, 80, 9, 7), 64, 0),
    ((2, 64, 11, 6), 96, 2),
    ((1, 96, 17, 9), 64, (1, 0)),
    ((1, 64, 3, 3), 64, 1),  # one tile per image, partly outside the output
]


@pytest.fixture(autouse=True)
def _small_tiles_allowed(monkeypatch):
    # the rule wants >= MIN_PIXELS output pixels; the arithmetic is tested on any size
    monkeypatch.setattr(wg, "MIN_PIXELS", 1)


@pytest.mark.parametrize("case", range(len(SHAPES)))
@pytest.mark.parametrize("bias", [True, False])
def test_matches_conv(case, bias, kernel_dir):
    xs, k, pad = SHAPES[case]
    g, node = conv_graph(xs, (k, xs[1], 3, 3), "nhwc", padding=pad, bias=bias)
    _check(g, node, kernel_dir)


EPILOGUES = [
    ("relu", ()),
    ("hardtanh", (("min_val", 0.0), ("max_val", 6.0))),
    ("leaky_relu", (("negative_slope", 0.1),)),
    ("silu", ()),
    ("hardswish", ()),
    ("sigmoid", ()),
    ("gelu", (("approximate", "none"),)),
]


@pytest.mark.parametrize("act", range(len(EPILOGUES)))
@pytest.mark.parametrize("residual", [False, True])
def test_epilogues(act, residual, kernel_dir):
    name, attrs = EPILOGUES[act]
    g, node = conv_graph(
        (2, 64, 10, 9),
        (64, 64, 3, 3),
        "nhwc",
        padding=1,
        activation=name,
        activation_attrs=attrs,
        residual=residual,
    )
    _check(g, node, kernel_dir)


def test_residual_only(kernel_dir):
    g, node = conv_graph((2, 64, 9, 9), (64, 64, 3, 3), "nhwc", padding=1, residual=True)
    _check(g, node, kernel_dir)


def test_into_residual_writes_over_it(kernel_dir):
    g, node = conv_graph(
        (2, 64, 10, 10), (64, 64, 3, 3), "nhwc", padding=1, activation="relu", residual=True
    )
    args = _inputs(g)
    ref = get_op("conv2d").bind(node)(*args)
    fn = _kernel(g, node, kernel_dir)
    r = args[-1]
    y = fn.into_residual(*args)
    assert y.data_ptr() == r.data_ptr()
    _close(y, ref)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("act", ["relu", None])
def test_nan_and_inf_reach_the_outputs_pytorch_gives(residual, act, kernel_dir):
    """A NaN or an infinity in the input would spread over its whole 4x4 tile through the
    transforms; such tiles run the direct convolution, so exactly the outputs PyTorch's
    convolution makes NaN or infinite are, with the same values elsewhere."""
    g, node = conv_graph(
        (2, 64, 13, 10), (64, 64, 3, 3), "nhwc", padding=1, activation=act, residual=residual
    )
    args = _inputs(g)
    x = args[0]
    x[0, 5, 6, 4] = float("nan")
    x[1, 17, 0, 9] = float("inf")
    x[1, 3, 12, 0] = float("-inf")
    ref = get_op("conv2d").bind(node)(*args)
    y = _kernel(g, node, kernel_dir)(*args)
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
    assert int(ref.isnan().sum()) > 0 and int(ref.isinf().sum()) > 0
    finite = ref.isfinite()
    _close(y[finite], ref[finite])
    assert torch.equal(y[y.isinf()], ref[ref.isinf()])


def test_many_chunks_and_a_partial_last_one(monkeypatch, kernel_dir):
    # 2 * 4 * 4 = 32 tiles in chunks of 5 (V + M of 5 tiles): 6 full chunks and one of 2
    monkeypatch.setattr(wg, "MIN_CHUNK_TILES", 1)
    monkeypatch.setattr(wg, "WORKSPACE_BYTES", 5 * 36 * 4 * (64 + 64))
    assert wg.chunk_tiles(64, 64, 32) == 5
    g, node = conv_graph((2, 64, 16, 15), (64, 64, 3, 3), "nhwc", padding=1, activation="relu")
    _check(g, node, kernel_dir)


def test_weight_transform_is_exact_on_one_tile():
    # U = G g G^T, then V = B^T d B and Y = A^T (U . V) A on one 6x6 patch, in float64,
    # equal the 4x4 correlation of the patch: checks the matrices the C code spells out
    torch.manual_seed(0)
    w = torch.randn(1, 1, 3, 3, dtype=torch.float64)
    d = torch.randn(6, 6, dtype=torch.float64)
    bt = torch.tensor(
        [
            [4, 0, -5, 0, 1, 0],
            [0, -4, -4, 1, 1, 0],
            [0, 4, -4, -1, 1, 0],
            [0, -2, -1, 2, 1, 0],
            [0, 2, -1, -2, 1, 0],
            [0, 4, 0, -5, 0, 1],
        ],
        dtype=torch.float64,
    )
    at = torch.tensor(
        [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]],
        dtype=torch.float64,
    )
    u = wg.transform_weight(w.numpy()).double().reshape(6, 6)
    y = at @ (u * (bt @ d @ bt.T)) @ at.T
    ref = torch.nn.functional.conv2d(d[None, None], w)[0, 0]
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)  # u was rounded to float32


@pytest.mark.parametrize(
    "xs,ws,kw,why",
    [
        ((1, 64, 16, 16), (64, 64, 3, 3), dict(stride=2, padding=1), "strided"),
        ((1, 64, 16, 16), (64, 64, 3, 3), dict(dilation=2, padding=2), "dilated"),
        ((1, 64, 16, 16), (64, 1, 3, 3), dict(groups=64, padding=1), "grouped"),
        ((1, 64, 16, 16), (64, 64, 1, 1), {}, "not 3x3"),
        ((1, 64, 16, 16), (64, 64, 5, 5), dict(padding=2), "not 3x3"),
        ((1, 32, 16, 16), (64, 32, 3, 3), dict(padding=1), "channels"),
        ((1, 64, 16, 16), (72, 64, 3, 3), dict(padding=1), "channels"),
        ((1, 64, 16, 16), (64, 64, 3, 3), dict(padding=3), "padding"),
    ],
)
def test_rule_says_why_not(xs, ws, kw, why):
    g, node = conv_graph(xs, ws, "nhwc", **kw)
    reason = wg.why_not(g, node)
    assert reason is not None and why in reason


def test_rule_wants_enough_pixels_and_channels_last(monkeypatch):
    monkeypatch.setattr(wg, "MIN_PIXELS", 256)
    g, node = conv_graph((1, 64, 8, 8), (64, 64, 3, 3), "nhwc", padding=1)  # 64 pixels
    assert "pixels" in wg.why_not(g, node)
    g, node = conv_graph((1, 64, 8, 8), (64, 64, 3, 3), "nchw", padding=1)
    assert "channels_last" in wg.why_not(g, node)
    g, node = conv_graph((1, 64, 16, 16), (64, 64, 3, 3), "nhwc", padding=1)
    assert wg.why_not(g, node) is None


def test_compile_failure_falls_back_to_onednn(monkeypatch, tmp_path):
    def broken(*_a, **_k):
        raise CompileError("cc failed", stderr="error: broken", source_path=tmp_path / "k.c")

    monkeypatch.setattr(wg, "build_c", broken)
    g, node = conv_graph((1, 64, 16, 16), (64, 64, 3, 3), "nhwc", padding=1)
    with pytest.warns(RuntimeWarning, match="Winograd transforms failed to compile"):
        assert wg.winograd_kernel(g, node, Options(cache_dir=tmp_path), hardware()) is None
    with pytest.raises(CompileError):
        wg.winograd_kernel(g, node, Options(cache_dir=tmp_path, strict=True), hardware())


class _Block(nn.Module):
    """conv-bn-relu, conv-bn + identity, relu: a resnet basic block behind a stem."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1), nn.ReLU())
        self.c1, self.b1 = nn.Conv2d(64, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64)
        self.c2, self.b2 = nn.Conv2d(64, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = torch.relu(self.b1(self.c1(x)))
        return torch.relu(self.b2(self.c2(y)) + x)


def _block() -> nn.Module:
    torch.manual_seed(0)
    m = _Block()
    with torch.no_grad():
        for bn in (m.b1, m.b2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2)
            bn.weight.uniform_(0.5, 1.5)
    return m.eval()


def test_network_runs_winograd_and_says_so(tmp_path):
    m = _block()
    x = torch.randn(2, 3, 20, 20)
    opt = middleware.optimize(m, example_inputs=[x], cache_dir=tmp_path)
    with torch.inference_mode():
        ref = m(x)
    _close(opt(x), ref)
    rep = opt.report()
    wino = [r.node for r in rep.rows if r.reason.startswith("winograd")]
    assert len(wino) == 2  # the two 64->64 convs; the 3->64 stem stays oneDNN's
    assert any("Winograd" in n for n in rep.notes)
    off = middleware.optimize(m, example_inputs=[x], cache_dir=tmp_path, winograd=False)
    _close(off(x), ref)
    assert not [r for r in off.report().rows if r.reason.startswith("winograd")]


def test_plan_counts_the_workspace(tmp_path):
    g, node = conv_graph((2, 64, 16, 16), (64, 64, 3, 3), "nhwc", padding=1, activation="relu")
    compiled = compile_graph(g, Options(cache_dir=tmp_path, measure_hardware=False))
    plan = compiled.plan
    (i,) = [k for k, st in enumerate(plan.steps) if st.nodes == (node.name,)]
    want = 36 * 4 * (64 + 64) * wg.chunk_tiles(64, 64, wg.tiles_of(2, 16, 16))
    assert plan.memory.temps[i] == want
    assert plan.predicted_peak_io() >= want


def test_prebuild_compiles_every_variant_the_graph_needs(tmp_path):
    m = _block()
    x = torch.randn(2, 3, 20, 20)
    g = middleware.optimize(m, example_inputs=[x], cache_dir=tmp_path / "a").graph
    opts = Options(cache_dir=tmp_path / "b", measure_hardware=False)
    wg.prebuild(g, opts, hardware()).join()
    built = sorted(p.name.rsplit("-", 1)[0] for p in (tmp_path / "b" / "kernels").iterdir())
    wanted = sorted(
        {wg.render(wg._epilogue(n), hardware().cores)[0] for n in g.nodes() if not wg.why_not(g, n)}
    )
    assert len(wanted) == 2 and built == wanted  # conv + BN + ReLU; conv + BN + residual + ReLU
    assert all(list((tmp_path / "b" / "kernels").glob(f"{w}-*/kernel.so")) for w in wanted)


def test_vendor_algorithms_default_is_winograd_by_rule_then_the_direct_call(monkeypatch, tmp_path):
    """conv2d's default in the vendor module (backends/vendor/algorithms.py): Winograd
    where its rule and Options(winograd=True) allow it, else oneDNN's direct call; an op
    without algorithms gets none (the catalogue reference runs)."""
    monkeypatch.setattr(wg, "MIN_PIXELS", 256)
    assert list(ALGORITHMS["conv2d"])[:3] == ["vendor", "winograd_f4x4", "im2col_gemm"]
    g, node = conv_graph((1, 64, 16, 16), (64, 64, 3, 3), "nhwc", padding=1)
    cpu = torch.device("cpu")
    fn, reason = vendor_call(g, node, cpu, Options(cache_dir=tmp_path), hardware())
    assert reason.startswith("winograd") and fn.algorithm == reason
    fn, reason = vendor_call(g, node, cpu, Options(cache_dir=tmp_path, winograd=False), hardware())
    assert reason == "" and not hasattr(fn, "algorithm")
    args = _inputs(g)
    _close(fn(*args), get_op("conv2d").bind(node)(*args))
    small, small_node = conv_graph((1, 64, 8, 8), (64, 64, 3, 3), "nhwc", padding=1)
    assert vendor_call(small, small_node, cpu, Options(cache_dir=tmp_path), hardware())[1] == ""
    relu = Node("r", "relu", ("x",), ("y",))
    assert vendor_call(g, relu, cpu, Options(cache_dir=tmp_path), hardware()) is None


@pytest.mark.parametrize(
    "shape,cout,intel,amd",
    [
        ((16, 256, 28, 28), 512, True, True),  # vgg16's 256->512 @28: Winograd on both
        ((4, 128, 112, 112), 128, True, True),
        ((16, 64, 56, 56), 64, False, True),  # resnet18's 64 @56: 64 channels, AMD only
        ((16, 512, 14, 14), 512, True, True),  # 512 channels over 3136 pixels: both
        ((1, 128, 28, 28), 128, True, True),  # 784 pixels, 128 channels: both
        ((16, 96, 28, 28), 128, False, True),  # 96 input channels: AMD only
        ((1, 512, 14, 14), 512, False, True),  # 196 pixels: >= 196 on AMD
        ((1, 160, 7, 7), 320, False, False),  # 49 pixels: neither
        ((16, 128, 14, 14), 32, False, True),  # densenet's 128->32: AMD only
        ((1, 32, 14, 14), 64, False, True),  # 32 channels over 196 pixels: AMD only
        ((16, 16, 55, 55), 64, False, False),  # 16 input channels: neither
    ],
)
def test_the_rule_looks_at_the_cpu(monkeypatch, shape, cout, intel, amd) -> None:
    """The default's Winograd rule is the measured one of the CPU's kind: AMD_RULE on AMD
    (and Hygon), MIN_CHANNELS/MIN_PIXELS elsewhere; without a hardware description the
    latter; a refusal names the rule it applied."""
    monkeypatch.undo()  # the shipped AMD rule, not the module's generic-rule fixture
    g, node = conv_graph(shape, (cout, shape[1], 3, 3), "nhwc", padding=1)
    for vendor, want in (("GenuineIntel", intel), ("AuthenticAMD", amd), ("HygonGenuine", amd)):
        hw = dataclasses.replace(hardware(), vendor=vendor)
        why = wg.why_not(g, node, hw)
        assert (why is None) == want, (vendor, why)
        if why is not None and vendor != "GenuineIntel":
            assert "on AMD the rule wants" in why
    assert (wg.why_not(g, node) is None) == intel


@pytest.mark.parametrize("seed", range(4))
def test_the_onednn_product_matches_bmm_over_random_sizes(seed, tmp_path):
    """``onednn.BatchedMatmul`` (the product of the transforms on oneDNN's matmul, U
    packed once) against ``torch.bmm``, at several row counts of one weight, and its
    unpacked weight (``plain``) equal to the one given."""
    from middleware.backends.vendor import onednn

    opts = Options(cache_dir=tmp_path)
    if onednn.unavailable(opts) is not None:
        pytest.skip(onednn.unavailable(opts))
    g = torch.Generator().manual_seed(seed)
    b = int(torch.randint(1, 40, (1,), generator=g))
    k, n = (int(v) * 16 for v in torch.randint(1, 9, (2,), generator=g))
    rows = sorted({int(v) for v in torch.randint(1, 300, (3,), generator=g)})
    w = torch.randn(b, k, n, generator=g)
    mm = onednn.batched_matmul(w, rows, opts)
    assert mm is not None
    for m in rows:
        x = torch.randn(b, m, k, generator=g)
        y = torch.full((b, m, n), float("nan"))
        mm.run(m, x.data_ptr(), y.data_ptr())
        _close(y, torch.bmm(x, w), 1e-5)
    assert torch.equal(mm.plain(), w)
    mm.close()


@pytest.mark.parametrize("residual", [False, True])
def test_chunks_the_destination_form_and_both_products(residual, tmp_path, monkeypatch):
    """Tiles in several chunks (the last one shorter: a product of another row count),
    the result written into the caller's buffer (the destination form), and the oneDNN
    product against ``torch.bmm``'s (``onednn_primitives=False``)."""
    monkeypatch.setattr(wg, "WORKSPACE_BYTES", 1)
    monkeypatch.setattr(wg, "MIN_CHUNK_TILES", 7)  # 2 x 5 x 4 = 40 tiles: 7 x 5 + 5
    g, node = conv_graph(
        (2, 64, 19, 13), (80, 64, 3, 3), "nhwc", padding=1, activation="relu", residual=residual
    )
    args = _inputs(g)
    ref = get_op("conv2d").bind(node)(*args)
    on = _kernel(g, node, tmp_path)
    off = _kernel(g, node, tmp_path, onednn_primitives=False)
    from middleware.backends.vendor import onednn

    if onednn.unavailable(Options(cache_dir=tmp_path)) is None:
        assert getattr(on, "product", "") == "oneDNN matmul"
    assert not hasattr(off, "product")
    for fn in (on, off):
        y = torch.full(ref.shape, float("nan")).contiguous(memory_format=CL)
        fn.out(*args, y)
        _close(y, ref)
        _close(fn(*args), ref)


class _ResBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.a = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.b = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.b(torch.relu(self.bn(self.a(x)))) + x)


@pytest.mark.parametrize("batch", [1, 3])
def test_winograd_layers_run_in_the_native_runner(batch, tmp_path, monkeypatch):
    """A plan with Winograd layers (one with the residual added in place) runs as one C
    call (the chunk loop's native form, winograd_driver.c.j2): bit for bit the Python steps'
    output, and PyTorch's within tolerance, also on an input holding a NaN (its tiles
    computed directly)."""
    from fusion_helpers import reinit

    from middleware.backends.vendor import onednn

    if onednn.unavailable(Options(cache_dir=tmp_path)) is not None:
        pytest.skip("the native form runs the oneDNN product")
    monkeypatch.setattr(wg, "WORKSPACE_BYTES", 1)
    monkeypatch.setattr(wg, "MIN_CHUNK_TILES", 7)  # 30 tiles an image: chunks of 7, then less
    torch.manual_seed(0)
    m = reinit(nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), _ResBlock(64), _ResBlock(64)), 0)
    m = m.eval()
    x = torch.randn(batch, 3, 21, 18)
    kw = dict(example_inputs=(x,), measure_hardware=False, cache_dir=tmp_path)
    on = middleware.optimize(m, **kw)
    off = middleware.optimize(m, native_runner=False, **kw)
    algs = [r.algorithm for r in on.report().rows if r.op == "conv2d"]
    assert algs.count("winograd_f4x4") == 4, algs
    bad = x.clone()
    bad[0, 1, 7, 5] = float("nan")
    with torch.no_grad():
        for inp in (x, bad):
            on(inp)
            got = on(inp)
            assert on.plan.native is not None, on.plan.notes
            assert torch.allclose(got, off(inp), rtol=0, atol=0, equal_nan=True)
            ref = m(inp)
            assert torch.equal(got.isnan(), ref.isnan())
            fin = ~ref.isnan()
            scale = float(ref[fin].abs().max())
            assert float((got[fin] - ref[fin]).abs().max()) < 1e-4 * scale
