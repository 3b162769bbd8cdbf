"""``OptimizedModule``: the ``torch.nn.Module`` that ``optimize()`` hands back."""

from __future__ import annotations

import copy
import dataclasses
import operator
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from ..enums import RunsAs
from ..errors import (
    InputMismatchError,
    InputTypeError,
    InternalError,
    MiddlewareError,
    TrainingModeError,
    UnsupportedError,
)
from ..graph import Graph
from ..options import Options
from .plan import Plan
from .profile import ProfileResult, measure
from .report import Report, ReportRow


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """What a compiled model accepts for one input: the rank, the channel count (dim 1),
    dtype and device are fixed; the batch and spatial sizes may change between calls."""

    rank: int
    channels: int | None
    dtype: torch.dtype
    device: torch.device

    def describe(self) -> str:
        dims = (
            ["N"]
            + ([str(self.channels)] if self.channels is not None else [])
            + [f"d{i}" for i in range(2, self.rank)]
        )
        if self.rank == 1:
            dims = ["N"]
        return f"{str(self.dtype).replace('torch.', '')}[{', '.join(dims[: self.rank])}] on {self.device}"

    @staticmethod
    def of(x: torch.Tensor) -> InputSpec:
        return InputSpec(x.dim(), int(x.shape[1]) if x.dim() >= 2 else None, x.dtype, x.device)


def _cl(x: torch.Tensor) -> bool:
    """Part of the signature: a 4-d input stored channels_last gets its own plan (which reads
    it without conversion and returns channels_last outputs, as PyTorch would)."""
    return (
        x.dim() == 4
        and not x.is_contiguous()
        and x.is_contiguous(memory_format=torch.channels_last)
    )


def _dense(inputs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """Inputs stored neither contiguous nor channels_last (a transposed or sliced view) are
    made contiguous: plans read their inputs in a declared layout."""
    if all(x.is_contiguous() or _cl(x) for x in inputs):
        return inputs
    return tuple(x if x.is_contiguous() or _cl(x) else x.contiguous() for x in inputs)


def _describe_tensor(x: Any) -> str:
    if not isinstance(x, torch.Tensor):
        return type(x).__name__
    return f"{str(x.dtype).replace('torch.', '')}[{', '.join(map(str, x.shape))}] on {x.device}"


@dataclasses.dataclass
class Compiled:
    """One input signature's passed graph, plan and report. ``plan`` is None for a signature
    that runs as the original model (``report`` says why)."""

    graph: Graph | None
    plan: Plan | None
    report: Report


# ---------------------------------------------------------------- parameter tracking
_VERSION = operator.attrgetter("_version")

# Bumped whenever any nn.Module registers a parameter, buffer or submodule (``m.w =
# nn.Parameter(...)``, ``load_state_dict(assign=True)``): replacing a tensor object moves no
# version counter, and walking the model on every call would cost more than the check.
_registrations = [0]
_hooks_installed = False


def _count_registration(*_: Any) -> None:
    _registrations[0] += 1


def _install_registration_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    from torch.nn.modules import module as nn_module

    nn_module.register_module_parameter_registration_hook(_count_registration)
    nn_module.register_module_buffer_registration_hook(_count_registration)
    nn_module.register_module_module_registration_hook(_count_registration)
    _hooks_installed = True


# Held around every compile in the process: the fx tracer patches nn.Module.__call__ and
# __getattr__ globally while it traces, so two modules tracing at once (each under its own
# lock) break each other ("module is not installed as a submodule"). Re-entrant: a model
# that holds an OptimizedModule compiles it from inside its own trace. Always taken before
# a module's own lock, so the two never deadlock.
_GLOBAL_COMPILE_LOCK = threading.RLock()


def _identity(t: torch.Tensor) -> tuple:
    try:
        ptr = t.data_ptr()
    except RuntimeError:  # a tensor without plain storage (sparse): shape, dtype, device only
        ptr = None
    return (ptr, tuple(t.shape), t.dtype, t.device)


def _version(t: torch.Tensor) -> int:
    # Inference tensors (made under torch.inference_mode()) have no version counter.
    return -1 if t.is_inference() else t._version


@dataclasses.dataclass(frozen=True)
class WeightSnapshot:
    """The user's parameters and buffers as the plans were built from them.

    Plans hold copies of the weights (prepacked oneDNN weights, Winograd-transformed weights,
    batch-norm folded into convolutions), so a change to the model must rebuild them.
    ``current()`` is the per-call check: one map over the version counters, compared in one
    go, and one integer; the identities (storage, shape, dtype, device) are compared only when
    that fails and when a new signature compiles.
    """

    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    versions: tuple[int, ...]  # per name, -1 for an inference tensor
    identities: tuple[tuple, ...]
    epoch: int
    tracked: tuple[torch.Tensor, ...]  # the tensors with a version counter
    tracked_versions: tuple[int, ...]

    @staticmethod
    def take(model: nn.Module) -> WeightSnapshot:
        named = list(model.named_parameters()) + list(model.named_buffers())
        tensors = tuple(t for _, t in named)
        tracked = tuple(t for t in tensors if not t.is_inference())
        return WeightSnapshot(
            names=tuple(n for n, _ in named),
            tensors=tensors,
            versions=tuple(map(_version, tensors)),
            identities=tuple(map(_identity, tensors)),
            epoch=_registrations[0],
            tracked=tracked,
            tracked_versions=tuple(map(_VERSION, tracked)),
        )

    def current(self) -> bool:
        return (
            _registrations[0] == self.epoch
            and tuple(map(_VERSION, self.tracked)) == self.tracked_versions
        )

    def changed(self, now: WeightSnapshot) -> list[str]:
        """Names of the tensors that differ between this snapshot and ``now`` (a replaced
        tensor object, new or removed names, moved storage, or an in-place write)."""
        if self.names != now.names:
            return sorted(set(self.names) ^ set(now.names)) or ["(parameter order)"]
        return [
            name
            for name, a, b, va, vb, ia, ib in zip(
                self.names,
                self.tensors,
                now.tensors,
                self.versions,
                now.versions,
                self.identities,
                now.identities,
                strict=True,
            )
            if a is not b or va != vb or ia != ib
        ]


_NOT_RUN = object()  # _compile's second result when it did not run the model itself


def _unsupported_inputs(inputs: Sequence[torch.Tensor]) -> str | None:
    """Why the compiler must not see these inputs, or None. Zero-size tensors crash deep in
    the x86 scheduler (isl "cannot handle void expression" from isl_helpers.loop_bounds,
    reached through backend.can_run -> schedule_group -> stage_loops) and there is nothing
    to gain from compiling them."""
    for i, x in enumerate(inputs):
        if x.numel() == 0:
            return (
                f"input {i} ({_describe_tensor(x)}) has no elements; the compiler does not "
                "schedule zero-size tensors, so this input signature runs as the original "
                "PyTorch code"
            )
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _rejected(model: nn.Module, inputs: Sequence[torch.Tensor], err: Exception) -> MiddlewareError:
    """The error for inputs the model itself refuses in eager PyTorch: what is wrong, the fix."""
    name = type(model).__name__
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    for i, x in enumerate(inputs):
        if len(dtypes) == 1 and x.dtype not in dtypes:
            (want,) = dtypes
            also = f" (or the model with model.to({x.dtype}))" if x.is_floating_point() else ""
            return InputTypeError(
                f"input {i} is {x.dtype} but {name}'s parameters are {want}: convert the input "
                f"with x.to({want}){also}; PyTorch itself fails on it: {_first_line(err)}"
            )
    given = ", ".join(_describe_tensor(x) for x in inputs)
    return InputMismatchError(
        f"{name} rejects the input(s) ({given}) in eager PyTorch too: {_first_line(err)}; "
        "pass inputs the original model accepts (rank, channels, sizes)"
    )


class OptimizedModule(nn.Module):
    """Runs a model through the middleware's plans; same outputs as the original model.

    One plan is built and cached per input signature (shapes, dtype, device). Attributes:
    ``graph`` (the passed graph of the latest signature) and ``report()``. Plans are rebuilt
    when the original model's parameters or buffers change (see :meth:`refresh`). A module
    may be called from several threads: a known signature takes no lock, a new one compiles
    under the module's lock (and the process-wide one that tracing needs).
    """

    # Bound here, not inherited: torch.fx replaces nn.Module.__call__ for the whole process
    # while a model traces, and a call of this module from another thread meanwhile would go
    # through the tracer ("module is not installed as a submodule").
    __call__ = nn.Module._wrapped_call_impl

    def __init__(
        self,
        model: nn.Module,
        options: Options,
        compile_fn: Callable[[nn.Module, Sequence[torch.Tensor], Options], Compiled],
        example_inputs: Sequence[torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        # Not registered as a submodule: .to()/.half() on this module must never reach
        # (and so modify) the user's model.
        object.__setattr__(self, "_original", model)
        object.__setattr__(self, "_compile_fn", compile_fn)
        self.train(False)  # an inference module; train() does not change what it computes
        self.options = options
        self._plans: dict[tuple, Compiled] = {}
        self._specs: list[InputSpec] | None = None
        self._latest: Compiled | None = None
        self._fallback_reason: str | None = None
        self._compile_lock = threading.Lock()
        self._weights: WeightSnapshot | None = None  # what the cached plans were built from
        self._rebuilds = 0  # how often plans were dropped because the weights changed
        self._rebuild_reason = ""  # the latest such change, for report()
        _install_registration_hooks()
        if example_inputs is not None:
            inputs = (
                tuple(example_inputs)
                if not isinstance(example_inputs, torch.Tensor)
                else (example_inputs,)
            )
            self._check_types(inputs)
            with _GLOBAL_COMPILE_LOCK:  # optimize() may run in several threads at once
                self._compile(inputs, self._signature(inputs))

    # ------------------------------------------------------------------ copies
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_compile_lock", None)  # a lock cannot be copied; each copy gets its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._compile_lock = threading.Lock()

    def __deepcopy__(self, memo: dict[int, Any]) -> OptimizedModule:
        # The copy's original is a copy too, with tensors of its own: plans built from (and
        # partly sharing memory with) this module's weights must not serve it, so it builds
        # its own on its first call.
        state = self.__getstate__()
        for key in ("_plans", "_latest", "_weights"):
            state.pop(key, None)
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        clone.__setstate__(copy.deepcopy(state, memo))
        clone._plans, clone._latest, clone._weights = {}, None, None
        return clone

    @property
    def original(self) -> nn.Module:
        return self._original

    @property
    def graph(self) -> Graph | None:
        """The passed graph of the latest input signature (None before the first call)."""
        return None if self._latest is None else self._latest.graph

    @property
    def signatures(self) -> list[tuple]:
        """The input signatures (per input: shape, dtype, device) with a cached plan."""
        return list(self._plans)

    @property
    def plan(self) -> Plan | None:
        return None if self._latest is None else self._latest.plan

    def report(self) -> Report:
        """What ran where and why, for the latest input signature."""
        if self._fallback_reason is not None:
            return self._model_report(
                self._fallback_reason, "the whole model runs as the original PyTorch code"
            )
        if self._latest is None:
            return Report(
                (),
                notes=(
                    "not compiled yet: call the module once (or pass example_inputs to optimize())",
                ),
            )
        report = self._latest.report
        if self._rebuilds:
            note = (
                f"plans rebuilt {self._rebuilds} time(s) because the original model's "
                f"parameters or buffers changed (latest: {self._rebuild_reason})"
            )
            report = dataclasses.replace(report, notes=(*report.notes, note))
        return report

    def _model_report(self, reason: str, note: str) -> Report:
        row = ReportRow(
            node=type(self._original).__name__,
            op="model",
            bound="-",
            group=None,
            runs_as=RunsAs.FALLBACK,
            reason=reason,
        )
        return Report((row,), notes=(note,))

    def refresh(self) -> None:
        """Rebuild every plan from the original model's current weights on the next call.

        In-place writes (``load_state_dict``, ``weight.mul_(3)``, optimizer steps, running
        statistics) and replaced parameters are noticed by themselves through PyTorch's
        version counters. Writes through ``.data`` (``p.data.add_(...)``, ``p.data = t``,
        ``model.half()``) and writes to inference tensors (a model built under
        ``torch.inference_mode()``) bypass those counters: call ``refresh()`` after them.
        """
        with self._compile_lock:
            self._forget_plans("refresh()")

    # ------------------------------------------------------------------ calling
    @staticmethod
    def _signature(inputs: Sequence[torch.Tensor]) -> tuple:
        return tuple((tuple(x.shape), x.dtype, x.device, _cl(x)) for x in inputs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._fallback_reason is not None:
            return self._original(*inputs, **kwargs)
        if kwargs:
            raise InputTypeError(
                f"keyword inputs ({', '.join(kwargs)}) are not supported; pass tensors positionally"
            )
        try:
            inputs = _dense(inputs)
            sig = tuple((tuple(x.shape), x.dtype, x.device, _cl(x)) for x in inputs)
        except AttributeError:
            self._check_types(inputs)
            raise
        if self._original.training:  # the plans compute inference semantics
            self._refuse_training()
        weights = self._weights
        if weights is not None and not weights.current():
            self._revalidate()
        entry = self._plans.get(sig)  # the fast path takes no lock
        if entry is None:
            entry, out = self._build(inputs, sig)
            if out is not _NOT_RUN:  # building it ran the original model on these inputs
                return out
            if entry is None:
                return self._original(*inputs)
        self._latest = entry
        with torch.no_grad():
            if entry.plan is None:  # this signature runs as the original model
                return self._original(*inputs)
            try:
                return entry.plan.run(inputs)
            except Exception as e:  # noqa: BLE001 - a plan bug must not reach the user
                return self._run_failed(inputs, sig, e)

    def _build(self, inputs: Sequence[torch.Tensor], sig: tuple) -> tuple[Compiled | None, Any]:
        """Double-checked: another thread may have built the signature while this one waited."""
        self._check_types(inputs)
        with _GLOBAL_COMPILE_LOCK, self._compile_lock:
            entry = self._plans.get(sig)
            if entry is not None:
                return entry, _NOT_RUN
            return self._compile(inputs, sig)

    def _run_failed(self, inputs: Sequence[torch.Tensor], sig: tuple, failure: Exception) -> Any:
        """A plan raised while running (validated inputs, so a middleware bug): this signature
        runs as the original model from now on, with the reason in report()."""
        if isinstance(failure, MiddlewareError) or getattr(self.options, "check_memory", False):
            raise failure  # raised on purpose, or a debug check the user asked to hear
        reason = self._internal_failure(
            f"the plan failed while running ({_first_line(failure)}); this input signature "
            "runs as the original PyTorch code",
            failure,
            stacklevel=3,
        )
        with self._compile_lock:
            self._runs_as_original(inputs, sig, reason)
        return self._original(*inputs)

    def _refuse_training(self) -> None:
        raise TrainingModeError(
            f"{type(self._original).__name__} is in training mode; training is not yet "
            "supported. Call model.eval() before running the optimized model"
        )

    def _revalidate(self) -> None:
        """The per-call check failed: drop the plans if a tensor really changed (the check
        also fails when any module anywhere registered a tensor)."""
        with self._compile_lock:
            old = self._weights
            if old is None or old.current():  # another thread got here first
                return
            now = WeightSnapshot.take(self._original)
            changed = old.changed(now)
            if changed:
                self._forget_plans(_names(changed))
            else:
                self._weights = now

    def _forget_plans(self, why: str) -> None:
        # A new dict: a thread that already looked its plan up finishes with it.
        self._plans = {}
        self._latest = None
        self._weights = None
        self._rebuilds += 1
        self._rebuild_reason = why

    def _check_types(self, inputs: Sequence[Any]) -> None:
        expected = (
            "" if self._specs is None else "(" + ", ".join(s.describe() for s in self._specs) + ")"
        )
        given = "(" + ", ".join(_describe_tensor(x) for x in inputs) + ")"
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                raise InputTypeError(
                    f"input {i} is a {type(x).__name__}; the optimized model takes tensors only"
                    + (f"; signature expected {expected}, given {given}" if expected else "")
                )
        if self._specs is None:
            return
        if len(inputs) != len(self._specs):
            raise InputMismatchError(
                f"expected {len(self._specs)} inputs {expected}, got {len(inputs)}: {given}"
            )
        for i, (x, s) in enumerate(zip(inputs, self._specs, strict=True)):
            if x.dim() != s.rank:
                raise InputMismatchError(
                    f"input {i}: expected rank {s.rank} ({s.describe()}), got rank {x.dim()} "
                    f"({_describe_tensor(x)}); signature expected {expected}, given {given}"
                    + _rank_fix(x.dim(), s.rank)
                )
            if s.channels is not None and int(x.shape[1]) != s.channels:
                raise InputMismatchError(
                    f"input {i}: expected {s.channels} channels ({s.describe()}), got "
                    f"{int(x.shape[1])} ({_describe_tensor(x)}); signature expected {expected}, "
                    f"given {given}"
                )
            if x.dtype != s.dtype:
                raise InputTypeError(
                    f"input {i}: expected dtype {s.dtype} ({s.describe()}), got {x.dtype}; "
                    f"signature expected {expected}, given {given}; convert the input with "
                    f"x.to({s.dtype})"
                )
            if x.device != s.device:
                raise InputTypeError(
                    f"input {i}: expected device {s.device} ({s.describe()}), got {x.device}; "
                    f"move the input with .to('{s.device}'); signature expected {expected}, "
                    f"given {given}"
                )

    def _compile(self, inputs: Sequence[torch.Tensor], sig: tuple) -> tuple[Compiled | None, Any]:
        """Build (and cache) this signature's plan: (the entry, or None when the whole model
        falls back; the model's output when building it had to run the model, else _NOT_RUN).
        Called under the process-wide compile lock (and the module's, after __init__)."""
        if self._original.training:  # switched back to training after optimize()
            self._refuse_training()
        device = torch.device(self.options.device)
        for i, x in enumerate(inputs):
            if x.device.type != device.type:
                raise InputTypeError(
                    f"input {i} is on {x.device} but the model was optimized for "
                    f"device={self.options.device!r}; move the input with .to('{device}')"
                )
        before = WeightSnapshot.take(self._original)
        if self._weights is not None:  # moved storage (p.data = ...) shows only here
            changed = self._weights.changed(before)
            if changed:
                self._forget_plans(_names(changed))
        reason = _unsupported_inputs(inputs)
        if reason is not None:
            return self._runs_as_original(inputs, sig, reason), _NOT_RUN
        saved = [(b, b.detach().clone()) for b in self._original.buffers()]
        failure: Exception | None = None
        try:
            entry = self._compile_fn(self._original, inputs, self.options)
        except Exception as e:  # noqa: BLE001 - a compiler crash must never reach the user
            failure = e
        after = WeightSnapshot.take(self._original)
        mutated = [n for n in before.changed(after) if n in before.names]
        if mutated:
            return self._mutates_state(mutated, saved, failure), _NOT_RUN
        if isinstance(failure, MiddlewareError) and not isinstance(failure, UnsupportedError):
            raise failure  # CompileError under strict=True
        if failure is not None:
            return self._compile_failed(inputs, sig, failure)
        self._weights = after
        self._register(inputs, sig, entry)
        return entry, _NOT_RUN

    def _register(self, inputs: Sequence[torch.Tensor], sig: tuple, entry: Compiled) -> None:
        if self._specs is None:
            self._specs = [InputSpec.of(x) for x in inputs]
        self._plans[sig] = entry
        self._latest = entry

    def _fall_back(self, reason: str) -> None:
        """The whole model runs as the original PyTorch code from now on."""
        warnings.warn(
            f"middleware: running {type(self._original).__name__} as the original "
            f"PyTorch model: {reason}",
            stacklevel=4,
        )
        self._fallback_reason = reason

    def _mutates_state(
        self,
        names: list[str],
        saved: list[tuple[torch.Tensor, torch.Tensor]],
        failure: Exception | None,
    ) -> None:
        """forward() writes the model's own parameters or buffers (a counter, a batch-norm
        in training mode): a plan would freeze them. Tracing ran forward() once, so the
        buffers get their values back before the original model runs."""
        with torch.no_grad():
            for b, old in saved:
                b.copy_(old)
        reason = (
            f"forward() updates {_names(names)} in place (e.g. a counter buffer, or a "
            "BatchNorm with track_running_stats in training mode); a compiled plan cannot "
            "update them, so the model runs as the original PyTorch code. Put every "
            "submodule in eval mode (model.eval()) or move the update out of forward() to "
            "optimize it"
        )
        if self.options.strict:
            raise UnsupportedError(reason) from failure
        self._fall_back(reason)

    def _compile_failed(
        self, inputs: Sequence[torch.Tensor], sig: tuple, failure: Exception
    ) -> tuple[Compiled | None, Any]:
        """Building the plan raised. If the model itself rejects these inputs in eager PyTorch
        the user gets one clear error and the module stays as it was (one bad call must not
        degrade it). Otherwise: a construct the middleware cannot lower (TraceError,
        UnsupportedError) runs the whole model as the original, any other exception is a
        compiler bug and only this signature does; either way the reason is in report() and
        the original's output, computed here, is this call's result."""
        try:
            with torch.no_grad():
                out = self._original(*inputs)
        except Exception as model_error:  # noqa: BLE001 - re-raised as the user's error
            raise _rejected(self._original, inputs, model_error) from model_error
        if isinstance(failure, UnsupportedError):
            if self.options.strict:
                raise failure
            self._fall_back(str(failure))
            return None, out
        reason = self._internal_failure(
            f"the compiler failed on this input signature ({_first_line(failure)}); it runs "
            "as the original PyTorch code",
            failure,
            stacklevel=4,
        )
        return self._runs_as_original(inputs, sig, reason), out

    def _internal_failure(self, reason: str, failure: Exception, stacklevel: int) -> str:
        """A middleware bug met while compiling or running a signature: ``InternalError``
        under ``strict``, else a warning naming the model; returns ``reason``."""
        if self.options.strict:
            raise InternalError(reason) from failure
        warnings.warn(
            f"middleware: {type(self._original).__name__}: {reason}", stacklevel=stacklevel + 1
        )
        return reason

    def _runs_as_original(
        self, inputs: Sequence[torch.Tensor], sig: tuple, reason: str
    ) -> Compiled:
        """An entry for a signature that runs as the original model (no plan)."""
        entry = Compiled(
            None,
            None,
            self._model_report(reason, "this input signature runs as the original model"),
        )
        self._register(inputs, sig, entry)
        return entry

    def profile(
        self,
        inputs: Sequence[torch.Tensor] | torch.Tensor,
        repeats: int = 5,
        warmup: int = 1,
        **options: Any,
    ) -> ProfileResult:
        """Peak memory and latency of the original and this optimized model side by side
        (``middleware.profile``); returns a ``ProfileResult``. ``options`` (settings of a
        new ``optimize()``) do not apply: this module is optimized already."""
        return measure(self._original, self, inputs, repeats=repeats, warmup=warmup)

    def extra_repr(self) -> str:
        return (
            f"original={type(self._original).__name__}, device={self.options.device!r}, "
            f"signatures={len(self._plans)}"
        )


def _names(names: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def _rank_fix(got: int, want: int) -> str:
    if got == want - 1:
        return "; add the batch dimension with x.unsqueeze(0)"
    return f"; pass a {want}-d tensor"
