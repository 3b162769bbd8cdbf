"""conv2d's algorithms as data and the per-layer choice (backends/vendor/algorithms.py).

Every numerical case runs seeded random inputs and compares against PyTorch (``F.conv2d``
and the epilogue, or the original module) with a tolerance relative to the output's scale:
``im2col_gemm`` and a user's algorithm are exact up to float rounding (2e-5 of the scale);
Winograd is held to its recorded error bound (1e-4, as in tests/test_winograd.py).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fusion_helpers import conv_graph, hardware

import middleware
from middleware.backends.vendor import ALGORITHMS, im2col
from middleware.backends.vendor import algorithms as alg
from middleware.backends.vendor import winograd as wg
from middleware.backends.vendor import winograd_f2 as wg2
from middleware.errors import OptionsError
from middleware.ops import get_op
from middleware.options import Options

# the default's Winograd rule of a non-AMD CPU whatever the host (conftest.py)
pytestmark = pytest.mark.usefixtures("winograd_generic_rule")

CL = torch.channels_last
CPU = torch.device("cpu")


def _close(y: torch.Tensor, ref: torch.Tensor, tol: float = 2e-5) -> None:
    scale = max(1e-12, float(ref.abs().max()))
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol * scale)


def _inputs(g, layout: str, seed: int = 1) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    fmt = CL if layout == "nhwc" else torch.contiguous_format
    args = [torch.randn(g.values["x"].shape).contiguous(memory_format=fmt)]
    args.append(torch.from_numpy(g.params["w"]))
    if "b" in g.params:
        args.append(torch.from_numpy(g.params["b"]))
    if "r" in g.values:
        args.append(torch.randn(g.values["r"].shape).contiguous(memory_format=fmt))
    return args


# (x shape, weight shape, conv attrs): odd sizes, strides, padding, dilation, groups
SHAPES = [
    ((2, 3, 13, 11), (8, 3, 3, 3), dict(padding=1)),
    ((1, 5, 9, 10), (7, 5, 1, 1), {}),
    ((2, 6, 15, 12), (4, 6, 5, 3), dict(stride=(2, 1), padding=(2, 1))),
    ((1, 4, 17, 14), (6, 4, 3, 3), dict(dilation=2, padding=2, stride=3)),
    ((2, 8, 10, 9), (12, 4, 3, 3), dict(groups=2, padding=1)),
    ((1, 16, 11, 7), (16, 1, 3, 3), dict(groups=16, padding=1, stride=2)),  # depthwise
    ((3, 3, 7, 7), (5, 3, 7, 7), dict(padding=3)),  # a 7x7 stem
]
EPILOGUES = [
    dict(),
    dict(bias=False),
    dict(activation="relu"),
    dict(activation="gelu", activation_attrs=(("approximate", "none"),), residual=True),
    dict(activation="hardtanh", activation_attrs=(("min_val", -0.5), ("max_val", 0.5))),
]


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("ep", range(len(EPILOGUES)))
@pytest.mark.parametrize("case", range(len(SHAPES)))
def test_im2col_gemm_matches_pytorch(case, ep, layout):
    xs, ws, kw = SHAPES[case]
    g, node = conv_graph(xs, ws, layout, **kw, **EPILOGUES[ep])
    assert alg.IM2COL_GEMM.applies(g, node, CPU, Options()) is None
    fn = alg.IM2COL_GEMM.build(g, node, CPU, Options(), hardware())
    args = _inputs(g, layout)
    before = [a.clone() for a in args]
    y = fn(*args)
    for a, b in zip(args, before, strict=True):
        assert torch.equal(a, b), "im2col_gemm wrote into an input"
    _close(y, get_op("conv2d").bind(node)(*args))
    fmt = CL if layout == "nhwc" else torch.contiguous_format
    assert y.is_contiguous(memory_format=fmt)


def test_im2col_gemm_equals_f_conv2d_and_chunks_the_batch(monkeypatch):
    """A plain conv straight against F.conv2d, with a workspace of one sample per chunk."""
    monkeypatch.setattr(im2col, "IM2COL_WORKSPACE_BYTES", 1)
    g, node = conv_graph((3, 6, 12, 10), (9, 6, 3, 3), "nhwc", stride=2, padding=1)
    x = torch.randn(3, 6, 12, 10)
    w, b = torch.from_numpy(g.params["w"]), torch.from_numpy(g.params["b"])
    y = alg.im2col_kernel(g, node)(x, w, b)
    _close(y, F.conv2d(x, w, b, 2, 1))
    per_sample, padded = 6 * 5 * 6 * 9 * 4, 3 * 6 * 14 * 12 * 4  # rows of one sample; x padded
    assert alg.im2col_kernel(g, node).workspace_bytes(3) == per_sample + padded


def test_records_say_exactness_memory_and_reasons():
    table = ALGORITHMS["conv2d"]
    assert list(table) == ["vendor", "winograd_f4x4", "im2col_gemm", "winograd_f2x2", "direct"]
    assert table["vendor"].exact and table["im2col_gemm"].exact
    assert not table["winograd_f4x4"].exact and table["winograd_f4x4"].error_bound == 1e-4
    assert not table["winograd_f2x2"].exact
    assert table["winograd_f2x2"].error_bound < table["winograd_f4x4"].error_bound
    g, node = conv_graph((2, 64, 16, 16), (64, 64, 3, 3), "nhwc", padding=1)
    assert table["vendor"].extra_bytes(g, node) == 0
    assert table["winograd_f4x4"].extra_bytes(g, node) >= 36 * 4 * 64 * 64  # U: 4x the weight
    assert table["im2col_gemm"].extra_bytes(g, node) >= 2 * 16 * 16 * 64 * 9 * 4
    g1, n1 = conv_graph((1, 64, 8, 8), (64, 64, 1, 1), "nhwc")
    assert "not 3x3" in table["winograd_f4x4"].applies(g1, n1, CPU, Options())
    assert table["winograd_f4x4"].applies(g1, n1, torch.device("cuda"), Options())


# ----------------------------------------------------------------- through optimize
class _Net(nn.Module):
    """A strided stem, a 3x3 conv (Winograd applies, its rule refuses: 32 channels), a 1x1
    conv with a residual, a depthwise conv."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, stride=2, padding=1)
        self.c1 = nn.Conv2d(32, 32, 3, padding=1)
        self.c2 = nn.Conv2d(32, 32, 1)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        y = torch.relu(self.c1(x))
        return self.dw(torch.relu(self.c2(y) + x))


def _net() -> nn.Module:
    torch.manual_seed(0)
    m = _Net()
    with torch.no_grad():  # keep the activations' variance through the layers
        for conv in (m.stem, m.c1, m.c2, m.dw):
            nn.init.kaiming_normal_(conv.weight, nonlinearity="relu")
            conv.bias.uniform_(-0.1, 0.1)
    return m.eval()


@pytest.fixture(scope="module")
def net_cache(tmp_path_factory):
    """One kernel cache for the cases that optimize ``_Net``: the algorithm choice changes
    no generated source, so its io-group kernels compile once per module, not per case."""
    return tmp_path_factory.mktemp("algorithms-net")


def _run(tmp_path, **opts):
    m = _net()
    torch.manual_seed(1)
    x = torch.randn(2, 3, 18, 14)
    opt = middleware.optimize(m, example_inputs=[x], cache_dir=tmp_path, **opts)
    with torch.inference_mode():
        ref = m(x)
    return opt, opt(x), ref


def _conv_rows(opt):
    return [r for r in opt.report().rows if r.op == "conv2d"]


def test_default_rows_say_vendor(net_cache):
    opt, y, ref = _run(net_cache)
    _close(y, ref)
    rows = _conv_rows(opt)
    assert len(rows) == 4 and {r.algorithm for r in rows} == {"vendor"}
    assert all(r.extra_bytes == 0 for r in rows)


@pytest.mark.parametrize("layout", ["auto", "nchw"])
def test_one_name_for_every_layer(layout, net_cache):
    opt, y, ref = _run(net_cache, algorithms={"conv2d": "im2col_gemm"}, layout=layout)
    _close(y, ref)
    rows = _conv_rows(opt)
    assert [r.algorithm for r in rows] == ["im2col_gemm"] * 4
    assert all("chosen by algorithms=" in r.reason for r in rows)
    assert all(r.extra_bytes > 0 for r in rows)  # its workspace
    assert "[im2col_gemm +" in opt.report().verbose()
    assert any("extra parameter and workspace memory" in n for n in opt.report().notes)


def test_a_list_by_layer_and_default(net_cache):
    sel = ["vendor", "im2col_gemm", "default", "im2col_gemm"]
    opt, y, ref = _run(net_cache, algorithms={"conv2d": sel})
    _close(y, ref)
    assert [r.algorithm for r in _conv_rows(opt)] == [
        "vendor",
        "im2col_gemm",
        "vendor",
        "im2col_gemm",
    ]


def test_a_callable_sees_each_layer(net_cache):
    seen = []

    def sel(layer: middleware.Layer) -> str:
        seen.append((layer.index, layer.weight_shape, layer.groups, layer.stride))
        return "im2col_gemm" if layer.weight_shape[2:] == (1, 1) else "default"

    opt, y, ref = _run(net_cache, algorithms={"conv2d": sel})
    _close(y, ref)
    assert [r.algorithm for r in _conv_rows(opt)] == ["vendor", "vendor", "im2col_gemm", "vendor"]
    assert sorted(seen) == [
        (0, (32, 3, 3, 3), 1, (2, 2)),
        (1, (32, 32, 3, 3), 1, (1, 1)),
        (2, (32, 32, 1, 1), 1, (1, 1)),
        (3, (32, 1, 3, 3), 32, (1, 1)),
    ]


def test_inapplicable_name_falls_back_with_the_reason(net_cache):
    """winograd_f4x4 named for every layer: it runs where it applies (c1, although its
    measured rule and winograd=False would not pick it), the default elsewhere, each row
    saying why."""
    opt, y, ref = _run(net_cache, algorithms={"conv2d": "winograd_f4x4"}, winograd=False)
    _close(y, ref, tol=1e-4)
    rows = _conv_rows(opt)
    assert [r.algorithm for r in rows] == ["vendor", "winograd_f4x4", "vendor", "vendor"]
    assert rows[1].reason.startswith("winograd")
    for r, why in zip(
        # the first conv reads the image converted to channels_last (it fits the caches)
        [rows[0], rows[2], rows[3]],
        ["strided", "not 3x3", "grouped"],
        strict=True,
    ):
        assert "algorithms= asked for winograd_f4x4, which does not apply" in r.reason
        assert why in r.reason
    assert any("instead of the one algorithms= named" in n for n in opt.report().notes)


def test_unknown_names_are_a_clear_error(tmp_path):
    m, x = _net(), torch.randn(1, 3, 8, 8)
    with pytest.raises(
        OptionsError,
        match="known: default, autotune, auto, vendor, winograd_f4x4, im2col_gemm, winograd_f2x2",
    ):
        middleware.optimize(m, example_inputs=[x], cache_dir=tmp_path, algorithms={"conv2d": "fft"})
    with pytest.raises(OptionsError, match="unknown conv2d algorithm 'nope'"):
        middleware.optimize(m, cache_dir=tmp_path, algorithms={"conv2d": ["vendor", "nope"]})
    with pytest.raises(OptionsError, match="no algorithms for op 'pool'"):
        middleware.optimize(m, cache_dir=tmp_path, algorithms={"pool": "vendor"})
    with pytest.raises(OptionsError, match="lists 2 names but the model has 4 conv2d"):
        middleware.optimize(
            m, example_inputs=[x], cache_dir=tmp_path, algorithms={"conv2d": ["vendor"] * 2}
        )
    with pytest.raises(OptionsError, match="unknown conv2d algorithm 'fast'"):
        middleware.optimize(
            m, example_inputs=[x], cache_dir=tmp_path, algorithms={"conv2d": lambda layer: "fast"}
        )


@pytest.fixture
def user_algorithm():
    calls = []

    def my_conv(x, weight, bias, stride, padding, dilation, groups):
        calls.append(tuple(weight.shape))
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)

    def applies(layer: middleware.Layer) -> str | None:
        return None if layer.groups == 1 else f"groups={layer.groups}: my_conv is dense only"

    middleware.register_algorithm("conv2d", "my_conv", my_conv, applies=applies)
    yield calls
    middleware.unregister_algorithm("conv2d", "my_conv")


def test_a_user_algorithm_is_selectable_like_a_built_in(user_algorithm, net_cache):
    opt, y, ref = _run(net_cache, algorithms={"conv2d": "my_conv"})
    _close(y, ref)
    rows = _conv_rows(opt)
    assert [r.algorithm for r in rows] == ["my_conv"] * 3 + ["vendor"]
    assert "groups=32: my_conv is dense only" in rows[3].reason
    assert sorted(set(user_algorithm)) == [(32, 3, 3, 3), (32, 32, 1, 1), (32, 32, 3, 3)]
    with pytest.raises(OptionsError, match="exists already"):
        middleware.register_algorithm("conv2d", "my_conv", F.conv2d)
    with pytest.raises(OptionsError, match="built in"):
        middleware.register_algorithm("conv2d", "vendor", F.conv2d, replace=True)


def test_a_user_algorithm_matches_pytorch_on_every_shape(user_algorithm):
    for xs, ws, kw in SHAPES:
        for ep in EPILOGUES:
            g, node = conv_graph(xs, ws, "nhwc", **kw, **ep)
            algorithm = ALGORITHMS["conv2d"]["my_conv"]
            why = algorithm.applies(g, node, CPU, Options())
            if kw.get("groups", 1) != 1:
                assert why is not None and "dense only" in why
                continue
            fn = algorithm.build(g, node, CPU, Options(), hardware())
            args = _inputs(g, "nhwc")
            _close(fn(*args), get_op("conv2d").bind(node)(*args))


def test_winograd_explicit_ignores_the_rule_only(monkeypatch, tmp_path):
    monkeypatch.setattr(wg, "MIN_PIXELS", 10**9)  # the rule never picks it
    g, node = conv_graph((1, 32, 9, 7), (48, 32, 3, 3), "nhwc", padding=1, activation="relu")
    opts = Options(cache_dir=tmp_path, algorithms={"conv2d": "winograd_f4x4"})
    choice = alg.choose(g, node, CPU, opts, hardware())
    assert choice is not None and choice.algorithm == "winograd_f4x4"
    args = _inputs(g, "nhwc")
    _close(choice.fn(*args), get_op("conv2d").bind(node)(*args), tol=1e-4)
    default = alg.choose(g, node, CPU, Options(cache_dir=tmp_path), hardware())
    assert default is not None and default.algorithm == "vendor" and default.reason == ""


def test_options_keep_the_selection_hashable_and_sorted():
    o = Options(algorithms={"linear": "vendor", "conv2d": ["vendor", "im2col_gemm"]})
    assert o.algorithms == (("conv2d", ("vendor", "im2col_gemm")), ("linear", "vendor"))
    assert hash(o) == hash(
        Options(algorithms=[("conv2d", ("vendor", "im2col_gemm")), ("linear", "vendor")])
    )


def test_the_memory_cap_keeps_algorithms_out(monkeypatch, tmp_path, net_cache):
    opt, y, ref = _run(net_cache, algorithms={"conv2d": "im2col_gemm"}, max_extra_param_bytes=0)
    _close(y, ref)
    rows = _conv_rows(opt)
    assert [r.algorithm for r in rows] == ["vendor"] * 4
    assert all("over max_extra_param_bytes" in r.reason for r in rows)
    monkeypatch.setattr(wg, "MIN_PIXELS", 1)  # the default's rule would pick Winograd
    g, node = conv_graph((1, 64, 8, 8), (64, 64, 3, 3), "nhwc", padding=1)
    free = alg.choose(g, node, CPU, Options(cache_dir=tmp_path), hardware())
    assert free is not None and free.algorithm == "winograd_f4x4"
    capped = Options(cache_dir=tmp_path, max_extra_param_bytes=36 * 4 * 64 * 64 - 1)
    assert alg.choose(g, node, CPU, capped, hardware()).algorithm == "vendor"
    with pytest.raises(OptionsError, match="max_extra_param_bytes=-1"):
        middleware.optimize(_net(), cache_dir=tmp_path, max_extra_param_bytes=-1)


# ------------------------------------------------------------------ winograd_f2x2
def test_winograd_f2x2_matrices_compute_the_correlation():
    """In float64, A^T [(G g G^T) (.) (B^T d B)] A is the 2x2 valid correlation of the 4x4
    patch d with the 3x3 g: the matrices the generated transforms are spelled from."""
    rng = np.random.default_rng(3)
    for _ in range(5):
        d, g = rng.standard_normal((4, 4)), rng.standard_normal((3, 3))
        y = wg2.AT @ ((wg2.G @ g @ wg2.G.T) * (wg2.BT @ d @ wg2.BT.T)) @ wg2.AT.T
        ref = [[(d[i : i + 3, j : j + 3] * g).sum() for j in range(2)] for i in range(2)]
        np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
    w = torch.randn(5, 3, 3, 3, dtype=torch.float64)
    u = wg2.transform_weight(w.numpy())  # [16][C][K]
    for k, c in ((0, 0), (4, 2)):
        np.testing.assert_allclose(
            u[:, c, k].numpy().reshape(4, 4),
            wg2.G @ w[k, c].numpy() @ wg2.G.T,
            rtol=1e-5,
            atol=1e-6,
        )


# (x shape, weight shape, padding): partial tiles at odd sizes, every padding the
# predicate accepts, several channel blocks, and 256 channels (the error grows with C)
F2_SHAPES = [
    ((1, 16, 9, 7), (32, 16, 3, 3), 1),
    ((2, 32, 8, 10), (16, 32, 3, 3), 0),
    ((1, 16, 5, 6), (16, 16, 3, 3), 2),
    ((1, 256, 6, 7), (256, 256, 3, 3), 1),
]


@pytest.mark.parametrize("ep", range(len(EPILOGUES)))
@pytest.mark.parametrize("case", range(len(F2_SHAPES)))
def test_winograd_f2x2_matches_pytorch_within_its_bound(case, ep):
    xs, ws, pad = F2_SHAPES[case]
    g, node = conv_graph(xs, ws, "nhwc", padding=pad, **EPILOGUES[ep])
    algorithm = ALGORITHMS["conv2d"]["winograd_f2x2"]
    opts = Options()  # the session's kernel cache: one compile per epilogue, not per shape
    assert algorithm.applies(g, node, CPU, opts) is None
    fn = algorithm.build(g, node, CPU, opts, hardware())
    assert fn is not None and fn.algorithm == "winograd F(2x2,3x3)"
    args = _inputs(g, "nhwc")
    before = [a.clone() for a in args]
    y = fn(*args)
    for a, b in zip(args, before, strict=True):
        assert torch.equal(a, b), "winograd_f2x2 wrote into an input"
    assert y.is_contiguous(memory_format=CL)
    # the error bound is relative to the scale before the activation (conv + bias +
    # residual): hardtanh's clamp shrinks the output's scale, not the convolution's error
    pre = {k: v for k, v in EPILOGUES[ep].items() if not k.startswith("activation")}
    g_pre, node_pre = conv_graph(xs, ws, "nhwc", padding=pad, **pre)
    scale = float(get_op("conv2d").bind(node_pre)(*args).abs().max())
    ref = get_op("conv2d").bind(node)(*args)
    err = float((y - ref).abs().max()) / scale
    assert err <= algorithm.error_bound, f"error {err:.2e} of scale"


def test_winograd_f2x2_into_residual_and_nonfinite_tiles():
    g, node = conv_graph(
        (2, 32, 7, 9), (32, 32, 3, 3), "nhwc", padding=1, activation="relu", residual=True
    )
    fn = alg.WINOGRAD_F2X2.build(g, node, CPU, Options(), hardware())
    args = _inputs(g, "nhwc")
    ref = get_op("conv2d").bind(node)(*args)
    r = args[-1]
    y = fn.into_residual(*args)
    assert y.data_ptr() == r.data_ptr()
    _close(y, ref, tol=wg2.ERROR_BOUND)
    # a NaN or infinity spreads over a whole tile through the transforms: such tiles run
    # the direct convolution, so exactly PyTorch's NaN/inf outputs are NaN/inf
    args = _inputs(g, "nhwc")
    x = args[0]
    x[0, 5, 3, 4] = float("nan")
    x[1, 17, 0, 8] = float("inf")
    ref = get_op("conv2d").bind(node)(*args)
    y = fn(*args)
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
    assert int(ref.isnan().sum()) > 0 and int(ref.isinf().sum()) > 0
    finite = ref.isfinite()
    _close(y[finite], ref[finite], tol=wg2.ERROR_BOUND)


def test_winograd_f2x2_chunks_and_memory(monkeypatch):
    """Extra bytes: U at 16 values per channel pair (16/9 of the weight; F(4x4): 36/9) plus
    one chunk's V + M; several chunks with a partial last one compute the same result."""
    g, node = conv_graph((2, 64, 16, 15), (64, 64, 3, 3), "nhwc", padding=1)
    extra2 = alg.WINOGRAD_F2X2.extra_bytes(g, node)
    tiles = wg2.tiles_of(2, 16, 15)
    assert tiles == 2 * 8 * 8
    assert extra2 == 16 * 4 * 64 * 64 + 16 * 4 * 128 * wg2.chunk_tiles(64, 64, tiles)
    ws4 = 36 * 4 * 128 * wg.chunk_tiles(64, 64, wg.tiles_of(2, 16, 15))
    assert alg.WINOGRAD_F4X4.extra_bytes(g, node) - ws4 == 36 * 4 * 64 * 64
    monkeypatch.setattr(wg2, "MIN_CHUNK_TILES", 1)
    monkeypatch.setattr(wg2, "WORKSPACE_BYTES", 7 * 16 * 4 * (64 + 64))
    assert wg2.chunk_tiles(64, 64, tiles) == 7  # 18 full chunks and one of 2
    fn = alg.WINOGRAD_F2X2.build(g, node, CPU, Options(), hardware())
    assert fn.workspace_bytes(2) == 7 * 16 * 4 * 128
    args = _inputs(g, "nhwc")
    _close(fn(*args), get_op("conv2d").bind(node)(*args), tol=wg2.ERROR_BOUND)


def test_winograd_f2x2_by_name_through_optimize(net_cache):
    """Named for every layer: it runs on the one 3x3 stride-1 dense channels_last conv (c1),
    the default elsewhere with the reason; the default never picks it."""
    opt, y, ref = _run(net_cache, algorithms={"conv2d": "winograd_f2x2"})
    _close(y, ref, tol=1e-4)
    rows = _conv_rows(opt)
    assert [r.algorithm for r in rows] == ["vendor", "winograd_f2x2", "vendor", "vendor"]
    assert rows[1].reason.startswith("winograd F(2x2,3x3), chosen by algorithms=")
    assert rows[1].extra_bytes >= 16 * 4 * 32 * 32
    assert "grouped" in rows[3].reason
    opt, _, _ = _run(net_cache)
    assert "winograd_f2x2" not in {r.algorithm for r in _conv_rows(opt)}


# A user's algorithm in C: a naive direct convolution, rendered per layer (jinja2)
NAIVE_C = r"""
/* {{ name }}: naive direct convolution, {{ input_shape }} -> {{ output_shape }} */
void {{ name }}(const float *x, const float *w, const float *b, float *y, int n)
{
  const int C = {{ input_shape[1] }}, H = {{ input_shape[2] }}, W = {{ input_shape[3] }};
  const int K = {{ output_shape[1] }}, OH = {{ output_shape[2] }}, OW = {{ output_shape[3] }};
  const int KH = {{ weight_shape[2] }}, KW = {{ weight_shape[3] }}, G = {{ groups }};
  const int CG = C / G, KG = K / G;
  #pragma omp parallel for collapse(2)
  for (int i = 0; i < n; ++i)
    for (int k = 0; k < K; ++k)
      for (int oh = 0; oh < OH; ++oh)
        for (int ow = 0; ow < OW; ++ow) {
          float acc = b ? b[k] : 0.0f;
          const int g = k / KG;
          for (int c = 0; c < CG; ++c)
            for (int kh = 0; kh < KH; ++kh)
              for (int kw = 0; kw < KW; ++kw) {
                const int ih = oh * {{ stride[0] }} - {{ padding[0] }} + kh * {{ dilation[0] }};
                const int iw = ow * {{ stride[1] }} - {{ padding[1] }} + kw * {{ dilation[1] }};
                if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                acc += x[(((long)i * C + g * CG + c) * H + ih) * W + iw]
                     * w[(((long)k * CG + c) * KH + kh) * KW + kw];
              }
          y[(((long)i * K + k) * OH + oh) * OW + ow] = acc;
        }
}
"""


@pytest.fixture
def c_algorithm():
    middleware.register_algorithm("conv2d", "naive_c", c_template=NAIVE_C)
    yield
    middleware.unregister_algorithm("conv2d", "naive_c")


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_a_c_algorithm_matches_pytorch_on_every_shape(c_algorithm, layout, tmp_path):
    algorithm = ALGORITHMS["conv2d"]["naive_c"]
    opts = Options(cache_dir=tmp_path)
    for xs, ws, kw in SHAPES:
        for ep in EPILOGUES:
            g, node = conv_graph(xs, ws, layout, **kw, **ep)
            assert algorithm.applies(g, node, CPU, opts) is None
            fn = algorithm.build(g, node, CPU, opts, hardware())
            args = _inputs(g, layout)
            y = fn(*args)
            fmt = CL if layout == "nhwc" else torch.contiguous_format
            assert y.is_contiguous(memory_format=fmt)
            _close(y, get_op("conv2d").bind(node)(*args))


def test_a_c_algorithm_is_selectable_like_a_built_in(c_algorithm, net_cache):
    opt, y, ref = _run(net_cache, algorithms={"conv2d": "naive_c"})
    _close(y, ref)
    assert [r.algorithm for r in _conv_rows(opt)] == ["naive_c"] * 4


def test_c_algorithm_errors_name_the_problem(tmp_path):
    with pytest.raises(OptionsError, match="exactly one of fn"):
        middleware.register_algorithm("conv2d", "both", F.conv2d, c_template=NAIVE_C)
    with pytest.raises(OptionsError, match="not a valid jinja2 template"):
        middleware.register_algorithm("conv2d", "broken", c_template="{% if %}")
    middleware.register_algorithm("conv2d", "bad_c", c_template="void {{ name }}(int) { oops }")
    try:
        g, node = conv_graph((1, 3, 8, 8), (4, 3, 3, 3), "nhwc", padding=1)
        with pytest.raises(OptionsError, match="'bad_c'.*does not compile"):
            ALGORITHMS["conv2d"]["bad_c"].build(
                g, node, CPU, Options(cache_dir=tmp_path), hardware()
            )
    finally:
        middleware.unregister_algorithm("conv2d", "bad_c")


def test_max_extra_bytes_is_the_old_name_of_max_extra_param_bytes():
    from middleware.api import make_options

    with pytest.warns(FutureWarning, match="max_extra_param_bytes"):
        o = make_options("cpu", None, {"max_extra_bytes": 1024})
    assert o.max_extra_param_bytes == 1024
    with pytest.raises(TypeError, match="max_extra_param_bytes only"):
        make_options("cpu", None, {"max_extra_bytes": 1, "max_extra_param_bytes": 2})


def test_the_default_runs_depthwise_layers_direct_at_batch_one(tmp_path):
    """The measured rule (bench/depthwise.py): where oneDNN is called through
    torch.ops.mkldnn, a depthwise convolution at batch 1 runs the generated direct kernel,
    at batch 2 and more oneDNN's; a dense one stays oneDNN's. As oneDNN primitives created
    once, oneDNN's runs it at every batch."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.ReLU(), nn.Conv2d(16, 8, 1)
    ).eval()
    for batch, prims, want in ((1, False, "direct"), (2, False, "vendor"), (1, True, "vendor")):
        x = torch.randn(batch, 16, 12, 12)
        opt = middleware.optimize(
            model, example_inputs=(x,), cache_dir=tmp_path, onednn_primitives=prims
        )
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")  # a plan that failed and ran eager would warn
            y, ref = opt(x), model(x)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        algs = [r.algorithm for r in opt.report().rows if r.op == "conv2d"]
        assert algs[0] == want and algs[1] != "direct", algs
