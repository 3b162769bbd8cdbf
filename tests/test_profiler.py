"""The profiler: measured peaks against hand-computed ones, exact parameter bytes, the
plot, and the optimized peak never above the original's."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

import middleware
from middleware.profiler import LiveStorageTracker, ProfileResult, measure_peak

F32 = 4


def _small_net() -> nn.Module:
    """conv(3->8, 3x3, pad 1) -> relu (not in place) -> max-pool 2x2, on 1x3x16x16."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=False), nn.MaxPool2d(2)
    ).eval()


def test_original_peak_matches_hand_computed() -> None:
    m = _small_net()
    x = torch.randn(1, 3, 16, 16)
    x_b = 3 * 16 * 16 * F32  # the input, live throughout
    conv_b = 8 * 16 * 16 * F32  # conv output
    relu_b = 8 * 16 * 16 * F32  # relu output (a new tensor)
    pool_b = 8 * 8 * 8 * F32  # pool output
    idx_b = 8 * 8 * 8 * 8  # int64 indices that ATen's CPU max-pool makes
    # nn.Sequential drops the conv output once relu returned: live sets in order
    at_relu = x_b + conv_b + relu_b
    at_pool = x_b + relu_b + pool_b + idx_b
    expected = max(at_relu, at_pool)
    params, peak = measure_peak(m, (x,))
    assert peak == expected
    assert params == (8 * 3 * 3 * 3 + 8) * F32


def test_profile_result_fields_and_table() -> None:
    m = _small_net()
    x = torch.randn(1, 3, 16, 16)
    # the relu stays a node of its own (merged into neither the pool nor the conv's oneDNN
    # epilogue) and the graph stays NCHW, so the plan runs it in place over the conv output
    r = middleware.profile(
        m,
        x,
        repeats=2,
        measure_hardware=False,
        fuse=False,
        disable_passes=["merge_pool_relu", "fuse_vendor_epilogue", "layout"],
    )
    assert isinstance(r, ProfileResult)
    exact_params = sum(p.numel() * p.element_size() for p in m.parameters())
    assert r.original.param_bytes == exact_params
    assert r.optimized.param_bytes == _held_params(m, x)
    assert r.original.peak_bytes == r.original.param_bytes + r.original.peak_io_bytes
    assert r.original.peak_io_bytes == 3 * 256 * F32 + 2 * 8 * 256 * F32
    # optimized: relu runs in place over the dead conv output
    assert r.optimized.peak_io_bytes < r.original.peak_io_bytes
    assert r.original.latency_ms > 0 and r.optimized.latency_ms > 0
    assert [g.ops for g in r.groups] == [("conv2d",), ("relu",), ("max_pool2d",)]
    assert r.groups[1].placement == "inplace"
    text = str(r)
    assert "peak I/O memory" in text and "parameter memory" in text and "latency" in text
    assert r.planned_peak_io_bytes == r.optimized.peak_io_bytes  # plan and measurement agree


def test_optimized_module_profile_method() -> None:
    m = _small_net()
    x = torch.randn(2, 3, 16, 16)
    om = middleware.optimize(m, example_inputs=(x,), measure_hardware=False)
    r = om.profile(x, repeats=1)
    assert r.optimized.peak_io_bytes <= r.original.peak_io_bytes
    assert r.optimized.param_bytes == _held_params(m, x)


def _held_params(m: nn.Module, x: torch.Tensor) -> int:
    """What the optimized model holds for the conv's parameters: oneDNN's packed copy of the
    weight (as a primitive: its bytes, the output channels padded to oneDNN's block) and the
    bias; through torch.ops.mkldnn the opaque tensor counted by its elements, the same bytes
    as the weight."""
    from middleware.backends.vendor import onednn
    from middleware.options import Options

    exact = sum(p.numel() * p.element_size() for p in m.parameters())
    if onednn.unavailable(Options()) is not None:
        return exact
    conv = m[0]
    packed = -(-conv.out_channels // 16) * 16 * conv.in_channels * 9 * F32
    assert packed >= conv.weight.numel() * F32
    return packed + conv.bias.numel() * F32


class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.a = nn.Sequential(nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4), nn.ReLU(True))
        self.b = nn.Sequential(nn.Conv2d(8, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(True))
        self.pool = nn.MaxPool2d(3, 1, 1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(18, 5))

    def forward(self, x):  # noqa: ANN001, ANN201
        y = self.stem(x)
        y = torch.cat([self.a(y), self.b(y), self.pool(y)], 1)
        return self.head(y)


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(True))
        self.c2 = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4))

    def forward(self, x):  # noqa: ANN001, ANN201
        return torch.relu(self.c2(self.c1(x)) + x).sigmoid()


@pytest.mark.parametrize(
    "make,shape",
    [(_small_net, (2, 3, 16, 16)), (_Branches, (2, 3, 12, 12)), (_Residual, (3, 4, 9, 9))],
)
def test_optimized_peak_never_exceeds_original(make, shape) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    m = make().eval()
    x = torch.randn(shape)
    r = middleware.profile(m, x, repeats=1, measure_hardware=False)
    # the arena aligns each value to 64 bytes: on these tiny tensors that padding is all
    # that can separate the two peaks
    assert r.optimized.peak_io_bytes <= r.original.peak_io_bytes + 64, str(r)
    with torch.no_grad():
        torch.testing.assert_close(middleware.optimize(m, example_inputs=(x,))(x), m(x))


def test_tracker_counts_each_storage_once_and_frees() -> None:
    x = torch.randn(1000)
    tr = LiveStorageTracker()
    with tr:
        a = x * 2  # 4000 bytes
        v = a[10:]  # a view: same storage, not counted again
        b = torch.cat([a, a])  # 8000 bytes
        del a, v, b
        c = x + 1  # 4000, after 12000 were freed
    assert tr.peak_io == 12000
    assert tr.current == 4000
    del c


def test_plot_writes_png(tmp_path) -> None:  # noqa: ANN001
    pytest.importorskip("matplotlib")
    m = _small_net()
    r = middleware.profile(m, torch.randn(1, 3, 16, 16), repeats=1, measure_hardware=False)
    path = r.plot(tmp_path / "mem.png", title="small")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5000


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    m = _small_net()
    r = middleware.profile(m, torch.randn(1, 3, 16, 16), repeats=1, measure_hardware=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        r.plot(tmp_path / "x.png")


def test_profile_command_line_on_a_user_file(tmp_path, capsys) -> None:  # noqa: ANN001
    pytest.importorskip("matplotlib")
    from middleware.__main__ import main

    src = tmp_path / "mynet.py"
    src.write_text(
        "import torch.nn as nn\n"
        "def small():\n"
        "    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), (3, 12, 12)\n"
    )
    png = tmp_path / "out.png"
    rc = main(["profile", f"{src}:small", "--batch", "2", "--repeats", "1", "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "small: batch 2, input 3x12x12" in out and "peak I/O memory" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profiler_counts_weights_a_step_reads_through_raw_pointers() -> None:
    """A generated algorithm (gemv) reads its weight by pointer, unseen by the dispatcher:
    the optimized parameter memory still counts it (Plan.held_tensors)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.ReLU()).eval()
    x = torch.randn(1, 512)
    result = middleware.profile(model, x, repeats=1, algorithms={"linear": "gemv"})
    opt_rows = [g for g in result.groups if "linear" in g.ops]
    assert opt_rows, result
    assert result.optimized.param_bytes >= 512 * 256 * 4, result
