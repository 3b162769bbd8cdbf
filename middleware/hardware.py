"""The ``Hardware`` description: what the passes and backends know of the machine.

Figures come from the machine itself: core count and cache sizes are read from the OS,
peak FLOP/s and memory bandwidth are measured once with a short micro-benchmark (an fp32
GEMM and a STREAM-like triad through the framework) and cached as JSON in the cache
directory. With measuring off, documented defaults are used (``CPU_DEFAULTS``: a 2-core
AVX-512 machine with a balance of about 10 FLOP/byte; ``GPU_DEFAULTS``: an A100-class GPU).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
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

    @property
    def balance(self) -> float:
        return self.peak_gflops / self.bandwidth_gbs

    @property
    def simd_floats(self) -> int:
        return max(1, self.simd_bytes // 4)

    def key(self) -> str:
        """What of the hardware changes generated code (for kernel cache keys)."""
        return (
            f"{self.kind}:{self.name}:{self.cores}:{self.simd_bytes}:{self.l1_bytes}:"
            f"{self.l2_bytes}:{self.arch}"
        )


# Documented defaults (used when measure_hardware=False or measuring fails): the figures
# measured on the project's 2-core Sapphire Rapids machine (shared/MEASURED.md).
CPU_DEFAULTS = dict(peak_gflops=220.0, bandwidth_gbs=21.0)
# An A100-class GPU: 19.5 TFLOP/s fp32, 1.5 TB/s.
GPU_DEFAULTS = dict(peak_gflops=19500.0, bandwidth_gbs=1500.0)


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


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


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
    )


def measure_cpu(seconds: float = 0.3) -> tuple[float, float]:
    """Peak fp32 GFLOP/s (GEMM) and triad bandwidth in GB/s, through the framework: the
    best of the calls that fit ``seconds`` (about 15 of each on a 2-core host). The
    operands are constant-filled: their values do not change the speed, and random
    filling would take longer than the measurement."""
    import torch

    n = 1024
    a, b = torch.full((n, n), 0.5), torch.full((n, n), 0.25)
    c = torch.empty(n, n)
    torch.mm(a, b, out=c)
    best = float("inf")
    t_end = time.perf_counter() + seconds / 2
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        best = min(best, time.perf_counter() - t0)
    gflops = 2 * n**3 / best / 1e9
    m = 32 * 1024 * 1024  # 128 MiB per array: far beyond the caches
    x, y, z = torch.full((m,), 0.5), torch.full((m,), 0.25), torch.empty(m)
    torch.add(x, y, alpha=3.0, out=z)
    best = float("inf")
    t_end = time.perf_counter() + seconds / 2
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        torch.add(x, y, alpha=3.0, out=z)
        best = min(best, time.perf_counter() - t0)
    gbs = 3 * 4 * m / best / 1e9
    return gflops, gbs


def detect_cpu(cache_dir: Path | None, measure: bool = True) -> Hardware:
    """The CPU's description; measured once and cached in ``cache_dir/hardware-cpu.json``."""
    static = cpu_static()
    if not measure:
        return Hardware(**static, **CPU_DEFAULTS)
    path = Path(cache_dir) / "hardware-cpu.json" if cache_dir else None
    if path is not None and path.exists():
        try:
            data = json.loads(path.read_text())
            if all(data.get(k) == v for k, v in static.items()):
                return Hardware(**data)
        except (OSError, ValueError, TypeError):
            pass
    try:
        gflops, gbs = measure_cpu()
    except Exception:  # noqa: BLE001 - a failed measurement falls back to the defaults
        return Hardware(**static, **CPU_DEFAULTS)
    hw = Hardware(
        **static, peak_gflops=round(gflops, 1), bandwidth_gbs=round(gbs, 1), measured=True
    )
    if path is not None:
        _write_json_atomic(path, dataclasses.asdict(hw))
    return hw


def detect_cuda(cache_dir: Path | None, measure: bool = True) -> Hardware:
    """The current CUDA device's description (properties from the framework)."""
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    major, minor = props.major, props.minor
    l2 = int(getattr(props, "L2_cache_size", 0) or 40 * 1024 * 1024)
    smem = int(getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024)
    return Hardware(
        kind="cuda",
        name=props.name,
        cores=props.multi_processor_count,
        simd_bytes=32 * 4,
        l1_bytes=128 * 1024,
        l2_bytes=l2,
        l3_bytes=0,
        warp_size=32,
        shared_mem_bytes=smem,
        arch=f"sm_{major}{minor}",
        **GPU_DEFAULTS,
    )


def detect(device: str, cache_dir: Path | None, measure: bool = True) -> Hardware:
    """The description of ``device`` ("cpu" or "cuda[:i]")."""
    if device.startswith("cuda"):
        return detect_cuda(cache_dir, measure)
    return detect_cpu(cache_dir, measure)


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
