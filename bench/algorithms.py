"""Conv2d algorithms per network: static choices against autotuning, timed interleaved in
one process, plus the cost of tuning cold and the reuse of its stored decisions.

For every network and batch size, five engines run the same input:

- ``eager_cl``: the model in ``torch.inference_mode()``, model and input channels_last;
- ``default``: ``middleware.optimize(model, example_inputs=(x,))`` (the middleware's own
  per-layer choice: Winograd F(4x4, 3x3) by its measured rule, else the vendor call);
- ``vendor``: ``algorithms={"conv2d": "vendor"}``: every convolution through PyTorch/oneDNN;
- ``im2col_gemm``: ``algorithms={"conv2d": "im2col_gemm"}``: im2row workspace + GEMM;
- ``autotune``: ``algorithms={"conv2d": "autotune"}``: every applicable algorithm measured
  on each layer's problem size, the fastest kept (decisions stored in the cache directory).

Latency is the median of ``--repeat`` rounds after ``--warmup`` rounds; each round calls
every engine once, in a new random order. Every engine's output is checked against eager
NCHW (max abs error over the reference's max magnitude).

Tuning cost: ``optimize()`` wall time of ``default`` and of ``autotune``, each in its own
fresh cache directory (both compile their kernels cold; autotune also times the
candidates), then a second ``optimize()`` of ``autotune`` with the same cache directory
after forgetting the in-process memo (``tuning.clear_memo()``, as a new process would):
its layers say "tuned: cached" and nothing is timed. ``vendor`` and ``im2col_gemm`` reuse
the default's (warm) kernel cache.

Weights are random (seeded) and re-initialised so that activations keep their variance
through the depth (Kaiming-normal convolutions, batch-norm as identity, 1/sqrt(fan_in)
linear layers): torchvision's own random init leaves e.g. mobilenet_v2's logits near
1e-9, which makes relative errors meaningless.

For ``--per-layer`` (default ``resnet18:16``) the table lists every conv2d layer, its
shape, the time autotune measured for each candidate (parsed from the report row's reason,
"tuned: X best of N: a 0.38 ms, b 0.49 ms") and the pick.

Usage::

    python bench/algorithms.py --out bench/results/algorithms_cpu.md
    python bench/algorithms.py --nets resnet18 --batch 1 --repeat 3
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import gc
import math
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torchvision.models as tvm

import middleware
from middleware.backends.vendor import tuning

NETWORKS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "resnet18": (tvm.resnet18, 224),
    "vgg16": (tvm.vgg16, 224),
    "mobilenet_v2": (tvm.mobilenet_v2, 224),
    "googlenet": (lambda: tvm.googlenet(aux_logits=False, init_weights=False), 224),
    "squeezenet1_1": (tvm.squeezenet1_1, 224),
}
DEFAULT_NETS = ("resnet18", "vgg16", "mobilenet_v2", "googlenet")
ENGINES = ("eager_cl", "default", "vendor", "im2col_gemm", "autotune")
MW_ENGINES = ENGINES[1:]


@dataclasses.dataclass
class Row:
    """One network at one batch size."""

    net: str
    batch: int
    ms: dict[str, float]  # median per engine
    err: dict[str, float]  # max relative error per engine against eager NCHW
    picks: dict[str, dict[str, int]]  # engine -> algorithm -> conv2d rows
    extra: dict[str, int]  # engine -> sum of rows' extra_bytes
    opt_s: dict[str, float]  # default_cold, autotune_cold, autotune_reuse
    reused: tuple[int, int]  # (rows saying "tuned: cached", tuned rows) in the reuse run
    layers: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def reinit(model: nn.Module) -> nn.Module:
    """Variance-keeping random weights (seeded by the caller)."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
            m.running_mean.zero_()
            m.running_var.fill_(1.0)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=1.0 / math.sqrt(m.in_features))
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    return model


def make_model(net: str) -> tuple[nn.Module, int]:
    torch.manual_seed(0)
    make, size = NETWORKS[net]
    with torch.no_grad():
        model = reinit(make())
    return model.eval(), size


def make_input(batch: int, size: int) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(batch, 3, size, size)


def max_rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max()) / max(1e-30, float(ref.abs().max()))


def interleaved(
    fns: dict[str, Callable[[], Any]], warmup: int, repeat: int, rng: random.Random
) -> dict[str, float]:
    """Median milliseconds per function; each round calls every function once, in a new
    random order."""
    names = list(fns)
    for _ in range(warmup):
        rng.shuffle(names)
        for k in names:
            fns[k]()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        rng.shuffle(names)
        for k in names:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def conv_rows(opt: Any) -> list[Any]:
    return [r for r in opt.report().rows if r.op == "conv2d"]


def picks_of(opt: Any) -> dict[str, int]:
    return dict(collections.Counter(r.algorithm or "generated" for r in conv_rows(opt)))


_TIME = re.compile(r"([A-Za-z_][\w]*) ([0-9.]+(?:e[+-]?\d+)?) ms")


def candidate_times(reason: str) -> dict[str, float]:
    """Candidate -> ms from a row's reason ("tuned: X best of N: a 0.38 ms, b 0.49 ms")."""
    tail = reason.split(" best of ", 1)[1] if " best of " in reason else ""
    return {m.group(1): float(m.group(2)) for m in _TIME.finditer(tail)}


def timed_optimize(
    model: nn.Module, x: torch.Tensor, cache: Path, sel: Any
) -> tuple[Callable[[], Any], Any, float]:
    t0 = time.perf_counter()
    kw = {} if sel is None else {"algorithms": {"conv2d": sel}}
    opt = middleware.optimize(model, example_inputs=(x,), cache_dir=cache, **kw)
    seconds = time.perf_counter() - t0

    def run() -> Any:
        return opt(x)

    return run, opt, seconds


def measure(net: str, batch: int, args: argparse.Namespace, scratch: Path, per_layer: bool) -> Row:
    model, size = make_model(net)
    x = make_input(batch, size)
    with torch.inference_mode():
        ref = model(x)
    model_cl = copy.deepcopy(model).to(memory_format=torch.channels_last)
    x_cl = x.contiguous(memory_format=torch.channels_last)

    def eager_cl() -> Any:
        with torch.inference_mode():
            return model_cl(x_cl)

    fns: dict[str, Callable[[], Any]] = {"eager_cl": eager_cl}
    opts: dict[str, Any] = {}
    opt_s: dict[str, float] = {}
    cache_default = scratch / f"{net}-{batch}-default"
    cache_tune = scratch / f"{net}-{batch}-autotune"
    fns["default"], opts["default"], opt_s["default_cold"] = timed_optimize(
        model, x, cache_default, None
    )
    fns["autotune"], opts["autotune"], opt_s["autotune_cold"] = timed_optimize(
        model, x, cache_tune, "autotune"
    )
    # a second optimize() on the same cache directory, as a new process would see it
    tuning.clear_memo()
    _, again, opt_s["autotune_reuse"] = timed_optimize(model, x, cache_tune, "autotune")
    reasons = [r.reason for r in conv_rows(again)]
    reused = (
        sum(r.startswith(("tuned: cached", "tuned: same problem")) for r in reasons),
        sum(r.startswith("tuned:") for r in reasons),
    )
    if picks_of(again) != picks_of(opts["autotune"]):
        print(f"  {net} b{batch}: the reuse run picked differently!", file=sys.stderr)
    del again
    for name in ("vendor", "im2col_gemm"):
        fns[name], opts[name], opt_s[f"{name}_warm"] = timed_optimize(model, x, cache_default, name)
    err = {k: max_rel_err(fn(), ref) for k, fn in fns.items()}
    rng = random.Random(f"{net}-{batch}")
    ms = interleaved(fns, args.warmup, args.repeat, rng)
    picks = {k: picks_of(o) for k, o in opts.items()}
    extra = {k: sum(r.extra_bytes for r in conv_rows(o)) for k, o in opts.items()}
    layers: list[dict[str, Any]] = []
    if per_layer:
        seen: dict[str, Any] = {}

        def record(layer: Any) -> str:
            seen[layer.name] = layer
            return "default"

        middleware.optimize(
            model, example_inputs=(x,), cache_dir=cache_default, algorithms={"conv2d": record}
        )
        for r in conv_rows(opts["autotune"]):
            lay = seen.get(r.node)
            layers.append(
                {
                    "node": r.node,
                    "layer": lay,
                    "pick": r.algorithm or "generated",
                    "default": next(
                        (d.algorithm for d in conv_rows(opts["default"]) if d.node == r.node), ""
                    ),
                    "times": candidate_times(r.reason),
                    "reason": r.reason,
                }
            )
    del fns, opts
    gc.collect()
    return Row(net, batch, ms, err, picks, extra, opt_s, reused, layers)


# ------------------------------------------------------------------------ report
def geomean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def _mib(n: int) -> str:
    return "0" if n == 0 else f"{n / 2**20:.1f}"


def _picks(p: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(p.items(), key=lambda kv: -kv[1]))


def _shape(lay: Any) -> str:
    if lay is None:
        return "?"
    n, c, h, w = lay.input_shape
    k, _, kh, kw = lay.weight_shape
    s = f"{c}->{k} {kh}x{kw}"
    if lay.stride != (1, 1):
        s += f"/{lay.stride[0]}"
    if lay.groups != 1:
        s += f" g{lay.groups}"
    if lay.residual:
        s += " +res"
    return f"{s} @ {n}x{h}x{w}"


def markdown(rows: Sequence[Row], meta: str) -> str:
    lines = [meta, ""]
    lines.append(
        "| network | batch | eager_cl ms | default ms | vendor ms | im2col_gemm ms | "
        "autotune ms | vendor / default | im2col / default | autotune / default | "
        "autotune picked |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        d = r.ms["default"]
        lines.append(
            f"| {r.net} | {r.batch} | "
            + " | ".join(f"{r.ms[e]:.1f}" for e in ENGINES)
            + " | "
            + " | ".join(f"{r.ms[e] / d:.2f}" for e in ("vendor", "im2col_gemm", "autotune"))
            + f" | {_picks(r.picks['autotune'])} |"
        )
    lines.append("")
    for b in sorted({r.batch for r in rows}):
        sel = [r for r in rows if r.batch == b]
        parts = [
            f"{e} {geomean([r.ms[e] / r.ms['default'] for r in sel]):.2f}"
            for e in ("eager_cl", "vendor", "im2col_gemm", "autotune")
        ]
        lines.append(
            f"Batch {b}, geometric mean of ms / default ms over {len(sel)} networks: "
            + ", ".join(parts)
            + " (< 1: faster than the default)."
        )
    lines += [
        "",
        "Conv2d algorithms per engine (conv2d rows of `report()`), extra bytes (sum of the "
        "rows' `extra_bytes`, MiB) and max error against eager NCHW (relative to the "
        "output's max magnitude):",
        "",
        "| network | batch | default picks | extra MiB: default / vendor / im2col / autotune | "
        "max rel. err: eager_cl / default / vendor / im2col / autotune |",
        "|---|---:|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.net} | {r.batch} | {_picks(r.picks['default'])} | "
            + " / ".join(_mib(r.extra[e]) for e in ("default", "vendor", "im2col_gemm", "autotune"))
            + " | "
            + " / ".join(f"{r.err[e]:.1e}" for e in ENGINES)
            + " |"
        )
    lines += [
        "",
        "`optimize()` wall time, s: default and autotune each in a fresh cache directory "
        "(cold kernels; autotune also times every candidate on every layer), then autotune "
        "again on its cache directory with the in-process memo cleared (decisions read "
        'from `tuning/decisions.json`; cached rows: conv2d rows timing nothing, "tuned: '
        "cached\" or the same problem's decision, / tuned rows); "
        "vendor and im2col_gemm on the default's warm kernel cache.",
        "",
        "| network | batch | default cold | autotune cold | tuning cost | autotune reuse | "
        "cached rows | vendor warm | im2col warm |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        o = r.opt_s
        lines.append(
            f"| {r.net} | {r.batch} | {o['default_cold']:.1f} | {o['autotune_cold']:.1f} | "
            f"{o['autotune_cold'] - o['default_cold']:+.1f} | {o['autotune_reuse']:.1f} | "
            f"{r.reused[0]}/{r.reused[1]} | {o['vendor_warm']:.1f} | {o['im2col_gemm_warm']:.1f} |"
        )
    for r in rows:
        if not r.layers:
            continue
        cands = sorted({c for lay in r.layers for c in lay["times"]})
        lines += [
            "",
            f"Per conv2d layer of {r.net} at batch {r.batch}: the time autotune measured for "
            "each candidate (best of its rounds, ms; a candidate pruned early keeps its "
            "best time so far; '-' not applicable), its pick and the default's. "
            "Shape: in->out channels, kernel[/stride] [groups] [+res: residual add fused "
            "into the call] @ N x H x W of the call's input (N is 1 for layers in the "
            "batch-sliced prefix, which run one sample slice at a time).",
            "",
            "| layer | shape | " + " | ".join(f"{c} ms" for c in cands) + " | autotune | default |",
            "|---|---|" + "---:|" * len(cands) + "---|---|",
        ]
        for lay in r.layers:
            t = lay["times"]
            cells = " | ".join(
                ("**" + f"{t[c]:.3g}" + "**")
                if c == lay["pick"] and c in t
                else (f"{t[c]:.3g}" if c in t else "-")
                for c in cands
            )
            lines.append(
                f"| {lay['node']} | {_shape(lay['layer'])} | {cells} | {lay['pick']} | "
                f"{lay['default']} |"
            )
    return "\n".join(lines) + "\n"


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nets", default=",".join(DEFAULT_NETS), help="comma-separated networks")
    p.add_argument("--batch", default="16,1", help="comma-separated batch sizes")
    p.add_argument("--repeat", type=int, default=5, help="timed rounds (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument(
        "--per-layer", default="resnet18:16", help="net:batch pairs for the per-layer table"
    )
    p.add_argument("--out", type=Path, help="write the markdown table here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    nets = [n.strip() for n in args.nets.split(",") if n.strip()]
    unknown = [n for n in nets if n not in NETWORKS]
    if unknown:
        raise SystemExit(f"unknown network(s) {unknown}; choose from {', '.join(NETWORKS)}")
    batches = [int(b) for b in str(args.batch).split(",")]
    per_layer = {tuple(s.split(":")) for s in args.per_layer.split(",") if s}
    t_start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="algorithms-") as tmp:
        for b in batches:
            for net in nets:
                t0 = time.perf_counter()
                row = measure(net, b, args, Path(tmp), (net, str(b)) in per_layer)
                rows.append(row)
                ms = "  ".join(f"{k} {v:.1f}" for k, v in row.ms.items())
                err = max(row.err.values())
                o = row.opt_s
                print(
                    f"{net} b{b}: {ms} ms | max err {err:.1e} | optimize default "
                    f"{o['default_cold']:.1f}s autotune {o['autotune_cold']:.1f}s reuse "
                    f"{o['autotune_reuse']:.1f}s | picked {_picks(row.picks['autotune'])} | "
                    f"{time.perf_counter() - t0:.0f}s",
                    file=sys.stderr,
                    flush=True,
                )
    meta = (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"median of {args.repeat} interleaved rounds (random order per round) after "
        f"{args.warmup} warm-up round(s); whole run {time.perf_counter() - t_start:.0f} s."
    )
    text = markdown(rows, meta)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
