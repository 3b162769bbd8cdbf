"""Registry entry of attention: ``scaled_dot_product_attention``, a vendor node calling
ATen's SDPA (on CPU its flash-attention kernel: tiles of queries against tiles of keys and
values with an online softmax, the score matrix never materialised). ``nn.MultiheadAttention``
is traced through to its projections (``linear``), head reshapes and this node
(``frontends/decompositions.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F

from .enums import Bound
from .graph import Node, TensorType
from .op_registry import Kernel, OpDef, register


def _sdpa(node: Node) -> Kernel:
    """``F.scaled_dot_product_attention(q, k, v, mask)`` (the mask input where ``has_mask``;
    dropout off: inference)."""
    causal, scale, has_mask = node.attrs["is_causal"], node.attrs["scale"], node.attrs["has_mask"]

    def scaled_dot_product_attention(q, k, v, *mask):
        m = mask[0] if has_mask else None
        return F.scaled_dot_product_attention(q, k, v, m, 0.0, causal, scale=scale)

    return scaled_dot_product_attention


def attention_flops(node: Node, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> float:
    """Two matrix products: (L x D) @ (D x S) and (L x S) @ (S x Dv), per batch and head."""
    q, k = ins[0].shape, ins[1].shape
    return 2.0 * outs[0].numel * k[-2] + 2.0 * (outs[0].numel // outs[0].shape[-1]) * k[-2] * q[-1]


register(OpDef("scaled_dot_product_attention", Bound.COMPUTE, _sdpa, flops_fn=attention_flops))
