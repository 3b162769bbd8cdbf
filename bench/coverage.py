"""Coverage: every torchvision classification and segmentation model through ``optimize()``.

For each model (``torchvision.models.list_models(module=torchvision.models)`` and the six of
``torchvision.models.segmentation``), in a process of its own (a crash, a memory blow-up or
a hang costs that model only):

- the model is built without pretrained weights and every parameter is re-initialised so
  that activations keep their variance (``variance_keeping``: zero-initialised heads and
  layer scales included), batch-norm statistics random and close to the identity;
- ``optimize(model, example_inputs=(x,))`` at batch 1 and 224x224 (or the weights'
  ``min_size`` where larger; the segmentation models take 224 too);
- the output (every tensor of a tuple or dict) against eager: max |y - ref| / max |ref|;
- ``report().rows``: the number of nodes, of fallback nodes, and the fallbacks' ops and
  reasons (most frequent first);
- latency at batch 1 (and at batch 8 where eager's batch-1 call takes under
  ``BATCH8_UNDER_MS``): eager NCHW, eager channels_last and the middleware timed in the same
  process by ``zoo.timed_blocks`` (each round every engine in a new seeded order, a block of
  calls each with its first discarded; medians), in ``torch.inference_mode()``; the speed-up
  is the faster eager layout's median over the middleware's (``--no-latency`` skips it).

Results go to ``bench/results/coverage_cpu.json`` (``--out``) (one entry per model, merged with the
entries already there, so a run over a few models updates their rows) and the table to
``bench/results/coverage_cpu.md``.

Usage::

    python bench/coverage.py --models vit_b_16,swin_t     # a few
    python bench/coverage.py --all                        # every model (long: hours on 2 cores)
    python bench/coverage.py --all --skip-done            # the ones without a row yet
    python bench/coverage.py --all --trace-only           # fallback counts only (minutes)
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
JSON_PATH = RESULTS / "coverage_cpu.json"
TRACE_JSON_PATH = RESULTS / "coverage_trace_cpu.json"

# Output equal to eager within this fraction of the output's scale (max |ref|).
TOLERANCE = 1e-3
# where eager float32 is itself far from float64: how much farther the middleware may be
F64_FACTOR = 2.0

# Too large for this 2-core shared host's time budget (parameters in millions, from
# torchvision's weight metadata): vit_l_*, vit_h_14, regnet_y_128gf. At load 8-10 a model
# of 30-90M parameters already took 5-16 minutes (densenet161 962 s); the rest run under
# ``--timeout`` and a model over it is listed as timed out.
MAX_PARAMS_M = 300.0

# Batch 8 is timed too where eager's batch-1 call is faster than this (the issue's "where the
# model fits in a few seconds": eight of those calls per block and three engines).
BATCH8_UNDER_MS = 60.0

SEGMENTATION = (
    "fcn_resnet50",
    "fcn_resnet101",
    "deeplabv3_resnet50",
    "deeplabv3_resnet101",
    "deeplabv3_mobilenet_v3_large",
    "lraspp_mobilenet_v3_large",
)


def classification_models() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def all_models() -> list[str]:
    return classification_models() + list(SEGMENTATION)


def weights_meta(name: str) -> dict[str, Any]:
    import torchvision

    try:
        return dict(torchvision.models.get_model_weights(name).DEFAULT.meta)
    except Exception:  # noqa: BLE001 - a model without registered weights
        return {}


def input_size(name: str) -> int:
    """224, or the weights' minimum where it is larger."""
    meta = weights_meta(name)
    low = meta.get("min_size", (224, 224))
    return max(224, int(low[0]))


def model_input_size(name: str, model: nn.Module) -> int:
    """The size the built model takes: a ViT's own ``image_size`` (vit_h_14 is built for
    224 without weights, while its weights' minimum is 518), else :func:`input_size`."""
    size = getattr(model, "image_size", None)
    return int(size) if isinstance(size, int) else input_size(name)


def skip_reason(name: str) -> str | None:
    params = weights_meta(name).get("num_params")
    if params is not None and params / 1e6 > MAX_PARAMS_M:
        return f"{params / 1e6:.0f}M parameters (over {MAX_PARAMS_M:.0f}M on this host)"
    return None


def build(name: str) -> nn.Module:
    import torchvision

    if name in SEGMENTATION:
        aux = not name.startswith("lraspp")
        fn = getattr(torchvision.models.segmentation, name)
        return fn(weights=None, weights_backbone=None, aux_loss=aux or None)
    return torchvision.models.get_model(name, weights=None)


def variance_keeping(model: nn.Module, seed: int = 0) -> nn.Module:
    """``model`` (in place, returned in eval mode) with every parameter re-initialised so
    that activations keep their variance: convolutions He (fan-in, 2/n: ReLU-like nets with
    batch norms in eval do not renormalise), linear layers and attention projections 1/n,
    norms' affine parameters near (1, 0), layer scales near 1, every other parameter (class
    tokens, position embeddings, relative-position tables) N(0, 0.1^2), batch-norm running
    statistics random near the identity."""
    gen = torch.Generator().manual_seed(seed)

    def randn(shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=gen)

    with torch.no_grad():
        for mod in model.modules():
            for pname, p in mod.named_parameters(recurse=False):
                if p is None:
                    continue
                fan_in = p[0].numel() if p.dim() >= 2 else 1
                if isinstance(mod, nn.modules.conv._ConvNd) and pname == "weight":
                    # a depthwise or grouped conv: fan-in is its group's input channels
                    p.copy_(randn(p.shape) * math.sqrt(2.0 / fan_in))
                elif (isinstance(mod, nn.Linear) and pname == "weight") or pname.endswith(
                    "proj_weight"
                ):
                    p.copy_(randn(p.shape) * math.sqrt(1.0 / fan_in))
                elif "scale" in pname or (pname == "weight" and p.dim() == 1):
                    p.copy_(1.0 + 0.1 * randn(p.shape))
                else:
                    p.copy_(0.1 * randn(p.shape))
            if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.running_mean is not None:
                c = mod.num_features
                mod.running_mean.copy_(0.1 * randn(torch.Size([c])))
                mod.running_var.copy_(torch.rand(c, generator=gen) * 0.5 + 0.75)
    return model.eval()


def tensors_of(out: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a model output (a tensor, a tuple/list, a dict), with their keys."""
    if isinstance(out, torch.Tensor):
        return [("", out)]
    if isinstance(out, dict):
        return [(f"{k}{'.' + s if s else ''}", t) for k, v in out.items() for s, t in tensors_of(v)]
    if isinstance(out, (tuple, list)):
        return [
            (f"{i}{'.' + s if s else ''}", t) for i, v in enumerate(out) for s, t in tensors_of(v)
        ]
    return []


def max_rel_err(got: Any, ref: Any) -> float:
    """Over every output tensor: max |got - ref| / max |ref|; inf where the structures or
    shapes differ."""
    g, r = dict(tensors_of(got)), dict(tensors_of(ref))
    if g.keys() != r.keys() or not r:
        return math.inf
    worst = 0.0
    for k, ref_t in r.items():
        if g[k].shape != ref_t.shape:
            return math.inf
        scale = max(1e-30, float(ref_t.abs().max()))
        worst = max(worst, float((g[k].float() - ref_t.float()).abs().max()) / scale)
    return worst


def measure(name: str, latency: bool = True) -> dict[str, Any]:
    """One model: build, optimize, compare, count, time (runs in the child process)."""
    import middleware
    from middleware.enums import RunsAs

    torch.manual_seed(0)
    model = variance_keeping(build(name))
    size = model_input_size(name, model)
    row: dict[str, Any] = {"model": name, "input": f"1x3x{size}x{size}"}
    x = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = model(x)
    t0 = time.perf_counter()
    opt = middleware.optimize(model, example_inputs=(x,))
    row["optimize_s"] = round(time.perf_counter() - t0, 1)
    with torch.inference_mode():
        got = opt(x)
        # float64: how far float32 itself is from the exact result on this network
        ref64 = copy.deepcopy(model).double()(x.double())
    row["max_rel_err"] = max_rel_err(got, ref)
    row["err64"] = max_rel_err(got, ref64)
    row["eager_err64"] = max_rel_err(ref, ref64)
    row["scale"] = max((float(t.abs().max()) for _, t in tensors_of(ref)), default=0.0)
    rep = opt.report()
    rows = list(rep.rows)
    fb = [r for r in rows if r.runs_as == RunsAs.FALLBACK]
    row["nodes"] = len(rows)
    row["fallbacks"] = len(fb)
    reasons = collections.Counter(reason_key(model, r.reason) for r in fb)
    row["reasons"] = reasons.most_common()
    row["notes"] = list(getattr(rep, "notes", ()))[:3]
    if latency:
        row["latency"] = {"1": time_engines(model, opt, x)}
        if row["latency"]["1"]["eager"] < BATCH8_UNDER_MS:
            x8 = torch.randn(8, 3, size, size, generator=torch.Generator().manual_seed(2))
            opt8 = middleware.optimize(model, example_inputs=(x8,))
            with torch.inference_mode():
                err8 = max_rel_err(opt8(x8), model(x8))
            row["latency"]["8"] = time_engines(model, opt8, x8)
            row["max_rel_err_b8"] = err8
    return row


def time_engines(model: nn.Module, opt: Any, x: torch.Tensor) -> dict[str, float]:
    """Median ms of eager NCHW, eager channels_last and the middleware on ``x``, interleaved
    (``zoo.timed_blocks``); rounds and block sized so that a model takes about 10-20 s."""
    from zoo import timed_blocks

    cl = copy.deepcopy(model).to(memory_format=torch.channels_last)
    x_cl = x.contiguous(memory_format=torch.channels_last)

    def engine(m: Any, inp: torch.Tensor) -> Any:
        def call() -> None:
            with torch.inference_mode():
                m(inp)

        return call

    fns = {"eager": engine(model, x), "eager_cl": engine(cl, x_cl), "middleware": engine(opt, x)}
    t0 = time.perf_counter()
    fns["eager"]()
    one = time.perf_counter() - t0
    block = 5 if one < 0.05 else (2 if one < 0.3 else 1)
    repeat = max(3, min(9, int(4.0 / (3 * (block + 1) * max(one, 1e-4)))))
    got = timed_blocks(fns, warmup=1, repeat=repeat, block=block, seed=0)
    return {k: round(v, 3) for k, v in got.items()} | {"rounds": repeat, "block": block}


def speedup(lat: dict[str, float] | None) -> float | None:
    """The faster eager layout over the middleware (> 1: the middleware is faster)."""
    if not lat:
        return None
    return min(lat["eager"], lat["eager_cl"]) / lat["middleware"]


def measure_trace(name: str) -> dict[str, Any]:
    """One model traced only (``middleware.trace``, seconds): its graph's nodes and fallback
    nodes, no plan and no comparison (``--trace-only``; runs in this process)."""
    import middleware

    model = build(name).eval()
    size = model_input_size(name, model)
    g = middleware.trace(model, torch.randn(1, 3, size, size))
    nodes = list(g.nodes())
    fb = [n for n in nodes if n.op == "fallback"]
    reasons = collections.Counter(reason_key(model, n.attrs["reason"]) for n in fb)
    return {
        "model": name,
        "input": f"1x3x{size}x{size}",
        "nodes": len(nodes),
        "fallbacks": len(fb),
        "reasons": reasons.most_common(),
        "max_rel_err": None,
    }


def reason_key(model: nn.Module, reason: str) -> str:
    """A fallback's reason with module paths replaced by the module's class, so that the
    twelve attention layers of a ViT count as one reason."""

    def kind(m: re.Match[str]) -> str:
        try:
            return f"module {type(model.get_submodule(m.group(1))).__name__}"
        except AttributeError:
            return m.group(0)

    return re.sub(r"module '([^']+)'", kind, reason)[:160]


def run_child(name: str, timeout: float, latency: bool = True) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name]
    cmd += [] if latency else ["--no-latency"]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"model": name, "error": f"timed out after {timeout:.0f} s"}
    wall = round(time.perf_counter() - t0, 1)
    for line in reversed(out.stdout.strip().splitlines()):
        if line.startswith("{"):
            got = json.loads(line)
            got["wall_s"] = wall
            return got
    tail = (out.stderr or out.stdout).strip().splitlines()
    return {"model": name, "error": (tail[-1] if tail else f"exit {out.returncode}")[:300]}


def load(path: Path) -> dict[str, dict[str, Any]]:
    if path.exists():
        return {r["model"]: r for r in json.loads(path.read_text())}
    return {}


def save(rows: dict[str, dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = [rows[k] for k in sorted(rows, key=order_key)]
    path.write_text(json.dumps(ordered, indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown(ordered))


def order_key(name: str) -> tuple[int, str]:
    return (name in SEGMENTATION, name)


def output_ok(r: dict[str, Any]) -> bool:
    """Equal to eager within ``TOLERANCE``, or, on a network whose float32 result is itself
    far from the float64 one (random weights can make a deep network ill-conditioned), at
    most ``F64_FACTOR`` times as far from the float64 result as eager float32 is."""
    err = r.get("max_rel_err")
    if err is None:
        return False
    if err < TOLERANCE:
        return True
    e64, eager64 = r.get("err64"), r.get("eager_err64")
    return e64 is not None and eager64 is not None and e64 <= F64_FACTOR * max(eager64, TOLERANCE)


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "# Coverage on CPU: torchvision models through optimize()",
        "",
        f"Batch 1, variance-keeping random weights, output equal when max |y - ref| / "
        f'max |ref| < {TOLERANCE:g} over every output tensor, or ("yes vs float64": a '
        f"network where eager float32 itself is far from the float64 result) when the "
        f"middleware is at most {F64_FACTOR:g}x as far from float64 as eager float32. Fallbacks: nodes of "
        '`report().rows` that run as one PyTorch call each (rows marked "trace only": '
        "nodes of `middleware.trace`'s graph, `--trace-only`). Written by "
        "`python bench/coverage.py`; each row from its model's latest run.",
        "",
        "",
        "Latency: median ms at batch 1 of the faster eager layout (NCHW or channels_last) and "
        "of the middleware, timed interleaved in the model's process; speed-up = eager / "
        f"middleware (> 1: faster); batch 8 where eager's batch-1 call is under "
        f"{BATCH8_UNDER_MS:g} ms.",
        "",
        "| model | input | nodes | fallbacks | % fallback | top reasons | output ok (rel. err) "
        "| b1 eager ms | b1 middleware ms | b1 speed-up | b8 speed-up |",
        "|---|---|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(
                f"| {r['model']} | - | - | - | - | skipped: {r['skipped']} | - | - | - | - | - |"
            )
            continue
        if "error" in r:
            err = r["error"].replace("|", "\\|")
            lines.append(f"| {r['model']} | - | - | - | - | error: {err} | no | - | - | - | - |")
            continue
        n, f = r["nodes"], r["fallbacks"]
        pct = 100.0 * f / n if n else 0.0
        top = "; ".join(f"{c}x {why}" for why, c in r["reasons"][:3]).replace("|", "\\|")
        err = r["max_rel_err"]
        if err is None:
            ok = "not run (trace only)"
        elif err < TOLERANCE:
            ok = f"yes ({err:.1e})"
        elif output_ok(r):
            ok = (
                f"yes vs float64 ({err:.1e} from eager; from float64 {r['err64']:.1e}, "
                f"eager float32 {r['eager_err64']:.1e})"
            )
        else:
            extra = (
                f"; from float64 {r['err64']:.1e}, eager float32 {r['eager_err64']:.1e}"
                if r.get("err64") is not None
                else ""
            )
            ok = f"**no** ({err:.1e}{extra})"
        lat = r.get("latency") or {}
        b1 = lat.get("1")
        times = (
            f"{min(b1['eager'], b1['eager_cl']):.2f} | {b1['middleware']:.2f} | "
            f"{speedup(b1):.2f}x | " + (f"{speedup(lat['8']):.2f}x" if "8" in lat else "-")
            if b1
            else "- | - | - | -"
        )
        lines.append(
            f"| {r['model']} | {r['input']} | {n} | {f} | {pct:.0f}% | {top or '-'} | {ok} | "
            f"{times} |"
        )
    done = [r for r in rows if "nodes" in r]
    if done:
        zero = sum(1 for r in done if r["fallbacks"] == 0)
        ok = sum(1 for r in done if output_ok(r))
        timed = [speedup((r.get("latency") or {}).get("1")) for r in done]
        timed = [v for v in timed if v is not None]
        lines += [
            "",
            f"{len(done)} models measured: {zero} with no fallback node, {ok} equal to eager; "
            f"{sum(1 for r in rows if 'skipped' in r)} skipped, "
            f"{sum(1 for r in rows if 'error' in r)} failed.",
        ]
        if timed:
            geo = math.exp(sum(math.log(v) for v in timed) / len(timed))
            lines.append(
                f"Batch 1 timed on {len(timed)}: faster than the faster eager layout on "
                f"{sum(1 for v in timed if v > 1)}, geometric mean {geo:.2f}x, slowest "
                f"{min(timed):.2f}x."
            )
    missing = sorted(set(all_models()) - {r["model"] for r in rows}, key=order_key)
    if missing:
        lines += ["", f"Not measured in this table ({len(missing)}): {', '.join(missing)}."]
    return "\n".join(lines) + "\n"


def readme_table() -> str:
    """One table of every model from both result files: the traced graph's nodes and
    fallbacks (``--trace-only``) and, where the full run reached it, the plan's fallbacks and
    the output against eager (README's coverage table)."""
    traced, full = load(TRACE_JSON_PATH), load(JSON_PATH)
    lines = [
        "| model | traced nodes | fallbacks (trace) | plan fallbacks | output vs eager | "
        "optimize s | b1 speed-up over eager | b8 speed-up |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for name in sorted(set(all_models()), key=order_key):
        t, f = traced.get(name, {}), full.get(name, {})
        if "skipped" in f:
            lines.append(
                f"| {name} | {t.get('nodes', '-')} | {t.get('fallbacks', '-')} | - | "
                f"skipped: {f['skipped']} | - | - | - |"
            )
            continue
        if "error" in f:
            plan, out = "-", f"not run: {f['error']}".replace("|", "\\|")
        elif "nodes" in f:
            err = f["max_rel_err"]
            plan = str(f["fallbacks"])
            if err < TOLERANCE:
                out = f"equal ({err:.1e})"
            elif output_ok(f):
                out = f"equal vs float64 ({f['err64']:.1e}; eager {f['eager_err64']:.1e})"
            else:
                out = f"**differs** ({err:.1e})"
            if f.get("note"):
                out += f" [{f['note']}]"
        else:
            plan, out = "-", "not run this session"
        lat = f.get("latency") or {}
        ups = [speedup(lat.get(b)) for b in ("1", "8")]
        lines.append(
            f"| {name} | {t.get('nodes', '-')} | {t.get('fallbacks', '-')} | {plan} | {out} | "
            f"{f.get('optimize_s', '-')} | "
            + " | ".join("-" if u is None else f"{u:.2f}x" for u in ups)
            + " |"
        )
    return "\n".join(lines) + "\n"


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="", help="comma-separated model names")
    p.add_argument("--all", action="store_true", help="every classification and segmentation model")
    p.add_argument(
        "--by-size", action="store_true", help="smallest models first (by parameter count)"
    )
    p.add_argument(
        "--trace-only",
        action="store_true",
        help="trace only, in this process: nodes and fallbacks, no plan, no comparison "
        "(default --out bench/results/coverage_trace_cpu.json)",
    )
    p.add_argument(
        "--readme", action="store_true", help="print one table of both result files and exit"
    )
    p.add_argument("--skip-done", action="store_true", help="only models without a row yet")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per model")
    p.add_argument("--out", type=Path, default=None, help="results JSON (the table beside it, .md)")
    p.add_argument("--no-latency", action="store_true", help="outputs and fallbacks only")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    if args.child:
        sys.path.insert(0, str(ROOT))
        print(json.dumps(measure(args.child, latency=not args.no_latency)))
        return
    if args.readme:
        print(readme_table(), end="")
        return
    if args.all:
        names = all_models()
    elif args.models:
        names = [n.strip() for n in args.models.split(",") if n.strip()]
    else:
        raise SystemExit("name --models a,b,... or --all")
    known = set(all_models())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown models: {', '.join(unknown)}")
    if args.by_size:
        names.sort(key=lambda n: weights_meta(n).get("num_params", 0))
    if args.out is None:
        args.out = TRACE_JSON_PATH if args.trace_only else JSON_PATH
    if args.trace_only:
        sys.path.insert(0, str(ROOT))
    rows = load(args.out)
    for name in names:
        have = rows.get(name, {})
        if (
            args.skip_done
            and have
            and "error" not in have
            and (args.no_latency or args.trace_only or "latency" in have or "skipped" in have)
        ):
            continue
        why = None if args.trace_only else skip_reason(name)  # a trace is cheap
        if why:
            row: dict[str, Any] = {"model": name, "skipped": why}
        elif args.trace_only:
            try:
                row = measure_trace(name)
            except Exception as e:  # noqa: BLE001 - one model's failure is its row
                row = {"model": name, "error": f"{type(e).__name__}: {e}"[:300]}
        else:
            row = run_child(name, args.timeout, latency=not args.no_latency)
        rows[name] = row
        save(rows, args.out)
        brief = (
            row.get("skipped")
            or row.get("error")
            or (
                f"{row['fallbacks']}/{row['nodes']} fallback, err {row['max_rel_err']}, "
                f"b1 {speedup((row.get('latency') or {}).get('1')) or 0:.2f}x, "
                f"{row.get('wall_s')} s"
            )
        )
        print(f"{name}: {brief}", flush=True)


if __name__ == "__main__":
    main()
