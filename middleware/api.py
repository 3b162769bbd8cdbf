"""The public entry points: ``optimize``, ``trace`` and the device checks."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.nn as nn

from .backends import backend_for, describe_available
from .backends.vendor import Layer, check_selection, register_algorithm, unregister_algorithm
from .capture import compile_or_capture
from .errors import DeviceError, OptionsError
from .frontends import trace as _trace
from .graph import Graph
from .options import Options, default_cache_dir, selection_pairs
from .passes import pass_names
from .runtime.module import OptimizedModule

DEVICES = ("cpu", "cuda", "auto")
# the algorithm registry's public half (backends/vendor/algorithms.py)
__all__ = [
    "Layer",
    "available_backends",
    "make_options",
    "optimize",
    "register_algorithm",
    "resolve_device",
    "trace",
    "unregister_algorithm",
]


def available_backends() -> list[str]:
    """The devices that can run here, each with what generates its kernels."""
    return describe_available()


def resolve_device(device: str | torch.device) -> str:
    """ "cpu", "cuda" or "auto" -> the device to run on; errors list what exists here."""
    name = str(device)
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = name.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise DeviceError(
            f"unknown device {name!r}; choose one of {', '.join(DEVICES)}. Backends available "
            f"here: {'; '.join(available_backends())}"
        )
    if kind == "cuda" and not torch.cuda.is_available():
        raise DeviceError(
            f"device={name!r} but no CUDA device exists on this machine (torch.cuda.is_available() "
            f"is False). Backends available here: {'; '.join(available_backends())}"
        )
    return name


def optimize(
    model: nn.Module,
    device: str = "cpu",
    example_inputs: Sequence[torch.Tensor] | torch.Tensor | None = None,
    cache_dir: str | Path | None = None,
    **options: object,
) -> OptimizedModule:
    """Make ``model`` faster and leaner; returns an ``OptimizedModule`` with the same outputs.

    ``device``: "cpu", "cuda" or "auto". Without ``example_inputs`` the model is traced on
    the first call. Further settings (``disable_passes``, ``debug_dir``, ``strict``,
    ``layout``, ``fuse``, ``algorithms``, ...) are the fields of :class:`middleware.Options`;
    ``algorithms={"conv2d": sel}`` picks each convolution's algorithm (a name, a list by
    layer, or a callable on a :class:`Layer`; see ``backends/vendor/algorithms.py``).
    A model in training mode (``model.train()``) gets training plans: the outputs carry
    autograd history over the model's own parameters, so ``loss.backward()`` and any
    ``torch.optim`` optimizer work as on the model (``optimized.train()``/``.eval()``
    switch both, each mode with plans of its own). Apart from that (and the running
    statistics a training-mode batch-norm updates) the original model is never modified.
    A model ``torch.fx`` cannot trace (data-dependent
    control flow) is captured through TorchDynamo instead: its subgraphs are optimized, the
    Python between them runs as written, and ``report()`` lists both.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize() takes a torch.nn.Module, got {type(model).__name__}")
    o = make_options(device, cache_dir, options)
    return OptimizedModule(model, o, compile_or_capture, example_inputs)


def make_options(
    device: str | torch.device = "cpu",
    cache_dir: str | Path | None = None,
    options: Mapping[str, object] | None = None,
) -> Options:
    """The ``Options`` of ``optimize(model, device, cache_dir=..., **options)``, every value
    checked (``TypeError`` for an unknown name, ``OptionsError`` for a bad value,
    ``DeviceError`` for a device this machine lacks)."""
    options = dict(options or {})
    if "max_extra_bytes" in options:  # the option's first name (session 8)
        if "max_extra_param_bytes" in options:
            raise TypeError("give max_extra_param_bytes only (max_extra_bytes is its old name)")
        warnings.warn("max_extra_bytes is now max_extra_param_bytes", FutureWarning, stacklevel=3)
        options["max_extra_param_bytes"] = options.pop("max_extra_bytes")
    fields = {f.name for f in dataclasses.fields(Options)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}; options are: {', '.join(sorted(fields))}")
    opts = dict(options)
    if "disable_passes" in opts:
        opts["disable_passes"] = tuple(opts["disable_passes"])  # type: ignore[arg-type]
    _check_option_values(opts)
    if opts.get("debug_dir") is not None:
        opts["debug_dir"] = Path(opts["debug_dir"])  # type: ignore[arg-type]
    resolved = resolve_device(device)
    backend_for(resolved).check_runtime()
    if opts.get("algorithms") and torch.device(resolved).type != "cpu":
        raise OptionsError(
            f"algorithms= chooses algorithms on the CPU only; the {resolved} backend runs "
            "its vendor calls (cuDNN/cuBLAS) without a choice yet"
        )
    return Options(
        device=resolved, cache_dir=Path(cache_dir) if cache_dir else default_cache_dir(), **opts
    )  # type: ignore[arg-type]


LAYOUTS = ("auto", "nchw", "nhwc")


def _check_option_values(opts: dict[str, object]) -> None:
    """Settings are checked here, before anything compiles: inside the compiler a bad value
    would look like a compiler failure and only make the model fall back."""
    known = pass_names()
    unknown = [p for p in opts.get("disable_passes", ()) if p not in known]  # type: ignore[union-attr]
    if unknown:
        raise OptionsError(
            f"unknown pass(es) {unknown} in disable_passes; passes are: {', '.join(known)}"
        )
    check_selection(selection_pairs(opts.get("algorithms")))
    cap = opts.get("max_extra_param_bytes")
    if cap is not None and not (isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0):
        raise OptionsError(
            f"max_extra_param_bytes={cap!r}: use None (no cap) or a number of bytes >= 0"
        )
    layout = opts.get("layout", "auto")
    if layout not in LAYOUTS:
        raise OptionsError(f"layout={layout!r} is not one of {', '.join(map(repr, LAYOUTS))}")
    chunk = opts.get("batch_chunk", "auto")
    if chunk != "auto" and not (
        isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 0
    ):
        raise OptionsError(
            f"batch_chunk={chunk!r}: use 'auto', 0 (off) or a positive number of samples per slice"
        )


def trace(model: nn.Module, example_inputs: Sequence[torch.Tensor] | torch.Tensor) -> Graph:
    """Lower ``model`` on ``example_inputs`` into the middleware's framework-neutral graph."""
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    return _trace(model, example_inputs)
