"""The persistent kernel cache (backends/cache.py) and the x86 build helpers
(backends/x86/build.py): keys, hits and misses, meta.json, atomic concurrent builds from two
processes, corruption detection, compile errors, build_many, and real C kernels called
through ctypes against PyTorch."""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import hashlib
import json
import multiprocessing
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest

import middleware
from middleware.backends import cache as cache_mod
from middleware.backends.cache import (
    BuildRequest,
    CachedKernel,
    KernelCache,
    compiler_version,
    kernel_cache,
)
from middleware.backends.x86 import build as x86_build
from middleware.backends.x86.build import (
    c_build_request,
    c_compiler,
    ispc_available,
    ispc_build_request,
    load_shared,
)
from middleware.errors import CompileError

# y[i] = x[i] * a + b, written so that a wrong argument order gives wrong numbers.
AXPB = """
void axpb(const float *x, float *y, float a, float b, long n) {
    #pragma omp parallel for simd
    for (long i = 0; i < n; ++i) y[i] = x[i] * a + b;
}
"""

# Inference batch-norm folded to a per-channel affine, then ReLU, NCHW, OpenMP over (n, c).
BN_RELU = """
#include <math.h>
void bn_relu(const float *x, float *y, const float *scale, const float *shift,
             int n, int c, int hw) {
    #pragma omp parallel for collapse(2)
    for (int in = 0; in < n; ++in)
        for (int ic = 0; ic < c; ++ic) {
            const float *xs = x + ((long)in * c + ic) * hw;
            float *ys = y + ((long)in * c + ic) * hw;
            const float s = scale[ic], t = shift[ic];
            #pragma omp simd
            for (int i = 0; i < hw; ++i) ys[i] = fmaxf(xs[i] * s + t, 0.0f);
        }
}
"""

# Softmax over the last axis of a (rows, cols) matrix.
SOFTMAX = """
#include <math.h>
void softmax_rows(const float *x, float *y, int rows, int cols) {
    #pragma omp parallel for
    for (int r = 0; r < rows; ++r) {
        const float *xr = x + (long)r * cols;
        float *yr = y + (long)r * cols;
        float m = -INFINITY, s = 0.0f;
        for (int i = 0; i < cols; ++i) m = fmaxf(m, xr[i]);
        for (int i = 0; i < cols; ++i) { yr[i] = expf(xr[i] - m); s += yr[i]; }
        for (int i = 0; i < cols; ++i) yr[i] /= s;
    }
}
"""

FLOAT_P = ctypes.POINTER(ctypes.c_float)


def _ptr(a: np.ndarray) -> ctypes._Pointer:
    assert a.dtype == np.float32 and a.flags.c_contiguous
    return a.ctypes.data_as(FLOAT_P)


def _call_axpb(binary: Path, x: np.ndarray, a: float, b: float) -> np.ndarray:
    fn = load_shared(binary).axpb
    fn.restype = None
    fn.argtypes = [FLOAT_P, FLOAT_P, ctypes.c_float, ctypes.c_float, ctypes.c_long]
    y = np.empty_like(x)
    fn(_ptr(x), _ptr(y), a, b, x.size)
    return y


def _axpb_source(tag: int) -> str:
    """Distinct sources (hence distinct keys) computing the same function."""
    return f"/* variant {tag} */\n" + AXPB


def _check_axpb(binary: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(1003).astype(np.float32)
    # Tolerance: gcc may contract x * a + b into one fused multiply-add (one rounding).
    y = _call_axpb(binary, x, 1.5, -0.25)
    np.testing.assert_allclose(y, x * 1.5 - 0.25, rtol=1e-6, atol=1e-6)


def _meta(kernel: CachedKernel) -> dict:
    return json.loads((kernel.folder / "meta.json").read_text())


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


# ---- hits, misses, keys ---------------------------------------------------------------------


def test_miss_then_hit_and_one_instance_per_root(root: Path) -> None:
    cache = kernel_cache(root)
    assert kernel_cache(root) is cache
    assert kernel_cache(root / ".." / "cache") is cache
    req = c_build_request("axpb", AXPB)
    assert cache.lookup(req) is None
    first = cache.build(req)
    assert first.compiled and first.rebuilt_reason == "" and first.compile_seconds > 0
    assert first.folder.parent == root.resolve() / "kernels"
    assert first.folder.name == f"axpb-{first.key[:16]}"
    assert first.binary == first.folder / "kernel.so" and first.binary.is_file()
    assert first.source_path == first.folder / "kernel.c"
    assert first.source_path.read_text() == AXPB
    second = cache.build(req)
    assert not second.compiled and second.binary == first.binary and second.key == first.key
    assert cache.lookup(req) == second
    # A fresh instance (as in a new process) verifies the files and hits too.
    third = KernelCache(root).build(req)
    assert not third.compiled and third.compile_seconds == pytest.approx(
        first.compile_seconds, abs=1e-5
    )
    _check_axpb(third.binary)


def test_key_covers_everything_that_changes_the_binary(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = KernelCache(root)
    req = c_build_request("axpb", AXPB, key_extra=("opts-a",))
    key = cache.key(req)
    assert len(key) == 64 and int(key, 16) >= 0
    assert cache.key(dataclasses.replace(req)) == key
    variants = {
        "source": dataclasses.replace(req, source=AXPB + "\n"),
        "command": dataclasses.replace(req, command=(*req.command[:-1], "-O2")),
        "key_extra": dataclasses.replace(req, key_extra=("opts-b",)),
        "steps": dataclasses.replace(req, steps=(("true",),)),
        "extra_files": dataclasses.replace(req, extra_files=(("x.h", "#define X 1"),)),
        "binary_name": dataclasses.replace(req, binary_name="other.so"),
    }
    keys = {what: cache.key(r) for what, r in variants.items()}
    for what, other in keys.items():
        assert other != key, what
    assert len(set(keys.values())) == len(keys)
    # meta only describes the kernel: not part of the key.
    assert cache.key(dataclasses.replace(req, meta={"group": 7})) == key
    # The package version and the compiler's version are part of the key.
    monkeypatch.setattr(middleware.version, "__version__", "99.0")
    assert KernelCache(root).key(req) != key
    monkeypatch.undo()
    assert KernelCache(root).key(req) == key
    real_text = cache_mod.compiler_version_text(req.compiler)
    monkeypatch.setitem(cache_mod._versions, req.compiler, "cc (imaginary) 99")
    assert KernelCache(root).key(req) != key
    # The whole --version output counts (nvcc's release is on a later line than the first).
    first = real_text.splitlines()[0]
    monkeypatch.setitem(cache_mod._versions, req.compiler, first + "\nrelease 99.9")
    assert compiler_version(req.compiler) == first.strip()
    assert KernelCache(root).key(req) != key


def test_compiler_version_is_first_line_and_memoised(monkeypatch: pytest.MonkeyPatch) -> None:
    cc = c_compiler()
    expected = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    assert compiler_version(cc) == expected.splitlines()[0].strip()
    calls = []
    real_run = subprocess.run

    def counting_run(*args, **kwargs):
        calls.append(args)
        return real_run(*args, **kwargs)

    monkeypatch.setattr(cache_mod.subprocess, "run", counting_run)
    compiler_version(cc)
    assert calls == []
    with pytest.raises(CompileError, match="cannot run the compiler"):
        compiler_version("no-such-compiler-xyz")


def test_meta_json_contents(root: Path) -> None:
    meta_in = {"group": "g3", "layers": ["bn1", "relu1"], "shapes": [[2, 3, 5, 7]]}
    req = c_build_request("g3_bn_relu", BN_RELU, meta=meta_in, key_extra=("k",))
    kernel = KernelCache(root).build(req)
    meta = _meta(kernel)
    data = kernel.binary.read_bytes()
    assert meta["name"] == "g3_bn_relu"
    assert meta["key"] == kernel.key
    assert meta["sha256"] == hashlib.sha256(data).hexdigest()
    assert meta["size"] == len(data)
    assert meta["command"] == list(req.command)
    assert meta["commands"] == [
        [
            c_compiler(),
            "-O3",
            "-march=native",
            "-fopenmp",
            "-shared",
            "-fPIC",
            "-o",
            str(kernel.binary),
            str(kernel.source_path),
            "-lm",
        ]
    ]
    assert meta["compiler"] == req.compiler
    assert meta["compiler_version"] == compiler_version(req.compiler)
    assert meta["compiler_version_text"].splitlines()[0] == meta["compiler_version"]
    assert meta["package_version"] == middleware.__version__
    assert meta["key_extra"] == list(req.key_extra)
    assert 0 < meta["compile_seconds"] == pytest.approx(kernel.compile_seconds, abs=1e-5)
    assert meta["meta"] == meta_in
    # Only the source, the binary, meta.json and the lock: no temporaries left behind.
    assert sorted(p.name for p in kernel.folder.iterdir()) == [
        ".lock",
        "kernel.c",
        "kernel.so",
        "meta.json",
    ]


def test_request_validation_and_coercion() -> None:
    req = c_build_request("axpb", AXPB)
    as_lists = dataclasses.replace(req, command=list(req.command), key_extra=list(req.key_extra))
    assert as_lists == req and hash(as_lists) == hash(req)
    with pytest.raises(ValueError, match="non-empty"):
        dataclasses.replace(req, command=())
    with pytest.raises(ValueError, match="plain file name"):
        dataclasses.replace(req, binary_name="../escape.so")
    with pytest.raises(ValueError, match="plain file name"):
        dataclasses.replace(req, binary_name="meta.json")
    with pytest.raises(ValueError, match="plain file name"):
        dataclasses.replace(req, extra_files=(("kernel.c", "x"),))
    with pytest.raises(ValueError, match="dot"):
        dataclasses.replace(req, suffix="c")


def test_threads_of_one_process_compile_once(root: Path) -> None:
    req = c_build_request("threads", "/* threads */\n" + AXPB)
    caches = [KernelCache(root), KernelCache(root)]  # two instances: the file lock still holds
    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(lambda i: caches[i % 2].build(req), range(6)))
    assert [k.compiled for k in results].count(True) == 1
    assert len({k.binary for k in results}) == 1
    _check_axpb(results[0].binary)


def test_same_source_under_two_names_gets_two_folders(root: Path) -> None:
    cache = KernelCache(root)
    a, b = c_build_request("first", AXPB), c_build_request("second", AXPB)
    assert cache.key(a) == cache.key(b)  # the name only names the folder
    ka, kb = cache.build(a), cache.build(b)
    assert ka.folder != kb.folder and ka.compiled and kb.compiled
    assert _meta(kb)["name"] == "second"
    both = cache.build_many([a, b, a])
    assert [k.folder for k in both] == [ka.folder, kb.folder, ka.folder]
    assert not any(k.compiled for k in both)


def test_folder_name_is_sanitised(root: Path) -> None:
    kernel = KernelCache(root).build(c_build_request("../g 1/bn+relu", AXPB))
    assert kernel.folder.parent == root / "kernels"
    assert kernel.folder.name.startswith("g_1_bn_relu-")


def test_verified_key_is_not_rehashed_in_process(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = KernelCache(root)
    req = c_build_request("axpb", AXPB)
    cache.build(req)
    fresh = KernelCache(root)
    hashes = []
    real = cache_mod._sha256_file

    def counting(path: Path) -> str:
        hashes.append(path)
        return real(path)

    monkeypatch.setattr(cache_mod, "_sha256_file", counting)
    assert not fresh.build(req).compiled
    assert len(hashes) == 1  # verified once
    for _ in range(3):
        assert not fresh.build(req).compiled
        assert fresh.lookup(req) is not None
    assert len(hashes) == 1  # never again while the file is unchanged


# ---- corruption -----------------------------------------------------------------------------


def _corrupt_flip(kernel: CachedKernel) -> None:
    data = bytearray(kernel.binary.read_bytes())
    data[len(data) // 2] ^= 0xFF
    kernel.binary.write_bytes(bytes(data))


def _corrupt_truncate(kernel: CachedKernel) -> None:
    with open(kernel.binary, "r+b") as f:
        f.truncate(kernel.binary.stat().st_size // 3)


def _corrupt_meta_missing(kernel: CachedKernel) -> None:
    (kernel.folder / "meta.json").unlink()


def _corrupt_meta_garbage(kernel: CachedKernel) -> None:
    (kernel.folder / "meta.json").write_text('{"sha256": "ab')


def _corrupt_binary_missing(kernel: CachedKernel) -> None:
    kernel.binary.unlink()


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (_corrupt_flip, "sha256"),
        (_corrupt_truncate, "truncated"),
        (_corrupt_meta_missing, "meta.json missing"),
        (_corrupt_meta_garbage, "unreadable"),
        (_corrupt_binary_missing, "missing"),
    ],
)
@pytest.mark.parametrize("same_instance", [False, True])
def test_corrupt_binary_is_detected_rebuilt_and_reported(
    root: Path, corrupt, reason: str, same_instance: bool
) -> None:
    cache = KernelCache(root)
    req = c_build_request("axpb", AXPB)
    good = cache.build(req)
    good_sha = _meta(good)["sha256"]
    corrupt(good)
    if same_instance and good.binary.exists():
        # The in-memory entry notices a change by size or modification time; file clocks
        # are coarse (a few ms), so give the modification a distinct time as a later one has.
        os.utime(good.binary, ns=(0, 0))
    leftover = good.folder / ".kernel.so.4242.deadbeef.partial"  # from a process that died
    leftover.write_bytes(b"half a binary")
    other = cache if same_instance else KernelCache(root)
    assert other.lookup(req) is None  # never returned as-is
    with pytest.warns(RuntimeWarning, match="kernel cache: .*rebuilding"):
        rebuilt = other.build(req)
    assert rebuilt.compiled
    assert reason in rebuilt.rebuilt_reason
    meta = _meta(rebuilt)
    assert meta["sha256"] == hashlib.sha256(rebuilt.binary.read_bytes()).hexdigest()
    assert meta["sha256"] == good_sha  # gcc is deterministic for one source and command
    assert meta["rebuilt_reason"] == rebuilt.rebuilt_reason
    assert not leftover.exists()
    # And the rebuilt binary is a hit afterwards, with no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = KernelCache(root).build(req)
    assert not again.compiled and again.rebuilt_reason == ""
    _check_axpb(again.binary)


def test_meta_of_another_key_is_rejected(root: Path) -> None:
    cache = KernelCache(root)
    req = c_build_request("axpb", AXPB)
    kernel = cache.build(req)
    meta = _meta(kernel)
    meta["key"] = "0" * 64
    (kernel.folder / "meta.json").write_text(json.dumps(meta))
    assert KernelCache(root).lookup(req) is None
    with pytest.warns(RuntimeWarning, match="belongs to key"):
        assert KernelCache(root).build(req).compiled


# ---- compile failures -----------------------------------------------------------------------


def test_compile_error_carries_stderr_command_and_source(root: Path) -> None:
    cache = KernelCache(root)
    bad = "void broken(float *x) { x[0] = undeclared_name; }\n"
    req = c_build_request("g9_broken", bad)
    with pytest.raises(CompileError) as info:
        cache.build(req)
    err = info.value
    assert "undeclared_name" in err.stderr and "error" in err.stderr
    source = Path(err.source_path)
    assert source.read_text() == bad
    assert source == cache.folder(req) / "kernel.c"
    assert err.command[0] == c_compiler()
    assert str(source) in err.command and str(cache.folder(req) / "kernel.so") in err.command
    assert not any("{" in arg for arg in err.command)
    assert "reproduce with:" in str(err) and str(source) in str(err)
    # The folder keeps the source and the error, never a binary or meta.json.
    names = {p.name for p in source.parent.iterdir()}
    assert names == {".lock", "kernel.c", "compile_error.txt"}
    assert "undeclared_name" in (source.parent / "compile_error.txt").read_text()
    # The printed command reproduces the failure by hand.
    proc = subprocess.run(err.command, capture_output=True, text=True)
    assert proc.returncode != 0 and "undeclared_name" in proc.stderr
    # Failures are not cached: fixing nothing fails again; a lookup is a miss.
    assert cache.lookup(req) is None
    with pytest.raises(CompileError):
        cache.build(req)


def test_missing_compiler_raises_compile_error(root: Path) -> None:
    with pytest.raises(CompileError, match="no C compiler"):
        c_compiler("no-such-cc-xyz")
    req = dataclasses.replace(c_build_request("axpb", AXPB), compiler="no-such-cc-xyz")
    with pytest.raises(CompileError, match="no-such-cc-xyz"):
        KernelCache(root).build(req)


def test_command_producing_no_binary_is_an_error(root: Path) -> None:
    req = BuildRequest(
        name="nothing",
        source=AXPB,
        suffix=".c",
        command=(c_compiler(), "-fsyntax-only", "{src}"),
        binary_name="kernel.so",
        compiler=c_compiler(),
    )
    with pytest.raises(CompileError, match="produced no binary"):
        KernelCache(root).build(req)
    assert not (KernelCache(root).folder(req) / "meta.json").exists()


# ---- build_many -----------------------------------------------------------------------------


def test_build_many_order_failures_duplicates_and_threads(
    root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    cache = KernelCache(root)
    good = [c_build_request(f"k{i}", _axpb_source(i)) for i in range(6)]
    bad = c_build_request("bad", "int broken( {\n")
    cache.build(good[0])  # one hit
    reqs = [good[3], bad, good[0], good[1], good[2], good[3], good[4], good[5]]

    pools = []
    real_pool = cache_mod.concurrent.futures.ThreadPoolExecutor

    class RecordingPool(real_pool):
        def __init__(self, max_workers=None, **kwargs):
            pools.append(max_workers)
            super().__init__(max_workers=max_workers, **kwargs)

    monkeypatch.setattr(cache_mod.concurrent.futures, "ThreadPoolExecutor", RecordingPool)
    results = cache.build_many(reqs)
    assert len(results) == len(reqs)
    assert pools and all(1 <= w <= (os.cpu_count() or 1) for w in pools)
    assert isinstance(results[1], CompileError) and "broken" in results[1].stderr
    for req, res in zip(reqs, results, strict=True):
        if req is bad:
            continue
        assert isinstance(res, CachedKernel)
        assert res.key == cache.key(req) and res.source_path.read_text() == req.source
        _check_axpb(res.binary)
    assert not results[2].compiled  # the earlier hit
    # good[3] appears twice: compiled once.
    assert [results[0].compiled, results[5].compiled].count(True) == 1
    assert all(results[i].compiled for i in (3, 4, 6, 7))
    # More than three compiled: a progress bar was shown (tqdm writes to stderr).
    assert "compiling kernels" in capsys.readouterr().err
    # A second call compiles nothing and shows no bar.
    again = cache.build_many([r for r in reqs if r is not bad])
    assert not any(k.compiled for k in again)
    assert "compiling kernels" not in capsys.readouterr().err


def test_build_many_no_progress_for_few(root: Path, capsys: pytest.CaptureFixture) -> None:
    cache = KernelCache(root)
    out = cache.build_many([c_build_request(f"s{i}", _axpb_source(100 + i)) for i in range(3)])
    assert all(k.compiled for k in out)
    assert "compiling kernels" not in capsys.readouterr().err
    assert cache.build_many([]) == []


# ---- several processes ----------------------------------------------------------------------


def _child_build(root: str, source: str, barrier, queue) -> None:
    """Runs in a spawned process: build the kernel, call it, report what happened."""
    try:
        if barrier is not None:
            barrier.wait(timeout=120)
        kernel = kernel_cache(Path(root)).build(c_build_request("twin", source))
        x = np.arange(64, dtype=np.float32)
        y = _call_axpb(kernel.binary, x, 2.0, 1.0)
        queue.put(
            {
                "compiled": kernel.compiled,
                "sha": hashlib.sha256(kernel.binary.read_bytes()).hexdigest(),
                "ok": bool(np.array_equal(y, x * 2 + 1)),
                "binary": str(kernel.binary),
            }
        )
    except BaseException as exc:  # report, do not hang the parent
        queue.put({"error": repr(exc)})


def _run_children(root: Path, source: str, count: int, together: bool) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    barrier = ctx.Barrier(count) if together else None
    results = []
    procs = []
    for _ in range(count):
        p = ctx.Process(target=_child_build, args=(str(root), source, barrier, queue))
        p.start()
        procs.append(p)
        if not together:
            results.append(queue.get(timeout=180))
            p.join(timeout=60)
    if together:
        results = [queue.get(timeout=180) for _ in range(count)]
        for p in procs:
            p.join(timeout=60)
    for p in procs:
        assert p.exitcode == 0
    for r in results:
        assert "error" not in r, r
    return results


def test_two_processes_building_the_same_kernel_at_once(root: Path) -> None:
    source = "/* twins */\n" + AXPB + BN_RELU + SOFTMAX  # a little longer to compile
    results = _run_children(root, source, count=2, together=True)
    assert all(r["ok"] for r in results)
    assert [r["compiled"] for r in results].count(True) == 1  # the other waited and hit
    assert results[0]["binary"] == results[1]["binary"]
    kernel = KernelCache(root).lookup(c_build_request("twin", source))
    assert kernel is not None and not kernel.compiled
    meta_sha = _meta(kernel)["sha256"]
    assert all(r["sha"] == meta_sha for r in results)
    assert not [p for p in kernel.folder.iterdir() if p.name.endswith((".tmp", ".partial"))]


def test_second_process_compiles_nothing(root: Path) -> None:
    source = "/* sequential */\n" + AXPB
    first, second = _run_children(root, source, count=2, together=False)
    assert first["compiled"] and not second["compiled"]
    assert first["sha"] == second["sha"] and first["ok"] and second["ok"]


# ---- real kernels through ctypes against PyTorch ---------------------------------------------


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 16, 1, 1), (3, 8, 13, 17)])
def test_bn_relu_kernel_matches_torch(root: Path, shape: tuple[int, int, int, int]) -> None:
    torch = pytest.importorskip("torch")
    n, c, h, w = shape
    torch.manual_seed(sum(shape))
    x = torch.randn(shape)
    mean, var = torch.randn(c), torch.rand(c) + 0.5
    weight, bias = torch.randn(c), torch.randn(c)
    eps = 1e-5
    expected = torch.relu(torch.nn.functional.batch_norm(x, mean, var, weight, bias, eps=eps))
    scale = (weight / torch.sqrt(var + eps)).numpy().astype(np.float32)
    shift = (bias - mean * weight / torch.sqrt(var + eps)).numpy().astype(np.float32)

    kernel = kernel_cache(root).build(
        c_build_request("bn_relu", BN_RELU, meta={"shapes": [list(shape)]})
    )
    fn = load_shared(kernel.binary).bn_relu
    fn.restype = None
    fn.argtypes = [FLOAT_P] * 4 + [ctypes.c_int] * 3
    xa = np.ascontiguousarray(x.numpy())
    y = np.full_like(xa, np.nan)
    fn(_ptr(xa), _ptr(y), _ptr(scale), _ptr(shift), n, c, h * w)
    # Tolerance: one fused multiply-add against PyTorch's normalise-then-scale.
    np.testing.assert_allclose(y, expected.numpy(), rtol=1e-5, atol=1e-5)
    assert (y >= 0).all() and (y == 0).any()


def test_softmax_kernel_matches_torch(root: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(3)
    x = torch.randn(37, 101) * 4
    kernel = kernel_cache(root).build(c_build_request("softmax", SOFTMAX))
    fn = load_shared(kernel.binary).softmax_rows
    fn.restype = None
    fn.argtypes = [FLOAT_P, FLOAT_P, ctypes.c_int, ctypes.c_int]
    xa = np.ascontiguousarray(x.numpy())
    y = np.empty_like(xa)
    fn(_ptr(xa), _ptr(y), *xa.shape)
    np.testing.assert_allclose(y, torch.softmax(x, dim=1).numpy(), rtol=1e-5, atol=1e-7)


def test_load_shared_once_per_path(root: Path) -> None:
    kernel = kernel_cache(root).build(c_build_request("axpb", AXPB))
    lib = load_shared(kernel.binary)
    assert load_shared(str(kernel.binary)) is lib
    assert load_shared(kernel.folder / ".." / kernel.folder.name / "kernel.so") is lib


def test_steps_and_dir_placeholder(root: Path) -> None:
    """A two-step build (object, then shared library) as the ISPC build uses."""
    cc = c_compiler()
    req = BuildRequest(
        name="two_step",
        source=AXPB,
        suffix=".c",
        command=(cc, "-O2", "-fPIC", "-fopenmp", "-c", "-o", "{dir}/part.o", "{src}"),
        binary_name="kernel.so",
        compiler=cc,
        steps=((cc, "-shared", "-fopenmp", "-o", "{out}", "{dir}/part.o", "{dir}/extra.c"),),
        extra_files=(("extra.c", "int extra_answer(void) { return 42; }\n"),),
    )
    kernel = KernelCache(root).build(req)
    assert (kernel.folder / "extra.c").is_file() and (kernel.folder / "part.o").is_file()
    lib = load_shared(kernel.binary)
    assert lib.extra_answer() == 42
    _check_axpb(kernel.binary)
    assert len(_meta(kernel)["commands"]) == 2


# ---- ISPC -----------------------------------------------------------------------------------

ISPC_SOURCE = """
export void axpb_ispc(uniform const float x[], uniform float y[], uniform float a,
                      uniform float b, uniform int n) {
    foreach (i = 0 ... n) y[i] = x[i] * a + b;
}
"""

# The C glue exposes the same entry point as AXPB (the ISPC header declares axpb_ispc).
ISPC_GLUE_C = """
#include "kernel_ispc.h"
void axpb(const float *x, float *y, float a, float b, long n) {
    axpb_ispc(x, y, a, b, (int)n);
}
"""


def test_ispc_request_shape() -> None:
    req = ispc_build_request("g1_ispc", ISPC_SOURCE, ISPC_GLUE_C, meta={"group": "g1"})
    assert req.suffix == ".ispc" and req.compiler == "ispc" and req.binary_name == "kernel.so"
    assert req.command[0] == "ispc" and "{src}" in req.command
    assert len(req.steps) == 1 and req.steps[0][0] == c_compiler()
    assert "{out}" in req.steps[0] and "{dir}/glue.c" in req.steps[0]
    assert req.extra_files == (("glue.c", ISPC_GLUE_C),)


def test_ispc_available_rejects_a_placeholder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "bin" / "ispc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'placeholder'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    x86_build.ispc_available.cache_clear()
    try:
        ok, reason = ispc_available()
        assert not ok and "not the Intel SPMD Program Compiler" in reason
    finally:
        x86_build.ispc_available.cache_clear()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    try:
        assert ispc_available() == (False, "no ispc binary on PATH")
    finally:
        x86_build.ispc_available.cache_clear()


def test_ispc_kernel_builds_and_matches(root: Path) -> None:
    ok, reason = ispc_available()
    if not ok:
        pytest.skip(f"ISPC build not tested: {reason}")
    kernel = KernelCache(root).build(ispc_build_request("axpb_ispc", ISPC_SOURCE, ISPC_GLUE_C))
    assert kernel.source_path.name == "kernel.ispc"
    _check_axpb(kernel.binary)


def test_rmtree_of_cache_is_a_clean_miss(root: Path) -> None:
    cache = KernelCache(root)
    req = c_build_request("axpb", AXPB)
    cache.build(req)
    shutil.rmtree(root)
    again = cache.build(req)  # the in-memory entry notices the binary is gone
    assert again.compiled and again.rebuilt_reason == ""
    _check_axpb(again.binary)
