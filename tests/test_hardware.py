"""The hardware model (middleware/hardware.py): medians with sanity bounds, a measurement
under load not cached, pins through Options and $MIDDLEWARE_HARDWARE, CUDA figures from the
device's own properties, the report's note, and a classification that a noisy balance
cannot flip (passes/classify.py)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import middleware
from middleware import hardware as hwmod
from middleware import trace
from middleware.hardware import CPU_DEFAULTS, GPU_DEFAULTS, Hardware
from middleware.options import Options
from middleware.passes import DEFAULT_HARDWARE
from middleware.passes.classify import classify, roofline
from middleware.runtime import report as report_mod

# the module (``middleware.passes.classify`` the attribute is the pass function)
classify_mod = importlib.import_module("middleware.passes.classify")


@pytest.fixture(autouse=True)
def _no_env_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MIDDLEWARE_HARDWARE", raising=False)
    monkeypatch.setattr(hwmod, "_MEASURED", {}, raising=False)


# ------------------------------------------------------------------ measuring
def test_median_of_runs_ignores_one_lucky_or_disturbed_run(monkeypatch: pytest.MonkeyPatch) -> None:
    durations = iter([0.5, 2.0, 2.0, 9.0, 2.0])  # one lucky, one disturbed run
    clock = [0.0]

    def fn() -> None:
        pass

    def perf_counter() -> float:
        return clock[0]

    def timed() -> None:  # each timed call advances the clock by its duration
        clock[0] += next(durations)

    monkeypatch.setattr(hwmod.time, "perf_counter", perf_counter)
    calls = iter([fn] + [timed] * 5)
    median, spread = hwmod._median_time(lambda: next(calls)(), 5)
    assert median == 2.0 and spread == 18.0


def test_each_run_is_its_fastest_call(monkeypatch: pytest.MonkeyPatch) -> None:
    durations = iter([5.0, 1.0, 5.0, 2.0, 5.0, 2.0, 9.0, 5.0, 2.0, 5.0])  # runs of 2 calls
    clock = [0.0]
    monkeypatch.setattr(hwmod.time, "perf_counter", lambda: clock[0])
    calls = iter([lambda: None] + [lambda: clock.__setitem__(0, clock[0] + next(durations))] * 10)
    median, spread = hwmod._median_time(lambda: next(calls)(), 5, 2)
    assert median == 2.0 and spread == 5.0  # run bests 1, 2, 2, 5, 2


def _fake_measure(monkeypatch: pytest.MonkeyPatch, m: object) -> list[int]:
    calls: list[int] = []

    def measure_cpu(*a: object) -> object:
        calls.append(1)
        if isinstance(m, Exception):
            raise m
        return m

    monkeypatch.setattr(hwmod, "measure_cpu", measure_cpu)
    return calls


@pytest.mark.parametrize(
    "figures, why",
    [
        ((1e9, 20.0), "peak_gflops"),
        ((200.0, 5000.0), "bandwidth_gbs"),
        ((200.0, 0.01), "bandwidth_gbs"),
        ((float("nan"), 20.0), "peak_gflops"),
    ],
)
def test_implausible_measurement_gives_defaults_and_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, figures: tuple[float, float], why: str
) -> None:
    _fake_measure(monkeypatch, hwmod.Measurement(*figures, 1.0))
    with pytest.warns(RuntimeWarning, match="documented defaults"):
        hw = hwmod.detect("cpu", tmp_path)
    assert (hw.peak_gflops, hw.bandwidth_gbs) == (
        CPU_DEFAULTS["peak_gflops"],
        CPU_DEFAULTS["bandwidth_gbs"],
    )
    assert hw.source == "default" and why in hw.detail and "outside" in hw.detail
    assert not list(tmp_path.glob("hardware-cpu*.json"))  # nothing cached


def test_failed_measurement_gives_defaults_and_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_measure(monkeypatch, RuntimeError("no timer"))
    with pytest.warns(RuntimeWarning, match="no timer"):
        hw = hwmod.detect("cpu", tmp_path)
    assert hw.source == "default" and "failed" in hw.detail and "no timer" in hw.detail


def test_noisy_measurement_is_cached_for_an_hour_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls = _fake_measure(monkeypatch, hwmod.Measurement(150.0, 15.0, 3.0))
    hw = hwmod.detect("cpu", tmp_path)
    assert hw.source == "measured" and hw.peak_gflops == 150.0
    hwmod.detect("cpu", tmp_path)  # the same process does not measure again
    monkeypatch.setattr(hwmod, "_MEASURED", {}, raising=False)
    hwmod.detect("cpu", tmp_path)  # nor does another one within the hour
    assert len(calls) == 1
    (path,) = tmp_path.glob("hardware-cpu*.json")
    data = json.loads(path.read_text())
    data["measured_at"] = time.time() - hwmod.NOISY_CACHE_SECONDS - 1
    path.write_text(json.dumps(data))
    monkeypatch.setattr(hwmod, "_MEASURED", {}, raising=False)
    hwmod.detect("cpu", tmp_path)  # a noisy figure is not kept longer
    assert len(calls) == 2


def test_quiet_measurement_is_cached_and_expires(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls = _fake_measure(monkeypatch, hwmod.Measurement(150.0, 15.0, 1.1))
    hwmod.detect("cpu", tmp_path)
    (path,) = tmp_path.glob("hardware-cpu*.json")
    monkeypatch.setattr(hwmod, "_MEASURED", {}, raising=False)
    hw = hwmod.detect("cpu", tmp_path)
    assert len(calls) == 1 and hw.peak_gflops == 150.0 and "cached" in hw.detail
    data = json.loads(path.read_text())
    data["measured_at"] = time.time() - hwmod.CACHE_SECONDS - 1
    path.write_text(json.dumps(data))
    monkeypatch.setattr(hwmod, "_MEASURED", {}, raising=False)
    hwmod.detect("cpu", tmp_path)
    assert len(calls) == 2  # too old: measured again


def test_cached_figures_outside_the_bounds_are_measured_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls = _fake_measure(monkeypatch, hwmod.Measurement(150.0, 15.0, 1.1))
    static = hwmod.cpu_static()
    bogus = dataclasses.asdict(Hardware(**static, peak_gflops=1e9, bandwidth_gbs=20.0))
    record = {**bogus, "measured_at": time.time(), "spread": 1.0}
    (tmp_path / hwmod.CACHE_FILE).write_text(json.dumps(record))
    assert hwmod.detect("cpu", tmp_path).peak_gflops == 150.0 and calls


# ------------------------------------------------------------------ pinning
def test_options_pin_a_dict_or_a_record() -> None:
    hw = hwmod.for_options(Options(hardware={"peak_gflops": 500, "bandwidth_gbs": 40}))
    assert (hw.peak_gflops, hw.bandwidth_gbs, hw.source) == (500, 40, "pinned")
    assert hw.l2_bytes == hwmod.cpu_static()["l2_bytes"]  # the rest is the machine's
    record = dataclasses.replace(DEFAULT_HARDWARE, peak_gflops=300.0, bandwidth_gbs=30.0)
    hw2 = hwmod.for_options(Options(hardware=record))
    assert (hw2.peak_gflops, hw2.bandwidth_gbs, hw2.name) == (300.0, 30.0, "default")
    part = hwmod.for_options(Options(hardware={"bandwidth_gbs": 40}))
    assert part.peak_gflops == CPU_DEFAULTS["peak_gflops"] and "not pinned" in part.detail
    hash(Options(hardware={"peak_gflops": 500, "bandwidth_gbs": 40}))  # still hashable


@pytest.mark.parametrize("bad", [{"bogus": 1}, {"bandwidth_gbs": 1e6}, "fast"])
def test_bad_pin_is_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        Options(hardware=bad)


def test_environment_pins_options_and_detect(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MIDDLEWARE_HARDWARE", '{"peak_gflops": 400, "bandwidth_gbs": 50}')
    assert dict(Options().hardware) == {"peak_gflops": 400, "bandwidth_gbs": 50}
    calls = _fake_measure(monkeypatch, hwmod.Measurement(150.0, 15.0, 1.0))
    hw = hwmod.detect("cpu", tmp_path, measure=True)  # what compile_graph calls
    assert (hw.peak_gflops, hw.bandwidth_gbs, hw.source) == (400, 50, "pinned") and not calls
    monkeypatch.setenv("MIDDLEWARE_HARDWARE", "{not json")
    with pytest.raises(ValueError, match="MIDDLEWARE_HARDWARE"):
        Options()


def test_environment_pin_reaches_the_classification(monkeypatch: pytest.MonkeyPatch) -> None:
    """A balance of 1e4 FLOP/byte makes even a dense 3x3 convolution io (far below the
    margin); a balance of 0.1 makes a depthwise one compute."""
    x = torch.randn(1, 16, 12, 12)
    dense = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1)).eval()
    monkeypatch.setenv("MIDDLEWARE_HARDWARE", '{"peak_gflops": 40000, "bandwidth_gbs": 4}')
    om = middleware.optimize(dense, example_inputs=(x,), fuse=False)
    assert {r.op: r.bound for r in om.report().rows}["conv2d"] == "io"
    monkeypatch.setenv("MIDDLEWARE_HARDWARE", '{"peak_gflops": 10, "bandwidth_gbs": 100}')
    om = middleware.optimize(dense, example_inputs=(x,), fuse=False)
    assert {r.op: r.bound for r in om.report().rows}["conv2d"] == "compute"


# ------------------------------------------------------------------ the report
def test_report_note_names_figures_source_and_use() -> None:
    hw = hwmod.for_options(Options(hardware={"peak_gflops": 500, "bandwidth_gbs": 40}))
    note = report_mod.hardware_note(hw)
    for part in ("500.0 GFLOP/s", "40.0 GB/s", "balance 12.5", "pinned", "classification", "tile"):
        assert part in note, (part, note)
    note = report_mod.hardware_note(hwmod.detect("cpu", None, measure=False))
    assert "default" in note and "measure_hardware=False" in note


# ------------------------------------------------------------------ classification
def _conv1x1_at(ratio: float) -> str:
    """The class of a 1x1 convolution on a machine whose balance is its intensity / ratio."""
    g = trace(nn.Conv2d(64, 64, 1).eval(), (torch.randn(1, 64, 28, 28),))
    (n,) = list(g.nodes())
    intensity = roofline(g, n).intensity
    hw = dataclasses.replace(
        DEFAULT_HARDWARE, peak_gflops=intensity / ratio * 10.0, bandwidth_gbs=10.0
    )
    return classify(g, hw).node(n.name).bound


@pytest.mark.parametrize("ratio", [0.85, 0.95, 1.0, 1.05, 1.15])
def test_dense_conv_near_the_balance_is_compute_either_side(ratio: float) -> None:
    assert _conv1x1_at(ratio) == "compute"


def test_far_from_the_balance_the_roofline_decides() -> None:
    assert _conv1x1_at(classify_mod.MARGIN * 1.1) == "compute"
    assert _conv1x1_at(1 / (classify_mod.MARGIN * 1.1)) in ("io", "param")


def _depthwise_at(ratio: float) -> str:
    g = trace(nn.Conv2d(32, 32, 3, padding=1, groups=32).eval(), (torch.randn(1, 32, 28, 28),))
    (n,) = list(g.nodes())
    intensity = roofline(g, n).intensity
    hw = dataclasses.replace(
        DEFAULT_HARDWARE, peak_gflops=intensity / ratio * 10.0, bandwidth_gbs=10.0
    )
    return classify(g, hw).node(n.name).bound


@pytest.mark.parametrize("ratio", [0.85, 1.0, 1.15])
def test_depthwise_conv_near_the_balance_is_io_either_side(ratio: float) -> None:
    assert _depthwise_at(ratio) == "io"


# ------------------------------------------------------------------ CUDA
H100 = dict(
    name="NVIDIA H100 80GB HBM3",
    major=9,
    minor=0,
    multi_processor_count=132,
    clock_rate=1_980_000,  # kHz
    memory_clock_rate=2_619_000,  # kHz
    memory_bus_width=5120,  # bits
    L2_cache_size=50 * 1024 * 1024,
    shared_memory_per_block_optin=227 * 1024,
    warp_size=32,
)


def test_cuda_figures_come_from_the_device_properties() -> None:
    hw = hwmod.cuda_hardware(SimpleNamespace(**H100))
    assert hw.source == "device" and hw.arch == "sm_90" and hw.cores == 132
    assert hw.bandwidth_gbs == pytest.approx(3352.3, rel=1e-3)  # 2 x 2.619 GHz x 640 B
    assert hw.peak_gflops == pytest.approx(132 * 128 * 2 * 1.98, rel=1e-3)
    assert hw.l2_bytes == 50 * 1024 * 1024
    assert (hw.peak_gflops, hw.bandwidth_gbs) != tuple(GPU_DEFAULTS.values())


def test_cuda_missing_properties_are_measured_not_defaulted() -> None:
    props = SimpleNamespace(**{**H100, "clock_rate": 0, "memory_clock_rate": 0})
    hw = hwmod.cuda_hardware(props, hwmod.Measurement(40000.0, 2500.0, 1.0))
    assert (hw.peak_gflops, hw.bandwidth_gbs) == (40000.0, 2500.0) and "measured" in hw.detail
    with pytest.raises(ValueError, match="memory clock"):
        hwmod.cuda_hardware(props)  # nothing to go on: measure, never another GPU's figures


def test_detect_cuda_reads_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    props = SimpleNamespace(**{**H100, "name": "Some GPU", "multi_processor_count": 20})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    hw = hwmod.detect_cuda(None, measure=False)
    assert hw.name == "Some GPU" and hw.cores == 20
    assert hw.peak_gflops == pytest.approx(20 * 128 * 2 * 1.98, rel=1e-3)
    assert hw.peak_gflops != GPU_DEFAULTS["peak_gflops"]


@pytest.mark.parametrize(
    "onednn,times,want",
    [
        ("faster", [0.010, 0.005, 0.004], 0.005),
        ("slower", [0.005, 0.010, 0.004], 0.005),
        ("missing", [0.010, 0.004], 0.010),
    ],
)
def test_the_gemm_peak_is_the_faster_of_mkl_and_onednn(monkeypatch, onednn, times, want) -> None:
    """measure_cpu times torch.mm, then oneDNN's linear where this PyTorch has it, then
    the triad; the GEMM peak is the faster GEMM's (on AMD, MKL's sgemm ran at half of
    oneDNN's speed), torch.mm's alone where oneDNN is missing."""
    it = iter(times)
    monkeypatch.setattr(hwmod, "_median_time", lambda fn, runs, calls=1: (next(it), 1.0))
    fake = None if onednn == "missing" else (lambda: None)
    monkeypatch.setattr(hwmod, "_onednn_gemm", lambda a, b: fake)
    m = hwmod.measure_cpu(runs=1)
    assert m.gflops == pytest.approx(2 * 1024**3 / want / 1e9)
    assert m.gbs == pytest.approx(3 * 4 * 32 * 1024 * 1024 / 0.004 / 1e9)


def test_the_onednn_gemm_computes_a_times_b_transposed() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 48, generator=gen), torch.randn(32, 48, generator=gen)
    fn = hwmod._onednn_gemm(a, b)
    if fn is None:
        pytest.skip("this PyTorch has no oneDNN")
    want = a @ b.T
    torch.testing.assert_close(fn(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
