"""The native runner: a sequence of C calls run by one C loop (runtime/native.py).

A plan whose every step is one C call (a generated kernel, a oneDNN primitive, a GEMV)
and whose every intermediate value lives at a fixed address (the arena) runs as one call
of :func:`load_runner`'s ``mw_run``: the Python between steps (the plan loop, each step's
wrapper, its ctypes call) was a third of a small network's time at batch 1.

Each step is a function address, whether it returns a status, and up to 48 64-bit
arguments, each the base address of a slot (the call's inputs and outputs, filled per
call) plus an offset, or a constant (slot -1: the offset is the value).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from ..interface import NativeCall
from .build import load_shared
from .compile import build_c

MAX_ARGS = 48  # RUNNER_C's MW_MAX_ARGS

RUNNER_C = r"""
#include <stdint.h>
#define MW_MAX_ARGS 48
typedef intptr_t P;
typedef struct { P fn; int32_t status, nargs; int32_t slot[MW_MAX_ARGS]; P off[MW_MAX_ARGS]; } mw_step;
typedef P (*mw_fn)(P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P);
/* Run the steps in order; 0, or 1 + the index of the first step that reported failure. */
int mw_run(const mw_step *s, int n, const P *slots) {
  for (int i = 0; i < n; ++i, ++s) {
    P a[MW_MAX_ARGS] = {0};
    for (int j = 0; j < s->nargs; ++j)
      a[j] = (s->slot[j] < 0 ? 0 : slots[s->slot[j]]) + s->off[j];
    /* every argument an integer or a pointer, passed as MW_MAX_ARGS of them: the x86-64
       System V convention passes each in the same register or stack slot whatever the
       callee's prototype says, and the caller pops the ones the callee does not read */
    const P r = ((mw_fn)s->fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15], a[16], a[17], a[18], a[19], a[20], a[21], a[22], a[23], a[24], a[25], a[26], a[27], a[28], a[29], a[30], a[31], a[32], a[33], a[34], a[35], a[36], a[37], a[38], a[39], a[40], a[41], a[42], a[43], a[44], a[45], a[46], a[47]);
    if (s->status && (int)r != 0) return i + 1;
  }
  return 0;
}
/* dst (dense, row-major) = src, d = {ndim, sizes[ndim], strides[ndim]} in elements,
   ndim <= 8: a reshape that copies (a channel shuffle's merge) */
void mw_strided_copy(const float *src, float *dst, const int64_t *d) {
  const int nd = (int)d[0];
  const int64_t *size = d + 1, *stride = d + 1 + nd;
  /* the two innermost dimensions as a tight loop nest, the rest by an index odometer */
  const int64_t n1 = nd > 0 ? size[nd - 1] : 1, s1 = nd > 0 ? stride[nd - 1] : 0;
  const int64_t n2 = nd > 1 ? size[nd - 2] : 1, s2 = nd > 1 ? stride[nd - 2] : 0;
  const int outer = nd > 2 ? nd - 2 : 0;
  int64_t idx[8] = {0}, total = 1, off = 0;
  for (int k = 0; k < outer; ++k) total *= size[k];
  for (int64_t i = 0; i < total; ++i) {
    const float *p = src + off;
    if (s1 == 1) {
      for (int64_t b = 0; b < n2; ++b, dst += n1)
        for (int64_t a = 0; a < n1; ++a) dst[a] = p[b * s2 + a];
    } else if (n1 == 2) { /* a channel shuffle's pairs */
      for (int64_t b = 0; b < n2; ++b, dst += 2) {
        dst[0] = p[b * s2];
        dst[1] = p[b * s2 + s1];
      }
    } else {
      for (int64_t b = 0; b < n2; ++b, dst += n1)
        for (int64_t a = 0; a < n1; ++a) dst[a] = p[b * s2 + a * s1];
    }
    for (int k = outer - 1; k >= 0; --k) {
      off += stride[k];
      if (++idx[k] < size[k]) break;
      off -= stride[k] * size[k];
      idx[k] = 0;
    }
  }
}
"""


class Step(ctypes.Structure):
    _fields_ = [
        ("fn", ctypes.c_ssize_t),
        ("status", ctypes.c_int32),
        ("nargs", ctypes.c_int32),
        ("slot", ctypes.c_int32 * MAX_ARGS),
        ("off", ctypes.c_ssize_t * MAX_ARGS),
    ]


def _library(cache_dir: Path) -> ctypes.CDLL:
    return load_shared(build_c("mw_native_runner", RUNNER_C, Path(cache_dir)).binary)


def load_runner(cache_dir: Path) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """``mw_run(steps, n, slots) -> int``, compiled once through the kernel cache."""
    fn = _library(cache_dir).mw_run
    fn.argtypes = [ctypes.POINTER(Step), ctypes.c_int, ctypes.POINTER(ctypes.c_ssize_t)]
    fn.restype = ctypes.c_int
    return fn


def function_address(cache_dir: Path, name: str) -> int:
    """The address of the runner library's function ``name``."""
    return int(ctypes.cast(getattr(_library(cache_dir), name), ctypes.c_void_p).value or 0)


def strided_copy(view: torch.Tensor, dst: Any) -> NativeCall | None:
    """The runner's strided copy of ``view`` (any strides, at most eight dimensions) into
    dense ``dst`` (a tensor or a workspace) in ``view``'s row-major order; None where it
    does not apply. The call's description of ``view`` is kept with the program."""
    if view.dtype != torch.float32 or view.dim() > 8 or 0 in view.stride():
        return None
    desc = torch.tensor([view.dim(), *view.shape, *view.stride()], dtype=torch.int64)
    return NativeCall("mw_strided_copy", (view, dst, desc.data_ptr()), keep=(desc,))
