"""Training-step time and peak training memory: eager, the middleware, ``torch.compile``.

For each network (``middleware.models.NETWORKS``, the eleven of ``bench/zoo.py``; random
seeded torchvision weights, training mode; googlenet and inception_v3 without auxiliary
heads, inception_v3 at 299x299) every engine trains its own copy of the same model with
its own ``torch.optim.SGD(lr=1e-3, momentum=0.9)`` on the same seeded batch:

- ``eager``: the model as it is (NCHW);
- ``middleware``: ``middleware.optimize(model)`` (its training plans);
- ``compile``: ``torch.compile(model)`` (default mode), forward and backward through
  Inductor;
- ``recompute`` (only where named in ``--engines``): the middleware with every fused
  group's backward recomputed through PyTorch (``torch.autograd.grad`` over the group's
  ops), as before the generated backward kernels: the A/B of issue 16's item 3 in one
  interleaved run. A bench-only switch: the plan builder's ``backward_kernels`` is
  replaced by one deriving none while this engine compiles.

One step is forward, cross-entropy against seeded labels, backward, the optimizer's step
and ``zero_grad(set_to_none=True)``. Dropout layers are put in eval mode in every copy:
``torch.compile`` draws its dropout masks from its own random stream, so with dropout on
the engines' losses could not be compared (the middleware draws them from PyTorch's
stream in eager order; ``tests/test_training.py`` checks that).

Timing: a warm-up step per engine (the compile), then ``--rounds`` rounds; each round runs
one step of every engine, in a new order drawn from a seeded generator; the median step
time per engine is reported with the ratio of the fastest other engine over the
middleware (> 1: the middleware is faster). Every engine takes the same number of steps
on the same batch, so their weights stay equal: each round's loss of every engine is
checked against eager's (relative difference), and after the warm-up step every
parameter's gradient (max abs difference over the largest eager gradient of that
parameter, worst parameter reported).

Peak training memory (eager and middleware): one step under the profiler's live-storage
tracker (``middleware.runtime.profile.step_peak``: activations kept for backward,
gradients, temporaries; weights and optimizer state are parameter memory and not counted).

Usage::

    python bench/train.py --nets resnet18,mobilenet_v3_small --batch 16 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import math
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import middleware
from middleware.models import NETWORKS, load_model
from middleware.runtime import training
from middleware.runtime.profile import step_peak

MIB = 2**20
ENGINES = ("eager", "middleware", "compile")


@contextlib.contextmanager
def recompute_backward() -> Iterator[None]:
    """Training plans built inside derive no generated backward (``recompute`` engine)."""
    real = training.backward_kernels

    def none(
        backend: Any, graph: Any, fused: dict, options: Any, hardware: Any, skip: Any = ()
    ) -> dict:
        return {
            key: (None, "generated backward off (bench/train.py recompute)")
            for key in fused
            if key not in skip
        }

    training.backward_kernels = none  # type: ignore[assignment]
    try:
        yield
    finally:
        training.backward_kernels = real  # type: ignore[assignment]


def make(net: str) -> tuple[nn.Module, tuple[int, ...]]:
    loaded = load_model(f"torchvision:{net}", seed=0)
    model = loaded.model.train()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.eval()
    return model, tuple(loaded.input_shape)


class Engine:
    """One engine's copy of the model, its optimizer and its step."""

    def __init__(self, name: str, model: nn.Module) -> None:
        self.name = name
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        if name in ("middleware", "recompute"):
            self.run: Callable[..., Any] = middleware.optimize(model)
        elif name == "compile":
            self.run = torch.compile(model)
        else:
            self.run = model
        self.times: list[float] = []
        self.backward_times: list[float] = []  # loss.backward() alone
        self.losses: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor, keep_grads: bool = False) -> dict:
        switch = recompute_backward() if self.name == "recompute" else contextlib.nullcontext()
        t0 = time.perf_counter()
        with switch:  # the first call builds the plan
            out = self.run(x)
        loss = F.cross_entropy(out, y)
        t1 = time.perf_counter()
        loss.backward()
        self.backward_times.append((time.perf_counter() - t1) * 1e3)
        grads = {}
        if keep_grads:
            grads = {n: p.grad.clone() for n, p in self.model.named_parameters()}
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.times.append((time.perf_counter() - t0) * 1e3)
        self.losses.append(float(loss.detach()))
        return grads


def grad_error(got: dict, ref: dict) -> float:
    """The worst parameter's max abs difference over its largest eager gradient, at least
    1e-3 of the model's largest (a gradient that is zero in exact arithmetic, a
    batch-norm's bias before another training-mode batch-norm, is rounding noise)."""
    floor = 1e-3 * max(float(e.abs().max()) for e in ref.values())
    worst = 0.0
    for name, e in ref.items():
        scale = max(float(e.abs().max()), floor, 1e-30)
        worst = max(worst, float((got[name] - e).abs().max()) / scale)
    return worst


def measure(net: str, batch: int, rounds: int, engines: Sequence[str], seed: int) -> dict:
    model, shape = make(net)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, *shape, generator=gen)
    y = torch.randint(0, 1000, (batch,), generator=gen)
    runs = {e: Engine(e, copy.deepcopy(model)) for e in engines}
    grads = {}
    compile_s = {}
    for e, eng in runs.items():  # the first step builds (traces, compiles)
        t0 = time.perf_counter()
        grads[e] = eng.step(x, y, keep_grads=True)
        compile_s[e] = time.perf_counter() - t0
    peaks = {}
    for e in ("eager", "middleware", "recompute"):  # a step each, also taken by the others
        if e in runs:
            eng = runs[e]
            peaks[e] = step_peak(lambda xx, eng=eng: eng.step(xx, y), [x])[1]
    for e in runs:
        if e not in peaks:
            runs[e].step(x, y)
    for eng in runs.values():  # timed rounds only
        eng.times.clear()
        eng.backward_times.clear()
    order = random.Random(seed)
    gc.disable()
    try:
        for _ in range(rounds):
            names = list(runs)
            order.shuffle(names)
            for e in names:
                runs[e].step(x, y)
    finally:
        gc.enable()
    ref = runs["eager"].losses
    loss_err = {
        e: max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r.losses, ref, strict=True))
        for e, r in runs.items()
    }
    return {
        "net": net,
        "ms": {e: statistics.median(r.times) for e, r in runs.items()},
        "backward_ms": {e: statistics.median(r.backward_times) for e, r in runs.items()},
        "first_s": compile_s,
        "peak": peaks,
        "loss_err": loss_err,
        "grad_err": {e: grad_error(grads[e], grads["eager"]) for e in runs},
        "report": str(runs["middleware"].run.report()).splitlines()[-1]
        if "middleware" in runs
        else "",
    }


def geomean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else math.nan


def markdown(rows: Sequence[dict], engines: Sequence[str], meta: str) -> str:
    ab = "recompute" in engines  # the A/B columns of the generated backward
    head = (
        "| network | "
        + " | ".join(f"{e} ms" for e in engines)
        + " | fastest other / middleware | peak MiB eager | peak MiB middleware | "
        + (
            "peak MiB recompute | recompute / middleware ms | backward ms middleware, recompute | "
            if ab
            else ""
        )
        + "memory ratio | loss rel. diff (max over steps) | grad rel. err (worst parameter) | "
        "first step s |"
    )
    lines = [meta, "", head, "|" + "---|" * (len(engines) + 8 + 3 * ab)]
    speed, mem, ab_speed = [], [], []
    for r in rows:
        ms = r["ms"]
        other = min(v for e, v in ms.items() if e not in ("middleware", "recompute"))
        ratio = other / ms["middleware"] if "middleware" in ms else math.nan
        pe, pm = r["peak"].get("eager", math.nan), r["peak"].get("middleware", math.nan)
        speed.append(ratio)
        mem.append(pm / pe)
        extra = ""
        if ab:
            ab_speed.append(ms["recompute"] / ms["middleware"])
            bwd = r["backward_ms"]
            extra = (
                f"{r['peak']['recompute'] / MIB:.0f} | {ab_speed[-1]:.2f}x | "
                f"{bwd['middleware']:.0f}, {bwd['recompute']:.0f} | "
            )
        errs = ", ".join(f"{e} {v:.1e}" for e, v in r["loss_err"].items() if e != "eager")
        gerrs = ", ".join(f"{e} {v:.1e}" for e, v in r["grad_err"].items() if e != "eager")
        first = ", ".join(f"{e} {v:.1f}" for e, v in r["first_s"].items())
        lines.append(
            f"| {r['net']} | "
            + " | ".join(f"{ms[e]:.0f}" for e in engines)
            + f" | {ratio:.2f}x | {pe / MIB:.0f} | {pm / MIB:.0f} | {extra}{pm / pe:.2f} | "
            f"{errs} | {gerrs} | {first} |"
        )
    ab_mean = f" | {geomean(ab_speed):.2f}x" if ab else ""
    lines.append(
        f"| geometric mean | {' | '.join('' for _ in engines)} | {geomean(speed):.2f}x | |"
        f"{' |' if ab else ''}{ab_mean}{' |' if ab else ''} | {geomean(mem):.2f} | | | |"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nets", default=",".join(NETWORKS), help="comma-separated networks")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="timed steps per engine")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--seed", type=int, default=0, help="seed of the engines' order per round")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    args = p.parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    if "eager" not in engines:
        engines.insert(0, "eager")
    rows = []
    for net in [n for n in args.nets.split(",") if n]:
        print(f"{net}: batch {args.batch} ...", flush=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = measure(net, args.batch, args.rounds, engines, args.seed)
        print(f"  {r['ms']}  peak {r['peak']}  {r['report']}", flush=True)
        rows.append(r)
    meta = (
        f"bench/train.py: batch {args.batch}, {args.rounds} timed rounds, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    text = markdown(rows, engines, meta)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
