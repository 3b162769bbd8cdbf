"""The network table: eleven torchvision CNNs, PyTorch's three fastest ways against the
middleware, timed interleaved in one process, plus compile times cold and warm.

For every network and batch size, four modes run the same input:

- ``eager``: the model in ``torch.inference_mode()``, NCHW;
- ``eager_cl``: the same with the model and the input in channels_last;
- ``compile``: ``torch.compile(model)`` (default mode, ``dynamic=False``), NCHW input;
- ``middleware``: ``middleware.optimize(model, example_inputs=(x,))``, NCHW input.

Latency is the median of ``--repeat`` rounds after ``--warmup`` rounds; a round calls each
mode once, in turn, so that the host's drift hits every mode alike. Speedup is the
fastest of the three PyTorch modes over the middleware (> 1: the middleware is faster).

Compile time is the wall time from wrapping the model to the end of its first call (so it
includes one run for both); the last column is the middleware's ``optimize()`` alone
(trace, passes, kernels and plan, which it does before any call). Cold: ``torch.compile`` with a fresh ``TORCHINDUCTOR_CACHE_DIR``
and ``optimize()`` with a fresh ``cache_dir``. Warm: the same cache folders, measured in a
new Python process (``--warm-child``), so that no in-memory cache helps.

Peak memory is not measured here (a per-mode peak on CPU needs one process per mode); the
profiler (``middleware.profile``) reports it.

Usage::

    python bench/zoo.py                                 # all eleven, batch 1 and 16
    python bench/zoo.py --nets resnet18,squeezenet1_1 --batch 16 --repeat 3 --no-compile
    python bench/zoo.py --out results.md

Duration on the 2-core host (quiet machine estimate from the per-network figures in
shared/MEASURED.md): the timed rounds take about 6 minutes for all eleven networks at both
batch sizes with ``--repeat 5``; cold ``torch.compile`` adds 30-120 s per network and batch
(about 20 minutes), its warm compile 2-13 s, the middleware's optimize a few seconds each:
the full table fits in about 35-40 minutes; ``--no-compile`` takes about 10.
Measured so far only on a host shared with five other jobs (load 7-9 on 2 cores, every
latency 5-50x its quiet value): squeezenet1_1 and mobilenet_v3_small at batch 1 with
``--repeat 3 --warmup 1``, compile included, took 380 s (cold torch.compile 137 s and
98 s of it); squeezenet1_1 and resnet18 at batch 1 and 16 with ``--no-compile`` 182 s.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torchvision.models as tvm

NETWORKS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "alexnet": (tvm.alexnet, 224),
    "vgg16": (tvm.vgg16, 224),
    "resnet18": (tvm.resnet18, 224),
    "resnet50": (tvm.resnet50, 224),
    "densenet121": (tvm.densenet121, 224),
    "squeezenet1_1": (tvm.squeezenet1_1, 224),
    "mobilenet_v2": (tvm.mobilenet_v2, 224),
    "mobilenet_v3_small": (tvm.mobilenet_v3_small, 224),
    "googlenet": (lambda: tvm.googlenet(aux_logits=False, init_weights=False), 224),
    "inception_v3": (lambda: tvm.inception_v3(aux_logits=False, init_weights=False), 299),
    "shufflenet_v2_x1_0": (tvm.shufflenet_v2_x1_0, 224),
}
MODES = ("eager", "eager_cl", "compile", "middleware")
TORCH_MODES = ("eager", "eager_cl", "compile")


@dataclasses.dataclass
class Row:
    """One network at one batch size."""

    net: str
    batch: int
    ms: dict[str, float]  # median latency per mode
    max_err: float  # middleware vs eager, relative to the output's scale
    compile_s: dict[str, float]  # compile_cold|warm, mw_cold|warm (+ _opt: optimize() alone)

    @property
    def fastest_torch(self) -> tuple[str, float]:
        have = [(m, self.ms[m]) for m in TORCH_MODES if m in self.ms]
        return min(have, key=lambda kv: kv[1])

    @property
    def speedup(self) -> float:
        return self.fastest_torch[1] / self.ms["middleware"]


def make_model(net: str) -> tuple[nn.Module, int]:
    """The network with seeded random weights, in eval mode, and its input size."""
    torch.manual_seed(0)
    make, size = NETWORKS[net]
    return make().eval(), size


def make_input(batch: int, size: int) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(batch, 3, size, size)


@contextlib.contextmanager
def inductor_cache(folder: Path) -> Iterator[None]:
    """Point torch.compile's on-disk cache at ``folder`` for the block."""
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def build_compile(model: nn.Module, x: torch.Tensor) -> tuple[Callable[[], Any], float]:
    """torch.compile the model; returns the runner and seconds to the end of the first call."""
    import torch._dynamo

    torch._dynamo.reset()
    t0 = time.perf_counter()
    compiled = torch.compile(model, dynamic=False)
    with torch.inference_mode():
        compiled(x)
    seconds = time.perf_counter() - t0

    def run() -> Any:
        with torch.inference_mode():
            return compiled(x)

    return run, seconds


def build_middleware(
    model: nn.Module, x: torch.Tensor, cache_dir: Path
) -> tuple[Callable[[], Any], float, float]:
    """optimize() the model; returns the runner, seconds to the end of the first call and
    seconds of ``optimize()`` alone (trace, passes, kernels, plan: no run)."""
    import middleware

    t0 = time.perf_counter()
    opt = middleware.optimize(model, device="cpu", example_inputs=(x,), cache_dir=cache_dir)
    alone = time.perf_counter() - t0
    opt(x)
    seconds = time.perf_counter() - t0

    def run() -> Any:
        return opt(x)

    return run, seconds, alone


def eager_runners(model: nn.Module, x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    model_cl = copy.deepcopy(model).to(memory_format=torch.channels_last)
    x_cl = x.contiguous(memory_format=torch.channels_last)

    def eager() -> Any:
        with torch.inference_mode():
            return model(x)

    def eager_cl() -> Any:
        with torch.inference_mode():
            return model_cl(x_cl)

    return {"eager": eager, "eager_cl": eager_cl}


def interleaved(fns: dict[str, Callable[[], Any]], warmup: int, repeat: int) -> dict[str, float]:
    """Median milliseconds per function; each round calls every function once, in turn."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def max_rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference over the reference's max magnitude (random-weight networks can
    have outputs far below 1, e.g. ~1e-9 for mobilenet_v2, so no floor at 1)."""
    return float((y - ref).abs().max()) / max(1e-30, float(ref.abs().max()))


def warm_in_child(what: str, net: str, batch: int, cache: Path) -> tuple[float, float]:
    """Seconds to compile ``net`` in a new process with the warm cache folder ``cache``
    (to the end of the first call; and for the middleware ``optimize()`` alone)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--warm-child", what]
    cmd += ["--nets", net, "--batch", str(batch), "--cache-dir", str(cache)]
    env = dict(os.environ)
    if what == "compile":
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        print(f"  warm {what} child failed: {out.stderr[-2000:]}", file=sys.stderr)
        return math.nan, math.nan
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return float(got["seconds"]), float(got.get("alone", math.nan))


def child_main(what: str, net: str, batch: int, cache: Path) -> None:
    model, size = make_model(net)
    x = make_input(batch, size)
    alone = math.nan
    if what == "compile":
        _, seconds = build_compile(model, x)
    else:
        _, seconds, alone = build_middleware(model, x, cache)
    print(json.dumps({"seconds": seconds, "alone": alone}))


def measure(net: str, batch: int, args: argparse.Namespace, scratch: Path) -> Row:
    """Every mode of one network at one batch size, and its compile times."""
    model, size = make_model(net)
    x = make_input(batch, size)
    fns = eager_runners(model, x)
    comp: dict[str, float] = {}
    if not args.no_compile:
        folder = scratch / f"inductor-{net}-{batch}"
        with inductor_cache(folder):
            fns["compile"], comp["compile_cold"] = build_compile(model, x)
        if not args.no_warm:
            comp["compile_warm"] = warm_in_child("compile", net, batch, folder)[0]
    mw_cache = scratch / f"middleware-{net}-{batch}"
    fns["middleware"], comp["mw_cold"], comp["mw_cold_opt"] = build_middleware(model, x, mw_cache)
    if not args.no_warm:
        comp["mw_warm"], comp["mw_warm_opt"] = warm_in_child("middleware", net, batch, mw_cache)
    ref = fns["eager"]()
    err = max_rel_err(fns["middleware"](), ref)
    ms = interleaved(fns, args.warmup, args.repeat)
    return Row(net, batch, ms, err, comp)


# ------------------------------------------------------------------------ report
def geomean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def markdown(rows: Sequence[Row], meta: str) -> str:
    """The README table: latency per mode, speedup, geometric means, compile times."""
    lines = [meta, ""]
    lines.append(
        "| network | batch | eager ms | eager channels_last ms | torch.compile ms | "
        "middleware ms | fastest PyTorch | speedup | max rel. err |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        best, _ = r.fastest_torch
        lines.append(
            f"| {r.net} | {r.batch} | {_f(r.ms.get('eager'))} | {_f(r.ms.get('eager_cl'))} | "
            f"{_f(r.ms.get('compile'))} | {_f(r.ms['middleware'])} | {best} | "
            f"{r.speedup:.2f}x | {r.max_err:.1e} |"
        )
    lines.append("")
    for b in sorted({r.batch for r in rows}):
        sel = [r.speedup for r in rows if r.batch == b]
        lines.append(
            f"Geometric mean speedup of the middleware over the fastest PyTorch mode, batch "
            f"{b}: **{geomean(sel):.2f}x** ({sum(s > 1 for s in sel)}/{len(sel)} networks faster)."
        )
    lines += [
        "",
        "| network | batch | torch.compile cold s | torch.compile warm s | "
        "middleware cold s | middleware warm s | optimize() alone cold / warm s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        c = r.compile_s
        lines.append(
            f"| {r.net} | {r.batch} | {_f(c.get('compile_cold'))} | "
            f"{_f(c.get('compile_warm'))} | {_f(c.get('mw_cold'))} | {_f(c.get('mw_warm'))} | "
            f"{_f(c.get('mw_cold_opt'))} / {_f(c.get('mw_warm_opt'))} |"
        )
    return "\n".join(lines) + "\n"


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nets", default=",".join(NETWORKS), help="comma-separated networks")
    p.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--repeat", type=int, default=5, help="timed rounds (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (slow cold)")
    p.add_argument("--no-warm", action="store_true", help="skip the warm-compile child runs")
    p.add_argument("--out", type=Path, help="write the markdown table here")
    p.add_argument("--warm-child", choices=("compile", "middleware"), help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    nets = [n.strip() for n in args.nets.split(",") if n.strip()]
    unknown = [n for n in nets if n not in NETWORKS]
    if unknown:
        raise SystemExit(f"unknown network(s) {unknown}; choose from {', '.join(NETWORKS)}")
    batches = [int(b) for b in str(args.batch).split(",")]
    if args.warm_child:
        child_main(args.warm_child, nets[0], batches[0], args.cache_dir)
        return
    t_start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="zoo-") as tmp:
        for net in nets:
            for b in batches:
                t0 = time.perf_counter()
                row = measure(net, b, args, Path(tmp))
                rows.append(row)
                ms = "  ".join(f"{k} {v:.1f}" for k, v in row.ms.items())
                cs = "  ".join(f"{k} {v:.1f}s" for k, v in row.compile_s.items())
                print(
                    f"{net} b{b}: {ms} ms | speedup {row.speedup:.2f}x | err {row.max_err:.1e}"
                    f" | {cs} | {time.perf_counter() - t0:.0f}s",
                    file=sys.stderr,
                    flush=True,
                )
    meta = (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"median of {args.repeat} interleaved rounds after {args.warmup} warm-up rounds; "
        f"whole run {time.perf_counter() - t_start:.0f} s."
    )
    text = markdown(rows, meta)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
