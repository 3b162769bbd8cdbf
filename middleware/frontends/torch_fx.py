"""PyTorch frontend: ``torch.fx`` tracing with concrete shapes, lowered to the middleware graph.

The tracer (``tracer.py``) runs the model on the example inputs while it records it, so
every fx node carries the real value it produced. Shape queries (``x.size()``,
``x.shape``, ``x.dim()``, ``len(x)``) answer with concrete numbers instead of recording
nodes: the graph is specialised to the input signature, exactly like the plan that runs
it. Data-dependent control flow still fails to trace (fx refuses ``bool()`` of a traced
value) and the model then runs unchanged.

Lowering (``lowering.py``) maps modules, functionals and tensor methods alike (``nn.ReLU``,
``F.relu``, ``torch.relu``, ``x.relu()``, in-place variants) onto one registry op each,
through the rule tables of ``module_rules.py`` and ``function_rules.py``. In-place ops
become functional: later readers of the mutated value read the op's result instead.
Anything not understood becomes a ``fallback`` node that calls the original callable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import TraceError
from ..graph import Graph
from .function_rules import FUNCTION_RULES, METHOD_RULES, NOOP_FUNCTIONS
from .lowering import Lowering, Rules
from .module_rules import MODULE_RULES
from .shape_rules import SHAPE_FUNCTION_RULES, SHAPE_METHOD_RULES, SHAPE_MODULE_RULES
from .tracer import ValueTracer, restore_containers

RULES = Rules(
    {**MODULE_RULES, **SHAPE_MODULE_RULES},
    {**FUNCTION_RULES, **SHAPE_FUNCTION_RULES},
    {**METHOD_RULES, **SHAPE_METHOD_RULES},
    NOOP_FUNCTIONS,
)


@contextlib.contextmanager
def _constants_off_the_model(model: nn.Module) -> Iterator[None]:
    """fx stores each constant tensor a traced call reads (a value folded at trace time) as
    an attribute ``_tensor_constant<i>`` of the model itself; the user's model must not
    change (nor hold the constants of every trace), so those attributes go afterwards."""
    before = set(vars(model))
    try:
        yield
    finally:
        for k in set(vars(model)) - before:
            if k.startswith("_tensor_constant"):
                delattr(model, k)


def trace(model: nn.Module, example_inputs: Sequence[torch.Tensor]) -> Graph:
    """Lower ``model`` called on ``example_inputs`` into a middleware :class:`Graph`.

    The graph is specialised to the inputs' shapes. Raises :class:`TraceError` when
    ``torch.fx`` cannot capture the model (the message names fx's error).
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    examples = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in example_inputs]
    # First on fake tensors (fast, no data); a model that needs real data to trace (an op
    # without a fake implementation, a value read back to Python) is traced on the real
    # example inputs instead.
    with _constants_off_the_model(model):
        try:
            tracer = ValueTracer(examples, fake=True)
            fx_graph = tracer.trace(model)
        except Exception:  # noqa: BLE001 - retried on real data just below
            tracer = ValueTracer(examples)
            try:
                fx_graph = tracer.trace(model)
            except Exception as e:  # noqa: BLE001 - any tracing failure: "run the original"
                raise TraceError(
                    f"torch.fx could not trace {type(model).__name__}: {type(e).__name__}: {e}"
                ) from e
        if tracer._next_input != len(examples):
            raise TraceError(
                f"forward() takes {tracer._next_input} inputs but "
                f"{len(examples)} example inputs were given"
            )
        gm = fx.GraphModule(tracer.root, fx_graph)  # copies the constants it reads
    g = Lowering(gm, fx_graph, example_inputs, RULES).run()
    g.set_outputs(restore_containers(tracer.output_template, g.output_tree))
    g.meta["model"] = type(model).__name__
    return g
