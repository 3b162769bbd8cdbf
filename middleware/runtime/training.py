"""Training plans: the optimized module in train mode, with autograd through every step.

A training plan (:class:`TrainingPlan`) is the inference pipeline's graph run as a sequence
of steps over fresh framework tensors (no buffer arena: autograd keeps what it saves), on
the user's own parameters and buffers (no copies, no batch-norm folding, no prepacked or
transformed weights), so that ``loss.backward()`` fills the model's ``.grad`` and an
optimizer's in-place updates are what the next step reads.

- Each generated io group (``backends/cpu/units.fusion_units``) is one
  :class:`torch.autograd.Function` (:class:`FusedGroup`): its forward is the generated
  depth-first kernel and it saves only the group's inputs. Its backward is generated too
  where every node has a backward rule in the op registry (:class:`GeneratedBackward`:
  ``passes/autodiff.differentiate`` builds one backward graph per input gradient, which
  recomputes the forward nodes it needs from the saved inputs, and the same code
  generator makes it a depth-first kernel: intermediates recomputed inside its tiles, not
  stored; max-pooling routes through the recomputed argmax, ``op_reductions.py``).
  Elsewhere (no rule: adaptive max-pooling, a max-pool merged with an activation other
  than relu/hardtanh, a view or reduction whose output gradient arrives in broadcast form;
  a compile failure) the backward recomputes the group's
  intermediates with the nodes' catalogue implementations and differentiates them
  (``torch.autograd.grad``); ``report()`` says which, and why, per group.
- Convolutions, matrix products and every other node run through their catalogue
  implementations (PyTorch's functional ops), whose backward is the framework's.
- Batch-norm in training mode and dropout are the frontend's ``fallback`` nodes: the user's
  own module is called, so batch statistics, running statistics (momentum, cumulative
  average, ``num_batches_tracked``) and the random stream are PyTorch's, in eager order.
  With ``DECOMPOSE_BATCH_NORM`` (off: see there) a batch-norm is instead a statistics node
  and elementwise nodes that fuse (``decompose_batch_norm``).

``compile_training`` builds one for a model in train mode; a model it cannot build one for
runs as the original (with autograd), the reason in ``report()``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

from ..backends import backend_for
from ..backends.cpu.units import fusion_units
from ..backends.interface import node_step, to_tensor
from ..enums import RunsAs
from ..errors import UnsupportedError
from ..frontends import trace
from ..graph import PARAM_SOURCES, TRAINING, Graph, Node, TensorType, map_tree
from ..hardware import Hardware, for_options
from ..loops import NotFusable
from ..op_data import ValueRef
from ..ops import get_op, infer_types
from ..options import Options
from ..passes import DECOMPOSITIONS, run_passes
from ..passes.autodiff import Backward, Gradient, differentiate, fit
from ..passes.patterns import Rewrite
from .plan import Step
from .report import Report, make_report

# Passes that replace the user's weights by derived copies (batch-norm folded into the
# convolution's weight and bias; a post-op fused into the vendor call): a gradient must
# reach the parameters themselves, so a training plan runs without them.
# The decompositions (LayerNorm, softmax): a mean, sum or max over a map's last
# dims has no backward rule (ATen's norm and softmax backward run instead)
TRAINING_DISABLED_PASSES = (
    "fold_batchnorm",
    "fuse_vendor_epilogue",
    "fuse_depthwise",
    "fuse_stem",
    *DECOMPOSITIONS,
)

# A generated group of one op fuses nothing, and as an autograd function it would save its
# input where PyTorch's own backward saves what the op needs: a ReLU after a batch-norm
# keeps its output, which the next convolution keeps anyway, and the group would keep the
# batch-norm's output besides (resnet18, batch 8, 112x112, peak training I/O: eager
# 52.1 MiB, every group generated 61.9 MiB).
SINGLE_OP_REASON = (
    "a group of one op runs through PyTorch in training: its own backward saves less than "
    "the group's input"
)

# Frontend fallback reasons that mean "the framework's own training-mode layer" (the
# module rules refuse them for inference): reported as framework calls, not fallbacks.
_TRAINING_LAYERS = {
    "batch-norm in training mode": "batch statistics through PyTorch (the model's own "
    "module: running statistics updated on its buffers)",
    "batch_norm with training=True": "batch statistics through PyTorch (F.batch_norm on the "
    "model's buffers)",
    "dropout in training mode": "dropout through PyTorch's random stream (the model's own module)",
    # batch_norm_decomposed: the statistics node of a decomposed batch-norm
    "batch statistics of a decomposed batch-norm": "batch statistics through PyTorch (mean "
    "and inverse standard deviation per channel, running statistics updated on the model's "
    "buffers by ATen's own update); the normalisation is elementwise nodes fused with their "
    "neighbours",
    "dropout with training=True": "dropout through PyTorch's random stream (F.dropout)",
}


# Batch-norm in training mode as a statistics node (PyTorch) and elementwise nodes that the
# io groups fuse with their neighbours (``decompose_batch_norm``); False: the user's module
# is called as one framework step. Off by default: the decomposed forward differs from
# ATen's in the last bit (ATen computes ``x * alpha + beta``; no spelling of it through
# PyTorch ops or the generated kernel is bitwise equal), which moves ReLU/ReLU6 kinks,
# and batch-norm's backward cancels its terms, so the gradients are 1e-4 of their scale
# from eager's (resnet18, batch 4, 32x32: 9e-5, where the module call is bitwise eager;
# mobilenet_v2 at batch 2 misses the 1e-4 criterion on some inputs; twenty SGD steps
# drift 5e-3 by step 3).
DECOMPOSE_BATCH_NORM = False
_DECOMPOSED = "batch statistics of a decomposed batch-norm"


def _memory_format(t: torch.Tensor) -> torch.memory_format:
    if (
        t.dim() == 4
        and not t.is_contiguous()
        and t.is_contiguous(memory_format=torch.channels_last)
    ):
        return torch.channels_last
    return torch.contiguous_format


class _BatchStats(torch.autograd.Function):
    """Per-channel batch mean and inverse standard deviation of ``x`` at (1, C, 1, 1), as
    eager's training-mode batch-norm saves them bit for bit (ATen's
    ``batch_norm_update_stats``, accumulated in float64, which also updates the running
    statistics where they are given; ``1 / sqrt(var + eps)`` in float64). Backward, from
    ``mean = sum(x) / n`` and ``invstd = (sum((x - mean)^2) / n + eps)^(-1/2)``:
    ``dx = g_mean / n - g_invstd * invstd^3 * (x - mean) / n``."""

    @staticmethod
    def forward(ctx: Any, x, running_mean, running_var, factor: float, eps: float):  # type: ignore[override]  # noqa: ANN001, ANN205
        mean, var = torch.batch_norm_update_stats(x, running_mean, running_var, factor)
        c = x.shape[1]
        mean = mean.view(1, c, 1, 1)
        invstd = (var.double() + eps).rsqrt().to(x.dtype).view(1, c, 1, 1)
        ctx.save_for_backward(x, mean, invstd)
        return mean, invstd

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g_mean, g_invstd):  # type: ignore[override]  # noqa: ANN001, ANN205
        x, mean, invstd = ctx.saved_tensors
        n = x.numel() // x.shape[1]
        if g_mean is None and g_invstd is None:
            return None, None, None, None, None
        # per-channel coefficients in float64, one rounding of each element's result
        a = torch.zeros_like(mean, dtype=torch.float64)
        if g_invstd is not None:
            a = g_invstd.double() * invstd.double().pow(3) * (-1.0 / n)
        c = -a * mean.double()
        if g_mean is not None:
            c = c + g_mean.double() / n
        dx = torch.addcmul(c, x.double(), a).to(x.dtype)
        return dx.contiguous(memory_format=_memory_format(x)), None, None, None, None


class BatchStatistics:
    """The batch statistics of a training-mode ``nn.BatchNorm2d`` (``module``): called on
    its input ``x``, returns ``(mean, invstd[, weight, bias])`` at shape (1, C, 1, 1):
    eager's own statistics, differentiable (:class:`_BatchStats`), and the affine
    parameters as views of the module's tensors (read at every call). Updates the
    module's running statistics as its forward does: ``num_batches_tracked`` counts the
    batch, the factor is ``momentum`` or, where it is None, the cumulative average's
    ``1 / num_batches_tracked``, and the update is ATen's (the unbiased variance, in
    float64: the same buffers bit for bit)."""

    def __init__(self, module: nn.BatchNorm2d) -> None:
        self.module = module

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        m = self.module
        factor, running = 0.0, (None, None)
        if m.training and m.track_running_stats and m.running_mean is not None:
            factor = 0.0 if m.momentum is None else float(m.momentum)
            if m.num_batches_tracked is not None:
                with torch.no_grad():
                    m.num_batches_tracked.add_(1)
                if m.momentum is None:
                    factor = 1.0 / float(m.num_batches_tracked)
            running = (m.running_mean, m.running_var)
        out = list(_BatchStats.apply(x, *running, factor, float(m.eps)))
        c = x.shape[1]
        if m.weight is not None:
            out.append(m.weight.view(1, c, 1, 1))
        if m.bias is not None:
            out.append(m.bias.view(1, c, 1, 1))
        return tuple(out)


def _decomposable(graph: Graph, node: Node) -> nn.BatchNorm2d | None:
    """The module of a training-mode batch-norm fallback node that decomposes: exactly
    ``nn.BatchNorm2d`` (a subclass may change its forward), no hooks, running statistics
    tracked, a 4-d float32 input with more than one value per channel (else PyTorch
    raises, which calling the module keeps)."""
    m = node.payload
    if node.op != "fallback" or type(m) is not nn.BatchNorm2d:
        return None
    if node.attrs.get("reason") != "batch-norm in training mode" or len(node.outputs) != 1:
        return None
    args = node.attrs.get("args", ())
    if len(args) != 1 or not isinstance(args[0], ValueRef) or args[0].index != 0:
        return None
    if node.attrs.get("kwargs") or len(node.inputs) != 1:
        return None
    if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks:
        return None
    if not (m.training and m.track_running_stats and m.running_mean is not None):
        return None
    t = graph.values[node.inputs[0]]
    if t.rank != 4 or t.dtype != "float32" or t.shape[0] * t.shape[2] * t.shape[3] <= 1:
        return None
    return m


def decompose_batch_norm(graph: Graph) -> Graph:
    """Each decomposable training-mode batch-norm (``_decomposable``) of ``graph`` as a
    :class:`BatchStatistics` fallback node (the batch-norm's name, so ``report()`` keeps
    its row) and ``(x - mean) * invstd [* weight] [+ bias]``: elementwise nodes over
    per-channel operands, which the passes group with the ReLU and residual add after it
    and whose generated backward gives the gradients of ``x``, the statistics and the
    affine parameters (summed over N, H, W by ``autodiff.fit``); autograd then carries the
    statistics' gradients back to ``x`` through ``torch.var_mean``. Together that is
    batch-norm's backward; the group stores its input and the per-channel tensors only."""
    rw = Rewrite(graph)
    for node in graph.nodes():
        m = _decomposable(graph, node)
        if m is None:
            continue
        (x,) = node.inputs
        (y,) = node.outputs
        xt = graph.values[x]
        c = xt.shape[1]
        per_channel = TensorType((1, c, 1, 1), "float32", xt.layout)
        names = ["mean", "invstd"] + ["weight"] * (m.weight is not None)
        names += ["bias"] * (m.bias is not None)
        outs = tuple(rw.fresh(f"{node.name}_{n}") for n in names)
        attrs = {**node.attrs, "reason": _DECOMPOSED}
        payload = BatchStatistics(m)
        stats = Node(node.name, "fallback", (x,), outs, attrs, source=node.source, payload=payload)
        emitted: list[tuple[Node, list[TensorType]]] = [(stats, [per_channel] * len(outs))]
        values = dict(graph.values)
        values.update(dict.fromkeys(outs, per_channel))
        v = x
        steps = [("sub", outs[0]), ("mul", outs[1])] + [
            ("mul" if n == "weight" else "add", o) for n, o in zip(names[2:], outs[2:], strict=True)
        ]
        for i, (op, operand) in enumerate(steps):
            out = y if i == len(steps) - 1 else rw.fresh(f"{node.name}_{op}")
            n = Node(
                rw.fresh(f"{node.name}_{op}"), op, (v, operand), (out,), {}, source=node.source
            )
            (t,) = infer_types(values, n)
            values[out] = t
            emitted.append((n, [t]))
            v = out
        rw.replace(node.name, emitted)
    return rw.build()


class _GroupFunction(torch.autograd.Function):
    """One fused group: forward = the generated kernel, backward = recompute + autograd."""

    @staticmethod
    def forward(ctx: Any, group: FusedGroup, *inputs: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.group = group
        if group.relu_of_sum:  # the output only (see ``relu_of_sum``)
            out = group.kernel(*inputs)
            ctx.shapes = [tuple(x.shape) for x in inputs]
            ctx.save_for_backward(out)
            return out
        ctx.save_for_backward(*inputs)
        return group.kernel(*inputs)

    @staticmethod
    @once_differentiable  # a second derivative through it raises instead of being wrong
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        group: FusedGroup = ctx.group
        need = ctx.needs_input_grad[1:]
        if group.relu_of_sum:
            (gy,) = grads
            (y,) = ctx.saved_tensors
            if gy is None:
                return (None,) * (1 + len(need))
            # ReLU's own backward (eager's, from its output), passed unchanged by the adds
            g = torch.ops.aten.threshold_backward(gy, y, 0)
            return (
                None,
                *[fit(g, sh) if n else None for sh, n in zip(ctx.shapes, need, strict=True)],
            )
        if group.backward is not None:
            try:
                return (None, *group.backward(ctx.saved_tensors, need, grads))
            except Exception as e:  # noqa: BLE001 - a kernel that cannot run: PyTorch's way
                warnings.warn(
                    f"group {group.name}'s generated backward failed ({type(e).__name__}: "
                    f"{e}); this step recomputes it through PyTorch",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return (None, *group.input_grads(ctx.saved_tensors, need, grads))


@dataclasses.dataclass(frozen=True)
class GeneratedGradient:
    """One input's gradient: ``kernel(*args)`` (values by name: the group's inputs and the
    output gradient), or the value ``args[0]`` itself where ``kernel`` is None (an add's
    operand), in broadcast form where ``fit_to`` is not None (``autodiff.fit``: expanded
    and summed to the input's shape through PyTorch)."""

    name: str
    value: str  # the gradient's value in the backward graph (inputs sharing it share a call)
    kernel: Callable[..., torch.Tensor] | None
    args: tuple[str, ...]
    fit_to: tuple[int, ...] | None


@dataclasses.dataclass(frozen=True)
class GeneratedBackward:
    """A group's backward as generated kernels (``passes/autodiff.py``), one per distinct
    input gradient; ``inputs`` and ``grad_output`` name the values its kernels read."""

    inputs: tuple[str, ...]
    grad_output: str
    gradients: tuple[GeneratedGradient | None, ...]

    def kernels(self) -> list[str]:
        """One line per kernel (per distinct gradient): its name and the inputs whose
        gradient it computes (two kernels of a group may share a name)."""
        by_value: dict[str, tuple[str, list[str]]] = {}
        for x, g in zip(self.inputs, self.gradients, strict=True):
            if g is not None and g.kernel is not None:
                by_value.setdefault(g.value, (g.name, []))[1].append(x)
        return [f"{name} -> d {', '.join(xs)}" for name, xs in by_value.values()]

    def __call__(
        self,
        saved: Sequence[torch.Tensor],
        need: Sequence[bool],
        grads: Sequence[torch.Tensor | None],
    ) -> list[torch.Tensor | None]:
        (gy,) = grads
        if gy is None:
            return [None] * len(saved)
        env = dict(zip(self.inputs, saved, strict=True))
        env[self.grad_output] = gy
        done: dict[str, torch.Tensor] = {}
        out: list[torch.Tensor | None] = []
        for g, n in zip(self.gradients, need, strict=True):
            if g is None or not n:
                out.append(None)
                continue
            if g.kernel is None:
                r = env[g.args[0]]
            else:
                r = done.get(g.value)
                if r is None:
                    r = done[g.value] = g.kernel(*[env[a] for a in g.args])
            out.append(fit(r, g.fit_to))
        return out


@dataclasses.dataclass(frozen=True)
class FusedGroup:
    """A generated io group as an autograd function over its inputs (values and weights).

    ``kernel``: the generated kernel (inputs -> a fresh output tensor); ``nodes``: the
    group's nodes as (catalogue implementation, input names, output names), in order, to
    recompute its intermediates in the backward pass."""

    name: str
    kernel: Callable[..., torch.Tensor]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: tuple[tuple[Callable[..., Any], tuple[str, ...], tuple[str, ...]], ...]
    # the generated backward; None: recompute through PyTorch (``input_grads``)
    backward: GeneratedBackward | None = None
    # ReLU of a sum of the inputs (``relu_of_sum``): saves its output, not its inputs
    relu_of_sum: bool = False

    @staticmethod
    def of(
        graph: Graph,
        name: str,
        kernel: Callable[..., Any],
        inputs,  # noqa: ANN001
        outputs,  # noqa: ANN001
        nodes,  # noqa: ANN001
        backward=None,  # noqa: ANN001
        relu_of_sum: bool = False,
    ):  # noqa: ANN205
        steps = tuple(
            (
                get_op(graph.node(n).op).bind(graph.node(n)),
                graph.node(n).inputs,
                graph.node(n).outputs,
            )
            for n in nodes
        )
        return FusedGroup(name, kernel, tuple(inputs), tuple(outputs), steps, backward, relu_of_sum)

    def __call__(self, *xs: torch.Tensor) -> Any:
        if torch.is_grad_enabled() and any(x.requires_grad for x in xs):
            return _GroupFunction.apply(self, *xs)
        return self.kernel(*xs)

    def recompute(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The group's outputs from its inputs through the catalogue implementations."""
        env = dict(zip(self.inputs, xs, strict=True))
        for fn, ins, outs in self.nodes:
            r = fn(*[env[i] for i in ins])
            if len(outs) == 1:
                env[outs[0]] = r
            else:
                env.update(zip(outs, r, strict=True))
        return [env[o] for o in self.outputs]

    def input_grads(
        self,
        saved: Sequence[torch.Tensor],
        need: Sequence[bool],
        grads: Sequence[torch.Tensor | None],
    ) -> list[torch.Tensor | None]:
        """Gradients of the inputs ``need`` marks, recomputing the intermediates."""
        with torch.enable_grad():
            xs = [x.detach().requires_grad_(n) for x, n in zip(saved, need, strict=True)]
            outs = self.recompute(xs)
        pairs = [
            (o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad
        ]
        wrt = [x for x, n in zip(xs, need, strict=True) if n]
        if not pairs or not wrt:
            return [None] * len(xs)
        got = iter(
            torch.autograd.grad(
                [o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True
            )
        )
        return [next(got) if n else None for n in need]


class TrainingPlan:
    """Steps over value slots, each a framework call recorded by autograd (no arena).

    ``run`` takes the input tensors and returns the output structure; the weights are the
    user's own tensors, read at every call."""

    notes: tuple[str, ...] = ()
    consumes_inputs = False
    memory = None
    arena_bytes = 0

    def __init__(
        self,
        graph: Graph,
        steps: list[Step],
        slot_of: dict[str, int],
        constants: dict[int, torch.Tensor],
        state_buffers: Sequence[torch.Tensor],
    ) -> None:
        self.graph = graph
        self.steps = steps
        self.slot_of = slot_of
        self.input_slots = tuple(slot_of[v] for v in graph.inputs)
        template: list[Any] = [None] * len(slot_of)
        for s, t in constants.items():
            template[s] = t
        self._template = template
        self._program = [(st.fn, st.ins, st.outs, len(st.outs) > 1, st.frees) for st in steps]
        self._out_tree = graph.output_tree
        # the buffers a step updates in place (batch-norm running statistics), put back when
        # a run fails half-way so that running the original instead updates them once
        self.state_buffers = tuple(state_buffers)

    def arenas(self) -> list[torch.Tensor]:
        return []

    def param_tensors(self) -> list[torch.Tensor]:
        return [t for t in self._template if isinstance(t, torch.Tensor)]

    def run(self, inputs: Sequence[torch.Tensor]) -> Any:
        saved = [b.clone() for b in self.state_buffers]
        try:
            return self._run(inputs)
        except Exception:
            with torch.no_grad():
                for b, old in zip(self.state_buffers, saved, strict=True):
                    b.copy_(old)
            raise

    def _run(self, inputs: Sequence[torch.Tensor]) -> Any:
        env = list(self._template)
        for s, x in zip(self.input_slots, inputs, strict=True):
            env[s] = x
        for fn, ins, outs, multi, frees in self._program:
            r = fn(*[env[i] for i in ins])
            if multi:
                for o, v in zip(outs, r, strict=True):
                    env[o] = v
            else:
                env[outs[0]] = r
            for f in frees:
                env[f] = None
        slot_of = self.slot_of
        return map_tree(self._out_tree, lambda name: env[slot_of[name]])


def training_options(options: Options) -> Options:
    """``options`` as a training plan uses them: no pass that derives weights, no batch
    slicing (a slice's backward would need the whole batch's statistics), no buffer plan,
    no Winograd (transformed weights). ``layout="auto"`` is NCHW: a training-mode
    batch-norm runs through PyTorch and the layout pass puts a conversion on each side of
    every one under channels_last (mobilenet_v3_small, batch 2, one thread, CPU time of
    the backward pass: 78 ms channels_last, 58 ms NCHW, eager 45 ms)."""
    disabled = tuple(dict.fromkeys((*options.disable_passes, *TRAINING_DISABLED_PASSES)))
    return dataclasses.replace(
        options,
        disable_passes=disabled,
        batch_chunk=0,
        plan_memory=False,
        winograd=False,
        layout="nchw" if options.layout == "auto" else options.layout,
    )


def mode_key(model: nn.Module) -> tuple[bool, ...]:
    """The training flags of every submodule: a plan is traced for one combination."""
    return tuple(m.training for m in model.modules())


def compile_training(
    model: nn.Module, inputs: Sequence[torch.Tensor], options: Options
) -> tuple[Graph, TrainingPlan, Report]:
    """Trace ``model`` (in train mode) on ``inputs`` and build its training plan.

    Raises :class:`UnsupportedError` (the reason for ``report()``) where a training plan
    cannot be built: a device other than the CPU, or a parameter that needs a gradient and
    that a pass replaced by a derived copy."""
    device = torch.device(options.device)
    if device.type != "cpu":
        raise UnsupportedError(
            f"training plans run on the CPU only so far (device={options.device!r}); the "
            "model trains as the original PyTorch code"
        )
    options = training_options(options)
    graph = _trace_keeping_state(model, inputs)
    if DECOMPOSE_BATCH_NORM:
        graph = decompose_batch_norm(graph)
    traced_params = dict(graph.params)
    backend = backend_for(device)
    hardware = for_options(options)
    stateful = [n.name for n in graph.nodes() if n.op == "fallback"]
    graph = run_passes(graph, options, hardware)
    dropped = sorted(set(stateful) - {n.name for n in graph.nodes()})
    if dropped:
        raise UnsupportedError(
            f"forward() calls {', '.join(dropped[:3])} without using the result; the passes "
            "drop such calls, and in training mode they may update state (running "
            "statistics, the random stream), so the model trains as the original PyTorch code"
        )
    constants, owned, grads_lost = _bind_weights(model, graph, traced_params, device)
    if grads_lost:
        raise UnsupportedError(
            f"the passes replaced parameter(s) {', '.join(grads_lost[:3])} that need a "
            "gradient by derived copies; the model trains as the original PyTorch code"
        )
    why: dict[str, str] = {}
    fused = {}
    if options.fuse:
        fused, failed = fusion_units(backend, graph, options, hardware, why)
        why.update(failed)
    _drop_unusable(graph, fused, why, owned)
    from_output = {
        key for key, u in fused.items() if relu_of_sum(graph, u.nodes, u.inputs, u.outputs)
    }
    backward = backward_kernels(backend, graph, fused, options, hardware, skip=from_output)
    plan = _assemble(graph, fused, why, constants, device, backward, from_output)
    return graph, plan, make_report(graph, plan, hardware)


def _trace_keeping_state(model: nn.Module, inputs: Sequence[torch.Tensor]) -> Graph:
    """Trace with the model's buffers and the random stream put back afterwards: tracing a
    training-mode batch-norm counts a batch (``num_batches_tracked``) and a dropout may
    draw, and the first step must start from exactly the state eager PyTorch would."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    rng = torch.random.get_rng_state()
    try:
        graph = trace(model, inputs)
        # the passes must not fold a parameter that needs a gradient into a constant
        # (passes/canonicalize.py): the constant would cut its gradient path
        graph.meta[TRAINING] = True
        return graph
    finally:
        torch.random.set_rng_state(rng)
        with torch.no_grad():
            for b, old in saved:
                if not torch.equal(b, old):
                    b.copy_(old)


def _bind_weights(
    model: nn.Module, graph: Graph, traced: dict[str, Any], device: torch.device
) -> tuple[dict[str, torch.Tensor], set[str], list[str]]:
    """Each graph constant as the tensor a training step reads: the user's own parameter
    or buffer where the graph still holds what the frontend read from it, else a copy;
    the names bound to the user's tensors; the parameters needing a gradient that no step
    reads any more."""
    own = {}
    for t in list(model.parameters()) + list(model.buffers()):
        try:
            own.setdefault((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype), t)
        except RuntimeError:  # no plain storage
            continue
    sources = graph.meta.get(PARAM_SOURCES, {})

    def users(name: str) -> torch.Tensor | None:
        src = sources.get(name)
        if src is None:
            return None
        t = src[1]
        return own.get((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype))

    constants: dict[str, torch.Tensor] = {}
    owned: set[str] = set()
    for name, arr in graph.params.items():
        user = users(name)
        if user is not None and sources[name][0] is arr:
            constants[name] = user
            owned.add(name)
        else:
            constants[name] = to_tensor(arr, device, graph.values[name].layout)
    needed = {id(t): name for name in traced if (t := users(name)) is not None and t.requires_grad}
    kept = {id(t) for t in constants.values()}
    return constants, owned, sorted(n for i, n in needed.items() if i not in kept)


def _drop_unusable(
    graph: Graph, fused: dict[str, Any], why: dict[str, str], owned: set[str]
) -> None:
    """Drop (in place, the reason in ``why``) the generated groups a training plan does
    not use: a kernel holding a user tensor as a constant, a group of one op."""
    for key, u in list(fused.items()):
        baked = [
            v
            for name in u.nodes
            for v in graph.node(name).inputs
            if v in owned and v not in u.inputs
        ]
        if baked:  # the kernel holds their values as of this build: stale after a step
            del fused[key]
            for name in u.nodes:
                why[name] = (
                    f"its group's generated kernel holds {', '.join(sorted(set(baked)))} as "
                    "constants; a training step must read the model's current tensors"
                )
    for key, u in list(fused.items()):
        if len(u.nodes) == 1:
            del fused[key]
            why[u.nodes[0]] = SINGLE_OP_REASON


def relu_of_sum(
    graph: Graph, nodes: Sequence[str], inputs: Sequence[str], outputs: Sequence[str]
) -> bool:
    """Whether a group is ``relu(x1 + x2 + ...)`` of its inputs, each input added once with
    coefficient 1 (the residual ``add > relu`` of a ResNet block): its input gradients are
    all ReLU's backward from the group's output, which the next layer saves anyway. Saving
    the output instead of the inputs keeps one tensor per block fewer alive until the
    backward pass (eager's in-place ``out += identity; relu(out)`` saves only the output)."""
    if len(outputs) != 1 or len(nodes) < 2:
        return False
    *adds, last = (graph.node(n) for n in nodes)
    if last.op != "relu" or last.outputs != (outputs[0],) or len(last.inputs) != 1:
        return False
    made = set(inputs)
    used: list[str] = []
    for n in adds:
        if (
            n.op != "add"
            or len(n.inputs) != 2
            or n.attrs.get("alpha", 1) != 1
            or n.attrs.get("scalar") is not None
            or not set(n.inputs) <= made
        ):
            return False
        used += [v for v in n.inputs if v in inputs]
        made.add(n.outputs[0])
    # every add's result used once, by the next add or the relu: a tree over the inputs
    results = [n.outputs[0] for n in adds]
    reads = [v for n in (*adds, last) for v in n.inputs]
    return (
        last.inputs[0] == results[-1]
        and sorted(used) == sorted(inputs)
        and len(set(used)) == len(used)
        and all(reads.count(r) == 1 for r in results)
    )


def backward_kernels(
    backend: Any,
    graph: Graph,
    fused: dict[str, Any],
    options: Options,
    hardware: Hardware,
    skip: Collection[str] = (),
) -> dict[str, tuple[GeneratedBackward | None, str]]:
    """Per generated group (keyed as ``fused``, but those in ``skip``): its generated
    backward, or None and why its backward recomputes through PyTorch. The kernels build
    from a thread pool, as the forward groups do (``fusion_units``)."""
    result: dict[str, tuple[GeneratedBackward | None, str]] = {}
    todo: list[tuple[str, Gradient]] = []  # (group key, a distinct gradient to build)
    derived: dict[str, Backward] = {}
    for key, u in fused.items():
        if len(u.outputs) != 1:
            result[key] = (None, f"{len(u.outputs)} outputs")
            continue
        if key in skip:
            continue
        try:
            derived[key] = differentiate(graph, u.nodes, u.inputs, u.outputs[0])
        except NotFusable as e:
            result[key] = (None, str(e))
            continue
        seen: set[str] = set()
        for g in derived[key].gradients:
            if g is not None and g.nodes and g.value not in seen:
                seen.add(g.value)
                todo.append((key, g))
    workers = max(1, min(len(todo), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_build_gradient, backend, g, options, hardware) for _, g in todo]
        built = [f.result() for f in futures]
    kernels: dict[tuple[str, str], Any] = {}
    for (key, g), (kernel, err) in zip(todo, built, strict=True):
        if err is None:
            kernels[(key, g.value)] = kernel
            continue
        if not isinstance(err, NotFusable):  # a compile failure or a generator bug: say so
            warnings.warn(
                f"group {fused[key].name}'s backward recomputes through PyTorch: generating "
                f"the gradient of {g.input} failed with {type(err).__name__}: {err}",
                RuntimeWarning,
                stacklevel=2,
            )
        result.setdefault(key, (None, f"generating the gradient of {g.input} failed: {err}"))
    for key, b in derived.items():
        if key in result:
            continue
        grads: list[GeneratedGradient | None] = []
        for g in b.gradients:
            if g is None:
                grads.append(None)
            elif not g.nodes:
                grads.append(GeneratedGradient(g.value, g.value, None, (g.value,), g.fit_to))
            else:
                k = kernels[(key, g.value)]
                grads.append(GeneratedGradient(k.name, g.value, k.fn, tuple(k.inputs), g.fit_to))
        result[key] = (GeneratedBackward(tuple(fused[key].inputs), b.grad_output, tuple(grads)), "")
    return result


def _build_gradient(
    backend: Any, g: Gradient, options: Options, hardware: Hardware
) -> tuple[Any, BaseException | None]:
    """The kernel of one gradient graph, or the error (sorted out by the caller)."""
    try:
        kernel = backend.build(g.graph, g.nodes, options, hardware)
    except Exception as e:  # noqa: BLE001 - a generator failure keeps the PyTorch backward
        return None, e
    if tuple(kernel.outputs) != (g.value,):
        return None, RuntimeError(f"its kernel writes {kernel.outputs}, not {g.value}")
    return kernel, None


RELU_OF_SUM_NOTE = (
    "backward: ReLU's from the saved output (a ReLU of a sum saves its output, which the "
    "next layer keeps anyway, instead of its inputs)"
)


def backward_note(backward: GeneratedBackward | None, why: str) -> str:
    """The report's words on a generated group's backward."""
    if backward is not None:
        names = backward.kernels()
        if not names:
            return "backward: generated (the output gradient passes through; no kernel)"
        return f"backward: generated ({', '.join(names)}), recomputing from the group's inputs"
    return f"backward: PyTorch recompute + autograd ({why})"


def _assemble(
    graph: Graph,
    fused: dict[str, Any],
    why: dict[str, str],
    constants: dict[str, torch.Tensor],
    device: torch.device,
    backward: dict[str, tuple[GeneratedBackward | None, str]],
    from_output: Collection[str] = (),
) -> TrainingPlan:
    """The plan's steps (``from_output``: the fused groups that save their output, a ReLU
    of a sum, instead of their inputs)."""
    slot_of: dict[str, int] = {}

    def slot(v: str) -> int:
        return slot_of.setdefault(v, len(slot_of))

    for v in graph.inputs:
        slot(v)
    const_slots = {slot(name): t for name, t in constants.items()}
    units: list[
        tuple[str, RunsAs, Callable[..., Any], Sequence[str], Sequence[str], tuple, str]
    ] = []
    state: list[torch.Tensor] = []
    covered = {n for u in fused.values() for n in u.nodes}
    for n in graph.nodes():
        if n.name in fused:
            u = fused[n.name]
            bwd, bwd_why = backward.get(n.name, (None, "not derived"))
            ros = n.name in from_output
            group = FusedGroup.of(graph, u.name, u.fn, u.inputs, u.outputs, u.nodes, bwd, ros)
            note = RELU_OF_SUM_NOTE if ros else backward_note(bwd, bwd_why)
            units.append(
                (u.name, RunsAs.GENERATED, group, u.inputs, u.outputs, tuple(u.nodes), note)
            )
            continue
        if n.name in covered:
            continue
        runs_as, fn, reason = node_step(graph, n, device)
        if n.op == "fallback":
            if isinstance(n.payload, nn.Module):
                state += list(n.payload.buffers())
            elif isinstance(n.payload, BatchStatistics):
                state += list(n.payload.module.buffers())
            framework = _TRAINING_LAYERS.get(str(n.attrs.get("reason", "")))
            if framework is not None:
                runs_as, reason = RunsAs.VENDOR, framework
        elif not reason:
            reason = why.get(n.name, "")
        units.append((n.name, runs_as, fn, n.inputs, n.outputs, (n.name,), reason))
    keep = set(graph.inputs) | set(graph.params) | set(graph.output_values())
    last_use: dict[str, int] = {}
    for i, u in enumerate(units):
        for v in u[3]:
            last_use[v] = i
    steps = []
    for i, (name, runs_as, fn, ins, outs, nodes, reason) in enumerate(units):
        frees = tuple(slot(v) for v, j in last_use.items() if j == i and v not in keep)
        steps.append(
            Step(
                name,
                runs_as,
                fn,
                tuple(slot(v) for v in ins),
                tuple(slot(v) for v in outs),
                nodes,
                frees,
                reason,
            )
        )
    for v in graph.output_values():
        slot(v)
    plan = TrainingPlan(graph, steps, slot_of, const_slots, state)
    plan.notes = backward_summary(fused, backward, from_output)
    return plan


def backward_summary(
    fused: dict[str, Any],
    backward: dict[str, tuple[GeneratedBackward | None, str]],
    from_output: Collection[str] = (),
) -> tuple[str, ...]:
    """The report's note on the fused groups' backward: how many are generated, how many
    backpropagate from their saved output (``from_output``), and the reasons of the
    others (counted)."""
    if not fused:
        return ()
    why: dict[str, int] = {}
    for key in fused:
        if key in from_output:
            continue
        bwd, reason = backward.get(key, (None, "not derived"))
        if bwd is None:
            why[reason] = why.get(reason, 0) + 1
    done = len(fused) - sum(why.values()) - len(from_output)
    text = f"backward of fused groups: {done} of {len(fused)} generated"
    if from_output:
        text += f", {len(from_output)} ReLU of a sum from its saved output"
    if why:
        text += "; PyTorch recompute for " + "; ".join(f"{n}: {r}" for r, n in why.items())
    return (text,)
