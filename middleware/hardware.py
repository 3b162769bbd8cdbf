"""The ``Hardware`` description: what the passes and backends know of the machine.

Figures come from the machine itself: core count and cache sizes are read from the OS,
peak FLOP/s and memory bandwidth are measured with a short micro-benchmark (an fp32 GEMM
and a STREAM-like triad through the framework), each the **median** of several short runs,
and cached as JSON in the cache directory for :data:`CACHE_SECONDS` (a noisy measurement,
whose runs spread more than :data:`MAX_SPREAD`, for :data:`NOISY_CACHE_SECONDS` only: long
enough that the processes of one job agree, short enough that a figure taken under load is
not kept). A figure
outside the sanity bounds (:data:`BOUNDS`) is taken as a broken measurement: the documented
defaults are used instead, and ``Hardware.detail`` says so. ``Options(hardware=...)`` (a
``Hardware`` or a dict of its fields) or ``$MIDDLEWARE_HARDWARE`` (JSON) pins the figures.
On CUDA the figures come from the device's properties (SM count and clock, memory clock and
bus width, L2), measured where a property is missing, never another GPU's defaults.

``Hardware.source`` says where the figures came from ("measured", "pinned", "device",
"default") and ``describe()`` puts it in one line for ``OptimizedModule.report()``.
With measuring off, documented defaults are used (``CPU_DEFAULTS``: a 2-core AVX-512
machine with a balance of about 10 FLOP/byte).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device's figures. ``balance`` (FLOP per byte) is the roofline ridge point."""

    kind: str  # "cpu" | "cuda"
    name: str
    cores: int  # CPU cores, or GPU streaming multiprocessors
    simd_bytes: int  # vector register width (CPU) or warp size * 4 (GPU)
    l1_bytes: int
    l2_bytes: int
    l3_bytes: int
    peak_gflops: float
    bandwidth_gbs: float
    warp_size: int = 1
    shared_mem_bytes: int = 0
    arch: str = ""  # e.g. "sm_90" on CUDA, the -march flags' target on CPU
    measured: bool = False
    # where peak_gflops and bandwidth_gbs came from: "measured", "pinned", "device" (CUDA
    # properties), "default" (documented defaults); ``detail`` says how or why
    source: str = "default"
    detail: str = ""
    # the CPU's vendor_id ("GenuineIntel", "AuthenticAMD"; "" unknown or a GPU): the
    # generated code's software prefetch hint depends on it (backends/x86/window.py)
    vendor: str = ""

    @property
    def balance(self) -> float:
        return self.peak_gflops / self.bandwidth_gbs

    @property
    def amd(self) -> bool:
        """An AMD CPU (or Hygon's, on AMD's Zen cores): the generated code's prefetch hint
        and the default's Winograd rule differ there, measured."""
        return self.vendor in ("AuthenticAMD", "HygonGenuine")

    @property
    def simd_floats(self) -> int:
        return max(1, self.simd_bytes // 4)

    def describe(self) -> str:
        """The figures and where they came from, in one line."""
        how = f"{self.source}" + (f": {self.detail}" if self.detail else "")
        return (
            f"{self.kind} {self.name}: {self.peak_gflops:.1f} GFLOP/s, "
            f"{self.bandwidth_gbs:.1f} GB/s, balance {self.balance:.1f} FLOP/B ({how})"
        )

    def key(self) -> str:
        """What of the hardware changes generated code (for kernel cache keys)."""
        return (
            f"{self.kind}:{self.name}:{self.cores}:{self.simd_bytes}:{self.l1_bytes}:"
            f"{self.l2_bytes}:{self.arch}:{self.vendor}"
        )


# Documented defaults (used when measure_hardware=False or measuring fails): the figures
# measured on the project's 2-core Sapphire Rapids machine (shared/MEASURED.md).
CPU_DEFAULTS = dict(peak_gflops=220.0, bandwidth_gbs=21.0)
# An A100-class GPU: 19.5 TFLOP/s fp32, 1.5 TB/s. Kept for callers that describe a GPU
# they do not have (tests, benchmarks); detect_cuda never uses it.
GPU_DEFAULTS = dict(peak_gflops=19500.0, bandwidth_gbs=1500.0)

# Plausible figures per device kind, (low, high): GFLOP/s from one slow core to a large
# server, GB/s from a single DDR channel to many HBM stacks. Outside -> a broken measurement.
BOUNDS = {
    "cpu": {"peak_gflops": (1.0, 50_000.0), "bandwidth_gbs": (1.0, 2000.0)},
    "cuda": {"peak_gflops": (100.0, 1_000_000.0), "bandwidth_gbs": (50.0, 20_000.0)},
}
# Short runs per measurement, each the best of CALLS_PER_RUN calls (a call interrupted by
# another process does not count), and the median over the runs is taken (one lucky run
# does not move it, as it moved a best of all calls). Measured on the 2-core host under the
# load of three other test processes, six trials of 15 triad calls each: the median of 7
# single calls gave 10.4-11.8 GB/s, the median of 5 best-of-3 runs 11.3-12.6, the best of
# all 15 calls 12.6-15.2 (one lucky call).
RUNS = 5
CALLS_PER_RUN = 3
# A measurement whose runs spread (slowest / fastest) more than this was made under load:
# it is cached for NOISY_CACHE_SECONDS only (processes started meanwhile, e.g. a warm start
# that must find the same groups, agree with it), a quiet one for CACHE_SECONDS.
MAX_SPREAD = 1.5
NOISY_CACHE_SECONDS = 3600.0
CACHE_SECONDS = 7 * 24 * 3600.0
# v3: the GEMM peak is the faster of torch.mm and oneDNN's linear (v2: torch.mm only)
CACHE_FILE = "hardware-cpu-v3.json"


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Median figures of several runs and how far the runs spread (slowest / fastest of
    the noisier of the two benchmarks; 1.0 is no noise)."""

    gflops: float
    gbs: float
    spread: float


def out_of_bounds(kind: str, gflops: float, gbs: float) -> str:
    """Which figures are implausible for a ``kind`` device ("" when both are fine)."""
    bad = []
    for name, value in (("peak_gflops", gflops), ("bandwidth_gbs", gbs)):
        lo, hi = BOUNDS[kind][name]
        if not lo <= value <= hi:  # also catches NaN
            bad.append(f"{name}={value:.4g} outside [{lo:g}, {hi:g}]")
    return ", ".join(bad)


_FIELDS = {f.name for f in dataclasses.fields(Hardware)}


def pin_fields(pin: Any) -> dict[str, Any]:
    """The fields a pin sets (``Options(hardware=...)``: a ``Hardware``, or a mapping of its
    field names, e.g. ``{"peak_gflops": 500, "bandwidth_gbs": 40}``). Raises ValueError on an
    unknown field or an implausible figure."""
    if isinstance(pin, Hardware):
        fields = dataclasses.asdict(pin)
    elif isinstance(pin, Mapping):
        fields = dict(pin)
    elif isinstance(pin, tuple | list):  # the (name, value) pairs Options keeps
        fields = dict(pin)
    else:
        raise ValueError(f"hardware must be a Hardware or a dict of its fields, not {pin!r}")
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        raise ValueError(f"unknown hardware field(s) {unknown}; known: {sorted(_FIELDS)}")
    kind = str(fields.get("kind", "cpu"))
    bad = out_of_bounds(
        kind if kind in BOUNDS else "cpu",
        float(fields.get("peak_gflops", CPU_DEFAULTS["peak_gflops"])),
        float(fields.get("bandwidth_gbs", CPU_DEFAULTS["bandwidth_gbs"])),
    )
    if bad:
        raise ValueError(f"pinned hardware figures are implausible: {bad}")
    return fields


def _pinned(static: dict[str, Any], pin: Any, figures: dict[str, float], rest: str) -> Hardware:
    """The machine's static description with the pinned fields over it; the figures the
    pin leaves out are ``figures`` (``rest`` says what those are)."""
    given = pin_fields(pin)
    fields = {**static, **figures, **given, "source": "pinned", "measured": False}
    named = {"peak_gflops", "bandwidth_gbs"} <= given.keys()
    fields["detail"] = "Options(hardware=...) or $MIDDLEWARE_HARDWARE" + (
        "" if named else f"; the figures not pinned are {rest}"
    )
    return Hardware(**fields)


def _cache_size(level: int, kind: str = "") -> int | None:
    """Size in bytes of the CPU cache of ``level`` (data or unified) from sysfs."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    if not base.exists():
        return None
    for idx in sorted(base.glob("index*")):
        try:
            lvl = int((idx / "level").read_text())
            typ = (idx / "type").read_text().strip()
            if lvl != level or typ == "Instruction":
                continue
            size = (idx / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        mult = 1024 if size.endswith("K") else 1024 * 1024 if size.endswith("M") else 1
        return int(size.rstrip("KM")) * mult
    return None


def _simd_bytes() -> int:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return 16
    if " avx512f" in flags:
        return 64
    if " avx2" in flags or " avx " in flags:
        return 32
    return 16


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` line's value in /proc/cpuinfo, or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == field:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_static() -> dict[str, Any]:
    """What can be read of the CPU without measuring."""
    import torch

    return dict(
        kind="cpu",
        name=_cpu_name(),
        cores=max(1, torch.get_num_threads()),
        simd_bytes=_simd_bytes(),
        l1_bytes=_cache_size(1) or 48 * 1024,
        l2_bytes=_cache_size(2) or 2 * 1024 * 1024,
        l3_bytes=_cache_size(3) or 32 * 1024 * 1024,
        arch="native",
        vendor=_cpuinfo("vendor_id") or "",
    )


def _median_time(fn: Callable[[], Any], runs: int, calls: int = 1) -> tuple[float, float]:
    """Median over ``runs`` short runs (after one warm-up call) of each run's fastest of
    ``calls`` timed calls, in seconds, and the spread of the runs (slowest / fastest)."""
    fn()
    times = []
    for _ in range(runs):
        best = float("inf")
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        times.append(best)
    return statistics.median(times), max(times) / max(min(times), 1e-12)


def _onednn_gemm(a: Any, b: Any) -> Callable[[], Any] | None:
    """``a @ b.T`` through oneDNN's linear on a weight packed once (what the vendor module
    runs), or None where this PyTorch has no oneDNN."""
    import torch

    try:
        if not torch.backends.mkldnn.is_available():
            return None
        packed = torch.ops.mkldnn._reorder_linear_weight(b, a.shape[0])
        lin = torch.ops.mkldnn._linear_pointwise.default
        lin(a, packed, None, "none", [], "")
    except Exception:  # noqa: BLE001 - a private op's signature changed: torch.mm only
        return None
    return lambda: lin(a, packed, None, "none", [], "")


def measure_cpu(runs: int = RUNS) -> Measurement:
    """Peak fp32 GFLOP/s (a 1024^3 GEMM) and triad bandwidth in GB/s (three 128 MiB
    arrays, far beyond the caches), through the framework: the median of :data:`RUNS`
    short runs of each (0.5-1 s in all on the 2-core host). The GEMM is the faster of
    ``torch.mm`` (MKL) and oneDNN's linear: on AMD, MKL's sgemm reached 214 GFLOP/s where
    oneDNN reached 470 (the peers and the vendor module run oneDNN). The operands are
    constant-filled: their values do not change the speed, and random filling would take
    longer."""
    import torch

    n = 1024
    a, b = torch.full((n, n), 0.5), torch.full((n, n), 0.25)
    c = torch.empty(n, n)
    t_gemm, s_gemm = _median_time(lambda: torch.mm(a, b, out=c), runs, CALLS_PER_RUN)
    onednn = _onednn_gemm(a, b)
    if onednn is not None:
        t_dnn, s_dnn = _median_time(onednn, runs, CALLS_PER_RUN)
        if t_dnn < t_gemm:
            t_gemm, s_gemm = t_dnn, s_dnn
    m = 32 * 1024 * 1024
    x, y, z = torch.full((m,), 0.5), torch.full((m,), 0.25), torch.empty(m)
    triad = lambda: torch.add(x, y, alpha=3.0, out=z)  # noqa: E731
    t_triad, s_triad = _median_time(triad, runs, CALLS_PER_RUN)
    return Measurement(2 * n**3 / t_gemm / 1e9, 3 * 4 * m / t_triad / 1e9, max(s_gemm, s_triad))


def _read_cache(path: Path | None, static: dict[str, Any]) -> Hardware | None:
    """A cached measurement of this machine younger than :data:`CACHE_SECONDS`
    (:data:`NOISY_CACHE_SECONDS` for a noisy one)."""
    if path is None or not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        when = float(data.pop("measured_at"))
        noisy = float(data.pop("spread")) > MAX_SPREAD
        too_old = time.time() - when > (NOISY_CACHE_SECONDS if noisy else CACHE_SECONDS)
        if too_old or any(data.get(k) != v for k, v in static.items()):
            return None
        hw = Hardware(**data)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if out_of_bounds("cpu", hw.peak_gflops, hw.bandwidth_gbs):
        return None
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(when))
    return dataclasses.replace(hw, detail=f"{hw.detail}, cached {stamp}")


# This process's measurements by cache file (each optimize() call does not measure again,
# also where a failed measurement left nothing on disk).
_MEASURED: dict[str, Hardware] = {}


def detect_cpu(cache_dir: Path | None, measure: bool = True, pinned: Any = None) -> Hardware:
    """The CPU's description: pinned, else measured (cached in
    ``cache_dir/hardware-cpu-v3.json``), else the documented defaults, saying why."""
    static = cpu_static()
    if pinned is not None:
        return _pinned(static, pinned, CPU_DEFAULTS, "the documented defaults")
    if not measure:
        return Hardware(**static, **CPU_DEFAULTS, detail="measure_hardware=False")
    path = Path(cache_dir) / CACHE_FILE if cache_dir else None
    memo = _MEASURED.get(str(path))
    if memo is not None and all(getattr(memo, k) == v for k, v in static.items()):
        return memo  # this process measured already (a failed one is not on disk)
    hw = _read_cache(path, static) or _measure_or_defaults(static, path)
    _MEASURED[str(path)] = hw
    return hw


def _measure_or_defaults(static: dict[str, Any], path: Path | None) -> Hardware:
    """A new measurement (cached in ``path`` when quiet), or the documented defaults with a
    warning when it failed or gave implausible figures."""
    try:
        m = measure_cpu()
        bad = out_of_bounds("cpu", m.gflops, m.gbs)
    except Exception as e:  # noqa: BLE001 - a failed measurement falls back, and says so
        m, bad = None, f"failed ({type(e).__name__}: {e})"
    if m is None or bad:
        why = f"the hardware measurement {'' if m is None else 'gave '}{bad}"
        warnings.warn(
            f"middleware: {why}; using the documented defaults {CPU_DEFAULTS} "
            "(pin the figures with Options(hardware=...) or $MIDDLEWARE_HARDWARE)",
            RuntimeWarning,
            stacklevel=3,
        )
        return Hardware(**static, **CPU_DEFAULTS, detail=f"{why}; documented defaults")
    hw = Hardware(
        **static,
        peak_gflops=round(m.gflops, 1),
        bandwidth_gbs=round(m.gbs, 1),
        measured=True,
        source="measured",
        detail=f"median of {RUNS} short GEMM and triad runs, spread {m.spread:.2f}",
    )
    if path is not None:  # a noisy one expires within the hour (_read_cache)
        record = {**dataclasses.asdict(hw), "measured_at": time.time(), "spread": m.spread}
        _write_json_atomic(path, record)
    return hw


# FP32 lanes per streaming multiprocessor by compute capability (CUDA programming guide,
# "arithmetic instructions"); 128 for the architectures after the table.
FP32_LANES = {(6, 0): 64, (7, 0): 64, (7, 2): 64, (7, 5): 64, (8, 0): 64}
# A clock for an SM count when the device reports none and nothing is measured: figures of
# the device itself, estimated, rather than another GPU's.
NOMINAL_SM_CLOCK_KHZ = 1_400_000


def cuda_figures(props: Any, measured: Measurement | None = None) -> tuple[float, float, str]:
    """(GFLOP/s, GB/s, how) of a CUDA device from its properties (``clock_rate`` and
    ``memory_clock_rate`` in kHz, ``memory_bus_width`` in bits, as
    ``torch.cuda.get_device_properties`` gives them); a figure the properties lack comes
    from ``measured`` when given, else from the SM count at a nominal clock.

    Checked on an H200 (torch 2.11): the properties give 66.9 TFLOP/s and 4814 GB/s, the
    data sheet's peaks (67 TFLOP/s fp32, 4.8 TB/s); :func:`measure_cuda` there measured
    48.9 TFLOP/s and 3957 GB/s in 0.4 s (the A100 defaults said 19.5 and 1500)."""
    how = []
    lanes = FP32_LANES.get((props.major, props.minor), 64 if props.major < 8 else 128)
    clock = int(getattr(props, "clock_rate", 0) or 0)
    if clock > 0:
        gflops = props.multi_processor_count * lanes * 2 * clock * 1e3 / 1e9
        how.append("FLOP/s from SMs x FP32 lanes x clock")
    elif measured is not None:
        gflops = measured.gflops
        how.append("FLOP/s measured (median GEMM)")
    else:
        gflops = props.multi_processor_count * lanes * 2 * NOMINAL_SM_CLOCK_KHZ * 1e3 / 1e9
        how.append("FLOP/s from SMs x FP32 lanes at a nominal 1.4 GHz")
    mem_clock = int(getattr(props, "memory_clock_rate", 0) or 0)
    bus = int(getattr(props, "memory_bus_width", 0) or 0)
    if mem_clock > 0 and bus > 0:  # double data rate: two transfers per clock
        gbs = 2 * mem_clock * 1e3 * bus / 8 / 1e9
        how.append("bandwidth from memory clock x bus width")
    elif measured is not None:
        gbs = measured.gbs
        how.append("bandwidth measured (median triad)")
    else:
        raise ValueError("the device reports no memory clock or bus width; measure it")
    return gflops, gbs, "; ".join(how)


def measure_cuda(runs: int = 5) -> Measurement:
    """Median fp32 GEMM (4096^3) GFLOP/s and triad (64 Mi floats) GB/s on the current CUDA
    device (a short measurement for properties the device does not report)."""
    import torch

    dev = torch.device("cuda")
    n, m = 4096, 64 * 1024 * 1024
    a, b, c = (torch.full((n, n), v, device=dev) for v in (0.5, 0.25, 0.0))
    x, y, z = (torch.full((m,), v, device=dev) for v in (0.5, 0.25, 0.0))

    def synced(fn: Callable[[], Any]) -> Callable[[], Any]:
        return lambda: (fn(), torch.cuda.synchronize())

    t_gemm, s_gemm = _median_time(synced(lambda: torch.mm(a, b, out=c)), runs)
    t_triad, s_triad = _median_time(synced(lambda: torch.add(x, y, alpha=3.0, out=z)), runs)
    return Measurement(2 * n**3 / t_gemm / 1e9, 3 * 4 * m / t_triad / 1e9, max(s_gemm, s_triad))


def cuda_static(props: Any) -> dict[str, Any]:
    """What the device's properties say besides the figures."""
    l2 = int(getattr(props, "L2_cache_size", 0) or 0)
    smem = int(getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024)
    return dict(
        kind="cuda",
        name=props.name,
        cores=props.multi_processor_count,
        simd_bytes=32 * 4,
        l1_bytes=128 * 1024,
        l2_bytes=l2 or 40 * 1024 * 1024,
        l3_bytes=0,
        warp_size=int(getattr(props, "warp_size", 32) or 32),
        shared_mem_bytes=smem,
        arch=f"sm_{props.major}{props.minor}",
    )


def cuda_hardware(props: Any, measured: Measurement | None = None, pinned: Any = None) -> Hardware:
    """A CUDA device's description from its properties (see :func:`cuda_figures`); a pin
    overrides the fields it names."""
    static = cuda_static(props)
    if pinned is not None and {"peak_gflops", "bandwidth_gbs"} <= pin_fields(pinned).keys():
        return _pinned(static, pinned, {}, "")
    gflops, gbs, how = cuda_figures(props, measured)
    bad = out_of_bounds("cuda", gflops, gbs)
    if bad:
        raise ValueError(f"implausible figures for {props.name}: {bad}")
    figures = dict(peak_gflops=round(gflops, 1), bandwidth_gbs=round(gbs, 1))
    if pinned is not None:
        return _pinned(static, pinned, figures, f"the device's ({how})")
    return Hardware(**static, **figures, measured=measured is not None, source="device", detail=how)


def detect_cuda(cache_dir: Path | None, measure: bool = True, pinned: Any = None) -> Hardware:
    """The current CUDA device's description: properties first, a short measurement for
    what they lack (when ``measure``)."""
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    try:
        return cuda_hardware(props, None, pinned)
    except ValueError:
        if not measure:
            raise
    return cuda_hardware(props, measure_cuda(), pinned)


def hardware_from_env() -> tuple[tuple[str, Any], ...] | None:
    """``$MIDDLEWARE_HARDWARE``: a JSON object of ``Hardware`` fields that pins the figures
    (e.g. ``{"peak_gflops": 500, "bandwidth_gbs": 40}``), as ``Options`` keeps it; None unset."""
    text = os.environ.get("MIDDLEWARE_HARDWARE", "").strip()
    if not text:
        return None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"$MIDDLEWARE_HARDWARE is not JSON ({e}): {text!r}") from None
    return hardware_pin(data)


def hardware_pin(value: Any) -> Hardware | tuple[tuple[str, Any], ...] | None:
    """A pin, checked (unknown fields, implausible figures raise ValueError) and hashable:
    a ``Hardware`` as it is, a mapping as sorted (field, value) pairs."""
    if value is None:
        return None
    fields = pin_fields(value)
    return value if isinstance(value, Hardware) else tuple(sorted(fields.items()))


def detect(
    device: str, cache_dir: Path | None, measure: bool = True, pinned: Any = None
) -> Hardware:
    """The description of ``device`` ("cpu" or "cuda[:i]"). ``pinned``: the figures to use
    (``Options.hardware``); None reads ``$MIDDLEWARE_HARDWARE``."""
    if pinned is None:
        pinned = hardware_from_env()
    if device.startswith("cuda"):
        return detect_cuda(cache_dir, measure, pinned)
    return detect_cpu(cache_dir, measure, pinned)


def for_options(options: Any) -> Hardware:
    """The hardware an ``Options`` record asks for (its device, cache, measuring, pin)."""
    return detect(options.device, options.cache_dir, options.measure_hardware, options.hardware)


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
