"""oneDNN convolution primitives created once and executed directly (vendor/onednn.py).

Random convolutions (geometry, groups, layouts, bias, fused activation, residual as a
binary add or accumulated into, a source that is a channel slice of a wider tensor, an
NCHW source into a channels_last output) against the catalogue reference
(``get_op("conv2d").bind``, i.e. ``F.conv2d``), tolerance relative to the output's scale.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn
from fusion_helpers import CONV_ACTIVATIONS as ACTIVATIONS
from fusion_helpers import close_to_scale as _close
from fusion_helpers import conv_graph
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import middleware
from middleware.backends.vendor import onednn
from middleware.backends.vendor.calls import vendor_kernel
from middleware.ops import get_op
from middleware.options import Options

CL = torch.channels_last
CPU = torch.device("cpu")


pytestmark = pytest.mark.skipif(
    onednn.unavailable(Options()) is not None,
    reason=f"no oneDNN primitives here: {onednn.unavailable(Options())}",
)


def _in_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.contiguous(memory_format=CL if layout == "nhwc" else torch.contiguous_format)


@st.composite
def conv_cases(draw):
    groups = draw(st.sampled_from([1, 1, 2, "depthwise"]))
    c_per = draw(st.integers(1, 9))
    cin = c_per * (1 if groups == "depthwise" else groups) if groups != "depthwise" else c_per
    groups = cin if groups == "depthwise" else groups
    cout = groups * draw(st.integers(1, 6)) if groups > 1 else draw(st.integers(1, 20))
    k = draw(st.sampled_from([(1, 1), (3, 3), (1, 3), (5, 5), (2, 2)]))
    stride = draw(st.sampled_from([1, 1, 2, (1, 2)]))
    dilation = draw(st.sampled_from([1, 1, 2]))
    pad = draw(st.sampled_from([0, 1, 2, (0, 1)]))
    h, w = draw(st.integers(5, 14)), draw(st.integers(5, 14))
    return dict(
        x=(draw(st.integers(1, 3)), cin, h, w),
        w=(cout, cin // groups, *k),
        stride=stride,
        padding=pad,
        dilation=dilation,
        groups=groups,
        bias=draw(st.booleans()),
        act=draw(st.integers(0, len(ACTIVATIONS) - 1)),
        residual=draw(st.sampled_from([None, "add", "into"])),
        layout=draw(st.sampled_from(["nchw", "nhwc"])),
        source=draw(st.sampled_from(["dense", "slice", "nchw_into_nhwc"])),
        seed=draw(st.integers(0, 2**16)),
    )


@given(conv_cases())
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_primitive_matches_reference(case):
    name, attrs = ACTIVATIONS[case["act"]]
    layout = case["layout"]
    if case["source"] == "nchw_into_nhwc":
        layout = "nhwc"
    oh = case["x"][2] + 2 * _pair(case["padding"])[0] - case["dilation"] * (case["w"][2] - 1) - 1
    ow = case["x"][3] + 2 * _pair(case["padding"])[1] - case["dilation"] * (case["w"][3] - 1) - 1
    if oh < 0 or ow < 0:
        return  # no output: the frontend never hands such a layer over
    residual = case["residual"] is not None
    if residual and name not in (None, "relu"):
        name, attrs = "relu", ()  # oneDNN takes only relu after the add
    g, node = conv_graph(
        case["x"], case["w"], layout, stride=case["stride"], padding=case["padding"],
        dilation=case["dilation"], groups=case["groups"], bias=case["bias"], activation=name,
        activation_attrs=attrs, residual=residual, seed=case["seed"],
    )  # fmt: skip
    if case["source"] == "nchw_into_nhwc":
        g.values["x"] = dataclasses.replace(g.values["x"], layout="nchw")
    # oneDNN has no fast kernel for some (a grouped 1x1 with a residual): the ideep call
    # runs those, and must be right too; test_common_layers_take_primitives checks that
    # the layers networks have do take the primitive
    fn = vendor_kernel(g, node, CPU, options=Options())
    assert fn is not None
    torch.manual_seed(case["seed"])
    x = torch.randn(case["x"])
    if case["source"] == "slice":  # channels [2, 2 + cin) of a wider tensor, as a split gives
        wide = _in_layout(torch.randn(case["x"][0], case["x"][1] + 5, *case["x"][2:]), layout)
        wide[:, 2 : 2 + case["x"][1]] = x
        x = wide[:, 2 : 2 + case["x"][1]]
    elif case["source"] == "nchw_into_nhwc":
        x = x.contiguous()
    else:
        x = _in_layout(x, layout)
    args = [x, torch.from_numpy(g.params["w"])]
    if case["bias"]:
        args.append(torch.from_numpy(g.params["b"]))
    if residual:
        args.append(_in_layout(torch.randn(g.values["r"].shape), layout))
    ref = get_op("conv2d").bind(node)(*args)
    before = [a.clone() for a in args]
    call = fn.into_residual if case["residual"] == "into" else fn
    for _ in range(2):  # a second call reuses the primitive and its memory objects
        if case["residual"] == "into":
            args[-1].copy_(before[-1])
        y = call(*args)
        _close(y, ref)
    want = CL if layout == "nhwc" else torch.contiguous_format
    assert y.is_contiguous(memory_format=want), f"output not in the declared layout {layout}"
    if case["residual"] == "into":
        assert y.data_ptr() == args[-1].data_ptr(), "into_residual did not write the residual"
        args, before = args[:-1], before[:-1]
    for a, b in zip(args, before, strict=True):
        assert torch.equal(a, b), "the primitive wrote into an input"


@pytest.mark.parametrize(
    "xs, ws, stride, padding, groups, act, residual",
    [
        ((1, 16, 14, 14), (32, 16, 3, 3), 1, 1, 1, "relu", False),  # dense 3x3
        ((2, 24, 7, 7), (48, 24, 1, 1), 1, 0, 1, "hardswish", False),  # 1x1 expand
        ((1, 48, 14, 14), (48, 1, 3, 3), 2, 1, 48, "hardtanh", False),  # depthwise, stride 2
        ((1, 96, 1, 1), (24, 96, 1, 1), 1, 0, 1, "relu", False),  # SE FC on one pixel
        ((2, 32, 8, 8), (32, 32, 1, 1), 1, 0, 1, "relu", True),  # project + residual
        ((1, 3, 32, 32), (16, 3, 3, 3), 2, 1, 1, "hardswish", False),  # stem
    ],
)
def test_common_layers_take_primitives(xs, ws, stride, padding, groups, act, residual):
    attrs = (("min_val", 0.0), ("max_val", 6.0)) if act == "hardtanh" else ()
    g, node = conv_graph(
        xs, ws, "nhwc", stride=stride, padding=padding, groups=groups, activation=act,
        activation_attrs=attrs, residual=residual,
    )  # fmt: skip
    fn = vendor_kernel(g, node, CPU, options=Options())
    assert hasattr(fn, "primitives"), "the primitive path was not taken"


def _pair(v):
    return (v, v) if isinstance(v, int) else v


def test_weight_held_once_packed():
    """The plain weight is let go once packed; every primitive of the node shares one
    packed copy where oneDNN reads the same format."""
    g, node = conv_graph((2, 16, 9, 9), (32, 16, 3, 3), "nhwc", padding=1, residual=True)
    fn = vendor_kernel(g, node, CPU, options=Options())
    prims = fn.primitives
    assert prims.weight is None
    packed = [t for t in fn.keep if t.numel() >= 32 * 16 * 9 * 4]
    assert len(packed) == 1, f"{len(packed)} packed weights held for one node"


def test_switch_and_unavailable_take_the_ideep_call(monkeypatch):
    g, node = conv_graph((1, 8, 9, 9), (8, 8, 3, 3), "nhwc", padding=1)
    fn = vendor_kernel(g, node, CPU, options=Options(onednn_primitives=False))
    assert not hasattr(fn, "primitives")
    monkeypatch.setattr(onednn, "_state", {"lib": "a stripped build (test)"})
    assert onednn.unavailable(Options()) == "a stripped build (test)"
    fn = vendor_kernel(g, node, CPU, options=Options())
    assert fn is not None and not hasattr(fn, "primitives")
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()).eval()
    x = torch.randn(2, 3, 12, 12)
    o = middleware.optimize(m, example_inputs=(x,))
    with torch.no_grad():
        _close(o(x), m(x))
    assert any("torch.ops.mkldnn: a stripped build (test)" in n for n in o.report().notes)


def test_optimize_with_and_without_primitives_equal_pytorch():
    """A mobile block (1x1 expand, depthwise, SE-free project, residual) through optimize()
    at batch 1 and 5, both switches, against eager."""
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.Hardswish())
            self.expand = nn.Sequential(nn.Conv2d(16, 48, 1), nn.BatchNorm2d(48), nn.ReLU())
            self.dw = nn.Sequential(
                nn.Conv2d(48, 48, 3, 1, 1, groups=48), nn.BatchNorm2d(48), nn.ReLU6()
            )
            self.project = nn.Sequential(nn.Conv2d(48, 16, 1), nn.BatchNorm2d(16))

        def forward(self, x):
            s = self.stem(x)
            return torch.relu(s + self.project(self.dw(self.expand(s))))

    m = Block().eval()
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.5, 0.5)
            mod.running_var.uniform_(0.5, 2.0)
    for b in (1, 5):
        x = torch.randn(b, 3, 32, 30)
        with torch.no_grad():
            ref = m(x)
        for on in (True, False):
            o = middleware.optimize(m, example_inputs=(x,), onednn_primitives=on)
            with warnings.catch_warnings():  # a plan that failed and ran eager would warn
                warnings.simplefilter("error")
                _close(o(x), ref)
            steps = [s for s in o.plan.steps if hasattr(s.fn, "primitives")]
            assert bool(steps) == on
            assert any("oneDNN primitives created once" in n for n in o.report().notes) == on


def _depthwise():
    return conv_graph((1, 64, 10, 10), (64, 1, 3, 3), "nhwc", padding=1, groups=64)


def _args(g):
    x = torch.randn(g.values["x"].shape).contiguous(memory_format=CL)
    return [x, torch.from_numpy(g.params["w"]), torch.from_numpy(g.params["b"])]


def test_first_call_of_a_thread_without_scratchpad():
    """A thread whose first primitive books no scratchpad (depthwise kernels) gets none,
    and one that needs one later gets it (review: the first crashed)."""
    import threading

    g, node = _depthwise()
    dense_g, dense_node = conv_graph((1, 16, 9, 9), (32, 16, 3, 3), "nhwc", padding=1)
    fns = [vendor_kernel(g, node, CPU, options=Options()),
           vendor_kernel(dense_g, dense_node, CPU, options=Options())]  # fmt: skip
    cases = [(fn, _args(gg)) for fn, gg in zip(fns, (g, dense_g), strict=True)]
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for (fn, args), nd in zip(cases, (node, dense_node), strict=True):
                _close(fn(*args), get_op("conv2d").bind(nd)(*args))
        except BaseException as e:  # noqa: BLE001 - reported to the test's thread
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, errors


def test_default_dtype_float64_and_a_broadcast_source():
    g, node = _depthwise()
    fn = vendor_kernel(g, node, CPU, options=Options())
    x, w, b = _args(g)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        y = fn(x, w, b)
    finally:
        torch.set_default_dtype(old)
    assert y.dtype == torch.float32
    _close(y, get_op("conv2d").bind(node)(x, w, b))
    wide = torch.randn(1, 1, 1, 1).expand(*g.values["x"].shape)  # strides all 0
    _close(fn(wide, w, b), get_op("conv2d").bind(node)(wide, w, b))


def test_thread_count_change_builds_its_own_primitive():
    g, node = conv_graph((2, 16, 9, 9), (32, 16, 3, 3), "nhwc", padding=1)
    fn = vendor_kernel(g, node, CPU, options=Options())
    x, w, b = _args(g)
    ref = get_op("conv2d").bind(node)(x, w, b)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _close(fn(x, w, b), ref)
    finally:
        torch.set_num_threads(threads)
    _close(fn(x, w, b), ref)
    counts = {key[2] for key in fn.primitives.handles}
    assert 1 in counts and threads in counts


def test_a_second_cache_behind_a_symlink(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    for cache in (tmp_path / "link", tmp_path / "other"):
        assert onednn.unavailable(Options(cache_dir=cache)) is None
    assert list((real / "kernels").glob("onednn_conv-*/kernel.so"))


def test_elf_reader_agrees_with_nm(tmp_path):
    """Adjacent names, a name that is the tail of another, local and global functions: the
    offsets the reader finds are nm's."""
    import shutil
    import subprocess

    if shutil.which("nm") is None or shutil.which("gcc") is None:
        pytest.skip("needs gcc and nm")
    src = tmp_path / "lib.c"
    src.write_text(
        "static int dnnl_a(int x) { return x + 1; }\n"
        "static int dnnl_b(int x) { return x * 3; }\n"
        "int my_dnnl_b2(int x) { return x - 2; }\n"
        "int dnnl_b2(int x) { return dnnl_a(x) + dnnl_b(x); }\n"
        "int (*keep[])(int) = {dnnl_a, dnnl_b};\n"
    )
    so = tmp_path / "lib.so"
    subprocess.run(["gcc", "-O0", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    nm = subprocess.run(["nm", str(so)], capture_output=True, text=True, check=True).stdout
    want = {
        parts[2]: int(parts[0], 16)
        for parts in (line.split() for line in nm.splitlines())
        if len(parts) == 3 and parts[1] in "tT"
    }
    names = ["dnnl_a", "dnnl_b", "dnnl_b2", "my_dnnl_b2", "dnnl_missing"]
    got = onednn.elf_function_offsets(so, names)
    assert got == {n: want[n] for n in names if n in want}
    assert set(got) == {"dnnl_a", "dnnl_b", "dnnl_b2", "my_dnnl_b2"}
