"""LayerNorm of a token sequence fuses: ``decompose_layer_norm`` writes it as registry ops
with loop semantics (mean over the normalized dims, sub, mul, add, rsqrt), and the whole
norm, with the residual add before it, runs in one generated depth-first group. Outputs
equal ``F.layer_norm``'s (NaN and infinity included); sqrt and rsqrt keep PyTorch's
semantics at 0, -0, negatives and infinity; a mean over the last dim sums as a SIMD
reduction."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import middleware
from middleware.options import Options
from middleware.passes import run_passes


class AddNorm(nn.Module):
    """A transformer block's seam: residual add, then LayerNorm over the last ``k`` dims."""

    def __init__(self, shape: tuple[int, ...], affine: str, eps: float, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.shape, self.eps = shape, eps
        self.w = nn.Parameter(1 + 0.3 * torch.randn(shape, generator=g)) if "w" in affine else None
        self.b = nn.Parameter(0.3 * torch.randn(shape, generator=g)) if "b" in affine else None

    def forward(self, x, r):
        y = x + r
        return y, F.layer_norm(y, self.shape, self.w, self.b, self.eps)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-5) -> None:
    finite = want[torch.isfinite(want)]
    scale = float(finite.abs().max()) if finite.numel() else 1.0
    assert scale > 1e-3, "degenerate reference"
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale, equal_nan=True)


def _norm_rows(opt) -> list:
    return [r for r in opt.report().rows if r.source == "ln" or r.op in ("mean", "rsqrt")]


@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(1, 3),
    t=st.integers(1, 37),
    c=st.sampled_from([2, 5, 16, 33, 96, 200]),
    two_dims=st.booleans(),
    affine=st.sampled_from(["wb", "w", ""]),
    eps=st.sampled_from([1e-5, 1e-6, 1e-2]),
    offset=st.sampled_from([0.0, 3.0, 300.0]),
    map_rows=st.sampled_from([None, 1, 3, 7]),
    seed=st.integers(0, 2**16),
)
def test_add_layer_norm_is_one_generated_group(
    n, t, c, two_dims, affine, eps, offset, map_rows, seed
):
    """A token sequence (N, T, C), or a token map (N, H, W, C) with ``map_rows`` rows."""
    shape = (t, c) if two_dims else (c,)
    model = AddNorm(shape, affine, eps, seed).eval()
    g = torch.Generator().manual_seed(seed + 1)
    full = (n, t, c) if map_rows is None else (n, map_rows, t, c)
    # rows with a large mean against their spread: the statistics must not cancel badly
    x = torch.randn(full, generator=g) * 2 + offset
    r = torch.randn(full, generator=g)
    opt = middleware.optimize(model, example_inputs=(x, r))
    with torch.no_grad():
        want = model(x, r)
        got = opt(x, r)
    _close(got[0], want[0])
    if offset < 100:
        _close(got[1], want[1])
    else:
        # rows of a large mean and a small spread are ill-conditioned for float32: at most
        # twice as far from the float64 result as ATen's LayerNorm is
        with torch.no_grad():
            exact = model.double()(x.double(), r.double())[1]
        ours, atens = (float((y.double() - exact).abs().max()) for y in (got[1], want[1]))
        assert ours <= 2 * atens + 1e-5 * float(exact.abs().max()), (ours, atens)
    rows = opt.report().rows
    assert not [r for r in rows if r.op == "layer_norm"], "the norm was not decomposed"
    norm = [r for r in rows if r.op in ("mean", "sub", "rsqrt")]
    assert norm and all(r.runs_as == "generated" for r in norm)
    # the add and the norm share one group
    groups = {r.group for r in rows if r.runs_as == "generated"}
    assert len(groups) == 1, [(r.node, r.group) for r in rows]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_element_poisons_its_row_only(value):
    model = AddNorm((24,), "wb", 1e-5, 3).eval()
    x, r = torch.randn(2, 5, 24), torch.randn(2, 5, 24)
    x[1, 2, 7] = value
    opt = middleware.optimize(model, example_inputs=(x, r))
    with torch.no_grad():
        want = model(x, r)
        got = opt(x, r)
    assert torch.isnan(want[1][1, 2]).all() and torch.isfinite(want[1][0]).all()
    for a, b in zip(got, want, strict=True):
        _close(a, b)


class Roots(nn.Module):
    def forward(self, x):
        return torch.sqrt(x) + 0.0, torch.rsqrt(x) * 1.0


def test_sqrt_and_rsqrt_keep_pytorchs_special_values():
    x = torch.tensor([0.0, -0.0, -1.0, math.inf, -math.inf, math.nan, 4.0, 1e-30, 2.0, 9.0])
    x = x.repeat(3, 4, 1)
    opt = middleware.optimize(Roots().eval(), example_inputs=(x,))
    assert {r.op for r in opt.report().rows if r.runs_as == "generated"} >= {"sqrt", "rsqrt"}
    with torch.no_grad():
        for a, b in zip(opt(x), Roots()(x), strict=True):
            # bit for bit: the signed infinity of rsqrt(-0.0), NaN where PyTorch has one
            assert torch.equal(torch.isnan(a), torch.isnan(b))
            ok = ~torch.isnan(b)
            assert torch.equal(a[ok], b[ok]), (a, b)
            assert torch.equal(torch.signbit(a[ok]), torch.signbit(b[ok]))


class LastMean(nn.Module):
    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) * 2.0


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 2), t=st.integers(1, 20), c=st.integers(2, 130), seed=st.integers(0, 999))
def test_a_mean_over_the_last_dim_is_generated(n, t, c, seed):
    x = torch.randn(n, t, c, generator=torch.Generator().manual_seed(seed)) + 1
    opt = middleware.optimize(LastMean().eval(), example_inputs=(x,))
    assert [r.runs_as for r in opt.report().rows if r.op == "mean"] == ["generated"]
    with torch.no_grad():
        _close(opt(x), LastMean()(x), tol=1e-5)


def test_the_row_sum_is_a_simd_reduction(tmp_path):
    """The statistics' sums over a row reduce to one output point: the generated C sums
    them as an OpenMP SIMD reduction, not as a chain of dependent adds."""
    model = AddNorm((64,), "wb", 1e-5, 0).eval()
    x = torch.randn(1, 50, 64)
    opt = middleware.optimize(model, example_inputs=(x, x), cache_dir=str(tmp_path))
    with torch.no_grad():
        opt(x, x)
    sources = [p.read_text() for p in tmp_path.rglob("kernel.c")]
    norm = [s for s in sources if "rsqrt" in s]
    assert norm and all(s.count("#pragma omp simd reduction(+:a)") == 2 for s in norm)


class Norms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.LayerNorm(8)
        self.map = nn.LayerNorm(8)
        self.vec = nn.LayerNorm(8)

    def forward(self, x):
        return self.seq(x), self.map(x.reshape(2, 3, 2, 8)), self.vec(x.reshape(12, 8))


def test_only_token_sequences_and_maps_are_decomposed():
    """Rank 3 (a token sequence) and rank 4 (Swin's, ConvNeXt's token maps) are decomposed;
    a rank-2 batch (its last dim is no logical h/w) stays ATen's."""
    graph = middleware.trace(Norms().eval(), (torch.randn(2, 6, 8),))
    passed = run_passes(graph, Options())
    ln = [n for n in passed.nodes() if n.op == "layer_norm"]
    assert sorted(n.source for n in ln) == ["vec"]
    for source in ("seq", "map"):
        ops = {n.op for n in passed.nodes() if n.source == source}
        assert ops == {"mean", "sub", "mul", "add", "rsqrt"}, ops
    kept = run_passes(graph, Options(disable_passes=("decompose_layer_norm",)))
    assert len([n for n in kept.nodes() if n.op == "layer_norm"]) == 3


def test_without_fusion_the_norm_stays_one_call():
    """fuse=False: the pieces would run as seven framework calls instead of one."""
    model = AddNorm((32,), "wb", 1e-5, 2).eval()
    x = torch.randn(2, 9, 32)
    opt = middleware.optimize(model, example_inputs=(x, x), fuse=False)
    assert [r.op for r in opt.report().rows].count("layer_norm") == 1
    with torch.no_grad():
        for a, b in zip(opt(x, x), model(x, x), strict=True):
            _close(a, b)


def test_training_keeps_atens_layer_norm():
    """A mean over the last dim has no backward rule: training plans keep the call, and the
    gradients are PyTorch's."""
    model = AddNorm((16,), "wb", 1e-5, 1).train()
    x = torch.randn(2, 7, 16, requires_grad=True)
    r = torch.randn(2, 7, 16)
    opt = middleware.optimize(model, example_inputs=(x, r))
    y = opt(x, r)[1]
    (y * torch.arange(16.0)).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    (model(x, r)[1] * torch.arange(16.0)).sum().backward()
    _close(gx, x.grad, tol=1e-4)
