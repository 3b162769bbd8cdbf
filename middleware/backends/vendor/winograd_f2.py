"""Winograd F(2x2, 3x3) convolutions on x86: transforms generated from the numpy matrices
around the framework's batched GEMM.

Each 2x2 output tile comes from a 4x4 input patch with 16 multiplications per (input,
output) channel pair instead of 36 (Lavin & Gray 2016, interpolation points 0, 1, -1):

    Y = A^T [ (G g G^T) (.) (B^T d B) ] A

Against F(4x4, 3x3) (``winograd.py``) it saves fewer multiplications (2.25x instead of 4x)
but its transformed weights hold 16 values per channel pair instead of 36 (16/9 = 1.8x the
weight instead of 4x) and its matrices hold only 0, +-1 and 1/2, so it rounds less (the
error bound below, measured).

- the weight transform ``U = G g G^T`` runs once, at optimize time, as one GEMM with
  ``G kron G`` (numpy, float64, then float32): ``U[16][C][K]``;
- ``<name>_in`` (C generated from ``BT``: each row becomes one linear combination, SIMD
  over channels) writes ``V[16][T][C]`` for a chunk of T tiles, zero padded at the borders
  and flagging tiles whose patch holds a NaN or an infinity;
- the product ``M[16][T][K] = V @ U`` as in winograd.py (oneDNN matmul primitives, else
  ``torch.bmm``; ``winograd.transform_call`` runs the chunks);
- ``<name>_out`` (generated from ``AT``) computes ``A^T M A`` with the fused epilogue (bias,
  residual, activation), writes the NHWC output clipped at the borders, and computes the
  flagged tiles directly (NaN and infinities reach what PyTorch's do).

Applicability is Winograd F(4x4)'s (``winograd.why_not_applicable``: 3x3, stride 1,
ungrouped, undilated float32 channels_last, channels a multiple of 16, padding <= 2,
constant weights); no default rule picks it: it runs where ``algorithms=`` names it or
autotuning measures it fastest.
"""

from __future__ import annotations

import ctypes
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from ...errors import CompileError
from ...graph import Graph, Node
from ...hardware import Hardware
from ...loops import Acc, NotFusable
from ...ops import activation_expr
from ...options import Options
from ..x86.build import load_shared
from ..x86.cfuncs import SCALAR_HELPERS, c_expr, c_float
from ..x86.compile import build_c
from . import winograd as wg

M_TILE = 2  # output tile
R = 3  # kernel
ALPHA = M_TILE + R - 1  # input patch (4): ALPHA**2 = 16 transformed positions
VL = wg.CHANNEL_MULTIPLE
WORKSPACE_BYTES = wg.WORKSPACE_BYTES
MIN_CHUNK_TILES = wg.MIN_CHUNK_TILES
# Measured max|y - ref| / max|conv + bias + residual| (the scale before the activation: a
# clamp such as hardtanh(-0.5, 0.5) shrinks the output's scale, not the error), 16..512
# channels, every epilogue, `python bench/algorithms.py --errors`: against float32
# F.conv2d 1.9e-6 (F(4x4): 7.2e-6; the prepacked oneDNN call: 1.2e-6), against float64
# F.conv2d 5.6e-7 (F(4x4): 7.2e-6; oneDNN: 2.0e-6); tests/test_algorithms.py's shapes and
# weights: 2.2e-6 against float32. The bound the tests and autotuning hold it to (about 4x
# the float32 figure):
ERROR_BOUND = 1e-5

# Lavin & Gray's F(2, 3) (points 0, 1, -1, infinity), exact as fractions
_BT = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]
_G = [[1, 0, 0], [Fraction(1, 2)] * 3, [Fraction(1, 2), Fraction(-1, 2), Fraction(1, 2)], [0, 0, 1]]
_AT = [[1, 1, 1, 0], [0, 1, -1, -1]]
BT = np.array(_BT, dtype=np.float64)
G = np.array(_G, dtype=np.float64)
AT = np.array(_AT, dtype=np.float64)


def transform_weight(weight: np.ndarray | torch.Tensor) -> torch.Tensor:
    """``U[16][C][K]`` (float32, contiguous) of a ``[K][C][3][3]`` weight: position
    ``i*4 + j`` holds ``(G g G^T)[i][j]``, as one ``[16][9] @ [9][C*K]`` GEMM."""
    w = torch.as_tensor(np.asarray(weight, dtype=np.float32))
    k, c = w.shape[0], w.shape[1]
    t = torch.from_numpy(np.kron(G, G)).to(torch.float32)  # (i*4 + j, a*3 + b)
    return (t @ w.permute(2, 3, 1, 0).reshape(R * R, c * k)).reshape(ALPHA * ALPHA, c, k)


def tiles_of(n: int, oh: int, ow: int) -> int:
    return n * -(-oh // M_TILE) * -(-ow // M_TILE)


def chunk_tiles(c: int, k: int, tiles: int) -> int:
    """Tiles per chunk: V + M within ``WORKSPACE_BYTES``, at least ``MIN_CHUNK_TILES``."""
    per_tile = ALPHA * ALPHA * 4 * (c + k)
    return max(1, min(tiles, max(MIN_CHUNK_TILES, WORKSPACE_BYTES // per_tile)))


def extra_bytes(graph: Graph, node: Node) -> int:
    """``U`` (16 values per channel pair: 16/9 of the weight) plus one call's workspace."""
    x_t, out_t = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    c, k = x_t.shape[1], out_t.shape[1]
    n, oh, ow = out_t.shape[0], out_t.shape[2], out_t.shape[3]
    per_tile = ALPHA * ALPHA * 4 * (c + k)
    return ALPHA * ALPHA * 4 * c * k + per_tile * chunk_tiles(c, k, tiles_of(n, oh, ow))


def lincomb(row: Any, terms: list[str]) -> str:
    """C text of ``sum(row[i] * terms[i])`` without the zero terms (coefficients +-1 as
    additions); "0.0f" when every coefficient is zero."""
    out = []
    for coef, term in zip(row, terms, strict=True):
        coef = float(coef)
        if coef == 0.0:
            continue
        sign = "-" if coef < 0 else "+"
        mag = abs(coef)
        text = term if mag == 1.0 else f"{c_float(mag)} * {term}"
        out.append(f"{sign} {text}")
    if not out:
        return "0.0f"
    first = out[0][2:] if out[0].startswith("+") else f"-{out[0][2:]}"
    return " ".join([first, *out[1:]])


def _transform(mat: np.ndarray, src: str, dst: str, indent: str) -> str:
    """Lines ``dst(r) = sum_k mat[r][k] * src(k)`` for every row ``r`` of ``mat``; ``src`` and
    ``dst`` are format strings of the index."""
    terms = [src.format(k) for k in range(mat.shape[1])]
    return "\n".join(
        f"{indent}{dst.format(r)} = {lincomb(mat[r], terms)};" for r in range(mat.shape[0])
    )


_SOURCE = """\
/*
 * {name}: Winograd F(2x2, 3x3) transforms of 3x3 stride-1 convolutions, generated by
 * middleware from the matrices B^T, A^T of vendor/winograd_f2.py.
 * y = {epilogue}, per 2x2 output tile t = (n*TH + th)*TW + tw:
 *   {name}_in:  V[16][T][C] = B^T d B of the tile's 4x4 input patch d (zero padded)
 *   (the framework's batched GEMM: M[16][T][K] = V @ U, U = G g G^T per position)
 *   {name}_out: y = A^T M A (+ bias, residual, activation), clipped at the borders
 * OpenMP over tiles ({threads} threads), SIMD over channels (blocks of {vl}).
 */
#include <math.h>
#include <stddef.h>

#define VL {vl}

static inline float mw_max(float a, float b) {{ return (a > b || a != a) ? a : b; }}
static inline float mw_min(float a, float b) {{ return (a < b || a != a) ? a : b; }}
{scalar_helpers}
void {name}_in(const float *restrict x, float *restrict V, int H, int W, int C, int PH,
               int PW, long t0, int T, unsigned char *restrict bad)
{{
  const int OH = H + 2 * PH - 2, OW = W + 2 * PW - 2;
  const int TH = (OH + 1) / 2, TW = (OW + 1) / 2;
  const long S = (long)T * C;
  #pragma omp parallel for schedule(static) num_threads({threads})
  for (int tt = 0; tt < T; ++tt) {{
    const long t = t0 + tt;
    const int n = (int)(t / ((long)TH * TW)), r = (int)(t % ((long)TH * TW));
    const int h0 = (r / TW) * 2 - PH, w0 = (r % TW) * 2 - PW;
    int nonfinite = 0;
    for (int c0 = 0; c0 < C; c0 += VL) {{
      float d[4][4][VL], u[4][4][VL];
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) {{
          const int h = h0 + i, w = w0 + j;
          if (h >= 0 && h < H && w >= 0 && w < W) {{
            const float *p = x + (((long)n * H + h) * W + w) * C + c0;
            #pragma omp simd reduction(|:nonfinite)
            for (int v = 0; v < VL; ++v) {{
              d[i][j][v] = p[v];
              nonfinite |= !(fabsf(p[v]) <= 3.402823466e38f);
            }}
          }} else {{
            #pragma omp simd
            for (int v = 0; v < VL; ++v) d[i][j][v] = 0.0f;
          }}
        }}
      /* columns: u = B^T d */
      for (int j = 0; j < 4; ++j) {{
        #pragma omp simd
        for (int v = 0; v < VL; ++v) {{
{in_cols}
        }}
      }}
      /* rows: V = u B; position (i, j) of tile tt at V[i*4 + j][tt][c] */
      for (int i = 0; i < 4; ++i) {{
        float *o = V + (long)(i * 4) * S + (long)tt * C + c0;
        #pragma omp simd
        for (int v = 0; v < VL; ++v) {{
{in_rows}
        }}
      }}
    }}
    bad[tt] = (unsigned char)nonfinite;
  }}
}}

void {name}_out(const float *restrict M, const float *restrict bias, const float *res,
                float *y, int OH, int OW, int K, long t0, int T,
                const unsigned char *restrict bad, const float *restrict x,
                const float *restrict wt, int H, int W, int C, int PH, int PW)
{{
  const int TH = (OH + 1) / 2, TW = (OW + 1) / 2;
  const long S = (long)T * K;
  (void)bias;
  (void)res;
  #pragma omp parallel for schedule(static) num_threads({threads})
  for (int tt = 0; tt < T; ++tt) {{
    const long t = t0 + tt;
    const int n = (int)(t / ((long)TH * TW)), r = (int)(t % ((long)TH * TW));
    const int oh = (r / TW) * 2, ow = (r % TW) * 2;
    if (bad[tt]) {{  /* the direct convolution: NaN and infinities as PyTorch's */
      for (int i = 0; i < 2 && oh + i < OH; ++i)
        for (int j = 0; j < 2 && ow + j < OW; ++j) {{
          const long o = (((long)n * OH + oh + i) * OW + ow + j) * K;
          for (int c = 0; c < K; ++c) {{
            float acc = 0.0f;
            for (int a = 0; a < 3; ++a) {{
              const int h = oh + i - PH + a;
              if (h < 0 || h >= H) continue;
              for (int b = 0; b < 3; ++b) {{
                const int w = ow + j - PW + b;
                if (w < 0 || w >= W) continue;
                const float *xp = x + (((long)n * H + h) * W + w) * C;
                const float *wp = wt + (long)c * C * 9 + a * 3 + b;
                for (int ci = 0; ci < C; ++ci) acc += xp[ci] * wp[ci * 9];
              }}
            }}
            const float acc_v = acc{bias_c}{res_direct};
            y[o + c] = {activation};
          }}
        }}
      continue;
    }}
    for (int c0 = 0; c0 < K; c0 += VL) {{
      float q[2][4][VL];
      /* columns: q = A^T M */
      for (int j = 0; j < 4; ++j) {{
        const float *m = M + (long)j * S + (long)tt * K + c0;
        #pragma omp simd
        for (int v = 0; v < VL; ++v) {{
{out_cols}
        }}
      }}
      /* rows: y = q A, then the epilogue */
      for (int i = 0; i < 2 && oh + i < OH; ++i) {{
        const long o = (((long)n * OH + oh + i) * OW + ow) * K + c0;
        #pragma omp simd
        for (int v = 0; v < VL; ++v) {{
          const int c = c0 + v;
          (void)c;
{out_rows}
          {{
            const float acc_v = o0{bias_c}{res_0};
            y[o + v] = {activation};
          }}
          if (ow + 1 < OW) {{
            const float acc_v = o1{bias_c}{res_1};
            y[o + K + v] = {activation};
          }}
        }}
      }}
    }}
  }}
}}
"""


def render(ep: wg._Epilogue, threads: int) -> tuple[str, str]:
    """(kernel name, C source) of the F(2x2, 3x3) transforms with epilogue ``ep``; raises
    ``NotFusable`` for an activation without loop semantics."""
    name = f"winograd_f23_{ep.tag()}"
    act = "acc_v"
    if ep.activation:
        act = c_expr(activation_expr(ep.activation, dict(ep.attrs), Acc()), lambda x: "")
    src = _SOURCE.format(
        name=name,
        epilogue=ep.text(),
        threads=threads,
        vl=VL,
        in_cols=_transform(BT, "d[{}][j][v]", "u[{}][j][v]", " " * 10),
        in_rows=_transform(BT, "u[i][{}][v]", "o[{} * S + v]", " " * 10),
        out_cols=_transform(AT, "m[{} * 4 * S + v]", "q[{}][j][v]", " " * 10),
        out_rows=_transform(AT, "q[i][{}][v]", "const float o{}", " " * 10),
        bias_c=" + bias[c]" if ep.bias else "",
        res_direct=" + res[o + c]" if ep.residual else "",
        res_0=" + res[o + v]" if ep.residual else "",
        res_1=" + res[o + K + v]" if ep.residual else "",
        activation=act,
        scalar_helpers=SCALAR_HELPERS,
    )
    return name, src


def kernel(graph: Graph, node: Node, options: Options, hardware: Hardware) -> Any | None:
    """The F(2x2, 3x3) call for ``node`` (``fn(x, w[, b][, residual])`` -> a new
    channels_last tensor, with ``workspace_bytes`` and ``into_residual``), or None where it
    does not apply or its transforms failed to compile (``options.strict`` raises)."""
    if wg.why_not_applicable(graph, node) is not None:
        return None
    ep = wg._epilogue(node)
    try:
        kname, src = render(ep, max(1, hardware.cores))
    except NotFusable:
        return None
    try:
        built = build_c(
            kname, src, options.cache_dir, key_extra=(options.codegen_key(), hardware.key())
        )
    except CompileError:
        if options.strict:
            raise
        return None
    lib = load_shared(built.binary)
    f_in = getattr(lib, f"{kname}_in")
    f_in.restype = None
    f_in.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 5 + [ctypes.c_long, ctypes.c_int]
    f_in.argtypes += [ctypes.c_void_p]
    f_out = getattr(lib, f"{kname}_out")
    f_out.restype = None
    f_out.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_long, ctypes.c_int]
    f_out.argtypes += [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5

    weight = graph.params[node.inputs[1]]
    return wg.transform_call(
        graph, node, options, (f_in, f_out), weight, transform_weight(weight), G, ep,
        "winograd F(2x2,3x3)", (tiles_of, chunk_tiles),
    )  # fmt: skip
