"""The op registry: the one place an op is described.

Each op has one :class:`OpDef` entry (``middleware.op_registry``) holding everything the
compiler knows about it: its default bound class, its reference implementation (the
framework call used for fallback, for the reference interpreter and for tests), its shape
rule (the reference on meta tensors), its FLOP count (roofline classification), its flags
for the passes (elementwise, view-like, monotone, per-sample for batch slicing, layout),
its loop semantics for depth-first code generation (``loops``, built from the vocabulary of
``middleware.loops``; ``pointwise``, an activation's scalar expression), its ATen ``out=``
form and in-place inputs (for the buffer planner), its in-place form and its vendor
post-op spelling (for the vendor calls). Every other table is derived from the entries.

The entries live in modules of one family each: ``op_layers`` (conv2d, linear, matmul),
``op_arith`` (batch_norm, add, sub, mul, div), ``op_activations``, ``op_reductions``
(pooling, mean, softmax, layer/group norm, interpolate), ``op_data`` (cat, views,
to_layout, fallback), ``op_shapes`` (slice, expand, repeat, roll, pad, take) and
``op_attention`` (scaled_dot_product_attention). Importing
this module imports all of them, so callers import the registry from here.

How to add an elementwise op of one input (an activation), e.g. ``elu``:

1. ``op_activations.py``: one ``register(OpDef(...))`` with ``Bound.IO``,
   ``elementwise=True``, its reference (``make``: node -> callable over tensors), its
   ``pointwise`` expression over ``loops.FUNCTIONS`` (the generated kernels of every
   backend derive from it; add a function to ``loops.FUNCTIONS`` and to each backend's
   spelling table only if the vocabulary lacks one), its ``flops_per_elem``, and where
   ATen or the vendor has them: ``out`` (an ATen ``out=`` form, with ``inplace_inputs``),
   ``inplace``, ``post_op``, ``defaults``, ``monotone``.
2. ``frontends/``: one rule mapping the framework's spellings (module, function, method)
   to the op and its attrs.
3. Tests: ``tests/test_ops.py`` (reference against eager), ``tests/test_fusion_ops.py``
   (generated code inside a fused group, C and reference backends),
   ``tests/test_nan_semantics.py`` (NaN/inf); ``tests/cuda_cases.py`` derives the CUDA
   cases of every entry with ``pointwise`` semantics itself.

Other ops are added the same way in the module of their family; an op with windows or
several inputs gives ``loops`` a rule of ``middleware.loops`` instead of ``pointwise``.
"""

from __future__ import annotations

from . import (
    op_activations,
    op_arith,
    op_attention,
    op_data,
    op_layers,
    op_reductions,
    op_shapes,
)
from .enums import Bound
from .op_data import ValueRef
from .op_registry import (
    CATALOGUE,
    Kernel,
    OpDef,
    OutForm,
    OutVariant,
    VendorPostOp,
    activation_expr,
    activation_fn,
    dtype_name,
    get_op,
    has_loops,
    infer_types,
    loops_of,
    register,
    torch_dtype,
)

# the op families, imported for their registrations
FAMILIES = (
    op_layers,
    op_arith,
    op_activations,
    op_reductions,
    op_data,
    op_shapes,
    op_attention,
)

__all__ = [
    "CATALOGUE",
    "FAMILIES",
    "Bound",
    "Kernel",
    "OpDef",
    "OutForm",
    "OutVariant",
    "ValueRef",
    "VendorPostOp",
    "activation_expr",
    "activation_fn",
    "dtype_name",
    "get_op",
    "has_loops",
    "infer_types",
    "loops_of",
    "register",
    "torch_dtype",
]
