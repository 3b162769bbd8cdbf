"""Benchmark: batch-norm -> ReLU -> 3x3/2 max-pool (padding 1) on 16x64x112x112 float32.

In one process, interleaved round by round (a new random order each round): PyTorch eager (NCHW, channels_last with an
in-place ReLU), torch.compile (NCHW, channels_last), the middleware (its generated
depth-first kernel through the compiler: ``optimize()`` as the pipeline lays the graph out,
and the graph laid out channels_last), and a STREAM triad (OpenMP C through the same
compiler and flags). Prints medians after warm-up, ratios and effective bandwidth (bytes
of the chain's input + output over time).

    python bench/chain.py [--rounds 15] [--shape 16 64 112 112] [--no-compile]
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

import middleware
from middleware.backends.x86 import X86Backend
from middleware.backends.x86.compile import build_c
from middleware.frontends import trace
from middleware.graph import Graph
from middleware.hardware import detect
from middleware.options import Options
from middleware.pipeline import compile_graph

TRIAD_C = """
#include <stddef.h>
void triad(float *restrict a, const float *restrict b, const float *restrict c, float s, long n)
{
  #pragma omp parallel for simd schedule(static)
  for (long i = 0; i < n; ++i)
    a[i] = b[i] + s * c[i];
}
"""


def chain(inplace: bool = False) -> nn.Module:
    m = nn.Sequential(nn.BatchNorm2d(64), nn.ReLU(inplace=inplace), nn.MaxPool2d(3, 2, 1))
    with torch.no_grad():
        m[0].running_mean.uniform_(-1, 1)
        m[0].running_var.uniform_(0.5, 2)
        m[0].weight.uniform_(0.5, 1.5)
        m[0].bias.uniform_(-0.5, 0.5)
    return m.eval()


def channels_last_graph(g: Graph) -> Graph:
    """The traced graph with every 4-d value laid out channels_last (what the layout pass
    of the pipeline decides on CPU)."""
    g = g.copy()
    for v, t in list(g.values.items()):
        if t.rank == 4:
            g.values[v] = dataclasses.replace(t, layout="nhwc")
    return g


def triad_fn(cache: Path, n: int) -> tuple[Callable[[], None], int]:
    built = build_c("stream_triad", TRIAD_C, cache)
    lib = ctypes.CDLL(str(built.binary))
    f = lib.triad
    f.restype = None
    f.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_float, ctypes.c_long]
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    pa, pb, pc = a.data_ptr(), b.data_ptr(), c.data_ptr()

    def run_keep() -> None:
        f(pa, pb, pc, 3.0, n)

    run_keep.tensors = (a, b, c)  # type: ignore[attr-defined]
    return run_keep, 3 * 4 * n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--shape", type=int, nargs=4, default=(16, 64, 112, 112))
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--cache-dir", type=Path, default=None)
    args = ap.parse_args()
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="mw-chain-"))
    torch.manual_seed(0)
    n, c, h, w = args.shape
    x = torch.randn(n, c, h, w)
    x_cl = x.contiguous(memory_format=torch.channels_last)
    model, model_inplace = chain(), chain(inplace=True)
    model_inplace.load_state_dict(model.state_dict())
    runs: dict[str, Callable[[], torch.Tensor]] = {}
    with torch.inference_mode():
        runs["eager nchw"] = lambda: model(x)
        runs["eager channels_last"] = lambda: model_inplace(x_cl)
        if not args.no_compile:
            t0 = time.perf_counter()
            comp = torch.compile(model)
            comp(x)
            model_cl = chain()
            model_cl.load_state_dict(model.state_dict())
            comp_cl = torch.compile(model_cl)
            comp_cl(x_cl)
            print(f"torch.compile: {time.perf_counter() - t0:.1f} s to compile both")
            runs["torch.compile nchw"] = lambda: comp(x)
            runs["torch.compile channels_last"] = lambda: comp_cl(x_cl)
    t0 = time.perf_counter()
    opt = middleware.optimize(model, device="cpu", example_inputs=[x_cl], cache_dir=cache)
    opt(x_cl)
    t_opt = time.perf_counter() - t0
    # feed optimize() the memory order its plan chose (no conversion inside the timing)
    g_opt = opt.graph
    x_opt = x_cl if g_opt.values[g_opt.inputs[0]].layout == "nhwc" else x
    opt(x_opt)
    opts = Options(cache_dir=cache)
    t0 = time.perf_counter()
    compiled = compile_graph(channels_last_graph(trace(model, [x_cl])), opts)
    t_cl = time.perf_counter() - t0
    plan = compiled.plan
    runs["middleware optimize()"] = lambda: opt(x_opt)
    runs["middleware channels_last"] = lambda: plan.run([x_cl])
    # the same generated kernel writing a preallocated output (the memory planner's form;
    # like the triad, no page faults of a fresh output in the timing)
    g_cl = compiled.graph
    kernel = X86Backend().build(
        g_cl, [n.name for n in g_cl.nodes()], opts, detect("cpu", cache, True)
    )
    out_buf = kernel.fn(x_cl)
    runs["middleware kernel out_fn"] = lambda: kernel.out_fn(x_cl, out_buf) or out_buf
    print(f"middleware: optimize() {t_opt:.1f} s, channels_last compile {t_cl:.1f} s")
    print(compiled.report)
    ref = model(x)
    for name, fn in runs.items():
        with torch.inference_mode():
            got = fn()
        err = (got - ref).abs().max().item()
        assert err < 1e-4, f"{name}: max error {err}"
    triad, triad_bytes = triad_fn(cache, 32 * 1024 * 1024)
    runs["stream triad"] = triad
    times: dict[str, list[float]] = {k: [] for k in runs}
    # each round runs every way once, in a new random order: a fixed order would hand the
    # same neighbour's cache and heap state (e.g. a freed output to reuse) to the same way
    order = random.Random(0)
    with torch.inference_mode():
        for r in range(args.warmup + args.rounds):
            names = list(runs)
            order.shuffle(names)
            for name in names:
                t0 = time.perf_counter()
                runs[name]()
                dt = time.perf_counter() - t0
                if r >= args.warmup:
                    times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    chain_bytes = x.numel() * 4 + ref.numel() * 4
    triad_gbs = triad_bytes / med["stream triad"] / 1e9
    fastest_torch = min(v for k, v in med.items() if k.startswith(("eager", "torch.compile")))
    mw = min(med["middleware optimize()"], med["middleware channels_last"])
    mw_kernel = med["middleware kernel out_fn"]
    print(
        f"\nchain {tuple(args.shape)} float32: {chain_bytes / 1e6:.1f} MB in+out; "
        f"{args.rounds} rounds after {args.warmup} warm-up, medians, interleaved"
    )
    print(
        f"{'what':30s} {'ms':>9s} {'x fastest torch':>16s} {'GB/s':>7s} {'% triad':>8s}"
        f" {'min ms':>9s}"
    )
    for name, t in med.items():
        nbytes = triad_bytes if name == "stream triad" else chain_bytes
        gbs = nbytes / t / 1e9
        print(
            f"{name:30s} {t * 1e3:9.2f} {fastest_torch / t:16.2f} {gbs:7.1f}"
            f" {100 * gbs / triad_gbs:7.0f}% {min(times[name]) * 1e3:9.2f}"
        )
    print(
        f"\nmiddleware vs fastest PyTorch: {fastest_torch / mw:.2f}x (target >= 2.5x); "
        f"effective bandwidth {chain_bytes / mw / 1e9:.1f} GB/s = "
        f"{100 * chain_bytes / mw / 1e9 / triad_gbs:.0f}% of triad (target >= 70%); "
        f"kernel into a preallocated output: {chain_bytes / mw_kernel / 1e9:.1f} GB/s = "
        f"{100 * chain_bytes / mw_kernel / 1e9 / triad_gbs:.0f}% of triad"
    )


if __name__ == "__main__":
    main()
