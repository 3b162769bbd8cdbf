"""``OptimizedModule``: the ``torch.nn.Module`` that ``optimize()`` hands back."""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import operator
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.module import (  # the hooks nn.Module's call runs (its own check)
    _global_backward_hooks,
    _global_backward_pre_hooks,
    _global_forward_hooks,
    _global_forward_pre_hooks,
)

from ..enums import RunsAs
from ..errors import (
    InputTypeError,
    InternalError,
    MiddlewareError,
    UnsupportedError,
)
from ..graph import Graph
from ..options import Options
from . import shortcut as _shortcut
from .inputs import (
    InputSpec,
    channels_last,
    check_inputs,
    dense_signature,
    first_line,
    rejected,
    unsupported_inputs,
)
from .plan import Plan
from .planned_steps import Recycled
from .profile import ProfileResult, measure, measure_training
from .report import Report, ReportRow
from .training import compile_training, mode_key
from .weights import (
    WeightSnapshot,
    describe_names,
    install_registration_hooks,
    registration_cell,
    registrations,
)


@dataclasses.dataclass
class Compiled:
    """One input signature's passed graph, plan and report. ``plan`` is None for a signature
    that runs as the original model (``report`` says why)."""

    graph: Graph | None
    plan: Plan | None
    report: Report


# Held around every compile in the process: the fx tracer patches nn.Module.__call__ and
# __getattr__ globally while it traces, so two modules tracing at once (each under its own
# lock) break each other ("module is not installed as a submodule"). Re-entrant: a model
# that holds an OptimizedModule compiles it from inside its own trace. Always taken before
# a module's own lock, so the two never deadlock.
_GLOBAL_COMPILE_LOCK = threading.RLock()
_set_grad_enabled = torch._C._set_grad_enabled
_is_grad_enabled = torch.is_grad_enabled
_TRAINING = operator.attrgetter("training")
_TRAINING_ITEM = operator.itemgetter("training")


_module_call = nn.Module._wrapped_call_impl
_tracing_state = torch._C._get_tracing_state

_NOT_RUN = object()  # _compile's second result when it did not run the model itself
# The plan key of calls whose inputs are not all tensors (a detection model's list of
# images): one TorchDynamo capture serves them all, its guards telling the structures apart.
_STRUCTURED = ("inputs other than tensors",)

try:  # PyTorch's C++ tensor guards (TorchDynamo's): dtype, device, sizes, strides, dispatch
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - a build without TorchDynamo: every call takes the
    _TensorGuards = None  # Python signature


@dataclasses.dataclass(frozen=True)
class _Repeat:
    """The latest inference call's signature and plan, behind a C++ guard over its inputs.

    Every call of an optimized module computes its inputs' signature in Python (a few
    PyTorch queries per input: contiguity, shape, dtype, device). A call whose inputs match
    the previous call's exactly (same tensor type, dtype, device, sizes and strides,
    requires_grad and dispatch keys: TorchDynamo's ``TensorGuards``, one C++ call for all
    inputs) has the same signature, so it skips that: on a cold cache (the previous layer's
    data evicted the interpreter's and PyTorch's code) those queries cost tens of
    microseconds. Only inputs that were dense already are guarded (the guard checks their
    strides, so a hit is dense too)."""

    check: Callable[..., bool]
    sig: tuple
    entry: Compiled
    # the plan's native runner (Plan.run_native) where it has or may have one: the
    # shortcut of OptimizedModule.__call__
    native: Callable[[Sequence[torch.Tensor]], torch.Tensor | None] | None = None


def _repeat_of(inputs: Sequence[torch.Tensor], sig: tuple, entry: Compiled) -> _Repeat | None:
    if _TensorGuards is None or not inputs:
        return None
    try:
        guard = _TensorGuards(
            *inputs,
            dynamic_dims_sizes=[list(x.shape) for x in inputs],
            dynamic_dims_strides=[list(x.stride()) for x in inputs],
        )
    except Exception:  # noqa: BLE001 - another PyTorch's signature: the Python path only
        return None
    plan = entry.plan
    native = plan.run_native if getattr(plan, "may_run_native", False) else None  # type: ignore[union-attr]
    return _Repeat(guard.check, sig, entry, native)


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors inside nested lists, tuples and dicts of call inputs."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [t for x in tree for t in _tensor_leaves(x)]
    return []


class OptimizedModule(nn.Module):
    """Runs a model through the middleware's plans; same outputs as the original model.

    One plan is built and cached per input signature (shapes, dtype, device). Attributes:
    ``graph`` (the passed graph of the latest signature) and ``report()``. Plans are rebuilt
    when the original model's parameters or buffers change (see :meth:`refresh`). A module
    may be called from several threads: a known signature takes no lock, a new one compiles
    under the module's lock (and the process-wide one that tracing needs).
    """

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        """``nn.Module``'s call, with a shortcut for the commonest one: no hooks, not
        compiled or traced (what ``nn.Module`` itself checks), inputs of the previous
        call's kind, inference, current weights and a plan that runs as one C call (or
        whose steps run from Python, below). It
        takes four Python frames and the gradient-mode switch fewer than ``forward``'s
        path: 35-60 us on a cold cache (the previous layer's data evicted the
        interpreter's), a tenth of a 22 MB fused kernel's time. The call after it that
        succeeds makes the same shortcut one C++ function (``_fast``,
        runtime/shortcut.cpp: about 20 us cold), tried first from then on. A plan whose
        steps run from Python (a CUDA plan, a CPU plan without the native runner) takes
        the same tests and then runs its steps (``_run_repeat``): three frames fewer
        than through ``nn.Module``'s call (``bench/call_overhead.py``, a one-step CPU plan:
        13.2-13.7 -> 5.2-8.0 us of module overhead per call, two alternated runs each)."""
        fast = self._fast
        if fast is not None and not kwargs:
            # every test below and the native program's run as one C++ call
            # (runtime/shortcut.cpp); None: a test failed, the Python path decides again
            try:
                out = fast(inputs)
            except Exception as e:  # noqa: BLE001 - a plan bug must not reach the user
                with torch.no_grad():
                    return self._run_failed(inputs, fast.repeat.sig, e)
            if out is not None:
                return out
        repeat = self._repeat
        if (
            repeat is not None
            and self._fallback_reason is None
            and not kwargs
            and self._compiled_call_impl is None
            and not (
                self._forward_hooks
                or self._forward_pre_hooks
                or self._backward_hooks
                or self._backward_pre_hooks
                or _global_forward_hooks
                or _global_forward_pre_hooks
                or _global_backward_hooks
                or _global_backward_pre_hooks
            )
            and _tracing_state() is None
        ):
            # the tests of forward's _Repeat branch, inlined (a frame costs 3-5 us on a
            # cold cache): a change to one is a change to both
            try:
                same = repeat.check(*inputs)
            except TypeError:  # another number of inputs
                same = False
            if same and not self._training_call():
                weights = self._weights
                if weights is not None and weights.current():
                    if repeat.native is None:  # a plan whose steps run from Python
                        return self._run_repeat(repeat, inputs)
                    try:
                        out = repeat.native(inputs)
                    except Exception as e:  # noqa: BLE001 - a plan bug must not reach the user
                        with torch.no_grad():  # as forward's path runs the plan
                            return self._run_failed(inputs, repeat.sig, e)
                    if out is not None:
                        self.__dict__["_latest"] = repeat.entry
                        if fast is None or fast.repeat is not repeat or fast.weights is not weights:
                            # (a new snapshot of unchanged weights keeps the plans and the
                            # guard: the C++ call, tied to the old one, is made again)
                            self._make_fast(repeat, inputs)
                        return out
                    if not repeat.entry.plan.may_run_native:  # refused: no more tries
                        with self._compile_lock:  # unless another thread replaced the guard
                            if self.__dict__.get("_repeat") is repeat:
                                self.__dict__["_repeat"] = dataclasses.replace(repeat, native=None)
        # Bound at import, not inherited: torch.fx replaces nn.Module.__call__ for the whole
        # process while a model traces, and a call of this module from another thread
        # meanwhile would go through the tracer ("module is not installed as a submodule").
        return _module_call(self, *inputs, **kwargs)

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
        # every module of the original: a submodule switched to training mode on its own
        # (model.eval(); model.bn.train()) makes the call a training one, as in eager
        object.__setattr__(self, "_all_modules", tuple(model.modules()))
        self._watch_training()
        # mirrors the original's mode; train()/eval() on this module switch the original's
        nn.Module.train(self, model.training)
        self.options = options
        self._plans: dict[tuple, Compiled] = {}
        self._specs: list[InputSpec] | None = None
        self._latest: Compiled | None = None
        self._repeat: _Repeat | None = None  # the latest inference call, behind its guard
        # _repeat's call as one C++ function (runtime/shortcut.py), once made; the _repeat it
        # was refused for (not tried again)
        self._fast: Any = None
        self._fast_refused: _Repeat | None = None
        self._fast_why = ""  # why the latest plan's call could not be made C++
        self._fallback_reason: str | None = None
        self._compile_lock = threading.Lock()
        self._weights: WeightSnapshot | None = None  # what the cached plans were built from
        self._rebuilds = 0  # how often plans were dropped because the weights changed
        self._rebuild_reason = ""  # the latest such change, for report()
        # training plans, keyed by (input signature, every submodule's training flag); they
        # read the user's own tensors, so only a replaced tensor object rebuilds them
        self._train_plans: dict[tuple, Compiled] = {}
        self._train_weights: WeightSnapshot | None = None
        install_registration_hooks()
        if example_inputs is not None:
            inputs = (
                tuple(example_inputs)
                if not isinstance(example_inputs, torch.Tensor)
                else (example_inputs,)
            )
            structured = not all(isinstance(x, torch.Tensor) for x in inputs)
            if structured and model.training:
                self._check_types(inputs)  # training plans take tensors only
            if not structured:
                self._check_types(inputs)
            with _GLOBAL_COMPILE_LOCK:  # optimize() may run in several threads at once
                if structured:
                    self._compile(inputs, _STRUCTURED)
                elif model.training:
                    self._compile_train(inputs, (self._signature(inputs), mode_key(model)))
                else:
                    self._compile(inputs, self._signature(inputs))

    # ------------------------------------------------------------------ copies
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_compile_lock", None)  # a lock cannot be copied; each copy gets its own
        state["_repeat"] = None  # a C++ guard cannot be copied; the copy guards its own calls
        state["_fast"] = state["_fast_refused"] = None  # nor the C++ call
        state.pop("_training_dicts", None)  # the copy's own modules' (__setstate__)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._compile_lock = threading.Lock()
        self._watch_training()

    def _watch_training(self) -> None:
        """The attribute dictionaries of every module of the original, where each holds its
        ``training`` flag there (what ``nn.Module`` does): reading the flags from them is a
        third of the attribute lookups' cost, on every call. None (the lookups serve) where
        a module's class defines ``training`` itself."""
        mods = self.__dict__.get("_all_modules", ())
        plain = all("training" in vars(m) and not hasattr(type(m), "training") for m in mods)
        self.__dict__["_training_dicts"] = tuple(vars(m) for m in mods) if plain else None

    def __deepcopy__(self, memo: dict[int, Any]) -> OptimizedModule:
        # The copy's original is a copy too, with tensors of its own: plans built from (and
        # partly sharing memory with) this module's weights must not serve it, so it builds
        # its own on its first call.
        state = self.__getstate__()
        for key in (
            "_plans",
            "_latest",
            "_repeat",
            "_fast",
            "_weights",
            "_train_plans",
            "_train_weights",
        ):
            state.pop(key, None)
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        clone.__setstate__(copy.deepcopy(state, memo))
        clone._plans, clone._latest, clone._weights = {}, None, None
        clone._repeat = clone._fast = clone._fast_refused = None
        clone._train_plans, clone._train_weights = {}, None
        return clone

    # ------------------------------------------------------------------ modes
    def train(self, mode: bool = True) -> OptimizedModule:
        """Switch this module and the original model to training (or, ``False``, eval)
        mode; each mode runs plans of its own."""
        nn.Module.train(self, mode)
        self._original.train(mode)
        return self

    def named_modules(
        self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Any:
        """This module, then the original model's modules under the names they have there,
        so that ``parameters()``, ``named_parameters()`` and ``buffers()`` are the user's own
        tensors (an optimizer over ``optimized.parameters()``, ``zero_grad()``,
        ``DistributedDataParallel``). The original is still no child: ``.to()``/``.half()``
        on this module never reach it, and ``state_dict()`` stays the original's to keep."""
        if memo is None:
            memo = set()
        if self not in memo or not remove_duplicate:
            if remove_duplicate:
                memo.add(self)
            yield prefix, self
        yield from self._original.named_modules(memo, prefix, remove_duplicate)

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
        call = self._call_note()
        if call:
            report = dataclasses.replace(report, notes=(*report.notes, call))
        if self._rebuilds:
            note = (
                f"plans rebuilt {self._rebuilds} time(s) because the original model's "
                f"parameters or buffers changed (latest: {self._rebuild_reason})"
            )
            report = dataclasses.replace(report, notes=(*report.notes, note))
        return report

    def _call_note(self) -> str:
        """How an inference call reaches the latest plan, where it runs natively."""
        plan = getattr(self._latest, "plan", None)
        if not isinstance(plan, Plan) or plan.native is None:
            return ""
        fast, repeat = self._fast, self._repeat
        if fast is not None and fast.repeat is repeat and repeat.entry is self._latest:
            return "call: one C++ function (checks, output buffer and native program)"
        if not self.options.native_call:
            why = "off (Options.native_call)"
        elif self._fast_refused is not None and self._fast_refused is repeat:
            why = self._fast_why or _shortcut.why_not() or "this plan's call cannot be one"
        elif _shortcut.why_not():
            why = _shortcut.why_not()
        else:
            why = "made by the next repeated call"
        return f"call: the Python shortcut; the C++ call: {why}"

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
            self._train_plans, self._train_weights = {}, None

    # ------------------------------------------------------------------ calling
    @staticmethod
    def _signature(inputs: Sequence[torch.Tensor]) -> tuple:
        return tuple((tuple(x.shape), x.dtype, x.device, channels_last(x)) for x in inputs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._fallback_reason is not None:
            return self._original(*inputs, **kwargs)
        if kwargs:
            raise InputTypeError(
                f"keyword inputs ({', '.join(kwargs)}) are not supported; pass tensors positionally"
            )
        repeat = self._repeat
        if repeat is not None:
            # the call of the previous inputs' kind (the _Repeat guard): the fewest Python
            # operations to the plan, since a step-by-step GPU plan waits on this host time
            try:
                same = repeat.check(*inputs)
            except TypeError:  # another number of inputs
                same = False
            if same and not self._training_call():
                weights = self._weights  # None: plans forgotten meanwhile (another thread)
                if weights is not None and weights.current():
                    return self._run_repeat(repeat, inputs)
        try:
            dense_inputs, sig = dense_signature(inputs)
        except AttributeError:  # an input that is not a tensor
            return self._forward_structured(inputs)
        if self._training_call():
            # the inference plans compute eval semantics, of every submodule
            return self._forward_train(dense_inputs, (sig, mode_key(self._original)))
        weights = self._weights
        if weights is not None and not weights.current():
            self._revalidate()
        return self._plan_call(dense_inputs, sig, guard=dense_inputs is inputs)

    def _run_repeat(self, repeat: _Repeat, inputs: Sequence[torch.Tensor]) -> Any:
        """The plan of ``repeat`` on ``inputs`` (its guard passed, the weights current),
        without autograd: the end of forward's shortcut and of ``__call__``'s for a plan
        whose steps run from Python (a CUDA plan: its host time per call is what a
        step-by-step GPU plan waits on)."""
        entry = repeat.entry
        self.__dict__["_latest"] = entry
        grad = _is_grad_enabled()
        if grad:
            _set_grad_enabled(False)
        try:
            return entry.plan.run(inputs)
        except Exception as e:  # noqa: BLE001 - a plan bug must not reach the user
            return self._run_failed(inputs, repeat.sig, e)
        finally:
            if grad:
                _set_grad_enabled(True)

    def _training_call(self) -> bool:
        """The original, or any submodule switched on its own, is in training mode."""
        dicts = self._training_dicts
        if dicts is not None:
            try:
                return any(map(_TRAINING_ITEM, dicts))
            except KeyError:  # a flag deleted from a module's attributes: the lookups say
                pass
        return any(map(_TRAINING, self._all_modules))

    def _make_fast(self, repeat: _Repeat, inputs: Sequence[torch.Tensor]) -> None:
        """After a call that took the Python shortcut: make that call one C++ function
        (runtime/shortcut.cpp) for the inputs ``repeat`` guards, where the extension is
        loaded (else it starts building, and a later call tries again). A plan it cannot
        serve is refused once, not on every call."""
        if self.__dict__.get("_fast_refused") is repeat or not self.options.native_call:
            return
        ext = _shortcut.extension()
        if ext is None:
            if _shortcut.failed():  # not while it builds: a later call tries again
                self._fast_refused = repeat
            return
        with self._compile_lock:
            if self.__dict__.get("_repeat") is not repeat:
                return  # replaced meanwhile (another thread)
            self._fast_refused = repeat  # unless made below
            self._fast_why = ""
            plan = repeat.entry.plan
            native = plan.native
            weights, dicts = self._weights, self._training_dicts
            if dicts is None:
                self._fast_why = "a module's class defines its training flag itself"
                return
            if native is None or weights is None or not weights.current():
                return  # changed meanwhile (another thread): the next call decides
            pool = getattr(native.output_source, "__self__", None)
            with plan._busy:  # no call takes an output meanwhile
                try:
                    self._fast = self._shortcut_of(
                        ext, repeat, inputs, pool, native, weights, dicts
                    )
                except Exception as e:  # noqa: BLE001 - the Python shortcut serves
                    self._fast_why = f"the C++ call was refused ({first_line(e)})"
                    return
            self._fast_refused = None

    def _shortcut_of(
        self,
        ext: Any,
        repeat: _Repeat,
        inputs: Sequence[torch.Tensor],
        pool: Any,
        native: Any,
        weights: WeightSnapshot,
        dicts: tuple[dict, ...],
    ) -> Any:
        """The C++ call of ``repeat``'s plan (under the plan's lock)."""
        output = pool.adopt(ext) if isinstance(pool, Recycled) else native.output_source()
        return ext.Shortcut(
            module_dict=self.__dict__,
            repeat=repeat,
            weights=weights,
            entry=repeat.entry,
            inputs=tuple(inputs),
            global_hooks=(
                _global_forward_hooks,
                _global_forward_pre_hooks,
                _global_backward_hooks,
                _global_backward_pre_hooks,
            ),
            tracing_state=_tracing_state,
            training_dicts=dicts,
            registrations=registration_cell(),
            epoch=weights.epoch,
            tracked=weights.tracked,
            versions=weights.tracked_versions,
            threads=native.threads,
            lock=repeat.entry.plan._busy,
            run=ctypes.cast(native.run, ctypes.c_void_p).value,
            steps=ctypes.addressof(native.steps),
            n=native.n,
            names=tuple(native.names),
            output=output,
            keep=native,
        )

    def _plan_call(self, inputs: Sequence[Any], sig: tuple, guard: bool = False) -> Any:
        """The plan of ``sig`` (built on first use) run on ``inputs``, without gradients.
        ``guard``: the inputs are the caller's own (dense already), so the next call may
        take the ``_Repeat`` path."""
        entry = self._plans.get(sig)  # the fast path takes no lock
        if entry is None:
            entry, out = self._build(inputs, sig)
            if out is not _NOT_RUN:  # building it ran the original model on these inputs
                return out
            if entry is None:
                return self._original(*inputs)
        if guard and entry.plan is not None:
            # this call's inputs, which the guard missed (or a new plan): guard them
            repeat = _repeat_of(inputs, sig, entry)
            self.__dict__["_repeat"] = repeat
            if repeat is not None and self._plans.get(sig) is not entry:
                # another thread forgot or replaced the plans since the lookup: a guard
                # published now would serve the old plan to every later call
                self.__dict__["_repeat"] = None
        return self._run_plan(entry, inputs, sig)

    def _run_plan(self, entry: Compiled, inputs: Sequence[Any], sig: tuple) -> Any:
        # a plain attribute, not through nn.Module.__setattr__ (which looks the name up in
        # the parameter, buffer and module tables: a few microseconds on every call)
        self.__dict__["_latest"] = entry
        if torch.is_grad_enabled():
            # torch.no_grad() without its Python context manager (tens of microseconds
            # when the interpreter's caches are cold)
            _set_grad_enabled(False)
            try:
                return self._run_entry(entry, inputs, sig)
            finally:
                _set_grad_enabled(True)
        return self._run_entry(entry, inputs, sig)

    def _run_entry(self, entry: Compiled, inputs: Sequence[torch.Tensor], sig: tuple) -> Any:
        if entry.plan is None:  # this signature runs as the original model
            return self._original(*inputs)
        try:
            return entry.plan.run(inputs)
        except Exception as e:  # noqa: BLE001 - a plan bug must not reach the user
            return self._run_failed(inputs, sig, e)

    def _forward_structured(self, inputs: Sequence[Any]) -> Any:
        """A call with inputs that are not all tensors (a list of images, None, a number):
        the model through TorchDynamo (``compile_fn``: the frontend refuses such inputs with
        a ``TraceError``), whose subgraphs over tensors are optimized and whose guards follow
        the inputs' structure; inference only."""
        if self._training_call():
            self._check_types(inputs)  # raises: training plans take tensors only
        return self._plan_call(inputs, _STRUCTURED)

    def _build(self, inputs: Sequence[torch.Tensor], sig: tuple) -> tuple[Compiled | None, Any]:
        """Double-checked: another thread may have built the signature while this one waited."""
        if sig is not _STRUCTURED:
            self._check_types(inputs)
        with _GLOBAL_COMPILE_LOCK, self._compile_lock:
            entry = self._plans.get(sig)
            if entry is not None:
                return entry, _NOT_RUN
            return self._compile(inputs, sig)

    def _run_failed(self, inputs: Sequence[torch.Tensor], sig: tuple, failure: Exception) -> Any:
        """A plan raised while running. Where the original model rejects the same inputs in
        eager PyTorch (a float64 input to a float32 model, whose plan built), the user gets
        that one clear error and the module forgets the signature (and the input spec taken
        from it, when it was the first); otherwise it is a middleware
        bug: this signature runs as the original model from now on, with the reason in
        report(), and this call returns the original's output."""
        if isinstance(failure, MiddlewareError) or getattr(self.options, "check_memory", False):
            raise failure  # raised on purpose, or a debug check the user asked to hear
        try:
            out = self._original(*inputs)
        except Exception as model_error:  # noqa: BLE001 - re-raised as the user's error
            with self._compile_lock:  # the module as before this call: no plan, no spec
                self._plans.pop(sig, None)
                self._repeat = None
                self._fast = None  # (it ran that _repeat's plan)
                if not self._plans:
                    self._specs = None  # taken from these inputs, which nothing accepts
            raise rejected(self._original, inputs, model_error) from model_error
        reason = self._internal_failure(
            f"the plan failed while running ({first_line(failure)}); this input signature "
            "runs as the original PyTorch code",
            failure,
            stacklevel=4,
        )
        with self._compile_lock:
            self._runs_as_original(inputs, sig, reason)
        return out

    # ------------------------------------------------------------------ training
    def _forward_train(self, inputs: Sequence[torch.Tensor], key: tuple) -> Any:
        """A call in training mode: the signature's training plan (outputs with autograd
        history over the user's own parameters), built on first use."""
        if self._train_weights is not None and self._train_weights.epoch != registrations():
            self._check_train_weights()
        entry = self._train_plans.get(key)
        if entry is None:
            self._check_types(inputs)
            with _GLOBAL_COMPILE_LOCK, self._compile_lock:
                entry = self._train_plans.get(key)
                if entry is None:
                    entry = self._compile_train(inputs, key)
        self.__dict__["_latest"] = entry
        if entry.plan is None:
            return self._original(*inputs)
        try:
            return entry.plan.run(inputs)
        except Exception as e:  # noqa: BLE001 - a plan bug must not reach the user
            if isinstance(e, MiddlewareError) or self.options.strict:
                raise
            reason = self._internal_failure(
                f"the training plan failed while running ({first_line(e)}); this input "
                "signature trains as the original PyTorch code",
                e,
                stacklevel=3,
            )
            with self._compile_lock:
                self._train_plans[key] = self._original_entry(reason)
            return self._original(*inputs)

    def _compile_train(self, inputs: Sequence[torch.Tensor], key: tuple) -> Compiled:
        """Build (and cache) the training plan of ``key``; where none can be built the
        signature trains as the original model, the reason in report()."""
        device = torch.device(self.options.device)
        for i, x in enumerate(inputs):
            for t in _tensor_leaves(x):
                if t.device.type != device.type:
                    raise InputTypeError(
                        f"input {i} is on {t.device} but the model was optimized for "
                        f"device={self.options.device!r}; move the input with .to('{device}')"
                    )
        reason = unsupported_inputs(inputs)
        entry: Compiled | None = None
        if reason is None:
            try:
                graph, plan, report = compile_training(self._original, inputs, self.options)
                entry = Compiled(graph, plan, report)  # type: ignore[arg-type]
            except UnsupportedError as e:
                if self.options.strict:
                    raise
                reason = str(e)
            except MiddlewareError:
                raise
            except Exception as e:  # noqa: BLE001 - a compiler crash must never reach the user
                reason = self._internal_failure(
                    f"the compiler failed on this input signature in training mode "
                    f"({first_line(e)}); it trains as the original PyTorch code",
                    e,
                    stacklevel=4,
                )
        if entry is None:
            entry = self._original_entry(reason or "")
        if self._specs is None:
            self._specs = [InputSpec.of(x) for x in inputs]
        if self._train_weights is None:
            self._train_weights = WeightSnapshot.take(self._original)
        self._train_plans[key] = entry
        self._latest = entry
        return entry

    def _original_entry(self, reason: str) -> Compiled:
        return Compiled(
            None,
            None,
            self._model_report(reason, "this input signature trains as the original model"),
        )

    def _check_train_weights(self) -> None:
        """Some module registered a tensor: drop the training plans if the original's
        parameters or buffers are other objects now (an in-place write needs nothing)."""
        with self._compile_lock:
            old = self._train_weights
            if old is None or old.epoch == registrations():
                return
            now = WeightSnapshot.take(self._original)
            same = old.names == now.names and all(
                a is b for a, b in zip(old.tensors, now.tensors, strict=True)
            )
            if same:
                self._train_weights = now
            else:
                self._train_plans, self._train_weights = {}, None

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
                self._forget_plans(describe_names(changed))
            else:
                self._weights = now

    def _forget_plans(self, why: str) -> None:
        # A new dict: a thread that already looked its plan up finishes with it.
        self._plans = {}
        self._latest = None
        self._repeat = None
        self._fast = None  # (it ran that _repeat's plan)
        self._weights = None
        self._rebuilds += 1
        self._rebuild_reason = why

    def _check_types(self, inputs: Sequence[Any]) -> None:
        check_inputs(self._specs, inputs)

    def _compile(self, inputs: Sequence[torch.Tensor], sig: tuple) -> tuple[Compiled | None, Any]:
        """Build (and cache) this signature's plan: (the entry, or None when the whole model
        falls back; the model's output when building it had to run the model, else _NOT_RUN).
        Called under the process-wide compile lock (and the module's, after __init__)."""
        device = torch.device(self.options.device)
        for i, x in enumerate(inputs):
            for t in _tensor_leaves(x):
                if t.device.type != device.type:
                    raise InputTypeError(
                        f"input {i} is on {t.device} but the model was optimized for "
                        f"device={self.options.device!r}; move the input with .to('{device}')"
                    )
        before = WeightSnapshot.take(self._original)
        if self._weights is not None:  # moved storage (p.data = ...) shows only here
            changed = self._weights.changed(before)
            if changed:
                self._forget_plans(describe_names(changed))
        reason = unsupported_inputs(inputs) if sig is not _STRUCTURED else None
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
        if self._specs is None and sig is not _STRUCTURED:
            self._specs = [InputSpec.of(x) for x in inputs]
        self._plans[sig] = entry
        self._latest = entry
        self._repeat = None  # it may have guarded the entry this one replaces
        self._fast = None  # (it ran that _repeat's plan)

    def _fall_back(self, reason: str) -> None:
        """The whole model runs as the original PyTorch code from now on."""
        warnings.warn(
            f"middleware: running {type(self._original).__name__} as the original "
            f"PyTorch model: {reason}",
            stacklevel=4,
        )
        self._fallback_reason = reason
        self._repeat = None  # its shortcut would run a plan
        self._fast = None  # (it ran that _repeat's plan)

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
            f"forward() updates {describe_names(names)} in place (e.g. a counter buffer, or a "
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
            raise rejected(self._original, inputs, model_error) from model_error
        if isinstance(failure, UnsupportedError):
            if self.options.strict:
                raise failure
            self._fall_back(str(failure))
            return None, out
        reason = self._internal_failure(
            f"the compiler failed on this input signature ({first_line(failure)}); it runs "
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
        train: bool = False,
        **options: Any,
    ) -> ProfileResult:
        """Peak memory and latency of the original and this optimized model side by side
        (``middleware.profile``); returns a ``ProfileResult``. ``options`` (settings of a
        new ``optimize()``) do not apply: this module is optimized already. ``train=True``:
        one training step each (on copies, see ``runtime.profile.measure_training``)."""
        if train:
            return measure_training(self._original, self, inputs, repeats=repeats, warmup=warmup)
        return measure(self._original, self, inputs, repeats=repeats, warmup=warmup)

    def extra_repr(self) -> str:
        return (
            f"original={type(self._original).__name__}, device={self.options.device!r}, "
            f"signatures={len(self._plans)}"
        )
