"""The inference call of an optimized module as one C++ function (``shortcut.cpp``).

``OptimizedModule.__call__``'s Python shortcut costs 40-60 us a call on a cold cache (the
previous layer's data evicted the interpreter's and PyTorch's): a tenth of a 0.5 ms fused
kernel, and most of what separates ``optimize()`` from the bare kernel (bench/README.md,
issue 18). The C++ extension does the same checks, picks the output buffer and runs the
recorded native program in one call.

The extension is compiled against the installed PyTorch's headers through the kernel cache
(g++, 20-30 s, once: in the default cache folder, see :func:`build_dir`), in a background
thread started by the first plan that runs natively; until it is loaded, and wherever it cannot be (no C++ compiler, no
``Python.h``, another PyTorch ABI), the Python shortcut serves, and ``report()`` says why.
``$MIDDLEWARE_NATIVE_CALL=0`` or ``Options(native_call=False)`` keeps the Python shortcut.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import sys
import sysconfig
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ..backends.cache import BuildRequest, kernel_cache
from ..options import default_cache_dir

SOURCE = Path(__file__).with_name("shortcut.cpp")
MODULE_NAME = "mw_shortcut"  # PyInit_mw_shortcut


class _State:
    """The extension of one cache folder: loaded, failed (why) or building."""

    def __init__(self) -> None:
        self.module: ModuleType | None = None
        self.why = "not built yet"
        self.thread: threading.Thread | None = None
        self.done = threading.Event()


_states: dict[str, _State] = {}
_lock = threading.Lock()


def _compiler() -> str | None:
    for cxx in (os.environ.get("CXX"), "c++", "g++"):
        if cxx and shutil.which(cxx):
            return cxx
    return None


def build_request() -> BuildRequest:
    """The g++ command that builds the extension against this process's PyTorch and Python;
    ValueError (why) where it cannot be built here."""
    cxx = _compiler()
    if cxx is None:
        raise ValueError("no C++ compiler (c++, g++ or $CXX) on PATH")
    py_include = sysconfig.get_paths()["include"]
    if not (Path(py_include) / "Python.h").exists():
        raise ValueError(f"Python.h not found in {py_include} (install the Python headers)")
    torch_dir = Path(torch.__file__).parent
    include, lib = torch_dir / "include", torch_dir / "lib"
    if not (include / "torch" / "csrc" / "autograd" / "python_variable.h").exists():
        raise ValueError(f"PyTorch's C++ headers not found under {include}")
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    command = (
        cxx,
        "-O2",
        "-std=c++20",
        "-shared",
        "-fPIC",
        "-DNDEBUG",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{py_include}",
        f"-I{include}",
        "-o",
        "{out}",
        "{src}",
        f"-L{lib}",
        f"-Wl,-rpath,{lib}",
        "-lc10",
        "-ltorch_cpu",
        "-ltorch_python",
    )
    return BuildRequest(
        name="mw_shortcut",
        source=SOURCE.read_text(),
        suffix=".cpp",
        command=command,
        binary_name="shortcut.so",
        compiler=cxx,
        # the binary is tied to this PyTorch build and this Python
        key_extra=(torch.__version__, str(torch_dir), sys.version, sysconfig.get_platform()),
        meta={"kind": "extension: OptimizedModule's call"},
    )


def _load(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, str(path), loader=loader)
    if spec is None:  # pragma: no cover - a path the import system refuses
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def protocol_ok(ext: ModuleType) -> str:
    """Check the Recycler's rules (shortcut.cpp's ``Kept::free``) on this PyTorch: a buffer
    whose output, view, storage object (made before or not), NumPy array or DLPack capsule
    is held is never handed out again; one that nobody holds is. "" where they hold, else
    what failed (the extension is then not used: a wrong rule would let a call overwrite a
    user's tensor)."""

    def storage_dropped(y: torch.Tensor) -> torch.Tensor:
        st = y.untyped_storage()  # its Python object now lives with the storage
        del st
        return y

    holders: dict[str, Any] = {
        "the output": lambda y: y,
        "a view": lambda y: y[1:],
        "the storage object": lambda y: y.untyped_storage(),
        "a NumPy array": lambda y: y.numpy(),
        "a DLPack capsule": torch.utils.dlpack.to_dlpack,
        "the output (its storage object made and dropped)": storage_dropped,
        "the storage object (made, dropped, taken again)": lambda y: storage_dropped(
            y
        ).untyped_storage(),
        "nothing (its storage object made and dropped)": lambda y: (storage_dropped(y), None)[1],
    }
    for what, hold in holders.items():
        pool = ext.Recycler(lambda: torch.empty(4096), 1)
        y = pool.take()
        first = y.data_ptr()
        del y
        y = pool.take()
        if y.data_ptr() != first:
            return "a buffer nobody holds was not reused"
        holder = hold(y)
        del y
        z = pool.take()
        if (z.data_ptr() == first) != (holder is None):
            return f"a buffer was {'not ' if holder is None else ''}reused while {what} was held"
        del holder, z
    return ""


def _build(state: _State, cache_dir: Path) -> None:
    try:
        req = build_request()
        cache = kernel_cache(cache_dir)
        module = _load(cache.build(req).binary)
        wrong = protocol_ok(module)
        if wrong:
            raise RuntimeError(f"this PyTorch's storage references differ: {wrong}")
        state.module = module
        state.why = ""
    except Exception as e:  # noqa: BLE001 - the Python shortcut serves; report() says why
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        state.why = f"the C++ call could not be built: {first}"
    finally:
        state.done.set()


def _cached(cache_dir: Path) -> bool:
    """The extension's binary is in the cache already (loading it takes milliseconds)."""
    try:
        cache = kernel_cache(cache_dir)
        req = build_request()
        return cache._check(req, cache.key(req))[0] is not None
    except Exception:  # noqa: BLE001 - the background build then says why
        return False


def build_dir() -> Path:
    """Where the extension is built: ``$MIDDLEWARE_EXTENSION_DIR`` where set (a kernel cache
    folder shared by processes whose kernel caches are not: the test suite's workers),
    else the default kernel cache (``options.default_cache_dir``), whatever cache folder a
    plan uses: the binary depends on PyTorch and Python only, and a benchmark that gives
    each network a fresh cache must not build it again each time."""
    env = os.environ.get("MIDDLEWARE_EXTENSION_DIR")
    return Path(env) if env else default_cache_dir()


_ENV = ("MIDDLEWARE_EXTENSION_DIR", "MIDDLEWARE_CACHE_DIR", "XDG_CACHE_HOME")
_default: list = [None, None]  # (the environment it was resolved under, its state)


def extension(wait: bool = False, where: Path | None = None) -> ModuleType | None:
    """The loaded extension, or None while it builds (in a background thread, started by
    the first call) or where it cannot be built (:func:`why_not`). ``wait``: block until
    the build is done. ``where``: the kernel cache folder to build in (default
    :func:`build_dir`)."""
    if where is None and not wait:  # the per-call path: no folder resolved again
        env = tuple(map(os.environ.get, _ENV))
        if _default[0] == env and _default[1].done.is_set():
            return _default[1].module
    cache_dir = Path(where) if where is not None else build_dir()
    key = str(cache_dir)
    state = _states.get(key)
    if state is None:
        with _lock:
            state = _states.get(key)
            if state is None:
                state = _State()
                if _cached(cache_dir):
                    _build(state, cache_dir)  # in this thread: a cache hit
                else:
                    state.why = "the C++ call is being built"
                    state.thread = threading.Thread(
                        target=_build,
                        args=(state, cache_dir),
                        name="middleware-shortcut",
                        daemon=True,
                    )
                    state.thread.start()
                _states[key] = state
    if where is None:
        _default[:] = [tuple(map(os.environ.get, _ENV)), state]
    if wait:
        state.done.wait()
    return state.module


def failed() -> bool:
    """The default extension's build is over and it is not loaded (:func:`why_not`)."""
    state = _states.get(str(build_dir()))
    return state is not None and state.done.is_set() and state.module is None


def why_not(where: Path | None = None) -> str:
    """Why the extension (of ``where``, default :func:`build_dir`) is not loaded ("" where
    it is)."""
    state = _states.get(str(Path(where) if where is not None else build_dir()))
    return "the C++ call was not asked for yet" if state is None else state.why
