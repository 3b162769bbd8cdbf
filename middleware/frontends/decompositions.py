"""What the tracer traces through instead of recording as one opaque call.

- ``nn.MultiheadAttention`` (a leaf of ``torch.nn`` for fx, and its forward a single
  ``F.multi_head_attention_forward`` call) becomes its projections (``F.linear``), head
  reshapes and ``F.scaled_dot_product_attention`` (or, where the caller asks for the
  attention weights, ``matmul``, ``softmax`` and ``matmul``): ``multihead_attention`` below,
  where ``mha_refusal`` accepts the call (else the module stays one call, a fallback).
- Functions that torchvision wraps with ``torch.fx.wrap`` so that fx records them as one
  call (Swin's window attention, its relative-position bias and patch-merging pad) are
  traced into (``TRACED_THROUGH``, by dotted name): their bodies are ordinary tensor code
  over concrete shapes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

# fx.wrap'ed functions whose bodies the tracer records (module.qualname)
TRACED_THROUGH = frozenset(
    {
        "torchvision.models.swin_transformer.shifted_window_attention",
        "torchvision.models.swin_transformer._get_relative_position_bias",
        "torchvision.models.swin_transformer._patch_merging_pad",
    }
)


def traced_through(target: Any) -> bool:
    """``target`` is a wrapped function whose body the tracer records."""
    name, module = getattr(target, "__qualname__", None), getattr(target, "__module__", None)
    return (
        isinstance(name, str) and isinstance(module, str) and f"{module}.{name}" in TRACED_THROUGH
    )


_MHA_PARAMS = (
    "query",
    "key",
    "value",
    "key_padding_mask",
    "need_weights",
    "attn_mask",
    "average_attn_weights",
    "is_causal",
)


def _mha_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = dict(zip(_MHA_PARAMS, args, strict=False))
    bound.update(kwargs)
    defaults = {
        "key_padding_mask": None,
        "need_weights": True,
        "attn_mask": None,
        "average_attn_weights": True,
        "is_causal": False,
    }
    return {**defaults, **bound}


def mha_refusal(
    mod: nn.MultiheadAttention, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """Why ``mod(*args, **kwargs)`` (the call's concrete values) is not decomposed (None:
    it is)."""
    b = _mha_args(args, kwargs)
    if set(b) - set(_MHA_PARAMS):
        return "unknown keyword arguments"
    if mod.training:
        return "training mode"
    if not all(isinstance(b[k], torch.Tensor) and b[k].dim() == 3 for k in _MHA_PARAMS[:3]):
        return "unbatched input"
    mask = b["attn_mask"]
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.is_floating_point()):
        return "a mask that is not a float tensor"
    if mod.bias_k is not None or mod.add_zero_attn:
        return "add_bias_kv or add_zero_attn"
    if b["key_padding_mask"] is not None:
        return "a key_padding_mask"
    if b["is_causal"]:
        return "is_causal"
    if b["attn_mask"] is not None and b["need_weights"]:
        return "attention weights asked for with a mask"
    if not isinstance(b["need_weights"], bool) or not isinstance(b["average_attn_weights"], bool):
        return "need_weights or average_attn_weights not a bool"
    return None


def multihead_attention(mod: nn.MultiheadAttention, *args: Any, **kwargs: Any) -> Any:
    """``mod(*args, **kwargs)`` (eval mode) in traceable calls; equal to the module's
    forward for the calls ``mha_refusal`` accepts (a float ``attn_mask`` is added to the
    scores, as SDPA does)."""
    b = _mha_args(args, kwargs)
    query, key, value = b["query"], b["key"], b["value"]
    self_attention = query is key and key is value
    if not mod.batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    n, lq, e = query.shape
    ls = key.shape[1]
    h = mod.num_heads
    d = e // h
    if mod._qkv_same_embed_dim:
        w, bias = mod.in_proj_weight, mod.in_proj_bias
        if self_attention:
            q, k, v = F.linear(query, w, bias).chunk(3, dim=-1)
        else:
            wq, wk, wv = w.chunk(3)
            bq, bk, bv = bias.chunk(3) if bias is not None else (None, None, None)
            q, k, v = F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)
    else:
        bq, bk, bv = mod.in_proj_bias.chunk(3) if mod.in_proj_bias is not None else (None,) * 3
        q = F.linear(query, mod.q_proj_weight, bq)
        k = F.linear(key, mod.k_proj_weight, bk)
        v = F.linear(value, mod.v_proj_weight, bv)
    q = q.reshape(n, lq, h, d).transpose(1, 2)
    k = k.reshape(n, ls, h, d).transpose(1, 2)
    v = v.reshape(n, ls, h, v.shape[-1] // h).transpose(1, 2)
    weights = None
    if b["need_weights"]:
        attn = torch.softmax(torch.matmul(q * (d**-0.5), k.transpose(-2, -1)), dim=-1)
        out = torch.matmul(attn, v)
        weights = attn.mean(dim=1) if b["average_attn_weights"] else attn
    else:
        mask = b["attn_mask"]
        if mask is not None and mask.dim() == 3:  # (N * heads, L, S)
            mask = mask.reshape(n, h, lq, ls)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out = out.transpose(1, 2).reshape(n, lq, out.shape[1] * out.shape[-1])
    out = F.linear(out, mod.out_proj.weight, mod.out_proj.bias)
    if not mod.batch_first:
        out = out.transpose(0, 1)
    return out, weights


# module type -> (refusal, traceable forward)
MODULE_DECOMPOSITIONS: dict[type, tuple[Any, Any]] = {
    nn.MultiheadAttention: (mha_refusal, multihead_attention),
}
