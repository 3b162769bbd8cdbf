"""Load a cubin and launch its kernels on PyTorch's current CUDA stream.

Two loaders, one interface (:class:`Loader`):

- ``pycuda`` (the optional extra ``middleware[cuda]``), used when it is installed. pycuda
  cannot wrap a stream it did not create, so a launch goes to the legacy default stream,
  which is PyTorch's default stream; when the current stream is another one, the launch
  waits for it and is waited for (correct, slower).
- ``cuda.bindings`` (cuda-python's driver API: ``cuModuleLoadData``, ``cuModuleGetFunction``,
  ``cuLaunchKernel``), which launches straight on ``torch.cuda.current_stream()``.

Both work in PyTorch's primary context on the tensors' device, so pointers from
``tensor.data_ptr()`` (the CUDA caching allocator) are passed as they are.
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from ...errors import DeviceError

INSTALL_HINT = (
    "install one of: pip install 'middleware[cuda]' (pycuda), or pip install cuda-python "
    "(cuda.bindings)"
)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package ("cuda") raises
        return False


def available_loaders() -> list[str]:
    """The loaders importable here, in the order they are preferred."""
    out = []
    if _importable("pycuda"):
        out.append("pycuda")
    if _importable("cuda.bindings"):
        out.append("cuda.bindings")
    return out


class Loader(Protocol):
    name: str

    def load(self, cubin: bytes, function: str, device: int) -> Any: ...

    def launch(self, fn: Any, grid: int, block: int, ptrs: Sequence[int], stream: int) -> None: ...


class CudaBindingsLoader:
    """cuda-python's driver API; launches on the given stream handle."""

    name = "cuda.bindings"

    def __init__(self) -> None:
        from cuda.bindings import driver

        self.cu = driver
        self._check(driver.cuInit(0)[0], "cuInit")
        self._images: list[Any] = []  # cubin buffers stay alive as long as their modules
        # kernelParams arrays, per thread (two threads launching at once must not overwrite
        # each other's argument values between filling them and the launch)
        self._local = threading.local()
        self._streams: dict[int, Any] = {}
        self._direct = _direct_launch()

    def _check(self, err: Any, what: str) -> None:
        if int(err) != 0:
            _, msg = self.cu.cuGetErrorString(err)
            text = msg.decode() if isinstance(msg, bytes) else str(msg)
            raise DeviceError(f"CUDA driver: {what} failed: {err} ({text})")

    def _ensure_context(self, device: int) -> None:
        cu = self.cu
        err, ctx = cu.cuCtxGetCurrent()
        self._check(err, "cuCtxGetCurrent")
        if int(ctx) != 0:
            return
        err, dev = cu.cuDeviceGet(device)
        self._check(err, "cuDeviceGet")
        err, ctx = cu.cuDevicePrimaryCtxRetain(dev)
        self._check(err, "cuDevicePrimaryCtxRetain")
        self._check(cu.cuCtxSetCurrent(ctx)[0], "cuCtxSetCurrent")

    def load(self, cubin: bytes, function: str, device: int) -> Any:
        self._ensure_context(device)
        image = ctypes.create_string_buffer(cubin, len(cubin))
        self._images.append(image)
        err, module = self.cu.cuModuleLoadData(ctypes.addressof(image))
        self._check(err, "cuModuleLoadData")
        err, fn = self.cu.cuModuleGetFunction(module, function.encode())
        self._check(err, f"cuModuleGetFunction({function})")
        return fn

    def launch(self, fn: Any, grid: int, block: int, ptrs: Sequence[int], stream: int) -> None:
        # kernelParams: an array of pointers to the argument values (the driver copies the
        # values at launch, so the two arrays are reused from launch to launch)
        n = len(ptrs)
        arrays = getattr(self._local, "params", None)
        if arrays is None:
            arrays = self._local.params = {}
        entry = arrays.get(n)
        if entry is None:
            entry = arrays[n] = _params_array(n)
        values, address = entry
        values[:] = ptrs
        direct = self._direct
        if direct is not None:  # libcuda's cuLaunchKernel through ctypes: the fast path
            try:
                handle = int(fn)
            except TypeError:  # a cuda.bindings without int(CUfunction): its own launch
                self._direct = None
                return self.launch(fn, grid, block, ptrs, stream)
            err = direct(
                _ptr(handle), grid, 1, 1, block, 1, 1, 0, _ptr(stream), _ptr(address), None
            )
            if err:
                self._check(self.cu.CUresult(err), "cuLaunchKernel")
            return
        cu_stream = self._streams.get(stream)
        if cu_stream is None:
            cu_stream = self._streams[stream] = self.cu.CUstream(stream)
        (err,) = self.cu.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, 0, cu_stream, address, 0)
        self._check(err, "cuLaunchKernel")

    def bind(self, fn: Any, device: int, stream_of: Any) -> Any:
        """``launch(grid, block, ptrs)`` for ``fn`` on PyTorch's current stream of
        ``device``, through libcuda's ``cuLaunchKernel`` with the function handle converted
        once and a kernelParams array per thread; None where the direct path is missing
        (then ``launch`` serves)."""
        direct = self._direct
        if direct is None:
            return None
        try:
            handle = int(fn)
        except TypeError:  # a cuda.bindings without int(CUfunction)
            return None
        local = threading.local()
        check, result = self._check, self.cu.CUresult
        fn_arg = _ptr(handle)  # the pointer arguments as c_void_p (see _direct_launch)

        def launch(grid: int, block: int, ptrs: Sequence[int]) -> None:
            try:
                values, params = local.arrays
            except AttributeError:
                values, address = _params_array(len(ptrs))
                values, params = local.arrays = values, _ptr(address)
            values[:] = ptrs
            err = direct(fn_arg, grid, 1, 1, block, 1, 1, 0, _ptr(stream_of(device)), params, None)
            if err:
                check(result(err), "cuLaunchKernel")

        return launch


def _params_array(n: int) -> tuple[Any, int]:
    """(values, address of kernelParams): ``n`` argument slots and the array of pointers to
    them that cuLaunchKernel takes (the driver copies the values at launch, so both are
    reused from launch to launch; the pointer array lives as long as ``values``)."""
    values = (ctypes.c_void_p * n)()
    base, size = ctypes.addressof(values), ctypes.sizeof(ctypes.c_void_p)
    params = (ctypes.c_void_p * n)(*[base + i * size for i in range(n)])
    values._params = params  # type: ignore[attr-defined]  # kept alive with the values
    return values, ctypes.addressof(params)


_ptr = ctypes.c_void_p


def _direct_launch(library: str = "libcuda.so.1", symbol: str = "cuLaunchKernel") -> Any:
    """``cuLaunchKernel`` of the driver library (the one cuda.bindings calls) through ctypes,
    or None where it cannot be loaded: about a microsecond per launch instead of several
    through cuda.bindings' argument conversion.

    Without ``argtypes`` (their conversion of eleven arguments costs half a microsecond per
    launch), so callers pass each argument in a form of its C type's size: the pointers
    (function, stream, kernelParams) as ``c_void_p`` (a Python int would go as a 32-bit
    C int), ``extra`` as None (NULL), the unsigned grid, block and shared-memory sizes as
    Python ints (a 32-bit C int, the bits of an unsigned int below 2**32)."""
    try:
        lib = ctypes.CDLL(library)
        fn = getattr(lib, symbol)
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    return fn


class PyCudaLoader:
    """pycuda, in PyTorch's primary context; launches on the legacy default stream."""

    name = "pycuda"

    def __init__(self) -> None:
        import pycuda.driver as drv

        drv.init()
        self.drv = drv
        self._contexts: dict[int, Any] = {}

    def load(self, cubin: bytes, function: str, device: int) -> Any:
        if device not in self._contexts:
            ctx = self.drv.Device(device).retain_primary_context()
            ctx.push()
            self._contexts[device] = ctx
        module = self.drv.module_from_buffer(cubin)
        return (module, module.get_function(function))

    def launch(self, fn: Any, grid: int, block: int, ptrs: Sequence[int], stream: int) -> None:
        import numpy as np
        import torch

        _, func = fn
        args = [np.uintp(p) for p in ptrs]
        if stream != 0:  # not the legacy default stream: order the launch around it
            torch.cuda.current_stream().synchronize()
        func(*args, block=(block, 1, 1), grid=(grid, 1, 1))
        if stream != 0:
            self.drv.Context.synchronize()


_LOADERS = {"pycuda": PyCudaLoader, "cuda.bindings": CudaBindingsLoader}
_instances: dict[str, Loader] = {}


def get_loader(prefer: str | None = None) -> Loader:
    """The loader to use: ``prefer`` if given, else pycuda, else cuda.bindings.

    Raises ``DeviceError`` saying how to install one when neither is importable.
    """
    names = available_loaders()
    if prefer is not None:
        if prefer not in _LOADERS:
            raise DeviceError(f"unknown CUDA loader {prefer!r}; known: {', '.join(_LOADERS)}")
        if prefer not in names:
            raise DeviceError(f"the CUDA loader {prefer!r} is not installed; {INSTALL_HINT}")
        names = [prefer]
    if not names:
        raise DeviceError(
            "device='cuda' needs a CUDA kernel loader, and neither pycuda nor cuda-python "
            f"is importable here; {INSTALL_HINT}"
        )
    name = names[0]
    if name not in _instances:
        _instances[name] = _LOADERS[name]()
    return _instances[name]


class LoadedKernel:
    """One kernel function of a cubin, launched on the current stream of ``device``."""

    def __init__(self, cubin: bytes, function: str, device: int, loader: Loader) -> None:
        self.loader = loader
        self.device = device
        self.function = function
        self._fn = loader.load(cubin, function, device)
        self._stream = current_stream_handle()
        bind = getattr(loader, "bind", None)
        fast = bind(self._fn, device, self._stream) if bind is not None else None
        if fast is not None:  # the loader's launch specialised to this function
            self.launch = fast  # type: ignore[method-assign]

    def launch(self, grid: int, block: int, ptrs: Sequence[int]) -> None:
        self.loader.launch(self._fn, grid, block, ptrs, self._stream(self.device))


def current_stream_handle() -> Any:
    """A function of a device index giving the raw handle of PyTorch's current stream on it
    (``torch._C._cuda_getCurrentRawStream``: no Stream object made per launch), or the
    public API's where that private function is missing."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda device: torch.cuda.current_stream(device).cuda_stream
