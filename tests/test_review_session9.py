"""Session 9 review: properties the session's changes must keep.

- The depthwise direct convolution's 8-pixel blocks (direct_conv.c.j2, ``dwblock``):
  random geometries weighted to its tails (channels off the 16-lane block, widths around
  the 8-pixel block, padding wider than the kernel, strides and dilations), with the
  input and the residual placed inside a sea of NaN: a read before or after either one
  that reaches a stored output turns it NaN.
"""

from __future__ import annotations

import pytest
import torch
from fusion_helpers import conv_graph, hardware
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from middleware.backends.vendor import algorithms as alg
from middleware.ops import get_op
from middleware.options import Options

CPU = torch.device("cpu")
SEA = 4096  # NaN floats on either side of the input and the residual


def _in_nan_sea(shape: tuple[int, ...], values: torch.Tensor | None = None) -> torch.Tensor:
    """A channels_last tensor of ``shape`` whose storage sits inside NaN on both sides."""
    n, c, h, w = shape
    buf = torch.full((2 * SEA + n * h * w * c,), float("nan"))
    x = buf[SEA : SEA + n * h * w * c].view(n, h, w, c).permute(0, 3, 1, 2)
    x.copy_(torch.randn(shape) if values is None else values)
    assert x.is_contiguous(memory_format=torch.channels_last)
    return x


@st.composite
def depthwise(draw):
    kh, kw = draw(st.sampled_from([(1, 1), (3, 3), (5, 5), (3, 1), (1, 5), (7, 7)]))
    sh, sw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dh, dw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    ph, pw = draw(st.integers(0, kh + 1)), draw(st.integers(0, kw + 2))
    c = draw(st.sampled_from([1, 3, 15, 16, 17, 31, 32, 33, 48]))
    min_h = max(1, (kh - 1) * dh + 1 - 2 * ph)
    min_w = max(1, (kw - 1) * dw + 1 - 2 * pw)
    h = draw(st.integers(min_h, min_h + 6))
    w = draw(st.integers(min_w, min_w + 40))
    n = draw(st.sampled_from([1, 2]))
    geo = dict(stride=(sh, sw), padding=(ph, pw), dilation=(dh, dw), groups=c)
    return (n, c, h, w), (c, 1, kh, kw), geo


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    geo=depthwise(),
    bias=st.booleans(),
    residual=st.booleans(),
    act=st.sampled_from([None, "relu"]),
)
def test_depthwise_direct_blocks_read_only_their_input(geo, bias, residual, act):
    xs, ws, kw = geo
    g, node = conv_graph(
        xs, ws, "nhwc", **kw, bias=bias, residual=residual, activation=act, seed=len(xs)
    )
    assert alg.DIRECT.applies(g, node, CPU, Options()) is None
    fn = alg.DIRECT.build(g, node, CPU, Options(), hardware())
    assert fn is not None
    args = [_in_nan_sea(xs), torch.from_numpy(g.params["w"])]
    if bias:
        args.append(torch.from_numpy(g.params["b"]))
    if residual:
        args.append(_in_nan_sea(g.values["r"].shape))
    y = fn(*args)
    # the reference on fresh contiguous copies: PyTorch 2.14.1's conv2d computes x of shape
    # (1, 1, 1, 7) with strides (7, 1, 7, 1) (channels_last of one channel) wrongly under a 7x7
    # kernel, stride (1, 2), padding (4, 0): the middle output row is off; contiguous: right
    ref = get_op("conv2d").bind(node)(
        *[a.clone(memory_format=torch.contiguous_format) for a in args]
    )
    assert not y.isnan().any(), "the direct convolution read outside its input or residual"
    scale = max(1e-12, float(ref.abs().max()))
    torch.testing.assert_close(y, ref, rtol=2e-5, atol=2e-5 * scale)


@pytest.mark.parametrize("w", [3, 7, 8, 9, 10, 16, 17])
@pytest.mark.parametrize("pad", [0, 1, 4])
def test_depthwise_direct_nan_and_inf_per_pixel(w, pad):
    """A NaN or an infinity in one pixel reaches exactly the outputs PyTorch's does."""
    xs = (1, 17, 3, w)
    g, node = conv_graph(xs, (17, 1, 3, 3), "nhwc", padding=pad, groups=17)
    fn = alg.DIRECT.build(g, node, CPU, Options(), hardware())
    assert fn is not None
    x = torch.randn(xs)
    x[0, 16, 1, w - 1] = float("nan")
    x[0, 0, 0, 0] = float("inf")
    x[0, 5, 2, w // 2] = float("-inf")
    args = [_in_nan_sea(xs, x), torch.from_numpy(g.params["w"]), torch.from_numpy(g.params["b"])]
    y = fn(*args)
    # the reference on fresh contiguous copies: PyTorch 2.14.1's conv2d computes x of shape
    # (1, 1, 1, 7) with strides (7, 1, 7, 1) (channels_last of one channel) wrongly under a 7x7
    # kernel, stride (1, 2), padding (4, 0): the middle output row is off; contiguous: right
    ref = get_op("conv2d").bind(node)(
        *[a.clone(memory_format=torch.contiguous_format) for a in args]
    )
    assert torch.equal(y.isnan(), ref.isnan())
    assert torch.equal(y.isinf(), ref.isinf())
    fin = ref.isfinite()
    torch.testing.assert_close(y[fin], ref[fin], rtol=2e-5, atol=1e-4)


class _LegacyBackend:
    """A backend written against the interface before ``passes_off`` joined it: the
    reference backend's every member except that one."""

    def __init__(self) -> None:
        from middleware.backends.reference.backend import ReferenceBackend

        self._inner = ReferenceBackend()

    def __getattr__(self, name: str):
        if name == "passes_off":
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_a_backend_without_passes_off_still_compiles(monkeypatch):
    """``compile_graph`` asked every backend for ``passes_off``: one registered through
    ``register_backend`` before it existed failed with an AttributeError from inside the
    compiler; it turns no pass off."""
    import torch.nn as nn

    import middleware
    from middleware import backends
    from middleware.pipeline import compile_graph

    monkeypatch.setattr(backends, "BACKENDS", dict(backends.BACKENDS))
    monkeypatch.setattr(backends, "DEVICE_DEFAULTS", dict(backends.DEVICE_DEFAULTS))
    backends.register_backend("legacy", _LegacyBackend, device_type="cpu")
    assert not hasattr(backends.backend_for("cpu"), "passes_off")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    x = torch.randn(1, 3, 6, 6)
    compiled = compile_graph(middleware.trace(model, [x]), Options(measure_hardware=False))
    assert "batch_norm" not in [n.op for n in compiled.graph.nodes()]  # folded: no pass off
    with torch.no_grad():
        torch.testing.assert_close(compiled.plan.run([x]), model(x), rtol=1e-4, atol=1e-4)


def test_generated_kernel_without_inputs():
    """``GeneratedKernel``'s one-output fast path took the output's device from
    ``inputs[0]``: a kernel without inputs (the emulation's CPU default) raised IndexError."""
    from types import SimpleNamespace

    from middleware.backends.cuda.kernel import GeneratedKernel
    from middleware.graph import TensorType

    rendered = SimpleNamespace(
        name="k",
        inputs=[],
        outputs=["y"],
        launch=SimpleNamespace(grid=1, block=1),
        in_types=[],
        out_types=[TensorType((2, 3))],
    )
    launched = []
    kernel = GeneratedKernel(rendered, SimpleNamespace(launch=lambda *a: launched.append(a)))
    y = kernel()
    assert y.shape == (2, 3) and y.device == CPU
    assert launched == [(1, 1, [y.data_ptr()])]


def test_gpu_memory_cuts_networks_not_modes():
    """bench/gpu_memory.py started every child of one mode before the next mode's: with
    the budget spent, the last mode (``mw_share``, the one the run was for) had no row."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "gpu_memory.py"
    spec = importlib.util.spec_from_file_location("gpu_memory_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    work = mod.order_work(["a", "b"], ["compile_ro", "mw_graph", "mw_share"])
    assert work == [
        ("a", "compile_ro"),
        ("b", "compile_ro"),
        ("a", "mw_graph"),
        ("a", "mw_share"),
        ("b", "mw_graph"),
        ("b", "mw_share"),
    ]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.tensor(3.0),
        lambda: torch.empty(0, 3, 4, 4),
        lambda: torch.empty(2, 0, 4, 4).contiguous(memory_format=torch.channels_last),
        lambda: torch.randn(1, 3, 1, 1).contiguous(memory_format=torch.channels_last),
        lambda: torch.randn(2, 3, 4, 5)[:, :, :, 1:],
        lambda: torch.randn(3, 1).expand(3, 4),
    ],
)
def test_dense_signature_edge_tensors(make):
    """0-dim, empty, size-1 and view inputs: ``dense_signature`` equals ``dense`` followed
    by the signature it replaced."""
    from middleware.runtime.inputs import channels_last, dense, dense_signature

    inputs = (make(), torch.randn(2, 2))
    want = dense(inputs)
    got, sig = dense_signature(inputs)
    assert sig == tuple((tuple(x.shape), x.dtype, x.device, channels_last(x)) for x in want)
    for g, w in zip(got, want, strict=True):
        assert g.stride() == w.stride() and g.shape == w.shape


@pytest.mark.parametrize("bad", [3, None, [1.0], "x"])
def test_non_tensor_input_still_gets_the_clear_error(bad, tmp_path):
    import torch.nn as nn

    import middleware
    from middleware.errors import InputTypeError

    opt = middleware.optimize(nn.ReLU(), cache_dir=tmp_path)
    with pytest.raises(InputTypeError, match="input 1 is a .*the optimized model takes tensors"):
        opt(torch.randn(2, 3), bad)
