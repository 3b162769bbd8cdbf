"""The 1x1 -> depthwise 3x3 pair as one layer (passes/fuse_depthwise.py, ``conv2d_dw``),
run on the CPU as one oneDNN primitive with the depthwise layer fused as a post-op
(vendor/onednn.fused_dw_conv): PyTorch's values over random shapes, strides,
activations, biases, batch sizes and input layouts; the pairs it must leave alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from fusion_helpers import reinit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import middleware
from middleware.backends.vendor import onednn
from middleware.enums import RunsAs
from middleware.options import Options

# small caches: the pass fuses a pair only where the expanded tensor outgrows the cores' L2
SMALL_L2 = {"l2_bytes": 64, "cores": 1}
ACTIVATIONS = {
    "none": nn.Identity,
    "relu": nn.ReLU,
    "relu6": nn.ReLU6,
    "hardswish": nn.Hardswish,
    "silu": nn.SiLU,
}

needs_primitives = pytest.mark.skipif(
    onednn.unavailable(Options()) is not None,
    reason=f"no oneDNN primitives here: {onednn.unavailable(Options())}",
)


def _pair(
    ic: int, oc: int, stride: int, act1: str, act2: str, bias: bool | tuple[bool, bool], bn: bool
) -> nn.Module:
    b1, b2 = bias if isinstance(bias, tuple) else (bias, bias)
    layers: list[nn.Module] = [nn.Conv2d(ic, oc, 1, bias=b1)]
    if bn:
        layers.append(nn.BatchNorm2d(oc))
    layers += [ACTIVATIONS[act1](), nn.Conv2d(oc, oc, 3, stride, 1, groups=oc, bias=b2)]
    if bn:
        layers.append(nn.BatchNorm2d(oc))
    layers.append(ACTIVATIONS[act2]())
    return reinit(nn.Sequential(*layers), ic * 131 + oc)


def _check(
    m: nn.Module, x: torch.Tensor, tmp_path, fused: bool, **options
) -> middleware.OptimizedModule:  # noqa: ANN001
    opt = middleware.optimize(
        m, example_inputs=[x], cache_dir=tmp_path, measure_hardware=False, **options
    )
    with torch.inference_mode():
        ref, got = m(x), opt(x)
        got2 = opt(x)  # the native runner's call, after the recording
    scale = ref.abs().max().item()
    assert scale > 1e-3
    for y in (got, got2):
        assert y.shape == ref.shape
        assert (y - ref).abs().max().item() <= 1e-5 * scale
    assert not opt.report().fallbacks, opt.report()  # compiled, not the original run
    assert opt.plan is not None
    rows = [r for r in opt.report().rows if r.op == "conv2d_dw"]
    assert bool(rows) == fused, opt.report()
    if fused:  # the fused primitive itself, not the reference's two convolutions
        assert all(r.runs_as == RunsAs.VENDOR for r in rows), opt.report()
        note = next(n for n in opt.report().notes if "primitives created once" in n)
        assert f"({len(rows)} of them a 1x1 and a depthwise" in note, note
    return opt


@needs_primitives
@settings(
    max_examples=14, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ic=st.integers(3, 40),
    oc=st.sampled_from([8, 13, 24, 40]),
    hw=st.tuples(st.integers(3, 19), st.integers(3, 19)),
    stride=st.sampled_from([1, 2]),
    act1=st.sampled_from(sorted(ACTIVATIONS)),
    act2=st.sampled_from(sorted(ACTIVATIONS)),
    bias=st.tuples(st.booleans(), st.booleans()),
    bn=st.booleans(),
    batch=st.sampled_from([1, 5]),
    channels_last=st.booleans(),
)
def test_fused_pair_matches_pytorch(
    ic,
    oc,
    hw,
    stride,
    act1,
    act2,
    bias,
    bn,
    batch,
    channels_last,
    tmp_path,  # noqa: ANN001
) -> None:
    """Odd sizes and channel counts, stride 1 and 2, every fusable activation before and
    after the depthwise layer (or none), with and without biases and batch norms, batch 1
    and 5, NCHW and channels_last inputs: one ``conv2d_dw`` layer run by the vendor,
    PyTorch's values."""
    # a 3x3 layer first: a 1x1 reading the NCHW graph input itself converts it on the way
    # (conv2d's output_layout) and stays unfused (the primitive reads channels_last)
    stem = nn.Conv2d(ic, ic, 3, padding=1)
    with torch.no_grad():
        stem.weight.copy_(
            torch.randn(stem.weight.shape, generator=torch.Generator().manual_seed(ic))
            / (3 * ic**0.5)
        )
    m = nn.Sequential(stem, _pair(ic, oc, stride, act1, act2, bias, bn)).eval()
    x = torch.randn(batch, ic, *hw, generator=torch.Generator().manual_seed(sum(hw)))
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    _check(m, x, tmp_path, fused=True, hardware=SMALL_L2)


@needs_primitives
def test_a_network_of_pairs_runs_natively(tmp_path) -> None:  # noqa: ANN001
    """Two inverted-residual-like blocks back to back at batch 1: the fused layers are C
    calls of the native runner too."""
    m = nn.Sequential(
        nn.Conv2d(8, 8, 3, padding=1),
        _pair(8, 24, 1, "relu6", "relu6", False, True),
        nn.Conv2d(24, 8, 1),
        _pair(8, 32, 2, "hardswish", "none", True, False),
    ).eval()
    x = torch.randn(1, 8, 21, 21)
    opt = _check(m, x, tmp_path, fused=True, hardware=SMALL_L2)
    assert opt.plan.native is not None, opt.plan.notes
    assert sum(r.op == "conv2d_dw" for r in opt.report().rows) == 2
    threads = torch.get_num_threads()
    try:  # another thread count: its own primitives (built on first use)
        torch.set_num_threads(1 if threads > 1 else 2)
        with torch.inference_mode():
            ref, got = m(x), opt(x)
        assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "case",
    [
        "dw5x5",
        "dilated",
        "stride3",
        "pointwise_stride2",
        "read_twice",
        "small",
        "disabled",
        "training",
        "named_algorithm",
        "control",
        "auto",
    ],
)
def test_pairs_left_alone(case: str, tmp_path) -> None:  # noqa: ANN001
    """What the fused primitive does not compute stays two layers, with PyTorch's values:
    a 5x5 or dilated depthwise layer, stride 3, a strided 1x1, an expanded tensor read by
    another layer too, one that fits the caches, the pass switched off, training, conv2d
    algorithms the user named. (The controls: the same net unchanged, or with
    ``algorithms="auto"``, is fused.)"""
    options: dict = {"hardware": SMALL_L2}
    dw = {"kernel_size": 3, "stride": 1, "padding": 1, "dilation": 1}
    pw_stride = 1
    if case == "dw5x5":
        dw.update(kernel_size=5, padding=2)
    elif case == "dilated":
        dw.update(padding=2, dilation=2)
    elif case == "stride3":
        dw.update(stride=3)
    elif case == "pointwise_stride2":
        pw_stride = 2
    elif case == "small":
        options = {}  # the host's caches: a 16-channel 9x9 tensor fits them
    elif case == "disabled":
        options["disable_passes"] = ("fuse_depthwise",)
    elif case == "named_algorithm":  # every conv2d layer the user's: none merged away
        options["algorithms"] = {"conv2d": "vendor"}
    elif case == "auto":  # the middleware decides: the pair stays fused
        options["algorithms"] = {"conv2d": "auto"}

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(6, 6, 3, padding=1)  # the pair reads a channels_last value
            self.pw = nn.Conv2d(6, 16, 1, stride=pw_stride)
            self.dw = nn.Conv2d(16, 16, groups=16, **dw)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.pw(self.stem(x)))
            z = self.dw(y)
            return z + y.mean() if case == "read_twice" else z

    m = Net().eval()
    x = torch.randn(2, 6, 9, 9)
    if case == "training":
        m.train()
        opt = middleware.optimize(m, cache_dir=tmp_path, measure_hardware=False, **options)
        y = opt(x)
        assert torch.allclose(y, m(x), rtol=1e-5, atol=1e-5)
        assert not any(r.op == "conv2d_dw" for r in opt.report().rows)
        return
    _check(m, x, tmp_path, fused=case in ("control", "auto"), **options)
