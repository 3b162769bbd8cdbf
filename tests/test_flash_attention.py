"""The generated flash-attention kernel (the scaled_dot_product_attention algorithm
"flash", ``backends/vendor/flash.py``) against ``F.scaled_dot_product_attention``: random
shapes (odd lengths, head dims 32/64/80, query tiles and key tiles cut anywhere), masks
(float and boolean, broadcast), causal, scale; NaN and infinity as ATen's CPU kernel; through
``optimize()``; and its memory at a sequence of 4096 (no L x S score matrix)."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import middleware
from middleware.backends.vendor import flash
from middleware.hardware import for_options
from middleware.options import Options

OPTS = Options(cache_dir=tempfile.mkdtemp(prefix="mw-flash-"), measure_hardware=False)
HW = for_options(OPTS)
SDPA = "scaled_dot_product_attention"


class Attn(nn.Module):
    def __init__(self, causal: bool = False, scale: float | None = None) -> None:
        super().__init__()
        self.causal, self.scale = causal, scale

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=self.scale)


class MaskedAttn(Attn):
    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)


def _flash(model: nn.Module, args: list[torch.Tensor]) -> torch.Tensor:
    g = middleware.trace(model.eval(), tuple(args))
    (node,) = [n for n in g.nodes() if n.op == SDPA]
    assert flash.why_not(g, node, torch.device("cpu")) is None
    fn = flash.kernel(g, node, OPTS, HW)
    assert fn is not None
    return fn(*args)


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=2e-6 * float(ref.abs().max()))


@st.composite
def problems(draw):
    rank = draw(st.sampled_from([3, 4]))
    lead = tuple(draw(st.integers(1, 3)) for _ in range(rank - 2))
    L = draw(st.sampled_from([1, 7, 16, 17, 33, 64, 65, 100]))
    S = draw(st.sampled_from([1, 5, 63, 64, 65, 130]))
    D = draw(st.sampled_from([32, 64, 80]))
    DV = draw(st.sampled_from([D, 16, 48]))
    kind = draw(st.sampled_from(["none", "causal", "float", "bool"]))
    scale = draw(st.sampled_from([None, 0.3]))
    return lead, L, S, D, DV, kind, scale


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.integers(0, 2**16))
def test_flash_matches_sdpa(problem, seed):
    lead, L, S, D, DV, kind, scale = problem
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, L, D, generator=gen)
    k = torch.randn(*lead, S, D, generator=gen)
    v = torch.randn(*lead, S, DV, generator=gen)
    args = [q, k, v]
    if kind in ("float", "bool"):
        shape = (L, S) if len(lead) == 1 else (lead[0], 1, L, S)  # broadcast over heads
        if kind == "float":
            args.append(torch.randn(*shape, generator=gen))
        else:
            args.append(torch.rand(*shape, generator=gen) > 0.3)
        model: nn.Module = MaskedAttn(scale=scale)
    else:
        model = Attn(causal=kind == "causal", scale=scale)
    ref = model(*args)
    _close(_flash(model, args), ref)


def test_nan_and_infinity_as_aten():
    """A fully masked row and a NaN query row are 0, a NaN key spreads NaN to every row,
    an infinite value gives infinity in its column: as ATen's CPU kernel (one key tile)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 20, 32), torch.randn(1, 1, 90, 32), torch.randn(1, 1, 90, 32)
    mask = torch.zeros(1, 1, 20, 90)
    mask[..., 3, :] = float("-inf")
    mask[..., 5, :70] = float("-inf")  # a row masked over the first key tile only
    cases = [(MaskedAttn(), [q, k, v, mask])]
    q2 = q.clone()
    q2[0, 0, 4, 0] = float("nan")
    cases.append((Attn(), [q2, k, v]))
    k2 = k.clone()
    k2[0, 0, 70, 1] = float("nan")  # a NaN key in the second key tile
    cases.append((Attn(), [q, k2, v]))
    k3 = k.clone()
    k3[0, 0, :64, 0] = float("nan")  # a whole key tile of NaN scores
    cases.append((Attn(), [q, k3, v]))
    v2 = v.clone()
    v2[0, 0, 2, 7] = float("inf")
    cases.append((Attn(), [q, k, v2]))
    for model, args in cases:
        y, ref = _flash(model, args), model(*args)
        assert torch.equal(y.isnan(), ref.isnan()), (model, y.isnan().sum(), ref.isnan().sum())
        assert torch.equal(y.isinf(), ref.isinf())
        finite = ref.isfinite()
        if finite.any():
            _close(y[finite], ref[finite])


def test_flash_through_optimize_and_the_default_says_why(tmp_path):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 33, 64), torch.randn(2, 4, 47, 64), torch.randn(2, 4, 47, 64)
    model = Attn().eval()
    ref = model(q, k, v)
    named = middleware.optimize(
        model, example_inputs=(q, k, v), cache_dir=tmp_path, algorithms={SDPA: "flash"}
    )
    default = middleware.optimize(model, example_inputs=(q, k, v), cache_dir=tmp_path)
    with torch.no_grad():
        _close(named(q, k, v), ref)
        _close(default(q, k, v), ref)
    (row,) = [r for r in named.report().rows if r.op == SDPA]
    assert row.algorithm == "flash"
    (row,) = [r for r in default.report().rows if r.op == SDPA]
    assert row.algorithm == "vendor" and "measured faster than the generated flash" in row.reason


def test_flash_declines_what_it_does_not_run():
    q, k, v = torch.randn(2, 3, 8, 16), torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16)
    g = middleware.trace(Attn().eval(), (q, k, v))
    (node,) = [n for n in g.nodes() if n.op == SDPA]
    assert "leading dims differ" in flash.why_not(g, node, torch.device("cpu"))
    assert "x86 only" in flash.why_not(g, node, torch.device("cuda"))


@pytest.mark.slow
def test_memory_at_a_sequence_of_4096_is_linear(tmp_path):
    """One attention call at L = S = 4096, one head of 64: the profiler's peak I/O is the
    inputs and the output (4 x 1 MiB) plus O(sequence), not the 64 MiB score matrix."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 4096, 64) for _ in range(3))
    model = Attn().eval()
    result = middleware.profile(
        model, (q, k, v), cache_dir=tmp_path, algorithms={SDPA: "flash"}, repeats=1
    )
    assert result.optimized.peak_io_bytes < 8 * 2**20, str(result)


@pytest.mark.parametrize("S", [5, 16, 17, 90, 600])
def test_nan_rows_follow_aten_on_both_sides_of_its_vector_width(S):
    """ATen's row maximum propagates NaN over 16-lane vectors and ignores it in the last
    S % 16 keys (unless a mask is added): a NaN query row is NaN, or 0 with fewer than 16
    keys; a NaN key or a row masked but for one key follow the same rule."""
    torch.manual_seed(S)
    L = 20
    q, k, v = torch.randn(1, 1, L, 32), torch.randn(1, 1, S, 32), torch.randn(1, 1, S, 32)
    cases = []
    q2 = q.clone()
    q2[0, 0, 1, 0] = float("nan")
    cases.append((Attn(), [q2, k, v]))
    for idx in sorted({0, S - 1, max(0, S // 16 * 16 - 1)}):
        k2 = k.clone()
        k2[0, 0, idx, 0] = float("nan")
        cases.append((Attn(), [q, k2, v]))
        mask = torch.full((1, 1, L, S), float("-inf"))
        mask[..., idx] = 0.0
        cases.append((MaskedAttn(), [q2, k, v, mask]))
    for model, args in cases:
        y, ref = _flash(model, args), model(*args)
        assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
        finite = ref.isfinite()
        if finite.any():
            _close(y[finite], ref[finite])
