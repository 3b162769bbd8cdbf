"""The network table: eleven torchvision CNNs, every engine a CPU user would pick against
the middleware, timed in one process, with each network's roofline and compile times.

For every network and batch size these engines run the same seeded input (fp32, random
seeded weights, ``torch.get_num_threads()`` threads everywhere):

- ``eager``: the model in ``torch.inference_mode()``, NCHW;
- ``eager_cl``: the same with the model and the input in channels_last;
- ``compile_freeze``: ``torch.compile(model, dynamic=False)`` with
  ``torch._inductor.config.freezing = True`` (Inductor's CPU inference setting: folded
  constants, prepacked oneDNN weights, fused post-ops), model and input in channels_last;
- ``ort``: ONNX Runtime, ``CPUExecutionProvider``, ``ORT_ENABLE_ALL``,
  ``intra_op_num_threads`` = the thread count, on the model exported with
  ``torch.onnx.export(..., opset_version=17, dynamo=False)``;
- ``openvino``: OpenVINO on the same ONNX file, device CPU, ``INFERENCE_NUM_THREADS`` =
  the thread count, ``INFERENCE_PRECISION_HINT=f32``, ``PERFORMANCE_HINT=LATENCY``;
- ``middleware``: ``middleware.optimize(model, example_inputs=(x,))``, NCHW input.

The peers are optional (``pip install -e '.[bench]'``): an engine whose package is missing
is skipped with a printed note, as is one whose export or compile fails.

Timing. Each round runs every engine in a new order drawn from a seeded generator; an
engine runs a block of ``--block`` + 1 calls and the block's first call is discarded (ONNX
Runtime's and OpenVINO's thread pools spin after a run and slow whoever runs next; timing
engines call by call in alternation made the middleware look up to 1.5x better at batch 1
than it is). Garbage collection is off inside a block. Latency is the median of all the
timed calls (``--repeat`` rounds x block calls). Every engine's output is checked against
eager's (max abs difference over the reference's max magnitude; above ``--tol`` the
engine is flagged ``!`` in the table and a warning is printed).

Ratio: the fastest engine other than the middleware over the middleware (> 1: the
middleware is faster). Roofline: the FLOPs of the algorithms the middleware actually runs
(a Winograd layer counts its own multiplications: 36 per 4x4 tile and channel pair for
F(4x4,3x3), 16 per 2x2 tile for F(2x2,3x3), not the direct convolution's 144 and 36)
at the GEMM peak measured at the start of the run, plus the compulsory bytes (the plan's
weights after folding, the input and the output) at the measured triad bandwidth
(``middleware.hardware.measure_cpu``); "x roofline" is the middleware's time over it.

Compile times: the wall time from wrapping the model to the end of its first call; the
middleware's ``optimize()`` alone too; the ONNX export; each peer's session build or
compile. Cold: ``torch.compile`` with a fresh ``TORCHINDUCTOR_CACHE_DIR`` and
``optimize()`` with a fresh ``cache_dir``. Warm (unless ``--no-warm``): the same cache
folders in a new Python process (``--warm-child``), so no in-memory cache helps.

Peak memory is not measured here (a per-engine peak needs one process per engine; see
``bench/memory.py``).

Usage::

    python bench/zoo.py                                   # all eleven, batch 1 and 16
    python bench/zoo.py --nets mobilenet_v3_small,resnet18 --batch 1,16 --no-warm
    python bench/zoo.py --engines eager_cl,ort,middleware --out results.md

Duration on the 2-core host: all eleven networks at batch 1 and 16 take about 35-45
minutes when the host is quiet (per network and batch a cold ``torch.compile`` with
freezing 10-45 s and its warm rerun 10-15 s, the ONNX export 2-10 s, ``optimize()`` a few
seconds; the timed blocks about 2 minutes at batch 1 and 8 at batch 16 in all, vgg16 at
batch 16 the largest share); ``--no-warm`` saves about 5 minutes. Measured on a host
loaded by other jobs (load average 9-12): three mobile networks at both batch sizes with
``--no-warm`` took about 36 minutes, every PyTorch-based engine 10-50x its quiet time.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
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
# Issue 15's transformers and ConvNeXt: not in the default run; give them with ``--nets``.
# Their heads are zero-initialised (the output would be all zeros), so their weights are
# re-initialised to keep the activations' variance (``coverage.variance_keeping``).
TRANSFORMERS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    name: (getattr(tvm, name), 224) for name in ("vit_b_16", "swin_t", "convnext_tiny", "maxvit_t")
}
ENGINES = ("eager", "eager_cl", "compile_freeze", "ort", "openvino", "middleware")
LABELS = {
    "eager": "eager",
    "eager_cl": "eager channels_last",
    "compile_freeze": "torch.compile freezing",
    "ort": "ONNX Runtime",
    "openvino": "OpenVINO",
    "middleware": "middleware",
}
# the Python package each peer needs (checked before anything is built)
NEEDS = {"ort": ("onnx", "onnxruntime"), "openvino": ("onnx", "openvino")}
OPSET = 17


@dataclasses.dataclass
class Row:
    """One network at one batch size."""

    net: str
    batch: int
    ms: dict[str, float]  # median latency per engine
    err: dict[str, float]  # each engine against eager, relative to the output's scale
    compile_s: dict[str, float]  # build times (see ``measure``)
    roofline_ms: float = math.nan
    mflop: float = math.nan  # of the algorithms the middleware runs
    mbytes: float = math.nan  # compulsory: weights + input + output

    @property
    def fastest_other(self) -> tuple[str, float]:
        have = [(m, v) for m, v in self.ms.items() if m != "middleware"]
        return min(have, key=lambda kv: kv[1])

    @property
    def ratio(self) -> float:
        """The fastest other engine over the middleware (> 1: the middleware is faster)."""
        return self.fastest_other[1] / self.ms["middleware"]


def missing_packages(engine: str) -> list[str]:
    return [p for p in NEEDS.get(engine, ()) if importlib.util.find_spec(p) is None]


def make_model(net: str) -> tuple[nn.Module, int]:
    """The network with seeded random weights, in eval mode, and its input size."""
    torch.manual_seed(0)
    if net in TRANSFORMERS:
        from coverage import variance_keeping

        make, size = TRANSFORMERS[net]
        return variance_keeping(make()), size
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


# ------------------------------------------------------------------------ engines
def build_compile_freeze(model: nn.Module, x: torch.Tensor) -> tuple[Callable[[], Any], float]:
    """torch.compile with freezing on channels_last; the runner and seconds to the end of
    the first call (freezing is read when the graph compiles, i.e. at the first call)."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    model_cl = copy.deepcopy(model).to(memory_format=torch.channels_last)
    x_cl = x.contiguous(memory_format=torch.channels_last)
    t0 = time.perf_counter()
    with inductor_config.patch(freezing=True):
        compiled = torch.compile(model_cl, dynamic=False)
        with torch.inference_mode():
            compiled(x_cl)
    seconds = time.perf_counter() - t0

    def run() -> Any:
        with torch.inference_mode():
            return compiled(x_cl)

    return run, seconds


def export_onnx(model: nn.Module, x: torch.Tensor, path: Path) -> float:
    """Seconds to export the model to ONNX (the TorchScript exporter, opset 17)."""
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(path), opset_version=OPSET, dynamo=False)
    return time.perf_counter() - t0


def build_ort(path: Path, x: torch.Tensor, threads: int) -> tuple[Callable[[], Any], float]:
    import onnxruntime as ort

    t0 = time.perf_counter()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    feed = {sess.get_inputs()[0].name: x.numpy()}
    sess.run(None, feed)
    seconds = time.perf_counter() - t0

    def run() -> Any:
        return sess.run(None, feed)[0]

    return run, seconds


def build_openvino(path: Path, x: torch.Tensor, threads: int) -> tuple[Callable[[], Any], float]:
    import openvino as ov

    t0 = time.perf_counter()
    config = {
        "INFERENCE_NUM_THREADS": threads,
        "INFERENCE_PRECISION_HINT": "f32",
        "PERFORMANCE_HINT": "LATENCY",
    }
    compiled = ov.Core().compile_model(str(path), "CPU", config)
    request = compiled.create_infer_request()
    feed = {0: x.numpy()}
    request.infer(feed, share_inputs=True)
    seconds = time.perf_counter() - t0

    def run() -> Any:
        request.infer(feed, share_inputs=True)
        return request.get_output_tensor(0).data

    return run, seconds


def build_middleware(
    model: nn.Module, x: torch.Tensor, cache_dir: Path
) -> tuple[Any, Callable[[], Any], float, float]:
    """optimize() the model; returns the module, the runner, seconds to the end of the first
    call and seconds of ``optimize()`` alone (trace, passes, kernels, plan: no run)."""
    import middleware

    t0 = time.perf_counter()
    opt = middleware.optimize(model, device="cpu", example_inputs=(x,), cache_dir=cache_dir)
    alone = time.perf_counter() - t0
    opt(x)
    seconds = time.perf_counter() - t0

    def run() -> Any:
        return opt(x)

    return opt, run, seconds, alone


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


# ------------------------------------------------------------------------ timing
def timed_blocks(
    fns: dict[str, Callable[[], Any]], warmup: int, repeat: int, block: int, seed: int
) -> dict[str, float]:
    """Median milliseconds per engine. Each round runs every engine in a new seeded order,
    a block of ``block`` + 1 calls each, the first discarded; ``warmup`` rounds untimed."""
    rng = random.Random(seed)
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(warmup + repeat):
        order = names[:]
        rng.shuffle(order)
        for k in order:
            fn = fns[k]
            gc.collect()
            gc.disable()
            try:
                fn()  # discarded: the previous engine's spinning threads, cold caches
                for _ in range(block):
                    t0 = time.perf_counter()
                    fn()
                    dt = time.perf_counter() - t0
                    if r >= warmup:
                        times[k].append(dt)
            finally:
                gc.enable()
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def as_tensor(y: Any) -> torch.Tensor:
    if isinstance(y, torch.Tensor):
        return y.detach().contiguous()
    return torch.from_numpy(y.copy())


def max_rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference over the reference's max magnitude (random-weight networks can
    have outputs far below 1, e.g. ~1e-9 for mobilenet_v2, so no floor at 1)."""
    if y.shape != ref.shape:
        return math.inf
    return float((y - ref).abs().max()) / max(1e-30, float(ref.abs().max()))


# ------------------------------------------------------------------------ roofline
WINOGRAD_MULTS = {"winograd_f4x4": (4, 36), "winograd_f2x2": (2, 16)}  # tile, mults/tile


def algorithm_flops(opt: Any) -> tuple[float, float]:
    """(FLOPs of the algorithms the middleware runs, compulsory bytes) of an optimized
    module's plan: report() FLOPs per node, a Winograd conv counted by its own
    multiplications; bytes = the plan's weights (after folding) + the input + the output."""
    plan = opt.plan
    graph = plan.graph
    flops = 0.0
    names = {n.name for n in graph.nodes()}
    for row in opt.report().rows:
        f = float(row.flops)
        if row.algorithm in WINOGRAD_MULTS and row.node in names:
            tile, mults = WINOGRAD_MULTS[row.algorithm]
            node = graph.node(row.node)
            n, k, h, w = graph.values[node.outputs[0]].shape
            c = graph.values[node.inputs[0]].shape[1]
            tiles = n * math.ceil(h / tile) * math.ceil(w / tile)
            f = 2.0 * mults * tiles * c * k
        flops += f
    weights = sum(int(a.nbytes) for a in graph.params.values())
    io = sum(graph.values[v].nbytes for v in graph.inputs) + sum(
        graph.values[v].nbytes for v in graph.output_values()
    )
    return flops, float(weights + io)


# ------------------------------------------------------------------------ one network
def warm_in_child(what: str, net: str, batch: int, cache: Path) -> tuple[float, float]:
    """Seconds to compile ``net`` in a new process with the warm cache folder ``cache``
    (to the end of the first call; and for the middleware ``optimize()`` alone)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--warm-child", what]
    cmd += ["--nets", net, "--batch", str(batch), "--cache-dir", str(cache)]
    env = dict(os.environ)
    if what == "compile_freeze":
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
    if what == "compile_freeze":
        _, seconds = build_compile_freeze(model, x)
    else:
        _, _, seconds, alone = build_middleware(model, x, cache)
    print(json.dumps({"seconds": seconds, "alone": alone}))


def note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_engines(
    net: str, batch: int, args: argparse.Namespace, scratch: Path, engines: Sequence[str]
) -> tuple[dict[str, Callable[[], Any]], dict[str, float], Any]:
    """Every available engine of ``engines`` for one network and batch: runners, build
    seconds (``<engine>`` to the end of the first call, ``<engine>_warm`` in a new
    process, ``onnx_export``, ``middleware_opt`` = optimize() alone) and the optimized
    module. A peer that fails to build is skipped with a note."""
    model, size = make_model(net)
    x = make_input(batch, size)
    threads = torch.get_num_threads()
    fns = {k: v for k, v in eager_runners(model, x).items() if k in engines}
    comp: dict[str, float] = {}
    if "compile_freeze" in engines:
        folder = scratch / f"inductor-{net}-{batch}"
        try:
            with inductor_cache(folder):
                fns["compile_freeze"], comp["compile_freeze"] = build_compile_freeze(model, x)
            if not args.no_warm:
                comp["compile_freeze_warm"] = warm_in_child("compile_freeze", net, batch, folder)[0]
        except Exception as e:  # noqa: BLE001 - a peer's failure skips the peer only
            note(f"  torch.compile freezing skipped on {net} b{batch}: {type(e).__name__}: {e}")
    peers = [e for e in ("ort", "openvino") if e in engines]
    onnx_path = scratch / f"{net}-{batch}.onnx"
    if peers:
        try:
            comp["onnx_export"] = export_onnx(model, x, onnx_path)
        except Exception as e:  # noqa: BLE001
            note(f"  ONNX export failed on {net} b{batch} ({type(e).__name__}: {e}): no ORT/OV")
            peers = []
    for peer, build in (("ort", build_ort), ("openvino", build_openvino)):
        if peer not in peers:
            continue
        try:
            fns[peer], comp[peer] = build(onnx_path, x, threads)
        except Exception as e:  # noqa: BLE001
            note(f"  {LABELS[peer]} skipped on {net} b{batch}: {type(e).__name__}: {e}")
    mw_cache = scratch / f"middleware-{net}-{batch}"
    opt, fns["middleware"], comp["middleware"], comp["middleware_opt"] = build_middleware(
        model, x, mw_cache
    )
    if not args.no_warm:
        comp["middleware_warm"], comp["middleware_opt_warm"] = warm_in_child(
            "middleware", net, batch, mw_cache
        )
    return fns, comp, opt


def measure(
    net: str, batch: int, args: argparse.Namespace, scratch: Path, peak: tuple[float, float]
) -> Row:
    """Every engine on one network at one batch size, its roofline and build times."""
    fns, comp, opt = build_engines(net, batch, args, scratch, args.engines)
    build = "  ".join(f"{k} {v:.1f}s" for k, v in comp.items())
    note(f"  {net} b{batch} built: {build}")
    ref = as_tensor(fns["eager"]())
    err = {k: max_rel_err(as_tensor(fn()), ref) for k, fn in fns.items()}
    for k, e in err.items():
        if not e <= args.tol:
            note(
                f"  WARNING {net} b{batch}: {LABELS[k]} differs from eager by {e:.1e} (> {args.tol})"
            )
    block = args.block or (5 if batch <= 2 else 2)
    ms = timed_blocks(
        fns, args.warmup, args.repeat, block, seed=zlib.crc32(f"{net}/{batch}".encode())
    )
    flops, nbytes = algorithm_flops(opt)
    gflops, gbs = peak
    roof = (flops / (gflops * 1e9) + nbytes / (gbs * 1e9)) * 1e3
    return Row(net, batch, ms, err, comp, roof, flops / 1e6, nbytes / 1e6)


# ------------------------------------------------------------------------ report
def geomean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def markdown(rows: Sequence[Row], meta: str, tol: float) -> str:
    """The README tables: latency per engine, the ratio over the fastest other engine, the
    roofline, geometric means, then build times."""
    engines = [e for e in ENGINES if any(e in r.ms for r in rows)]
    lines = [meta, ""]
    head = " | ".join(f"{LABELS[e]} ms" for e in engines)
    lines.append(
        f"| network | batch | {head} | fastest other | ratio | roofline ms | "
        "x roofline | max rel. err |"
    )
    lines.append("|---|---:|" + "---:|" * len(engines) + "---|---:|---:|---:|---:|")
    for r in rows:
        best, _ = r.fastest_other
        cells = []
        for e in engines:
            flag = "!" if e in r.err and not r.err[e] <= tol else ""
            cells.append(_f(r.ms.get(e)) + flag)
        worst = max((v for k, v in r.err.items() if k != "eager"), default=0.0)
        lines.append(
            f"| {r.net} | {r.batch} | {' | '.join(cells)} | {LABELS[best]} | "
            f"{r.ratio:.2f}x | {_f(r.roofline_ms, 2)} | "
            f"{r.ms['middleware'] / r.roofline_ms:.1f}x | {worst:.1e} |"
        )
    lines.append("")
    for b in sorted({r.batch for r in rows}):
        sel = [r.ratio for r in rows if r.batch == b]
        roof = [r.ms["middleware"] / r.roofline_ms for r in rows if r.batch == b]
        lines.append(
            f"Batch {b}: the middleware over the fastest other engine, geometric mean "
            f"**{geomean(sel):.2f}x** ({sum(s > 1 for s in sel)}/{len(sel)} networks faster); "
            f"its distance to the roofline, geometric mean {geomean(roof):.1f}x."
        )
    lines += [
        "",
        f"Ratio: the fastest other engine's median over the middleware's (> 1: the middleware "
        f"is faster). `!`: output differs from eager by more than {tol:g} of its scale. "
        "Roofline: FLOPs of the algorithms the middleware runs at the measured GEMM peak plus "
        "weights + input + output bytes at the measured triad.",
        "",
        "| network | batch | MFLOP (algorithms used) | compulsory MB | ONNX export s | "
        "ORT session s | OpenVINO compile s | torch.compile freezing cold / warm s | "
        "middleware cold / warm s | optimize() alone cold / warm s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        c = r.compile_s
        lines.append(
            f"| {r.net} | {r.batch} | {_f(r.mflop)} | {_f(r.mbytes)} | "
            f"{_f(c.get('onnx_export'))} | {_f(c.get('ort'))} | {_f(c.get('openvino'))} | "
            f"{_f(c.get('compile_freeze'))} / {_f(c.get('compile_freeze_warm'))} | "
            f"{_f(c.get('middleware'))} / {_f(c.get('middleware_warm'))} | "
            f"{_f(c.get('middleware_opt'))} / {_f(c.get('middleware_opt_warm'))} |"
        )
    return "\n".join(lines) + "\n"


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nets", default=",".join(NETWORKS), help="comma-separated networks")
    p.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    p.add_argument(
        "--engines", default=",".join(ENGINES), help="comma-separated (eager, middleware always)"
    )
    p.add_argument("--repeat", type=int, default=3, help="timed rounds")
    p.add_argument(
        "--block", type=int, default=0, help="timed calls per block (0: 5 at batch 1-2, else 2)"
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--tol", type=float, default=1e-3, help="max relative error against eager")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (slow cold)")
    p.add_argument("--no-warm", action="store_true", help="skip the warm-compile child runs")
    p.add_argument("--out", type=Path, help="write the markdown table here")
    p.add_argument("--warm-child", choices=("compile_freeze", "middleware"), help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    nets = [n.strip() for n in args.nets.split(",") if n.strip()]
    known = {**NETWORKS, **TRANSFORMERS}
    unknown = [n for n in nets if n not in known]
    if unknown:
        raise SystemExit(f"unknown network(s) {unknown}; choose from {', '.join(known)}")
    batches = [int(b) for b in str(args.batch).split(",")]
    if args.warm_child:
        child_main(args.warm_child, nets[0], batches[0], args.cache_dir)
        return
    asked = {e.strip() for e in args.engines.split(",") if e.strip()} | {"eager", "middleware"}
    bad = asked - set(ENGINES)
    if bad:
        raise SystemExit(f"unknown engine(s) {sorted(bad)}; choose from {', '.join(ENGINES)}")
    if args.no_compile:
        asked.discard("compile_freeze")
    engines = []
    for e in ENGINES:
        if e not in asked:
            continue
        gone = missing_packages(e)
        if gone:
            note(
                f"{LABELS[e]} skipped: package(s) {', '.join(gone)} not installed "
                "(pip install -e '.[bench]')"
            )
            continue
        engines.append(e)
    args.engines = engines
    from middleware.hardware import measure_cpu

    m = measure_cpu()
    note(f"measured: GEMM {m.gflops:.0f} GFLOP/s, triad {m.gbs:.1f} GB/s (spread {m.spread:.2f})")
    load = os.getloadavg()
    t_start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="zoo-") as tmp:
        for net in nets:
            for b in batches:
                t0 = time.perf_counter()
                row = measure(net, b, args, Path(tmp), (m.gflops, m.gbs))
                rows.append(row)
                ms = "  ".join(f"{k} {v:.2f}" for k, v in row.ms.items())
                note(
                    f"{net} b{b}: {ms} ms | ratio {row.ratio:.2f}x over {row.fastest_other[0]} "
                    f"| roofline {row.roofline_ms:.2f} ms | {time.perf_counter() - t0:.0f}s"
                )
    load_end = os.getloadavg()
    meta = (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} cores; GEMM peak {m.gflops:.0f} GFLOP/s and triad {m.gbs:.1f} GB/s "
        f"measured at the start; median of {args.repeat} rounds x a block per engine "
        f"(block {args.block or '5 at batch 1, 2 at batch 16'}, first call of each block "
        f"discarded) after {args.warmup} warm-up round(s), seeded random order per round; "
        f"load average {load[0]:.1f} at the start, {load_end[0]:.1f} at the end; "
        f"whole run {time.perf_counter() - t_start:.0f} s."
    )
    text = markdown(rows, meta, args.tol)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
