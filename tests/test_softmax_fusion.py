"""Softmax over a row fuses: ``decompose_softmax`` writes it as registry ops with loop
semantics (amax, sub, exp, sum, div), and the softmax, with the bias or mask add before it,
runs in one generated depth-first group. Outputs equal ``torch.softmax``'s (NaN and
infinity included). ``exp``, ``amax`` and ``sum`` are registry ops of their own (user code
calls them): exp within 1 ulp of the exact result with PyTorch's special values, amax
NaN-propagating, both row reductions written as AVX-512 loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import middleware
from middleware.options import Options
from middleware.passes import run_passes


class BiasSoftmax(nn.Module):
    """Attention's seam: scores plus a (broadcast) bias, then softmax over ``dim``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x, b):
        return torch.softmax(x + b, self.dim)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    finite = want[torch.isfinite(want)]
    scale = float(finite.abs().max()) if finite.numel() else 1.0
    assert scale > 1e-3, "degenerate reference"
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale, equal_nan=True)


def _generated_groups(opt) -> set[int]:
    return {r.group for r in opt.report().rows if r.runs_as == "generated"}


@settings(max_examples=14, deadline=None)
@given(
    shape=st.lists(st.integers(1, 70), min_size=3, max_size=4),
    last=st.booleans(),
    bias_rank=st.integers(1, 3),
    spread=st.sampled_from([0.1, 3.0, 30.0]),
    masked=st.booleans(),
    layout=st.sampled_from(["contiguous", "channels_last"]),
    seed=st.integers(0, 2**16),
)
def test_bias_softmax_is_one_generated_group(shape, last, bias_rank, spread, masked, layout, seed):
    dim = -1 if last else -2
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * spread
    if layout == "channels_last" and x.dim() == 4:
        x = x.to(memory_format=torch.channels_last)
    if masked:  # a shifted window's mask: -100 or -inf at some positions, never a whole row
        b = torch.randn(shape[-max(bias_rank, 2) :], generator=g)
        keep = torch.rand(b.shape, generator=g) < 0.7
        keep.select(dim, 0).fill_(True)
        b = torch.where(keep, b, torch.tensor(-math.inf if seed % 2 else -100.0))
    else:
        b = torch.randn(shape[-bias_rank:], generator=g)
    model = BiasSoftmax(dim).eval()
    opt = middleware.optimize(model, example_inputs=(x, b))
    with torch.no_grad():
        _close(opt(x, b), model(x, b))
    rows = opt.report().rows
    assert not [r for r in rows if r.op == "softmax"], "the softmax was not decomposed"
    assert {"amax", "exp", "sum"} <= {r.op for r in rows if r.runs_as == "generated"}
    assert len(_generated_groups(opt)) == 1, [(r.node, r.op, r.group) for r in rows]


@pytest.mark.parametrize("width", [40, 197])
@pytest.mark.parametrize(
    "value", [math.nan, math.inf, -math.inf, "row of -inf", "row of +inf", "large"]
)
def test_non_finite_values_give_atens_rows(value, width):
    """A NaN poisons its row; a +inf makes its row NaN (inf - inf), a -inf gives 0; a row
    of -inf is NaN; a row of +inf is NaN; values near the float limit do not overflow.
    Rows of 40 (two vector chunks and a masked one) and of 197 (vit_b_16's)."""
    model = BiasSoftmax(-1).eval()
    g = torch.Generator().manual_seed(5)
    x, b = torch.randn(2, 3, 6, width, generator=g), torch.zeros(width)
    if value == "row of -inf":
        x[1, 2, 3] = -math.inf
    elif value == "row of +inf":
        x[1, 2, 3] = math.inf
    elif value == "large":
        x[1, 2] = 3e38 * torch.rand(6, width, generator=g)
    else:
        x[1, 2, 3, width - 3] = value
    opt = middleware.optimize(model, example_inputs=(x, b))
    with torch.no_grad():
        want, got = model(x, b), opt(x, b)
    assert torch.isfinite(want[0]).all()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    _close(got, want)


class Ops(nn.Module):
    def forward(self, x):
        return (
            torch.exp(x - 3.5) * 1.0,
            (x - 7.0).amax(-1, keepdim=True) + 0.0,  # rows all below 0
            torch.amax(x - 7.0, (2, 3)) * 1.0,
            x.sum(-1, keepdim=True) + 0.0,
            torch.sum(x, (2, 3), keepdim=True) * 1.0,
            x.sum(-1) - 0.0,  # (N, C, H): the output dims move, ATen's sum (unless W is 1)
        )


@settings(max_examples=10, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 20), st.integers(1, 45)),
    nan=st.booleans(),
    seed=st.integers(0, 999),
)
def test_exp_amax_and_sum_are_generated(shape, nan, seed):
    # values 0.5-6: no output near 0 to compare against (exp sees -3 to 2.5)
    x = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 5.5 + 0.5
    if nan:
        x.view(-1)[seed % x.numel()] = math.nan
    opt = middleware.optimize(Ops().eval(), example_inputs=(x,))
    ops = [r.runs_as for r in opt.report().rows if r.op in ("exp", "amax", "sum")]
    assert ops[:5] == ["generated"] * 5, ops
    with torch.no_grad():
        for got, want in zip(opt(x), Ops()(x), strict=True):
            assert got.shape == want.shape
            assert torch.equal(torch.isnan(got), torch.isnan(want))
            _close(got, want)


def _ulps(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """Distance from the float64 result in units of the float32 result's last place
    (subnormal spacing at the bottom)."""
    spacing = np.maximum(np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64), 2**-149)
    return np.abs(got.astype(np.float64) - exact) / spacing


class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x) + 0.0


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_exp_is_within_one_ulp_with_pytorchs_special_values(layout):
    """The generated exp (a polynomial, vectorised; not libm's) over a dense sweep of its
    whole range, the overflow and subnormal thresholds and the special values: within 1
    ulp of float64's exp, infinity and 0 where PyTorch gives them, NaN for NaN."""
    sweep = np.linspace(-110.0, 95.0, 200_003, dtype=np.float32)
    special = np.array(
        [math.nan, math.inf, -math.inf, 0.0, -0.0, 88.72283, 88.722839, 88.7229, -87.33655,
         -103.972, -103.9721, -104.0, -150.0, 1e-8, -1e-8, 1000.0, -1000.0],
        dtype=np.float32,
    )  # fmt: skip
    flat = np.concatenate([sweep, special])
    flat = np.concatenate([flat, np.zeros(-flat.size % (2 * 3 * 17 * 31), np.float32)])
    x = torch.from_numpy(flat).reshape(-1, 3, 17, 31)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    opt = middleware.optimize(Exp().eval(), example_inputs=(x,))
    assert [r.runs_as for r in opt.report().rows if r.op == "exp"] == ["generated"]
    with torch.no_grad():
        got = opt(x).contiguous().numpy().reshape(-1)
    want = torch.exp(torch.from_numpy(flat)).numpy()
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    exact = np.exp(flat[finite].astype(np.float64))
    assert _ulps(got[finite], exact).max() <= 1.0
    assert np.array_equal(got[flat == -np.inf], np.zeros(1, np.float32))


def test_row_reductions_are_avx512_loops(tmp_path):
    """The row max, the row sum and exp are written with AVX-512 intrinsics (masked last
    chunk, no scalar remainder), gcc's portable loops kept under #else."""
    x, b = torch.randn(2, 3, 9, 50), torch.randn(50)
    opt = middleware.optimize(BiasSoftmax(-1).eval(), example_inputs=(x, b), cache_dir=tmp_path)
    with torch.no_grad():
        opt(x, b)
    (src,) = [p.read_text() for p in tmp_path.rglob("kernel.c") if "amax" in p.parent.name]
    # call sites (the helpers' definitions are in every kernel)
    for needle in (
        "_mm512_reduce_max_ps(m_)",
        "_mm512_reduce_add_pd(",
        "mw_vexp(_mm512_",
        "= mw_expf(",
    ):
        assert needle in src, needle
    assert "#pragma omp simd reduction(max:a) reduction(|:any_nan)" in src


class Shapes(nn.Module):
    def forward(self, x):
        return (
            torch.softmax(x, -1),
            torch.softmax(x, 1),
            torch.softmax(x.reshape(2, 3, 2, 5, 4), -1),
            torch.softmax(x.reshape(30, 8), -1),
        )


def test_only_rows_a_generated_reduction_covers_are_decomposed():
    """A softmax over the last dims of a rank-3/4 value, or the last dim of a rank-5 one
    (viewed as rank 4), is decomposed; over the channel dim or of a rank-2 batch (no
    logical h/w there) it stays ATen's."""
    x = torch.randn(2, 3, 5, 8)
    graph = middleware.trace(Shapes().eval(), (x,))
    passed = run_passes(graph, Options())
    assert len([n for n in passed.nodes() if n.op == "softmax"]) == 2
    assert len([n for n in passed.nodes() if n.op == "amax"]) == 2
    kept = run_passes(graph, Options(disable_passes=("decompose_softmax",)))
    assert len([n for n in kept.nodes() if n.op == "softmax"]) == 4
    opt = middleware.optimize(Shapes().eval(), example_inputs=(x,))
    with torch.no_grad():
        for got, want in zip(opt(x), Shapes()(x), strict=True):
            _close(got, want)


@pytest.mark.parametrize(
    "shape,bias",
    [
        ((2, 4, 3, 7, 7), (3, 7, 7)),
        ((1, 64, 2, 9, 9), (1, 2, 9, 9)),  # MaxViT's relative-position bias
        ((1, 2, 2, 3, 5, 33), (1, 3, 5, 33)),
        ((1, 2, 2, 3, 5, 33), (1, 1, 1, 5, 33)),  # a rank-5 bias: the add stays rank 6
        ((2, 4, 3, 7, 7), (4, 1, 7, 7)),  # varies along a merged dim: the add stays rank 5
    ],
)
def test_high_rank_scores_are_viewed_as_rank_four(shape, bias):
    """MaxViT's (B, windows, heads, T, T) scores: the leading dims merged into one, the
    softmax generated on the view, the result viewed back; the bias add before it joins
    the view (and the group) where the bias is 1 along the merged dims."""
    b = torch.randn(bias)
    x = torch.randn(shape) * 3
    opt = middleware.optimize(BiasSoftmax(-1).eval(), example_inputs=(x, b))
    rows = opt.report().rows
    assert not [r for r in rows if r.op == "softmax"]
    assert {"amax", "exp", "sum", "div"} <= {r.op for r in rows if r.runs_as == "generated"}
    aligned = (1,) * (len(shape) - len(bias)) + bias
    merged = len(bias) <= 4 and all(d == 1 for d in aligned[: len(shape) - 3])
    (add,) = [r for r in rows if r.op == "add"]
    assert (add.runs_as == "generated") == merged
    with torch.no_grad():
        got = opt(x, b)
        assert got.shape == x.shape
        _close(got, BiasSoftmax(-1)(x, b))


def test_without_fusion_or_in_training_the_softmax_stays_one_call():
    """fuse=False: the pieces would be five framework calls; training: amax and sum have
    no backward rule, so ATen's softmax and its backward run, and the gradients are
    PyTorch's."""
    x, b = torch.randn(2, 4, 7, 12), torch.randn(12)
    opt = middleware.optimize(BiasSoftmax(-1).eval(), example_inputs=(x, b), fuse=False)
    assert [r.op for r in opt.report().rows].count("softmax") == 1
    model = BiasSoftmax(-1).train()
    xg = x.clone().requires_grad_(True)
    opt = middleware.optimize(model, example_inputs=(xg, b))
    assert [r.op for r in opt.report().rows].count("softmax") == 1
    w = torch.randn(2, 4, 7, 12)
    (opt(xg, b) * w).sum().backward()
    got = xg.grad.clone()
    xg.grad = None
    (model(xg, b) * w).sum().backward()
    _close(got, xg.grad, tol=1e-4)


def test_the_scalar_exp_helper_alone(tmp_path):
    """``mw_expf`` compiled on its own and called per element (where a host without
    AVX-512, a hoisted scalar or an epilogue runs it), in a program built with the
    undefined-behaviour sanitizer: within 1 ulp over a sweep of its range, PyTorch's special
    values, no undefined shift on NaN (the sanitizer stops the program on one)."""
    import shutil
    import subprocess

    from middleware.backends.x86.cfuncs import SCALAR_HELPERS

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "expf.c"
    src.write_text(
        "#include <math.h>\n#include <stdio.h>\n" + SCALAR_HELPERS + "int main(void) {\n"
        "  float x;\n"
        "  while (fread(&x, 4, 1, stdin) == 1) { const float y = mw_expf(x); fwrite(&y, 4, 1, stdout); }\n"
        "  return 0;\n}\n"
    )
    exe = tmp_path / "expf"
    flags = ["-O1", "-fno-tree-vectorize", "-fsanitize=undefined", "-fno-sanitize-recover=all"]
    subprocess.run([cc, *flags, "-o", exe, src, "-lm"], check=True)
    flat = np.concatenate(
        [
            np.linspace(-110.0, 95.0, 100_003, dtype=np.float32),
            np.array([math.nan, math.inf, -math.inf, 0.0, -0.0, 88.72283, 88.7229, -103.972,
                      -104.0, -1000.0, 1000.0], dtype=np.float32),
        ]
    )  # fmt: skip
    done = subprocess.run([exe], input=flat.tobytes(), capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    got = np.frombuffer(done.stdout, dtype=np.float32)
    want = torch.exp(torch.from_numpy(flat)).numpy()
    assert got.shape == want.shape
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    assert _ulps(got[finite], np.exp(flat[finite].astype(np.float64))).max() <= 1.0
