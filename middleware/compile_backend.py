"""The middleware as a ``torch.compile`` backend.

    compiled = torch.compile(model.eval(), backend="middleware", options={"device": "cpu"})
    with torch.no_grad():
        y = compiled(x)
    print(middleware.compile_report({"device": "cpu"}))  # subgraphs and graph breaks so far

``options`` are ``optimize()``'s settings (``device``, ``layout``, ``strict``, ``algorithms``,
``cache_dir``, ... : the fields of ``middleware.Options``), checked the same way. Every
subgraph TorchDynamo captures is compiled by the middleware's pipeline (``capture.py``);
one it must not compile (training mode, gradients required, an in-place write to an input)
runs as captured, with the reason in the report. To keep one model's report apart, pass a
backend object instead of the name: ``backend=middleware.Backend(device="cpu")`` and
``backend.report()``.

``import middleware`` registers the name (``register_when_dynamo_loads``): at once where
TorchDynamo is loaded already, else the moment its backend registry is imported (importing
dynamo only for this would add a second to ``import middleware``). The
``torch_dynamo_backends`` entry point (pyproject.toml) also lets ``torch.compile`` find it
without importing the middleware first.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.fx as fx

from .api import make_options
from .capture import Capture, CaptureReport
from .options import Options

NAME = "middleware"


class Backend(Capture):
    """A ``torch.compile`` backend with its own report:
    ``torch.compile(model, backend=Backend(device="cpu", layout="nhwc"))``."""

    def __init__(self, device: str = "cpu", **options: Any) -> None:
        cache_dir = options.pop("cache_dir", None)
        super().__init__(make_options(device, cache_dir, options))

    def __call__(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], **compile_kwargs: Any
    ) -> Callable[..., Any]:
        if compile_kwargs.get("options"):
            raise TypeError(
                "torch.compile(options=...) with a middleware.Backend object: give the "
                "options to Backend(...) instead"
            )
        return super().__call__(gm, example_inputs)


_BACKENDS: dict[Any, Capture] = {}
_LOCK = threading.Lock()


def _capture_for(options: Mapping[str, Any] | None, mode: str | None) -> Capture:
    """The capture of ``torch.compile(backend="middleware", options=options)``: one per
    distinct resulting ``Options`` (``{}`` and ``{"device": "cpu"}`` share one)."""
    opts = dict(options or {})
    device = opts.pop("device", "cpu")
    cache_dir = opts.pop("cache_dir", None)
    resolved = make_options(device, cache_dir, opts)
    key: Any = resolved
    try:
        hash(resolved)
    except TypeError:  # an unhashable setting: its spelling is the key
        key = repr(resolved)
    with _LOCK:
        found = _BACKENDS.get(key)
        if found is None:
            found = _BACKENDS[key] = Capture(resolved)
        if mode not in (None, "default"):
            note = (
                f"torch.compile(mode={mode!r}) has no meaning for the middleware backend "
                "and was ignored"
            )
            if note not in found.notes:
                found.notes.append(note)
    return found


def middleware_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The ``torch.compile`` backend ``"middleware"``: ``options`` are ``optimize()``'s."""
    return _capture_for(options, mode)(gm, example_inputs)


def compile_report(options: Mapping[str, Any] | None = None) -> CaptureReport:
    """What ``torch.compile(..., backend="middleware", options=options)`` captured and how
    each subgraph runs, over every model compiled with those options in this process."""
    return _capture_for(options, None).report()


def register() -> None:
    """Register ``"middleware"`` with TorchDynamo (once; a no-op where the entry point is
    about to load it, which registers it itself)."""
    from torch._dynamo.backends import registry

    if NAME in registry._COMPILER_FNS or registry._BACKENDS.get(NAME) is not None:
        return
    registry.register_backend(middleware_backend, name=NAME)


_REGISTRY = "torch._dynamo.backends.registry"


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Runs ``register()`` right after TorchDynamo's backend registry module is imported."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _REGISTRY:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _remove_hook()
            register()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_HOOK = _RegisterAfterImport()


def _remove_hook() -> None:
    if _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)


def register_when_dynamo_loads() -> None:
    """``register()`` now if TorchDynamo's registry is loaded, else when it is imported."""
    if _REGISTRY in sys.modules:
        register()
    elif _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)


__all__ = [
    "Backend",
    "Options",
    "compile_report",
    "middleware_backend",
    "register",
    "register_when_dynamo_loads",
]
