"""Conv2d algorithms per network: static choices against autotuning, timed interleaved in
one process, plus the cost of tuning cold and the reuse of its stored decisions.

For every network and batch size (the eleven networks of ``zoo.py``), nine engines run
the same input:

- ``eager_cl``: the model in ``torch.inference_mode()``, model and input channels_last;
- ``default``: ``middleware.optimize(model, example_inputs=(x,))`` (the middleware's own
  per-layer choice: Winograd F(4x4, 3x3) by its measured rule, the direct kernel for
  depthwise layers at batch 1, else the vendor call);
- one static choice per built-in conv2d algorithm, ``algorithms={"conv2d": name}`` for
  ``vendor``, ``winograd_f4x4``, ``winograd_f2x2``, ``im2col_gemm`` and ``direct`` (the
  algorithm on every layer it applies to, the default's choice on the others);
- ``autotune``: ``algorithms={"conv2d": "autotune"}``: every applicable algorithm measured
  on each layer's problem size, the fastest kept, then the network's plan chosen as a
  whole among the per-layer tuned plan, the default and the static choices within reach
  (``pipeline.network_choice``; decisions stored in the cache directory).

Every engine plans with the same hardware figures (measured once per run), so that two
engines differ in their algorithms only. ``autotune / best static`` is the median over
rounds of autotune's time over the fastest static engine's (default included) in the same
round; "same plan" marks a static engine that runs autotune's algorithm on every conv2d
layer (the same code: their difference is the host's noise).

Latency is the median of ``--repeat`` rounds after ``--warmup`` rounds; each round gives
every engine a turn, in a new random order: one discarded call, then five timed ones at
batch 1-2 (their median), one above (``--block``). Repeated inference, as ``zoo.py`` times
it and as the network-level choice times a plan: with one call a turn, every call met the
caches, pages and threads the other eight engines had left (a 0.5 ms network ran at 1 ms,
and densenet121's default plan at batch 16 at 234 ms against 202 ms in a loop). Every
engine's output is checked against eager NCHW (max abs error over the reference's max
magnitude).

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

``auto`` (``algorithms={"conv2d": "auto"}``) is timed as an ``optimize()`` on autotune's
cache directory with the memo cleared: it takes every stored decision (its picks must equal
autotune's) and times nothing; with no stored decision it is the default.

``--layers``: per 3x3 stride-1 layer shape of resnet18/vgg16 (batch 1 and 16), the time of
every applicable conv2d algorithm's call (vendor, winograd_f4x4, winograd_f2x2,
im2col_gemm), median of ``--repeat`` interleaved rounds, with each one's extra bytes.

``--errors``: each algorithm's max error over a set of conv shapes and epilogues, relative
to the scale before the activation (``max|conv + bias + residual|``), against float32 and
float64 ``F.conv2d``: the measurement behind the approximate algorithms' error bounds.

Usage::

    python bench/algorithms.py --out bench/results/algorithms_cpu.md
    python bench/algorithms.py --nets resnet18 --batch 1 --repeat 3
    python bench/algorithms.py --layers --repeat 11
    python bench/algorithms.py --errors
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import gc
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

import middleware
from middleware.backends.vendor import ALGORITHMS, tuning
from middleware.backends.vendor.algorithms import candidate_times
from middleware.graph import Graph, Node, TensorType
from middleware.hardware import detect
from middleware.ops import get_op, infer_types
from middleware.options import Options

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zoo import NETWORKS  # noqa: E402  (the eleven networks, the same builders as the peer table)

DEFAULT_NETS = tuple(NETWORKS)  # the eleven
# every conv2d algorithm as one static choice for the whole network (a layer it does not
# apply to runs the default's choice, and the report says why)
STATIC = ("vendor", "winograd_f4x4", "winograd_f2x2", "im2col_gemm", "direct")
ENGINES = ("eager_cl", "default", *STATIC, "autotune")
MW_ENGINES = ENGINES[1:]


@dataclasses.dataclass
class Row:
    """One network at one batch size."""

    net: str
    batch: int
    ms: dict[str, float]  # median per engine
    err: dict[str, float]  # max relative error per engine against eager NCHW
    picks: dict[str, dict[str, int]]  # engine -> algorithm -> conv2d rows
    plans: dict[str, dict[str, str]]  # engine -> conv2d node -> algorithm
    rounds: dict[str, list[float]]  # engine -> ms of each round (same rounds for all)
    extra: dict[str, int]  # engine -> sum of rows' extra_bytes
    opt_s: dict[str, float]  # default_cold, autotune_cold, autotune_reuse
    # (rows saying "tuned: cached", tuned rows) in the reuse run, then "auto"'s rows that
    # took a stored decision
    reused: tuple[int, ...]
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
    fns: dict[str, Callable[[], Any]],
    warmup: int,
    repeat: int,
    rng: random.Random,
    block: int = 1,
    discard: bool = False,
) -> dict[str, list[float]]:
    """Milliseconds of every round per function; each round calls every function, in a new
    random order. A function's turn is ``block`` timed calls (the round's time: their
    median), after one discarded call where ``discard``: repeated inference, as ``zoo.py``
    times it and as the network-level choice times a plan. Without the discarded call
    every call meets the caches, pages and threads the other engines left: a 0.5 ms
    network at batch 1 ran at 1 ms, and densenet121's default plan at batch 16 at 234 ms
    against 202 ms. (The single-layer tables call each layer once a turn: a layer does
    meet the caches its neighbours left.)"""
    names = list(fns)
    for _ in range(warmup):
        rng.shuffle(names)
        for k in names:
            fns[k]()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        rng.shuffle(names)
        for k in names:
            fn = fns[k]
            if discard:
                fn()  # discarded: the caches and threads the previous engine left
            got = []
            for _ in range(block):
                t0 = time.perf_counter()
                fn()
                got.append((time.perf_counter() - t0) * 1e3)
            times[k].append(statistics.median(got))
    return times


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in times.items()}


def conv_rows(opt: Any) -> list[Any]:
    return [r for r in opt.report().rows if r.op == "conv2d"]


def picks_of(opt: Any) -> dict[str, int]:
    return dict(collections.Counter(r.algorithm or "generated" for r in conv_rows(opt)))


# The hardware figures every engine plans with, measured once per run (``main``): each
# engine has its own cache directory, and a fresh one would measure the host again, so two
# engines could plan with different bandwidths (the batch-sliced prefix and the group
# classification depend on them) and differ in more than their algorithms.
HARDWARE: Any = None


def timed_optimize(
    model: nn.Module, x: torch.Tensor, cache: Path, sel: Any
) -> tuple[Callable[[], Any], Any, float]:
    t0 = time.perf_counter()
    kw: dict[str, Any] = {} if sel is None else {"algorithms": {"conv2d": sel}}
    if HARDWARE is not None:
        kw["hardware"] = HARDWARE
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
    # "auto" on the tuned cache directory: every stored decision, nothing timed
    tuning.clear_memo()
    _, auto, opt_s["auto_reuse"] = timed_optimize(model, x, cache_tune, "auto")
    if picks_of(auto) != picks_of(opts["autotune"]):
        print(f"  {net} b{batch}: auto picked differently from autotune!", file=sys.stderr)
    reused = (*reused, sum(r.reason.startswith("auto: stored") for r in conv_rows(auto)))
    del auto
    for name in STATIC:
        fns[name], opts[name], opt_s[f"{name}_warm"] = timed_optimize(model, x, cache_default, name)
    err = {k: max_rel_err(fn(), ref) for k, fn in fns.items()}
    rng = random.Random(f"{net}-{batch}")
    block = args.block or (5 if batch <= 2 else 1)
    rounds = interleaved(fns, args.warmup, args.repeat, rng, block, discard=True)
    ms = medians(rounds)
    picks = {k: picks_of(o) for k, o in opts.items()}
    plans = {k: {r.node: r.algorithm or "generated" for r in conv_rows(o)} for k, o in opts.items()}
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
    return Row(net, batch, ms, err, picks, plans, rounds, extra, opt_s, reused, layers)


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


def best_static(r: Row) -> str:
    """The fastest single static choice of the network (the default's rule included)."""
    return min(("default", *STATIC), key=lambda e: r.ms[e])


def paired(r: Row, a: str, b: str) -> float:
    """``a``'s time over ``b``'s: the median over rounds of the ratio within each round
    (the two ran moments apart, so the host's drift between rounds cancels)."""
    return statistics.median(x / y for x, y in zip(r.rounds[a], r.rounds[b], strict=True))


def same_plan(r: Row) -> list[str]:
    """The static engines whose every conv2d layer runs the algorithm autotune picked
    (the same plan: their measured difference is the host's noise)."""
    return [e for e in ("default", *STATIC) if r.plans[e] == r.plans["autotune"]]


def markdown(rows: Sequence[Row], meta: str) -> str:
    lines = [meta, ""]
    lines.append(
        "| network | batch | "
        + " | ".join(f"{e} ms" for e in ENGINES)
        + " | best static | autotune / best static | autotune / default | autotune picked |"
    )
    lines.append("|---|---:|" + "---:|" * len(ENGINES) + "---|---:|---:|---|")
    for r in rows:
        best = best_static(r)
        cells = " | ".join(f"**{r.ms[e]:.1f}**" if e == best else f"{r.ms[e]:.1f}" for e in ENGINES)
        same = same_plan(r)
        note = f" (same plan as {', '.join(same)})" if same else ""
        lines.append(
            f"| {r.net} | {r.batch} | {cells} | {best} | {paired(r, 'autotune', best):.2f} | "
            f"{paired(r, 'autotune', 'default'):.2f} | {_picks(r.picks['autotune'])}{note} |"
        )
    lines += [
        "",
        "Ratios are medians over rounds of the ratio within each round (`autotune / best "
        "static` < 1: autotune faster). Best static: the fastest of the default and every "
        "algorithm chosen for every layer (a layer it does not apply to runs the default's "
        "choice). Same plan: that static engine runs the algorithm autotune picked on every "
        "conv2d layer, so the two are the same code and their difference is the host's.",
        "",
    ]
    for b in sorted({r.batch for r in rows}):
        sel = [r for r in rows if r.batch == b]
        parts = [
            f"{e} {geomean([paired(r, e, 'default') for r in sel]):.2f}"
            for e in ENGINES
            if e != "default"
        ]
        vs_best = [paired(r, "autotune", best_static(r)) for r in sel]
        worst = max(range(len(sel)), key=lambda i: vs_best[i])
        lines.append(
            f"Batch {b}, geometric mean of ms / default ms over {len(sel)} networks: "
            + ", ".join(parts)
            + " (< 1: faster than the default). Autotune against each network's best static "
            f"choice: geometric mean {geomean(vs_best):.2f}, at least as fast on "
            f"{sum(v <= 1.0 for v in vs_best)} of {len(sel)}, worst {sel[worst].net} "
            f"{vs_best[worst]:.2f}."
        )
    lines += [
        "",
        "Conv2d algorithms per engine (conv2d rows of `report()`), extra bytes (sum of the "
        "rows' `extra_bytes`, MiB) and max error against eager NCHW (relative to the "
        "output's max magnitude):",
        "",
        "| network | batch | default picks | extra MiB: "
        + " / ".join(MW_ENGINES)
        + " | max rel. err: "
        + " / ".join(ENGINES)
        + " |",
        "|---|---:|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.net} | {r.batch} | {_picks(r.picks['default'])} | "
            + " / ".join(_mib(r.extra[e]) for e in MW_ENGINES)
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
        '`algorithms="auto"` likewise (memo cleared; auto stored rows: conv2d rows taking a '
        "stored decision, the rest by the default rule); "
        "vendor and im2col_gemm on the default's warm kernel cache.",
        "",
        "| network | batch | default cold | autotune cold | tuning cost | autotune reuse | "
        "cached rows | auto reuse | auto stored rows | vendor warm | im2col warm |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        o = r.opt_s
        lines.append(
            f"| {r.net} | {r.batch} | {o['default_cold']:.1f} | {o['autotune_cold']:.1f} | "
            f"{o['autotune_cold'] - o['default_cold']:+.1f} | {o['autotune_reuse']:.1f} | "
            f"{r.reused[0]}/{r.reused[1]} | {o['auto_reuse']:.1f} | {r.reused[2]} | "
            f"{o['vendor_warm']:.1f} | {o['im2col_gemm_warm']:.1f} |"
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


# ------------------------------------------------------------ single conv layers
def conv_case(
    x_shape: tuple[int, ...],
    w_shape: tuple[int, ...],
    padding: int = 1,
    activation: str | None = "relu",
    activation_attrs: tuple = (),
    residual: bool = False,
    seed: int = 0,
) -> tuple[Graph, Node]:
    """A channels_last graph of one conv2d (+ bias [+ residual] [+ activation]) with seeded
    weights of variance 2 / fan_in."""
    rng = np.random.default_rng(seed)
    g = Graph()
    g.add_input("x", TensorType(tuple(x_shape), layout="nhwc"))
    fan_in = w_shape[1] * w_shape[2] * w_shape[3]
    g.add_param("w", (rng.standard_normal(w_shape) * math.sqrt(2 / fan_in)).astype(np.float32))
    g.add_param("b", (rng.standard_normal(w_shape[0]) * 0.1).astype(np.float32))
    ins = ["x", "w", "b"]
    attrs: dict[str, Any] = dict(stride=1, padding=padding, dilation=1, groups=1)
    if activation:
        attrs.update(activation=activation, activation_attrs=tuple(activation_attrs))
    if residual:
        probe = Node("c", "conv2d", tuple(ins), ("y",), dict(attrs))
        g.add_input("r", TensorType(infer_types(g.values, probe)[0].shape, layout="nhwc"))
        ins.append("r")
        attrs["residual"] = True
    node = Node("c", "conv2d", tuple(ins), ("y",), attrs)
    g.add_node(node, infer_types(g.values, node))
    g.set_outputs("y")
    return g, node


def case_inputs(g: Graph, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    cl = torch.channels_last
    args = [torch.randn(g.values["x"].shape, generator=gen).contiguous(memory_format=cl)]
    args += [torch.from_numpy(g.params["w"]), torch.from_numpy(g.params["b"])]
    if "r" in g.values:
        args.append(torch.randn(g.values["r"].shape, generator=gen).contiguous(memory_format=cl))
    return args


# 3x3 stride-1 layers of resnet18 (64..512 channels) and vgg16's first ones, by input size
LAYER_SHAPES = [
    (64, 64, 56),
    (128, 128, 28),
    (256, 256, 14),
    (512, 512, 7),
    (64, 64, 224),
    (128, 128, 112),
]
LAYER_ALGORITHMS = ("vendor", "winograd_f4x4", "winograd_f2x2", "im2col_gemm")


def layers_table(args: argparse.Namespace, cache: Path) -> str:
    """Per layer shape and batch: each algorithm's call time (median ms) and extra bytes."""
    opts, hw = Options(cache_dir=cache), detect("cpu", None, measure=False)
    rng = random.Random(0)
    lines = [
        "| layer | batch | " + " | ".join(f"{a} ms" for a in LAYER_ALGORITHMS) + " | "
        "f2x2 / vendor | f2x2 / f4x4 | extra MiB f4x4 / f2x2 |",
        "|---|---:|" + "---:|" * (len(LAYER_ALGORITHMS) + 3),
    ]
    for b in [int(v) for v in str(args.batch).split(",")]:
        for c, k, hw_px in LAYER_SHAPES:
            if b > 1 and hw_px > 56 or b == 1 and hw_px > 112:
                continue  # keep the run short: vgg16's big layers at batch 1 only
            g, node = conv_case((b, c, hw_px, hw_px), (k, c, 3, 3))
            x = case_inputs(g)
            fns, extra = {}, {}
            for name in LAYER_ALGORITHMS:
                a = ALGORITHMS["conv2d"][name]
                if a.applies(g, node, torch.device("cpu"), opts) is not None:
                    continue
                fn = a.build(g, node, torch.device("cpu"), opts, hw)
                if fn is not None:
                    fns[name] = lambda fn=fn, x=x: fn(*x)
                    extra[name] = a.extra_bytes(g, node)
            with torch.inference_mode():
                ms = medians(interleaved(fns, args.warmup, args.repeat, rng))
            cells = " | ".join(f"{ms[a]:.2f}" if a in ms else "-" for a in LAYER_ALGORITHMS)
            lines.append(
                f"| {c}->{k} @ {hw_px}x{hw_px} | {b} | {cells} | "
                f"{ms['winograd_f2x2'] / ms['vendor']:.2f} | "
                f"{ms['winograd_f2x2'] / ms['winograd_f4x4']:.2f} | "
                f"{extra['winograd_f4x4'] / 2**20:.1f} / {extra['winograd_f2x2'] / 2**20:.1f} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines) + "\n"


NET_LAYER_NETS = ("resnet18", "vgg16", "mobilenet_v2", "squeezenet1_1")


def net_conv_problems(net: str, batch: int) -> list[tuple[dict[str, Any], list[str]]]:
    """The distinct conv2d problems of ``net`` at ``batch`` (input shape, weight shape,
    stride, padding, dilation, groups), each with the names of the layers that pose it, in
    first-use order (forward hooks on one eager call)."""
    model, size = make_model(net)
    seen: dict[tuple, tuple[dict[str, Any], list[str]]] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(mod: nn.Conv2d, inputs: tuple, _out: Any) -> None:
            prob = dict(
                x_shape=tuple(inputs[0].shape),
                w_shape=tuple(mod.weight.shape),
                stride=tuple(mod.stride),
                padding=tuple(mod.padding),
                dilation=tuple(mod.dilation),
                groups=mod.groups,
            )
            key = tuple(sorted(prob.items()))
            seen.setdefault(key, (prob, []))[1].append(name)

        return record

    handles = [
        m.register_forward_hook(hook(n))
        for n, m in model.named_modules()
        if isinstance(m, nn.Conv2d)
    ]
    with torch.inference_mode():
        model(make_input(batch, size))
    for h in handles:
        h.remove()
    return list(seen.values())


def net_layer_case(prob: dict[str, Any]) -> tuple[Graph, Node]:
    """One channels_last conv2d + bias + ReLU node of the problem, variance-keeping weights."""
    rng = np.random.default_rng(0)
    g = Graph()
    g.add_input("x", TensorType(prob["x_shape"], layout="nhwc"))
    ws = prob["w_shape"]
    fan_in = ws[1] * ws[2] * ws[3]
    g.add_param("w", (rng.standard_normal(ws) * math.sqrt(2 / fan_in)).astype(np.float32))
    g.add_param("b", (rng.standard_normal(ws[0]) * 0.1).astype(np.float32))
    attrs: dict[str, Any] = dict(
        stride=prob["stride"],
        padding=prob["padding"],
        dilation=prob["dilation"],
        groups=prob["groups"],
        activation="relu",
        activation_attrs=(),
    )
    node = Node("c", "conv2d", ("x", "w", "b"), ("y",), attrs)
    g.add_node(node, infer_types(g.values, node))
    g.set_outputs("y")
    return g, node


def net_layers_table(args: argparse.Namespace, cache: Path) -> str:
    """Per network and batch, per distinct conv2d problem: each applicable algorithm's call
    time (median ms of interleaved rounds), every output checked against the catalogue's
    reference (F.conv2d + bias + ReLU)."""
    opts, hw = Options(cache_dir=cache), detect("cpu", None, measure=False)
    rng = random.Random(0)
    names = [n for n in ALGORITHMS["conv2d"]]
    nets = [n.strip() for n in args.nets.split(",") if n.strip()]
    nets = [n for n in nets if n in NET_LAYER_NETS] or list(NET_LAYER_NETS)
    lines = [
        "Time per call (median ms); '-' not applicable; fastest in bold. Shape: "
        "in->out channels, kernel/stride [g groups] @ N x H x W; each layer with its "
        "convolution's bias and a ReLU epilogue.",
        "",
        "| network | batch | layer (count) | shape | " + " | ".join(names) + " | fastest |",
        "|---|---:|---|---|" + "---:|" * len(names) + "---|",
    ]
    totals: dict[tuple[str, int], dict[str, float]] = {}
    for b in [int(v) for v in str(args.batch).split(",")]:
        for net in nets:
            tot = totals.setdefault((net, b), {n: 0.0 for n in names} | {"best": 0.0})
            for prob, layers in net_conv_problems(net, b):
                g, node = net_layer_case(prob)
                x = case_inputs(g)
                ref = get_op("conv2d").bind(node)(*x)
                fns: dict[str, Callable[[], Any]] = {}
                for name in names:
                    a = ALGORITHMS["conv2d"][name]
                    if a.applies(g, node, torch.device("cpu"), opts) is not None:
                        continue
                    fn = a.build(g, node, torch.device("cpu"), opts, hw)
                    if fn is None:
                        continue
                    with torch.inference_mode():
                        err = max_rel_err(fn(*x), ref)
                    bound = 1e-4 if a.exact else 10 * (a.error_bound or 1e-4)
                    if err > bound:
                        raise SystemExit(f"{net} {layers[0]}: {name} error {err:.1e}")
                    fns[name] = lambda fn=fn, x=x: fn(*x)
                with torch.inference_mode():
                    ms = medians(interleaved(fns, args.warmup, args.repeat, rng))
                best = min(ms, key=ms.__getitem__)
                for name in names:
                    tot[name] += len(layers) * ms.get(name, ms["vendor"])
                tot["best"] += len(layers) * ms[best]
                ks = prob["w_shape"]
                xs = prob["x_shape"]
                shape = (
                    f"{xs[1]}->{ks[0]} {ks[2]}x{ks[3]}/{prob['stride'][0]}"
                    + (f" g{prob['groups']}" if prob["groups"] > 1 else "")
                    + f" @ {xs[0]}x{xs[2]}x{xs[3]}"
                )
                cells = " | ".join(
                    ("**" if n == best else "") + f"{ms[n]:.3g}" + ("**" if n == best else "")
                    if n in ms
                    else "-"
                    for n in names
                )
                lines.append(
                    f"| {net} | {b} | {layers[0]} ({len(layers)}) | {shape} | {cells} | {best} |"
                )
                print(lines[-1], file=sys.stderr, flush=True)
    lines += [
        "",
        "Sum over every conv2d layer (ms; a layer where an algorithm does not apply counts "
        "its vendor time), and the per-layer best:",
        "",
        "| network | batch | " + " | ".join(names) + " | per-layer best | best / vendor |",
        "|---|---:|" + "---:|" * (len(names) + 2),
    ]
    for (net, b), tot in totals.items():
        cells = " | ".join(f"{tot[n]:.1f}" for n in names)
        lines.append(
            f"| {net} | {b} | {cells} | {tot['best']:.1f} | {tot['best'] / tot['vendor']:.2f} |"
        )
    return "\n".join(lines) + "\n"


# (in, out) features of the classifiers: alexnet, vgg16, mobilenet_v3_small, resnet18/50
LINEAR_SHAPES = [(9216, 4096), (25088, 4096), (4096, 4096), (4096, 1000), (576, 1024),
                 (1024, 1000), (512, 1000), (2048, 1000)]  # fmt: skip


def triad_gbs(n: int = 1 << 25, repeat: int = 7) -> float:
    """STREAM triad a = b + s * c over float32 arrays of ``n`` elements (12 bytes per
    element moved), median GB/s, in this process."""
    b, c = torch.rand(n), torch.rand(n)
    a = torch.empty(n)
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        ts.append(time.perf_counter() - t0)
    return 12 * n / statistics.median(ts) / 1e9


def linear_table(args: argparse.Namespace, cache: Path) -> str:
    """Per classifier shape and row count: vendor and gemv call times and the weight's
    streaming rate, with the same run's triad."""
    opts, hw = Options(cache_dir=cache), detect("cpu", None, measure=False)
    rng = random.Random(0)
    triad = triad_gbs()
    lines = [
        f"STREAM triad in this run: {triad:.1f} GB/s; {torch.get_num_threads()} threads. "
        "GB/s: the weight's bytes over the call's time.",
        "",
        "| in -> out | rows | vendor ms | gemv ms | gemv / vendor | vendor GB/s | gemv GB/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for in_f, out_f in LINEAR_SHAPES:
        for rows in (1, 2, 4, 8):
            gen = np.random.default_rng(0)
            g = Graph()
            g.add_input("x", TensorType((rows, in_f)))
            w = (gen.standard_normal((out_f, in_f)) / math.sqrt(in_f)).astype(np.float32)
            g.add_param("w", w)
            g.add_param("b", np.zeros(out_f, np.float32))
            node = Node("l", "linear", ("x", "w", "b"), ("y",), dict(activation="relu"))
            g.add_node(node, infer_types(g.values, node))
            g.set_outputs("y")
            x = [torch.randn(rows, in_f), torch.from_numpy(w), torch.from_numpy(g.params["b"])]
            ref = get_op("linear").bind(node)(*x)
            fns = {}
            for name in ("vendor", "gemv"):
                fn = ALGORITHMS["linear"][name].build(g, node, torch.device("cpu"), opts, hw)
                err = max_rel_err(fn(*x), ref)
                if err > 1e-4:
                    raise SystemExit(f"linear {in_f}->{out_f} rows {rows}: {name} error {err}")
                fns[name] = lambda fn=fn, x=x: fn(*x)
            with torch.inference_mode():
                ms = medians(interleaved(fns, args.warmup, args.repeat, rng))
            gb = in_f * out_f * 4 / 1e9
            lines.append(
                f"| {in_f} -> {out_f} | {rows} | {ms['vendor']:.3f} | {ms['gemv']:.3f} | "
                f"{ms['gemv'] / ms['vendor']:.2f} | {gb / ms['vendor'] * 1e3:.1f} | "
                f"{gb / ms['gemv'] * 1e3:.1f} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines) + "\n"


ERROR_SHAPES = [
    ((1, 16, 9, 7), (32, 16, 3, 3), 1),
    ((2, 32, 8, 10), (16, 32, 3, 3), 0),
    ((1, 16, 5, 6), (16, 16, 3, 3), 2),
    ((1, 256, 6, 7), (256, 256, 3, 3), 1),
    ((2, 64, 28, 28), (64, 64, 3, 3), 1),
    ((1, 512, 7, 7), (512, 512, 3, 3), 1),
]
ERROR_EPILOGUES: list[dict[str, Any]] = [
    dict(activation=None),
    dict(activation="relu"),
    dict(activation="gelu", activation_attrs=(("approximate", "none"),), residual=True),
    dict(activation="hardtanh", activation_attrs=(("min_val", -0.5), ("max_val", 0.5))),
]


def errors_table(cache: Path) -> str:
    """Each algorithm's largest ``max|y - ref| / max|conv + bias + residual|`` over
    ``ERROR_SHAPES`` x ``ERROR_EPILOGUES``, against float32 and float64 ``F.conv2d``."""
    opts, hw, cpu = (
        Options(cache_dir=cache),
        detect("cpu", None, measure=False),
        torch.device("cpu"),
    )
    names = [n for n in ALGORITHMS["conv2d"] if n != "im2col_gemm"] + ["im2col_gemm"]
    worst = {(n, p): 0.0 for n in names for p in ("float32", "float64")}
    for xs, ws, pad in ERROR_SHAPES:
        for ep in ERROR_EPILOGUES:
            g, node = conv_case(xs, ws, pad, **ep)
            pre_kw = {k: v for k, v in ep.items() if not k.startswith("activation")}
            g_pre, pre_node = conv_case(xs, ws, pad, activation=None, **pre_kw)
            args = case_inputs(g)
            for prec, dt in (("float32", torch.float32), ("float64", torch.float64)):
                a64 = [a.to(dt) for a in args]
                ref = get_op("conv2d").bind(node)(*a64).float()
                scale = float(get_op("conv2d").bind(pre_node)(*a64).abs().max())
                for n in names:
                    a = ALGORITHMS["conv2d"][n]
                    if a.applies(g, node, cpu, opts) is not None:
                        continue
                    fn = a.build(g, node, cpu, opts, hw)
                    if fn is None:
                        continue
                    with torch.inference_mode():
                        err = float((fn(*args) - ref).abs().max()) / scale
                    worst[n, prec] = max(worst[n, prec], err)
    lines = [
        f"Largest max|y - ref| / max|conv + bias + residual| over {len(ERROR_SHAPES)} shapes x "
        f"{len(ERROR_EPILOGUES)} epilogues (16..512 channels, 3x3 stride 1):",
        "",
        "| algorithm | recorded bound | vs float32 F.conv2d | vs float64 F.conv2d |",
        "|---|---:|---:|---:|",
    ]
    for n in names:
        a = ALGORITHMS["conv2d"][n]
        bound = "exact" if a.exact else f"{a.error_bound:.0e}"
        lines.append(f"| {n} | {bound} | {worst[n, 'float32']:.1e} | {worst[n, 'float64']:.1e} |")
    return "\n".join(lines) + "\n"


def _non_negative(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n}: give 0 (the default per batch) or more")
    return n


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nets", default=",".join(DEFAULT_NETS), help="comma-separated networks")
    p.add_argument("--batch", default="16,1", help="comma-separated batch sizes")
    p.add_argument("--repeat", type=int, default=5, help="timed rounds (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument(
        "--block",
        type=_non_negative,
        default=0,
        help="network tables: timed calls per engine's turn, after a discarded one "
        "(0: 5 at batch 1-2, else 1)",
    )
    p.add_argument(
        "--per-layer", default="resnet18:16", help="net:batch pairs for the per-layer table"
    )
    p.add_argument("--out", type=Path, help="write the markdown table here")
    p.add_argument("--layers", action="store_true", help="single-layer times per algorithm")
    p.add_argument("--errors", action="store_true", help="each algorithm's measured error")
    p.add_argument(
        "--linear", action="store_true", help="vendor vs gemv on the classifiers' linear layers"
    )
    p.add_argument(
        "--net-layers",
        action="store_true",
        help="every conv2d layer of resnet18, vgg16, mobilenet_v2, squeezenet1_1 (or --nets): "
        "each applicable algorithm's time",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    if args.layers or args.errors or args.net_layers or args.linear:
        with tempfile.TemporaryDirectory(prefix="algorithms-") as tmp:
            if args.linear:
                text = linear_table(args, Path(tmp))
            elif args.net_layers:
                text = net_layers_table(args, Path(tmp))
            elif args.errors:
                text = errors_table(Path(tmp))
            else:
                text = layers_table(args, Path(tmp))
        print(text)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
        return
    nets = [n.strip() for n in args.nets.split(",") if n.strip()]
    unknown = [n for n in nets if n not in NETWORKS]
    if unknown:
        raise SystemExit(f"unknown network(s) {unknown}; choose from {', '.join(NETWORKS)}")
    batches = [int(b) for b in str(args.batch).split(",")]
    per_layer = {tuple(s.split(":")) for s in args.per_layer.split(",") if s}
    t_start = time.perf_counter()
    rows = []
    global HARDWARE
    with tempfile.TemporaryDirectory(prefix="algorithms-") as tmp:
        HARDWARE = detect("cpu", Path(tmp) / "hardware")
        print(f"hardware: {HARDWARE}", file=sys.stderr)
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
    turn = (
        f"a discarded call, then {args.block} timed (their median)"
        if args.block
        else "a discarded call, then 5 timed at batch 1-2 (their median), 1 above"
    )
    meta = (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"median of {args.repeat} interleaved rounds (random order per round) after "
        f"{args.warmup} warm-up round(s); an engine's turn in a round: {turn}; "
        f"whole run {time.perf_counter() - t_start:.0f} s."
    )
    text = markdown(rows, meta)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
