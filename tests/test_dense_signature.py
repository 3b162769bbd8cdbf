"""The one-pass ``dense_signature`` (every call's lookup key) equals ``dense`` followed by
the per-input signature it replaced, over random ranks, layouts, views and slices."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from middleware.runtime.inputs import channels_last, dense, dense_signature


@st.composite
def tensors(draw):
    rank = draw(st.integers(1, 5))
    shape = draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank))
    x = torch.randn(*shape)
    kind = draw(st.sampled_from(["plain", "channels_last", "permuted", "sliced", "expanded"]))
    if kind == "channels_last" and rank == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    elif kind == "permuted" and rank >= 2:
        x = x.transpose(0, rank - 1)
    elif kind == "sliced" and shape[-1] > 1:
        x = x[..., ::2]
    elif kind == "expanded":
        x = x.unsqueeze(0).expand(2, *shape)
    return x


@settings(max_examples=150, deadline=None)
@given(st.lists(tensors(), min_size=1, max_size=3))
def test_dense_signature_equals_dense_then_signature(xs):
    inputs = tuple(xs)
    want_inputs = dense(inputs)
    want_sig = tuple((tuple(x.shape), x.dtype, x.device, channels_last(x)) for x in want_inputs)
    got_inputs, got_sig = dense_signature(inputs)
    assert got_sig == want_sig
    assert len(got_inputs) == len(want_inputs)
    for g, w, x in zip(got_inputs, want_inputs, inputs, strict=True):
        assert g.stride() == w.stride() and torch.equal(g, x)
        assert (g is x) == (w is x)  # a dense input is passed on, not copied
