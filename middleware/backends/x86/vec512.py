"""AVX-512 intrinsics for the SIMD loops of a stage (issue 18).

gcc's vectoriser leaves a scalar remainder after every short SIMD loop (NCHW rows of 56
outputs: 3 vectors and 8 scalar iterations, the scalar ones several times the cost of a
vector one, with data-dependent branches for max/ReLU), and cannot be made to store
non-temporally. Here a loop over the inner variable ``v`` runs in chunks of 16 lanes
with a lane mask for the last one (masked loads and stores: no remainder, nothing read
or written outside the range). Loads by the stride of ``v`` in their address: 0 a
broadcast, 1 a masked load, 2 two loads and a ``vpermt2ps`` (stride-2 windows of NCHW
pooling), anything else a masked gather. Functions: the arithmetic, max/min with
PyTorch's NaN semantics (a NaN operand wins; against a constant one ``vmaxps``, whose
second operand wins on NaN), neg, abs, exp and sigmoid (the scalar ``mw_expf``'s steps,
``cfuncs.SCALAR_HELPERS``), the conditions and select. An expression with another
function (tanh, erf, log, ...) or an index that is not affine in
``v`` is not written here (:class:`Unsupported`): the caller keeps gcc's loop.

The generated code carries both: ``#ifdef __AVX512F__`` this, ``#else`` the portable loop.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from ...index_expr import Int, Ix, Op, Var, evaluate, variables
from ...loops import Acc, Call, Const, Expr, Load, ParamVec
from ...passes.schedule_ir import Buffer

LANES = 16

# Helpers the C template defines under #ifdef __AVX512F__ (see group.c.j2).
HELPERS = r"""#include <immintrin.h>
#include <stdint.h>
/* NaN-propagating max/min (PyTorch's): a NaN a is kept, else x86's max, which returns
   its second operand b when b is NaN. */
static inline __m512 mw_vmax(__m512 a, __m512 b) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_max_ps(a, b), a);
}
static inline __m512 mw_vmin(__m512 a, __m512 b) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_min_ps(a, b), a);
}
static inline __m512 mw_vneg(__m512 a) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32((int)0x80000000u)));
}
/* mw_expf of 16 lanes (the scalar helper's steps, written with FMAs) */
static inline __m512 mw_vexp(__m512 x) {
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
  /* x86 max/min return their second operand on NaN: put the NaN back */
  const __m512 xn = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), xc, x);
  const __m512 t = _mm512_fmadd_ps(xn, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(12582912.0f));
  const __m512 n = _mm512_sub_ps(t, _mm512_set1_ps(12582912.0f));
  const __m512i ni = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(0x4B400000));
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xn);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i n1 = _mm512_srai_epi32(ni, 1), n2 = _mm512_sub_epi32(ni, n1);
  const __m512i bias = _mm512_set1_epi32(127);
  const __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23));
  const __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23));
  return _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
}
static inline __m512 mw_vsigmoid(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, mw_vexp(mw_vneg(x))));
}
static inline __m512 mw_vbool(__mmask16 m) { return _mm512_maskz_mov_ps(m, _mm512_set1_ps(1.0f)); }
/* C's truth of a float: nonzero, NaN included */
static inline __mmask16 mw_vtrue(__m512 a) { return _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_NEQ_UQ); }
/* lanes s..e of a chunk (clamped to 0..15; none when e < s) */
static inline __mmask16 mw_range(int s, int e) {
  s = s < 0 ? 0 : s;
  e = e > 15 ? 15 : e;
  return e < s ? (__mmask16)0 : (__mmask16)(((2u << e) - 1u) & ~((1u << s) - 1u));
}
static const int mw_even[16] __attribute__((aligned(64))) = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
static const int mw_odd[16] __attribute__((aligned(64))) = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
"""


def prefetch(ident: str, offset: str, hint: str) -> str:
    """A software prefetch of float ``offset`` of buffer ``ident``, with the address in
    integer arithmetic: a prefetch ahead may point past the buffer's end (it does not
    fault), and a pointer formed there would be undefined behaviour in C."""
    return (
        f"_mm_prefetch((const char *)((uintptr_t){ident} + "
        f"(uintptr_t)(ptrdiff_t)({offset}) * sizeof(float)), {hint});"
    )


class Unsupported(Exception):
    """The loop cannot be written with these intrinsics (the caller keeps gcc's loop)."""


_BINARY = {
    "add": "_mm512_add_ps({0}, {1})",
    "sub": "_mm512_sub_ps({0}, {1})",
    "mul": "_mm512_mul_ps({0}, {1})",
    "div": "_mm512_div_ps({0}, {1})",
}
_CMP = {"gt": "_CMP_GT_OQ", "ge": "_CMP_GE_OQ", "le": "_CMP_LE_OQ"}


def stride_of(index: Sequence[Ix], var: str, strides: Sequence[int], extent: Sequence[int]) -> int:
    """The stride (in elements) of ``var`` in the flat address ``sum(index[d] *
    strides[d])`` (dims of extent 1 are index 0); raises Unsupported unless affine in
    ``var`` with an integer coefficient, checked at random points."""
    names = set()
    for d, ix in enumerate(index):
        if extent[d] > 1:
            names |= variables(ix)
    if var not in names:
        return 0
    for d, ix in enumerate(index):
        if extent[d] > 1 and not _affine_in(ix, var):
            raise Unsupported(f"index {ix} is not affine in {var}")
    rng = random.Random(0)
    coef = None
    for _ in range(4):
        env = {n: rng.randint(20, 60) for n in names}
        vals = []
        for v in (env[var], env[var] + 1, env[var] + 2, env[var] + 7):
            env[var] = v
            vals.append(
                sum(evaluate(ix, env) * strides[d] for d, ix in enumerate(index) if extent[d] > 1)
            )
        c = vals[1] - vals[0]
        if vals[2] - vals[1] != c or vals[3] - vals[0] != 7 * c:
            raise Unsupported(f"index not affine in {var}")
        if coef is None:
            coef = c
        elif coef != c:
            raise Unsupported(f"stride of {var} varies")
    assert coef is not None
    return int(coef)


def _affine_in(ix: Ix, var: str) -> bool:
    """Structurally affine in ``var``: sums, differences, negations and products with one
    ``var``-free factor of affine terms. (A channel shuffle's ``(c mod G) * K + c // G``
    agrees with a stride at many sample points but not across a block of 16 lanes.)"""
    if var not in variables(ix):
        return True
    if isinstance(ix, Var):
        return True
    if not isinstance(ix, Op):
        return False
    if ix.op in ("add", "sub", "neg"):
        return all(_affine_in(a, var) for a in ix.args)
    if ix.op == "mul":
        with_var = [a for a in ix.args if var in variables(a)]
        return len(with_var) == 1 and _affine_in(with_var[0], var)
    return False  # floordiv, mod, min, max, select, ...


def at(ix: Ix, var: str, start: str) -> Ix:
    """``ix`` with ``var`` replaced by the variable ``start`` (the chunk's first lane)."""
    if isinstance(ix, Var):
        return Var(start) if ix.name == var else ix
    if isinstance(ix, Op):
        return Op(ix.op, tuple(at(a, var, start) for a in ix.args))
    return ix


class VecExpr:
    """Prints expressions as ``__m512`` values for a chunk starting at ``start`` of the
    loop over ``var`` (mask ``mk``: the chunk's live lanes). ``prelude`` collects the
    statements the loads need; ``names`` maps scalar hoists and rows."""

    def __init__(
        self,
        var: str,
        start: str,
        buffer_of: Callable[[str], Buffer],
        ident: Callable[[Buffer], str],
        address: Callable[[Buffer, tuple[Ix, ...]], str],
        param_ident: Callable[[str], str],
        c_float: Callable[[float], str],
        rows: dict[str, str],
        scalars: set[str],
    ) -> None:
        self.var, self.start = var, start
        self.buffer_of = buffer_of
        self.ident = ident
        self.address = address
        self.param_ident = param_ident
        self.c_float = c_float
        self.rows, self.scalars = rows, scalars
        self.stride2 = False  # a stride-2 load needs the two masks mk2a/mk2b
        self.nt_target: Buffer | None = None  # the target, when stored non-temporally
        self.mask = "mk"  # the lanes the loads read (a guarded tap: its own)

    def target_address(self, b: Buffer) -> str:
        """``&target[element (n, c, h, w)]`` at the chunk's first lane."""
        idx = tuple(at(Var(d), self.var, self.start) for d in ("n", "c", "h", "w"))
        return f"&{self.ident(b)}[{self.address(b, idx)}]"

    def nt_offset_at(self, first: str) -> str:
        """The non-temporal target's element offset where ``var`` is ``first``."""
        assert self.nt_target is not None
        idx = tuple(at(Var(d), self.var, first) for d in ("n", "c", "h", "w"))
        return self.address(self.nt_target, idx)

    def load_address(self, x: Load) -> str:
        """``&buffer[element]`` of load ``x`` at the chunk's first lane."""
        ident, offset = self.load_offset(x)
        return f"&{ident}[{offset}]"

    def load_offset(self, x: Load) -> tuple[str, str]:
        """(the buffer's C name, the element offset) of load ``x`` at the chunk's first
        lane."""
        b = self.buffer_of(x.value)
        idx = tuple(at(i, self.var, self.start) for i in x.index)
        return self.ident(b), self.address(b, idx)

    def load(self, x: Load) -> str:
        if x.value in self.scalars:
            return f"_mm512_set1_ps({x.value})"
        if x.value in self.rows:
            row = f"&{x.value}[{self.start} - {self.rows[x.value]}]"
            return f"_mm512_maskz_loadu_ps({self.mask}, {row})"
        b = self.buffer_of(x.value)
        s = stride_of(x.index, self.var, b.strides, b.extent)
        base = f"&{self.ident(b)}[{self.address(b, tuple(at(i, self.var, self.start) for i in x.index))}]"
        return self._access(base, s)

    def _access(self, base: str, s: int) -> str:
        if s == 0:
            return f"_mm512_set1_ps(*({base}))"
        m = self.mask
        if s == 1:
            return f"_mm512_maskz_loadu_ps({m}, {base})"
        if s == 2:
            if m == "mk":
                self.stride2 = True
                ma, mb = "mk2a", "mk2b"
            else:  # lane i reads element 2i: the lane bits spread to the even bits
                ma = f"(__mmask16)_pdep_u32({m} & 0xFF, 0x5555)"
                mb = f"(__mmask16)_pdep_u32(({m} >> 8) & 0xFF, 0x5555)"
            return (
                f"_mm512_permutex2var_ps(_mm512_maskz_loadu_ps({ma}, {base}), "
                f"_mm512_load_si512(mw_even), _mm512_maskz_loadu_ps({mb}, ({base}) + 16))"
            )
        return (
            f"_mm512_mask_i32gather_ps(_mm512_setzero_ps(), {m}, "
            f"_mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, "
            f"2, 1, 0), _mm512_set1_epi32({s})), {base}, 4)"
        )

    def param(self, p: ParamVec) -> str:
        ix: Ix = p.index  # type: ignore[assignment]
        s = stride_of((ix,), self.var, (1,), (len(p.data),))
        base = f"&{self.param_ident(p.name)}[{_c(at(ix, self.var, self.start))}]"
        return self._access(base, s)

    def expr(self, e: Expr, acc: str = "acc_v") -> str:
        if isinstance(e, Const):
            return f"_mm512_set1_ps({self.c_float(e.value)})"
        if isinstance(e, Load):
            return self.load(e)
        if isinstance(e, ParamVec):
            return self.param(e)
        if isinstance(e, Acc):
            return acc
        if not isinstance(e, Call):
            raise Unsupported(f"not an expression: {e!r}")
        fn, args = e.fn, e.args
        if fn in _BINARY:
            return _BINARY[fn].format(*(self.expr(a, acc) for a in args))
        if fn in ("max", "min"):
            a, b = args
            if isinstance(a, Const) and not isinstance(b, Const):
                a, b = b, a
            if isinstance(b, Const) and not math.isnan(b.value):
                # x86 max/min return the second operand when either is NaN: a NaN a wins
                return f"_mm512_{fn}_ps({self.expr(b, acc)}, {self.expr(a, acc)})"
            return f"mw_v{fn}({self.expr(a, acc)}, {self.expr(b, acc)})"
        if fn == "neg":
            return f"mw_vneg({self.expr(args[0], acc)})"
        if fn in ("exp", "sigmoid"):
            return f"mw_v{fn}({self.expr(args[0], acc)})"
        if fn == "abs":
            return f"_mm512_abs_ps({self.expr(args[0], acc)})"
        if fn in _CMP:
            a, b = (self.expr(x, acc) for x in args)
            return f"mw_vbool(_mm512_cmp_ps_mask({a}, {b}, {_CMP[fn]}))"
        if fn == "and":
            a, b = (self.expr(x, acc) for x in args)
            return f"mw_vbool(mw_vtrue({a}) & mw_vtrue({b}))"
        if fn == "select":
            c, a, b = (self.expr(x, acc) for x in args)
            return f"_mm512_mask_blend_ps(mw_vtrue({c}), {b}, {a})"
        raise Unsupported(f"no AVX-512 spelling of {fn}")


def _c(ix: Ix) -> str:
    from ...index_expr import to_c

    return to_c(ix) if not isinstance(ix, Int) else str(ix.value)
