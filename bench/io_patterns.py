"""Benchmark: fused I/O patterns through ``middleware.optimize()`` against the memory limit.

Issue 18. Five I/O-bound patterns the networks contain, each in both memory layouts (the
inputs NCHW-contiguous or channels_last; ``optimize()`` decides its own internal layout):

* ``chain``: batch-norm -> ReLU -> 3x3/2 max-pool (padding 1)
* ``avgpool``: batch-norm -> ReLU -> 3x3/2 avg-pool (padding 1)
* ``residual``: ReLU(x + y)
* ``concat_maxpool``: cat([a, b, c], 1) -> 3x3/1 max-pool (padding 1), inception-style
* ``se_gate``: x * sigmoid(s), ``s`` of shape (N, C, 1, 1) (the global pool already done)

For each pattern and layout, in one process, interleaved in a new random order every
round: PyTorch eager (NCHW and channels_last inputs: the fastest PyTorch way is the best
of those, and of torch.compile with ``--compile``), ``optimize()``, a kernel that only
streams the same bytes (reads every input byte once, from the input tensors themselves,
and writes every output byte once; OpenMP C through the same compiler and flags, in four
variants: regular or non-temporal stores, with or without software prefetch of the reads
(prefetching was up to 27% faster on this host: a bound without it was beaten by the
generated kernels); the fastest variant counts) and a STREAM triad. Before every timed
call a read of ``--flush-mib`` MiB (128: four times this host's L3) evicts the caches, so
that every engine starts from memory: without it a pattern smaller than the L3 (the
concat, 22 MB) ran from the cache or from memory by which engine ran before it, and the
paired ratios swung by 30% between runs. Outputs are checked against eager first. Medians are
reported; ``% stream`` is the pattern's bytes (inputs + output) per second through
``optimize()`` as a share of the streaming kernel's (per round, the streaming kernel's time
over ``optimize()``'s in the same round; the median of those: the two ran moments apart,
so the host's drift between rounds cancels), ``% triad`` as a share of the triad's (the
triad's GB/s says how quiet the host was); ``faults``: page faults per call of
``optimize()`` (and of the fastest PyTorch way).

    python bench/io_patterns.py [--rounds 25] [--batch 16] [--patterns chain residual]
        [--layouts nchw nhwc] [--compile] [--one-core] [--flush-mib 128]

``--one-core`` runs everything on one thread (``OMP_THREAD_LIMIT=1``, one torch thread;
the script re-executes itself with that environment) and times each call by the thread's
CPU time: on a host shared with other jobs a two-thread kernel loses a whole scheduler
tick whenever either thread is preempted, which punishes a long call more than a short
one; CPU time of one thread does not count the time it was not running, so the ratios
say what the code does, not what the neighbours did.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import middleware
from middleware.backends.x86 import X86Backend
from middleware.backends.x86.compile import build_c
from middleware.hardware import detect
from middleware.options import Options
from middleware.runtime.pages import advise_huge_pages

STREAM_C = r"""
#include <stddef.h>
#include <immintrin.h>
/* Streams the bytes of a fused kernel: every input element read once, every output
   element written once, block by block (each output block of B floats reads the matching
   share of every input), so reads and writes interleave as in the kernel. */
#define B 1024
#define PF 512 /* floats ahead, where the reads prefetch */
static void run(int mode, int nin, const float **in, const long *len, float *out, long m)
{
  const int nt_stores = mode & 1, prefetch = mode & 2;
  long nb = (m + B - 1) / B;
  #pragma omp parallel for schedule(static)
  for (long b = 0; b < nb; ++b) {
    __m512 acc = _mm512_setzero_ps();
    for (int k = 0; k < nin; ++k) {
      long lo = len[k] * b / nb, hi = len[k] * (b + 1) / nb;
      const float *p = in[k];
      long i = lo;
      for (; i < lo + ((16 - (lo & 15)) & 15) && i < hi; ++i)
        acc = _mm512_max_ps(acc, _mm512_set1_ps(p[i]));
      __m512 a1 = acc, a2 = acc, a3 = acc; /* four chains: no latency bound */
      if (prefetch)
        for (; i + 64 <= hi; i += 64) {
          _mm_prefetch((const char *)(p + i + PF), _MM_HINT_T0);
          _mm_prefetch((const char *)(p + i + PF + 16), _MM_HINT_T0);
          _mm_prefetch((const char *)(p + i + PF + 32), _MM_HINT_T0);
          _mm_prefetch((const char *)(p + i + PF + 48), _MM_HINT_T0);
          acc = _mm512_max_ps(acc, _mm512_load_ps(p + i));
          a1 = _mm512_max_ps(a1, _mm512_load_ps(p + i + 16));
          a2 = _mm512_max_ps(a2, _mm512_load_ps(p + i + 32));
          a3 = _mm512_max_ps(a3, _mm512_load_ps(p + i + 48));
        }
      for (; i + 64 <= hi; i += 64) {
        acc = _mm512_max_ps(acc, _mm512_load_ps(p + i));
        a1 = _mm512_max_ps(a1, _mm512_load_ps(p + i + 16));
        a2 = _mm512_max_ps(a2, _mm512_load_ps(p + i + 32));
        a3 = _mm512_max_ps(a3, _mm512_load_ps(p + i + 48));
      }
      for (; i + 16 <= hi; i += 16)
        acc = _mm512_max_ps(acc, _mm512_load_ps(p + i));
      acc = _mm512_max_ps(_mm512_max_ps(acc, a1), _mm512_max_ps(a2, a3));
      for (; i < hi; ++i)
        acc = _mm512_max_ps(acc, _mm512_set1_ps(p[i]));
    }
    long lo = b * B, hi = lo + B < m ? lo + B : m;
    long i = lo;
    if (nt_stores) {
      for (; i + 16 <= hi; i += 16) _mm512_stream_ps(out + i, acc);
    } else {
      for (; i + 16 <= hi; i += 16) _mm512_store_ps(out + i, acc);
    }
    for (; i < hi; ++i) out[i] = _mm512_reduce_max_ps(acc);
  }
  if (nt_stores) _mm_sfence();
}
void stream(int mode, int nin, const float **in, const long *len, float *out, long m)
{
  run(mode, nin, in, len, out, m);
}
float flush(const float *p, long n)
{
  /* reads n floats, to evict the caches before a timed call (clean lines: nothing for the
     timed call to write back) */
  float s = 0.0f;
  #pragma omp parallel for reduction(+ : s) schedule(static)
  for (long i = 0; i < n; i += 16)
    s += p[i];
  return s;
}
void triad(float *restrict a, const float *restrict b, const float *restrict c, float s, long n)
{
  #pragma omp parallel for simd schedule(static)
  for (long i = 0; i < n; ++i)
    a[i] = b[i] + s * c[i];
}
"""


def _bn(c: int) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(c)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


class Residual(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.relu(x + y)


class ConcatMaxPool(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(torch.cat([a, b, c], 1), 3, 1, 1)


class SEGate(nn.Module):
    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(s)


def patterns(batch: int) -> dict[str, tuple[Callable[[], nn.Module], list[tuple[int, ...]]]]:
    """name -> (model factory, input shapes)."""
    n = batch
    return {
        "chain": (
            lambda: nn.Sequential(_bn(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)),
            [(n, 64, 112, 112)],
        ),
        "avgpool": (
            lambda: nn.Sequential(_bn(64), nn.ReLU(), nn.AvgPool2d(3, 2, 1)),
            [(n, 64, 112, 112)],
        ),
        "residual": (Residual, [(n, 64, 56, 56), (n, 64, 56, 56)]),
        "concat_maxpool": (
            ConcatMaxPool,
            [(n, 64, 28, 28), (n, 128, 28, 28), (n, 32, 28, 28)],
        ),
        "se_gate": (SEGate, [(n, 128, 56, 56), (n, 128, 1, 1)]),
    }


class Native:
    """The streaming kernel and the triad, built through the kernel cache."""

    def __init__(self, cache: Path) -> None:
        built = build_c("io_patterns_stream", STREAM_C, cache)
        self.lib = ctypes.CDLL(str(built.binary))
        self.lib.stream.restype = None
        self.lib.stream.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_long,
        ]
        self.lib.flush.restype = ctypes.c_float
        self.lib.flush.argtypes = [ctypes.c_void_p, ctypes.c_long]
        self.evict: Callable[[], None] = lambda: None
        self.lib.triad.restype = None
        self.lib.triad.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_float, ctypes.c_long]

    def stream(
        self, ins: list[torch.Tensor], out: torch.Tensor, nt: bool, prefetch: bool = False
    ) -> Callable[[], None]:
        k = len(ins)
        ptrs = (ctypes.c_void_p * k)(*[x.data_ptr() for x in ins])
        lens = (ctypes.c_long * k)(*[x.numel() for x in ins])
        f, po, m = self.lib.stream, out.data_ptr(), out.numel()
        mode = int(nt) | (2 if prefetch else 0)
        keep = (ins, out, ptrs, lens)

        def run() -> None:
            f(mode, k, ptrs, lens, po, m)

        run.keep = keep  # type: ignore[attr-defined]
        return run

    def set_flush(self, mib: int) -> None:
        """Before each timed call, read ``mib`` MiB that no engine touches (0: never)."""
        if mib <= 0:
            self.evict = lambda: None
            return
        n = mib * 1024 * 1024 // 4
        buf = torch.rand(n)
        f, p = self.lib.flush, buf.data_ptr()

        def evict() -> None:
            f(p, n)

        evict.keep = buf  # type: ignore[attr-defined]
        self.evict = evict

    def triad(self, n: int) -> tuple[Callable[[], None], int]:
        a, b, c = _aligned(n), torch.rand(n), torch.rand(n)
        f, pa, pb, pc = self.lib.triad, a.data_ptr(), b.data_ptr(), c.data_ptr()

        def run() -> None:
            f(pa, pb, pc, 3.0, n)

        run.keep = (a, b, c)  # type: ignore[attr-defined]
        return run, 3 * 4 * n


STREAMS = ("stream", "stream nt", "stream pf", "stream pf nt")
_TAG = dict(zip(STREAMS, " npb", strict=True))


def _aligned(n: int, huge: bool = False) -> torch.Tensor:
    """A float tensor of ``n`` elements starting on a 64-byte boundary (``huge``: advised
    to 2 MiB pages before its first write)."""
    raw = torch.empty(n + 16)
    if huge:
        advise_huge_pages(raw)
    off = (-(raw.data_ptr() // 4)) % 16
    return raw[off : off + n]


def _memory_of(x: torch.Tensor) -> torch.Tensor:
    """``x``'s own memory as a flat tensor (``x`` dense in NCHW or channels_last order),
    or a 64-byte-aligned copy where it does not start on a 64-byte boundary (the
    streaming kernel's vector loads are aligned)."""
    if x.dim() == 4 and not x.is_contiguous():
        flat = x.permute(0, 2, 3, 1).reshape(-1)  # channels_last: a view, no copy
    else:
        flat = x.reshape(-1)
    if flat.data_ptr() != x.data_ptr() or flat.data_ptr() % 64:
        a = _aligned(x.numel())
        a.copy_(flat)
        return a
    return flat


def to_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "nhwc" and x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    return x.contiguous()


def bench_case(
    name: str,
    layout: str,
    factory: Callable[[], nn.Module],
    shapes: list[tuple[int, ...]],
    native: Native,
    args: argparse.Namespace,
    cache: Path,
) -> dict:
    torch.manual_seed(0)
    model = factory().eval()
    xs_nchw = [torch.randn(s) for s in shapes]
    xs = [to_layout(x, layout) for x in xs_nchw]
    xs_cl = [to_layout(x, "nhwc") for x in xs_nchw]
    runs: dict[str, Callable[[], object]] = {}
    with torch.inference_mode():
        ref = model(*xs_nchw)
        runs["eager nchw"] = lambda: model(*xs_nchw)
        runs["eager channels_last"] = lambda: model(*xs_cl)
        if args.compile:
            comp = torch.compile(model)
            comp(*xs)
            runs["torch.compile"] = lambda: comp(*xs)
    t0 = time.perf_counter()
    opt = middleware.optimize(model, device="cpu", example_inputs=xs, cache_dir=cache)
    with torch.inference_mode():  # the mode of the timed calls (the output buffer's too)
        opt(*xs)
    t_opt = time.perf_counter() - t0
    runs["middleware"] = lambda: opt(*xs)
    # the memory optimize() writes its output to (the plan's first recycled buffer, free
    # again once a call's output is dropped): the streaming kernel and the bare kernel
    # write there too, so that all three read and write the very same pages (where the
    # pages lie moved a kernel by up to 15% on this host). None: a fresh buffer each call.
    own = _output_memory(opt)
    kernel_run = _kernel_into_buffer(opt, xs, cache, own)
    if kernel_run is not None:
        runs["kernel"] = kernel_run
    out_bytes = ref.numel() * 4
    in_bytes = sum(x.numel() * 4 for x in xs)
    # written into memory of the kind optimize() writes its outputs to: with
    # Options.huge_pages (the default), memory advised to 2 MiB pages (runtime/pages.py)
    sink = own if own is not None else _aligned(ref.numel(), huge=Options().huge_pages)
    # the very memory optimize() reads (a copy of the inputs elsewhere streamed up to 15%
    # faster than the originals on this host: where the pages lie matters, so the bound
    # reads the same pages)
    ins_same = [_memory_of(x) for x in xs]
    runs["stream"] = native.stream(ins_same, sink, nt=False)
    runs["stream nt"] = native.stream(ins_same, sink, nt=True)
    runs["stream pf"] = native.stream(ins_same, sink, nt=False, prefetch=True)
    runs["stream pf nt"] = native.stream(ins_same, sink, nt=True, prefetch=True)
    triad, triad_bytes = native.triad(16 * 1024 * 1024)
    runs["triad"] = triad
    with torch.inference_mode():
        for k in ("eager nchw", "eager channels_last", "torch.compile", "middleware", "kernel"):
            if k not in runs:
                continue
            got = runs[k]()
            assert isinstance(got, torch.Tensor)
            scale = ref.abs().max().item() or 1.0
            err = (got - ref).abs().max().item() / scale
            assert err < 1e-5, f"{name} {layout} {k}: relative error {err}"
    times: dict[str, list[float]] = {k: [] for k in runs}
    faults: dict[str, int] = {k: 0 for k in runs}
    order = random.Random(hash((name, layout)) & 0xFFFF)
    clock = time.thread_time if args.one_core else time.perf_counter
    evict = native.evict
    gc.collect()
    gc.disable()  # a collection inside a timed call would be charged to that engine
    with torch.inference_mode():
        for r in range(args.warmup + args.rounds):
            keys = list(runs)
            order.shuffle(keys)
            for k in keys:
                evict()
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = clock()
                runs[k]()
                dt = clock() - t0
                if r >= args.warmup:
                    times[k].append(dt)
                    faults[k] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    gc.enable()
    if own is not None:  # the plan wrote the shared buffer on every call (no second one)
        assert [b.data_ptr() for b in opt.plan.recycled[0].buffers()] == [own.data_ptr()]
    med = {k: statistics.median(v) for k, v in times.items()}
    nbytes = in_bytes + out_bytes
    torch_keys = [k for k in med if k.startswith(("eager", "torch.compile"))]
    fastest = min(torch_keys, key=lambda k: med[k])
    stream_k = min(STREAMS, key=lambda k: med[k])
    stream_t = med[stream_k]

    def paired(k: str) -> float:
        """The median over rounds of the streaming kernel's time over ``k``'s in the same
        round (the two ran moments apart: the host's drift cancels)."""
        return 100 * statistics.median(
            a / b for a, b in zip(times[stream_k], times[k], strict=True)
        )

    triad_gbs = triad_bytes / med["triad"] / 1e9
    mw = med["middleware"]
    kern = med.get("kernel")
    return dict(
        kernel_pct=paired("kernel") if kern else float("nan"),
        faults=faults["middleware"] / args.rounds,
        faults_torch=faults[fastest] / args.rounds,
        name=name,
        layout=layout,
        mb=nbytes / 1e6,
        mw_ms=mw * 1e3,
        mw_gbs=nbytes / mw / 1e9,
        stream_gbs=nbytes / stream_t / 1e9,
        stream_how=stream_k,
        pct_stream=paired("middleware"),
        triad_gbs=triad_gbs,
        pct_triad=100 * nbytes / mw / 1e9 / triad_gbs,
        torch_ms=med[fastest] * 1e3,
        torch_what=fastest,
        speedup=med[fastest] / mw,
        t_opt=t_opt,
        groups=_groups(opt),
    )


def _output_memory(opt: object) -> torch.Tensor | None:
    """The buffer a one-output plan writes its output to when the caller dropped the last
    one (``planned_steps.Recycled``): the tensor the plan holds itself, not a view (a
    view would count as the user's reference, and the plan would write elsewhere)."""
    recycled = getattr(opt.plan, "recycled", [])  # type: ignore[attr-defined]
    if len(recycled) != 1:
        return None
    bufs = recycled[0].buffers()
    return bufs[0] if len(bufs) == 1 else None


def _kernel_into_buffer(
    opt: object, xs: list[torch.Tensor], cache: Path, out: torch.Tensor | None = None
) -> Callable[[], object] | None:
    """The generated kernel of a one-group plan writing a preallocated output (``out``,
    or a new one: as the streaming kernel does): ``optimize()`` minus the allocation of a
    fresh output (and its page faults) and the plan's Python step. None when the plan is
    not one group."""
    g = opt.graph  # type: ignore[attr-defined]
    try:
        kernel = X86Backend().build(
            g, [n.name for n in g.nodes()], Options(cache_dir=cache), detect("cpu", cache, True)
        )
    except Exception:  # noqa: BLE001 - only informative
        return None
    by_name = dict(zip(g.inputs, xs, strict=True))
    args = [by_name[v] for v in kernel.inputs]
    if out is None:
        out = kernel.fn(*args)
        advise_huge_pages(out)  # as optimize()'s own outputs (runtime/pages.py)

    def run() -> object:
        kernel.out_fn(*args, out)
        return out

    return run


def _groups(opt: object) -> str:
    """How optimize() ran the pattern: the report's group lines, compacted."""
    try:
        text = str(opt.report())  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - the report is informative only
        return "?"
    runs = [ln.split()[2] for ln in text.splitlines() if ln.strip()[:1].isdigit()]
    return "+".join(runs) or "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--patterns", nargs="*", default=None)
    ap.add_argument("--layouts", nargs="*", default=["nchw", "nhwc"])
    ap.add_argument("--compile", action="store_true", help="also time torch.compile")
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument(
        "--one-core", action="store_true", help="one thread, timed by its CPU time (see above)"
    )
    ap.add_argument(
        "--flush-mib",
        type=int,
        default=128,
        help="read this many MiB before each timed call, evicting the caches (0: no flush)",
    )
    args = ap.parse_args()
    if args.one_core:
        if os.environ.get("OMP_THREAD_LIMIT") != "1":
            env = dict(os.environ, OMP_THREAD_LIMIT="1", OMP_NUM_THREADS="1")
            os.execve(sys.executable, [sys.executable, *sys.argv], env)
        torch.set_num_threads(1)
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="mw-io-"))
    native = Native(cache)
    native.set_flush(args.flush_mib)
    pats = patterns(args.batch)
    chosen = args.patterns or list(pats)
    rows = []
    for name in chosen:
        factory, shapes = pats[name]
        for layout in args.layouts:
            rows.append(bench_case(name, layout, factory, shapes, native, args, cache))
            r = rows[-1]
            print(
                f"  {name} {layout}: {r['pct_stream']:.0f}% of stream, triad "
                f"{r['triad_gbs']:.1f} GB/s",
                flush=True,
            )
    print(
        f"\nmedians of {args.rounds} rounds after {args.warmup} warm-up, interleaved in random "
        f"order; batch {args.batch}, float32, {torch.get_num_threads()} torch threads; "
        + (
            f"{args.flush_mib} MiB read before each call (caches evicted); "
            if args.flush_mib > 0
            else "caches not evicted; "
        )
        + ("one thread, CPU time" if args.one_core else "wall clock")
    )
    head = (
        f"{'pattern':15s} {'layout':6s} {'MB':>6s} {'mw ms':>7s} {'mw GB/s':>8s} "
        f"{'stream GB/s':>11s} {'% stream':>8s} {'triad GB/s':>10s} {'% triad':>7s} "
        f"{'torch ms':>8s} {'x torch':>7s} {'kernel %':>8s} {'faults':>6s}  fastest torch"
    )
    print(head)
    for r in rows:
        print(
            f"{r['name']:15s} {r['layout']:6s} {r['mb']:6.1f} {r['mw_ms']:7.2f} "
            f"{r['mw_gbs']:8.1f} {r['stream_gbs']:10.1f}{_TAG[r['stream_how']]} "
            f"{r['pct_stream']:7.0f}% {r['triad_gbs']:10.1f} {r['pct_triad']:6.0f}% "
            f"{r['torch_ms']:8.2f} {r['speedup']:7.2f} {r['kernel_pct']:7.0f}% "
            f"{r['faults']:6.0f}  {r['torch_what']} ({r['faults_torch']:.0f} faults)"
        )
    print(
        "(the streaming kernel's fastest variant: n non-temporal stores, p prefetching "
        "reads, b both, blank neither; % stream and kernel %: "
        "the median over rounds of the streaming kernel's time over optimize()'s, or over the "
        "generated kernel's writing a preallocated output as the streaming kernel does, in "
        "the same round; faults: page faults per call)"
    )
    worst = min(rows, key=lambda r: r["pct_stream"])
    print(
        f"worst: {worst['name']} {worst['layout']} at {worst['pct_stream']:.0f}% of the "
        f"streaming bound (target >= 90%)"
    )


if __name__ == "__main__":
    main()
