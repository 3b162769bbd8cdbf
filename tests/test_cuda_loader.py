"""The cuda.bindings loader's calls, checked against a stand-in driver module (no GPU):
context set-up, module loading from the cubin bytes, and the kernelParams array that
cuLaunchKernel reads (an array of pointers to each argument's value)."""

from __future__ import annotations

import ctypes
import types

import pytest

from middleware.backends.cuda import loader as loader_mod
from middleware.errors import DeviceError

_real_direct_launch = loader_mod._direct_launch  # (the fixture below replaces it)


class FakeDriver:
    """Records calls; returns (0, handle) tuples like cuda.bindings.driver."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.current = 0
        self.launch_args: list[int] = []
        self.fail_launch = False

    def cuInit(self, flags):
        return (0,)

    def cuCtxGetCurrent(self):
        return (0, self.current)

    def cuDeviceGet(self, i):
        return (0, 100 + i)

    def cuDevicePrimaryCtxRetain(self, dev):
        self.calls.append(("retain", dev))
        return (0, 555)

    def cuCtxSetCurrent(self, ctx):
        self.current = ctx
        return (0,)

    def cuModuleLoadData(self, address):
        self.calls.append(("load", ctypes.string_at(address, 4)))
        return (0, "module")

    def cuModuleGetFunction(self, module, name):
        self.calls.append(("function", module, name))
        return (0, "fn")

    def CUstream(self, handle):
        return ("stream", handle)

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        n = 3
        slots = (ctypes.c_void_p * n).from_address(params)
        self.launch_args = [ctypes.c_void_p.from_address(slots[i]).value for i in range(n)]
        self.calls.append(("launch", f, gx, bx, smem, stream, extra))
        return (1 if self.fail_launch else 0,)

    def cuGetErrorString(self, err):
        return (0, b"planted error")


def _value(arg):
    """A pointer argument of the direct launch (a c_void_p) as an int."""
    return (arg.value or 0) if isinstance(arg, ctypes.c_void_p) else arg


@pytest.fixture
def fake(monkeypatch):
    driver = FakeDriver()
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = driver
    monkeypatch.setitem(__import__("sys").modules, "cuda.bindings", bindings)
    monkeypatch.setitem(__import__("sys").modules, "cuda.bindings.driver", driver)
    # the driver library's own cuLaunchKernel is not called here (a test machine with a
    # GPU would have one): the cuda.bindings path, unless a test plants its own
    monkeypatch.setattr(loader_mod, "_direct_launch", lambda: None)
    return driver


def test_cuda_bindings_loader_launches_with_a_pointer_array(fake):
    ld = loader_mod.CudaBindingsLoader()
    fn = ld.load(b"\x7fELF-cubin", "mw_kernel", 0)
    assert ("retain", 100) in fake.calls and fake.current == 555
    assert ("load", b"\x7fELF") in fake.calls
    assert ("function", "module", b"mw_kernel") in fake.calls
    ld.launch(fn, 7, 256, [0x1000, 0x2000, 0x3000], 42)
    assert fake.launch_args == [0x1000, 0x2000, 0x3000]
    assert ("launch", "fn", 7, 256, 0, ("stream", 42), 0) in fake.calls
    ld.launch(fn, 1, 32, [0x4000, 0x5000, 0x6000], 0)  # arrays reused, values refreshed
    assert fake.launch_args == [0x4000, 0x5000, 0x6000]


def test_direct_launch_passes_the_handles_and_a_per_thread_pointer_array(fake, monkeypatch):
    """The ctypes path (libcuda's cuLaunchKernel): the function's and the stream's raw
    handles, and a kernelParams array per thread, so that two threads launching at once
    never read each other's argument values."""
    import threading

    seen = []

    def direct(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        f, stream, params = _value(f), _value(stream), _value(params)
        slots = (ctypes.c_void_p * 2).from_address(params)
        values = [ctypes.c_void_p.from_address(slots[i]).value for i in range(2)]
        seen.append((f, gx, bx, smem, stream, extra, values, params))
        return 0

    monkeypatch.setattr(loader_mod, "_direct_launch", lambda: direct)
    ld = loader_mod.CudaBindingsLoader()
    ld.launch(0xF00, 3, 64, [0x10, 0x20], 7)
    assert seen[-1][:7] == (0xF00, 3, 64, 0, 7, None, [0x10, 0x20])
    other = threading.Thread(target=ld.launch, args=(0xF00, 1, 32, [0x30, 0x40], 0))
    other.start()
    other.join()
    assert seen[-1][6] == [0x30, 0x40] and seen[-1][7] != seen[0][7]
    assert not any(c[0] == "launch" for c in fake.calls)  # cuda.bindings' launch unused


def test_bound_launch_of_a_loaded_kernel(fake, monkeypatch):
    """LoadedKernel takes the loader's launch specialised to its function (``bind``): the
    handle converted once, the current stream of the kernel's device read at every launch,
    a kernelParams array per thread, errors named as in the generic path."""
    import threading

    seen = []

    def direct(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        f, stream, params = _value(f), _value(stream), _value(params)
        slots = (ctypes.c_void_p * 2).from_address(params)
        values = [ctypes.c_void_p.from_address(slots[i]).value for i in range(2)]
        seen.append((f, gx, bx, stream, values, params))
        return 7 if values[0] == 0xBAD else 0

    class Handle:  # a CUfunction that converts to its int handle
        def __int__(self):
            return 0xF00

    monkeypatch.setattr(loader_mod, "_direct_launch", lambda: direct)
    streams = iter([11, 12, 13, 14])
    monkeypatch.setattr(loader_mod, "current_stream_handle", lambda: lambda dev: next(streams))
    ld = loader_mod.CudaBindingsLoader()
    monkeypatch.setattr(ld, "load", lambda cubin, function, device: Handle())
    fake.CUresult = int
    kernel = loader_mod.LoadedKernel(b"cubin", "k", 2, ld)
    assert "launch" in vars(kernel)  # the bound form, not the method
    kernel.launch(5, 128, [0x10, 0x20])
    kernel.launch(6, 128, [0x30, 0x40])
    assert [s[:5] for s in seen] == [
        (0xF00, 5, 128, 11, [0x10, 0x20]),
        (0xF00, 6, 128, 12, [0x30, 0x40]),
    ]
    assert seen[0][5] == seen[1][5]  # one thread: its array reused
    other = threading.Thread(target=kernel.launch, args=(1, 32, [0x50, 0x60]))
    other.start()
    other.join()
    assert seen[-1][4] == [0x50, 0x60] and seen[-1][5] != seen[0][5]
    with pytest.raises(DeviceError, match="cuLaunchKernel"):
        kernel.launch(1, 32, [0xBAD, 0x1])


def test_cuda_bindings_errors_name_the_call(fake):
    ld = loader_mod.CudaBindingsLoader()
    fn = ld.load(b"\x7fELF", "k", 0)
    fake.fail_launch = True
    with pytest.raises(DeviceError, match="cuLaunchKernel failed.*planted error"):
        ld.launch(fn, 1, 32, [1, 2, 3], 0)


def test_pycuda_loader_uses_the_primary_context_and_the_default_stream(monkeypatch):
    import sys

    calls = []

    class Ctx:
        def push(self):
            calls.append("push")

    class Device:
        def __init__(self, i):
            calls.append(("device", i))

        def retain_primary_context(self):
            return Ctx()

    class Module:
        def get_function(self, name):
            def fn(*args, block, grid):
                calls.append(("launch", [int(a) for a in args], block, grid))

            return fn

    drv = types.ModuleType("pycuda.driver")
    drv.init = lambda: calls.append("init")
    drv.Device = Device
    drv.module_from_buffer = lambda data: calls.append(("load", data[:4])) or Module()
    pycuda = types.ModuleType("pycuda")
    pycuda.driver = drv
    monkeypatch.setitem(sys.modules, "pycuda", pycuda)
    monkeypatch.setitem(sys.modules, "pycuda.driver", drv)
    ld = loader_mod.PyCudaLoader()
    fn = ld.load(b"\x7fELF...", "k", 1)
    ld.launch(fn, 5, 128, [11, 22], 0)
    assert calls[:4] == ["init", ("device", 1), "push", ("load", b"\x7fELF")]
    assert calls[-1] == ("launch", [11, 22], (128, 1, 1), (5, 1, 1))


def test_generated_kernel_launches_through_a_loaded_kernel(monkeypatch):
    """The whole launch path a plan's step takes on a GPU (GeneratedKernel.out ->
    LoadedKernel.launch -> loader.launch) with a stand-in loader: the loaded function, the
    grid and block of the rendered launch, the tensors' pointers (inputs, then the output)
    and the current stream's raw handle on the kernel's device."""
    import torch
    from cuda_cases import CASES, FAKE_GPU, schedule_of

    from middleware.backends.cuda.kernel import GeneratedKernel
    from middleware.backends.cuda.render import render_schedule

    class StandInLoader:
        name = "stand-in"

        def __init__(self):
            self.launches = []

        def load(self, cubin, function, device):
            return ("function", function, device)

        def launch(self, fn, grid, block, ptrs, stream):
            self.launches.append((fn, grid, block, list(ptrs), stream))

    monkeypatch.setattr(loader_mod, "current_stream_handle", lambda: lambda device: 1000 + device)
    graph, names = CASES["relu"]("nchw")
    rendered = render_schedule(schedule_of(graph, names), FAKE_GPU, emulate=False)
    stand_in = StandInLoader()
    kernel = GeneratedKernel(rendered, loader_mod.LoadedKernel(b"cubin", "k", 3, stand_in))
    (t,) = rendered.in_types
    x = torch.randn(t.shape)
    y = torch.empty(rendered.out_types[0].shape)
    kernel.out(x, y)
    assert stand_in.launches == [
        (
            ("function", "k", 3),
            rendered.launch.grid,
            rendered.launch.block,
            [x.data_ptr(), y.data_ptr()],
            1003,
        )
    ]


_RECORDING_LAUNCH = r"""
#include <stdint.h>
typedef struct { uint64_t f, stream, params, extra, p0, p1; unsigned dims[7]; } seen_t;
seen_t seen;
int fake_launch(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                unsigned bz, unsigned smem, void *stream, void **params, void **extra) {
  unsigned d[7] = {gx, gy, gz, bx, by, bz, smem};
  for (int i = 0; i < 7; i++) seen.dims[i] = d[i];
  seen.f = (uint64_t)f; seen.stream = (uint64_t)stream;
  seen.params = (uint64_t)params; seen.extra = (uint64_t)extra;
  seen.p0 = *(uint64_t *)params[0]; seen.p1 = *(uint64_t *)params[1];
  return gx == 13 ? 701 : 0;
}
"""


def test_direct_launch_reaches_c_with_cuLaunchKernels_argument_types(fake, monkeypatch, tmp_path):
    """The direct path calls the driver without ctypes' argtypes: a C function of
    cuLaunchKernel's prototype, called the way the bound launch calls it, must get every
    argument whole (64-bit handles, stream and kernelParams, including those passed on the
    stack; unsigned sizes up to 2**32 - 1; NULL extra) and its error code back."""
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "launch.c"
    src.write_text(_RECORDING_LAUNCH)
    lib = tmp_path / "liblaunch.so"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)

    class Seen(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint64) for n in ("f", "stream", "params", "extra", "p0", "p1")]
        _fields_ += [("dims", ctypes.c_uint * 7)]

    direct = _real_direct_launch(str(lib), "fake_launch")
    assert direct is not None
    seen = Seen.in_dll(ctypes.CDLL(str(lib)), "seen")
    monkeypatch.setattr(loader_mod, "_direct_launch", lambda: direct)
    ld = loader_mod.CudaBindingsLoader()
    fake.CUresult = int
    handle, stream = 0x7F12_3456_789A, 0x5555_AAAA_0000_1238
    launch = ld.bind(handle, 0, lambda device: stream)
    big = 2**32 - 1
    launch(big, 1024, [0x7F00_0000_0010, 0x10_0000_0020])
    assert (seen.f, seen.stream, seen.extra) == (handle, stream, 0)
    assert list(seen.dims) == [big, 1, 1, 1024, 1, 1, 0]
    assert (seen.p0, seen.p1) == (0x7F00_0000_0010, 0x10_0000_0020)
    ld.launch(handle, 5, 32, [1, 2], stream)  # the generic method's direct call alike
    assert (seen.f, seen.stream, list(seen.dims)[:4], seen.p1) == (handle, stream, [5, 1, 1, 32], 2)
    with pytest.raises(DeviceError, match="cuLaunchKernel"):
        launch(13, 32, [1, 2])
