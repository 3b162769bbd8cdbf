"""The one frozen record of every setting, passed explicitly down the pipeline."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import OptionsError
from .hardware import hardware_from_env, hardware_pin


def default_cache_dir() -> Path:
    """The kernel cache: ``$MIDDLEWARE_CACHE_DIR``, else ``$XDG_CACHE_HOME/middleware``,
    else ``~/.cache/middleware``. Read once, at ``optimize()`` time, never inside a stage."""
    env = os.environ.get("MIDDLEWARE_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "middleware"
    return Path.home() / ".cache" / "middleware"


def check_memory_default() -> bool:
    """``$MIDDLEWARE_CHECK_MEMORY`` set to anything but "" or "0" turns on the buffer plan's
    run-time check (``Options.check_memory``)."""
    return os.environ.get("MIDDLEWARE_CHECK_MEMORY", "") not in ("", "0")


def huge_pages_default() -> bool:
    """``$MIDDLEWARE_HUGE_PAGES=0`` keeps the runtime's CPU buffers on 4 KiB pages
    (``Options.huge_pages``); anything else, or unset, asks for 2 MiB pages."""
    return os.environ.get("MIDDLEWARE_HUGE_PAGES", "1") != "0"


def native_runner_default() -> bool:
    """``$MIDDLEWARE_NATIVE_RUNNER=0`` runs every CPU plan's steps from Python
    (``Options.native_runner``); anything else, or unset, the native runner where it
    applies."""
    return os.environ.get("MIDDLEWARE_NATIVE_RUNNER", "1") != "0"


def native_call_default() -> bool:
    """``$MIDDLEWARE_NATIVE_CALL=0`` keeps the optimized module's call in Python
    (``Options.native_call``); anything else, or unset, one C++ call where it applies."""
    return os.environ.get("MIDDLEWARE_NATIVE_CALL", "1") != "0"


def onednn_primitives_default() -> bool:
    """``$MIDDLEWARE_ONEDNN_PRIMITIVES=0`` makes ``torch.ops.mkldnn`` the default for CPU
    convolutions (``Options.onednn_primitives``); anything else, or unset, primitives."""
    return os.environ.get("MIDDLEWARE_ONEDNN_PRIMITIVES", "1") != "0"


def selection_pairs(algorithms: Any) -> tuple[tuple[str, Any], ...]:
    """``{op: selector}`` (or its pairs) as sorted, hashable pairs; lists become tuples."""
    if not algorithms:
        return ()
    items = algorithms.items() if isinstance(algorithms, Mapping) else algorithms
    out = []
    for op, sel in items:
        if isinstance(sel, Sequence) and not isinstance(sel, str):
            sel = tuple(sel)
        out.append((str(op), sel))
    return tuple(sorted(out, key=lambda p: p[0]))


@dataclasses.dataclass(frozen=True)
class Options:
    """Every setting of one ``optimize()`` call.

    Settings that change generated code (``device``, ``layout``, ``disable_passes``,
    ``fuse``) are part of the kernel cache key through :meth:`codegen_key`.
    """

    device: str = "cpu"
    cache_dir: Path = dataclasses.field(default_factory=default_cache_dir)
    disable_passes: tuple[str, ...] = ()
    debug_dir: Path | None = None
    strict: bool = False
    # "auto": channels_last on CPU unless measured slower; "nchw"/"nhwc" force one.
    layout: str = "auto"
    # Generate depth-first kernels for I/O-bound groups (False: run them through the framework).
    fuse: bool = True
    # Measure the machine's FLOP/s and bandwidth once (cached); False uses documented defaults.
    measure_hardware: bool = True
    # Use the buffer planner (arena reuse) in the runtime.
    plan_memory: bool = True
    # Run the network's first layers depth-first over slices of the batch (runtime/chunked.py):
    # "auto" (on CPU where it cuts the estimated peak memory), a number of samples per
    # slice (wherever a prefix exists), or 0 (never).
    batch_chunk: int | str = "auto"
    # On CPU, 3x3 stride-1 convolutions that the measured rule picks run as Winograd
    # F(4x4, 3x3) (backends/vendor/winograd.py): generated transforms around oneDNN's
    # batched matmul, 1.3-2.5x faster than oneDNN's direct kernels on most layers, within
    # ~1e-5 of the output's scale per layer. False keeps every convolution in oneDNN's
    # direct algorithm.
    winograd: bool = True
    # On CPU, vendor convolutions run as oneDNN primitives created once at plan time and
    # executed directly (backends/vendor/onednn.py: PyTorch's own oneDNN through its C API),
    # instead of through torch.ops.mkldnn, whose per-call setup is most of a small layer's
    # time. Same library, same kernels; False keeps the torch.ops.mkldnn call. Default:
    # $MIDDLEWARE_ONEDNN_PRIMITIVES (unset: on).
    onednn_primitives: bool = dataclasses.field(default_factory=onednn_primitives_default)
    # Per-layer algorithm choice, per op: {"conv2d": selector}, the selector a name (every
    # conv2d layer), a list of names (the i-th conv2d layer in graph order gets the i-th;
    # "default" lets the middleware decide) or a callable (layer) -> name
    # (backends/vendor/algorithms.py: Layer, ALGORITHMS). A named algorithm that does not
    # apply to a layer falls back to the default there, with the reason in report().
    # ``winograd`` only governs the default: an explicit "winograd_f4x4" runs wherever it
    # applies, even with winograd=False. Kept as sorted (op, selector) pairs. CPU only:
    # optimize() refuses it for another device. "autotune" measures (vendor/tuning.py).
    algorithms: Any = None
    # Cap on one layer's extra bytes for its algorithm (transformed weights + workspace
    # beyond the vendor call's: Algorithm.extra_bytes): an algorithm above it is not used
    # for that layer (named, autotuned or by the default's rule); None: no cap.
    max_extra_param_bytes: int | None = None
    # Seconds of candidate timing one optimize() compile may spend autotuning
    # (algorithms="autotune"); once spent, the remaining layers take a stored decision where
    # one exists, else the default, and report() says so. None: no cap.
    tune_budget_s: float | None = 60.0
    # On CUDA, a plan replays as one CUDA graph (captured on its first call): no launch
    # overhead per step. "auto": captured, then timed against running step by step (a
    # replay copies its inputs and clones its outputs) and kept only where faster; True
    # always replays, False runs the plan's steps one by one.
    cuda_graphs: bool | str = "auto"
    # On CUDA, how a plan holds the network's weights. "copy": batch norms folded into the
    # convolution weights and every convolution weight copied channels_last once, so that
    # cuDNN reads it as it is (a second copy of the weights on the GPU). "share": the plan
    # keeps no copy: convolutions read the model's own weights (PyTorch lays them out for
    # cuDNN at each call, a transient copy of one layer's weight) and a batch norm is a
    # per-channel multiply-add in the generated kernel after its convolution. The CPU
    # backends share every weight their vendor calls can read as it is, whatever this says.
    cuda_weights: str = "copy"
    # Debug: after every planned step, verify that no output lands in arena bytes its value
    # was not planned in (a framework allocation aliasing a live arena value); raises
    # runtime.memory.MemoryCheckError. Default: $MIDDLEWARE_CHECK_MEMORY.
    check_memory: bool = dataclasses.field(default_factory=check_memory_default)
    # On CPU under Linux, the plan's long-lived buffers (the arena, recycled outputs) ask
    # for transparent 2 MiB pages (runtime/pages.py: fewer TLB misses, prefetchers that do
    # not stop every 4 KiB; up to a third faster generated kernels). Same bytes, same
    # resident size. Default: $MIDDLEWARE_HUGE_PAGES (unset: on).
    huge_pages: bool = dataclasses.field(default_factory=huge_pages_default)
    # On CPU, a plan whose every step is one C call (generated kernels, oneDNN primitives,
    # the GEMV) and whose intermediates fit a 64 MiB arena runs as one C call after its
    # first run (runtime/native.py: recorded, then checked bit for bit against the Python
    # steps); report() says where it does not and why. Default: $MIDDLEWARE_NATIVE_RUNNER
    # (unset: on).
    native_runner: bool = dataclasses.field(default_factory=native_runner_default)
    # On CPU, an inference call whose plan runs natively is, from its third call (the
    # second makes it), one C++ function (runtime/shortcut.cpp: the call's checks, the output buffer and the native
    # program), built once per cache folder in a background thread. Default:
    # $MIDDLEWARE_NATIVE_CALL (unset: on).
    native_call: bool = dataclasses.field(default_factory=native_call_default)
    # Pin the hardware figures instead of measuring (middleware/hardware.py): a Hardware, or
    # a dict of its fields (kept as sorted (field, value) pairs). Default: $MIDDLEWARE_HARDWARE.
    hardware: Any = dataclasses.field(default_factory=hardware_from_env)

    def __post_init__(self) -> None:
        # frozen: the checked, hashable form of the pin replaces what was passed
        object.__setattr__(self, "hardware", hardware_pin(self.hardware))
        object.__setattr__(self, "algorithms", selection_pairs(self.algorithms))
        if self.tune_budget_s is not None and not (
            isinstance(self.tune_budget_s, (int, float)) and self.tune_budget_s >= 0
        ):
            raise OptionsError(
                f"tune_budget_s={self.tune_budget_s!r}: give the seconds autotuning may "
                "spend (a number >= 0), or None for no cap"
            )
        if self.cuda_weights not in ("copy", "share"):
            raise OptionsError(
                f'cuda_weights={self.cuda_weights!r}: use "copy" (folded, channels_last '
                'weights held by the plan) or "share" (the model\'s own weights, no copy)'
            )
        if self.cuda_graphs not in (True, False, "auto"):
            raise OptionsError(
                f"cuda_graphs={self.cuda_graphs!r}: use True (always replay the plan as one "
                'CUDA graph), False (run it step by step) or "auto" (the faster, measured)'
            )

    def codegen_key(self) -> str:
        """The settings that change generated code, as a stable string for cache keys."""
        return (
            f"device={self.device};layout={self.layout};fuse={self.fuse};"
            f"disable={','.join(sorted(self.disable_passes))}"
        )
