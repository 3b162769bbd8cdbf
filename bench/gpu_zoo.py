"""The network table on a GPU: eleven torchvision CNNs at batch 16, PyTorch eager
(cudnn.benchmark=True; NCHW and channels_last), ``torch.compile`` and the middleware, timed
with CUDA events, interleaved in one process, inside a time budget.

Order of work, so that a short budget still gives a useful table: first eager and the
middleware for every network (cheap), then ``torch.compile`` for as many networks as the
remaining budget allows (it costs tens of seconds per network; a network it does not reach
is marked "skipped: budget"). Results are written after every network (``--out``, JSON and
a markdown table beside it), so a run cut short keeps what it measured.

Usage: ``python bench/gpu_zoo.py --budget-s 240 --out $OUT/gpu_zoo.json``
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import cuda_medians  # noqa: E402

NETWORKS = {
    "alexnet": 224,
    "vgg16": 224,
    "resnet18": 224,
    "resnet50": 224,
    "densenet121": 224,
    "squeezenet1_1": 224,
    "mobilenet_v2": 224,
    "mobilenet_v3_small": 224,
    "googlenet": 224,
    "inception_v3": 299,
    "shufflenet_v2_x1_0": 224,
}


def make(net: str) -> torch.nn.Module:
    import torchvision.models as tvm

    if net == "googlenet":
        return tvm.googlenet(aux_logits=False, init_weights=False)
    if net == "inception_v3":
        return tvm.inception_v3(aux_logits=False, init_weights=False)
    return getattr(tvm, net)()


def time_modes(fns: dict, repeat: int, warmup: int) -> dict[str, float]:
    """Median milliseconds per mode (CUDA events), modes interleaved in every round."""
    return {k: round(v, 3) for k, v in cuda_medians(fns, repeat, warmup).items()}


def write(rows: dict, out: Path | None) -> None:
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    lines = [
        "| network | eager | eager_cl | compile | middleware | mw_graph | speedup vs fastest "
        "(middleware, mw_graph) | max rel err |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for net, r in rows.items():
        ms = r.get("ms", {})
        torch_ms = [ms[k] for k in ("eager", "eager_cl", "compile") if k in ms]
        speedup = ", ".join(
            f"{min(torch_ms) / ms[k]:.2f}x" if torch_ms and k in ms else "-"
            for k in ("middleware", "mw_graph")
        )
        cells = [
            f"{ms[k]:.2f}" if k in ms else r.get(k + "_note", "-")
            for k in ("eager", "eager_cl", "compile", "middleware", "mw_graph")
        ]
        lines.append(f"| {net} | {' | '.join(cells)} | {speedup} | {r.get('max_rel_err', '-')} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="torchvision networks on a GPU")
    p.add_argument("--nets", default=",".join(NETWORKS))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument(
        "--compile-reserve-s",
        type=float,
        default=45.0,
        help="start a torch.compile only with this much budget left",
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    import middleware

    t_start = time.perf_counter()
    torch.backends.cudnn.benchmark = True
    nets = [n for n in args.nets.split(",") if n]
    rows: dict[str, dict] = {}
    models: dict[str, tuple] = {}
    cache = Path(tempfile.mkdtemp(prefix="mw-gpu-zoo-"))

    def left() -> float:
        return args.budget_s - (time.perf_counter() - t_start)

    for net in nets:  # pass 1: eager and middleware
        row = rows.setdefault(net, {"ms": {}})
        if left() < 10:
            row["note"] = "skipped: budget"
            continue
        try:
            torch.manual_seed(0)
            model = make(net).eval().cuda()
            res = NETWORKS[net]
            x = torch.randn(args.batch, 3, res, res, device="cuda")
            model_cl = copy.deepcopy(model).to(memory_format=torch.channels_last)
            x_cl = x.contiguous(memory_format=torch.channels_last)
            fns = {"eager": lambda m=model, x=x: m(x), "eager_cl": lambda m=model_cl, x=x_cl: m(x)}
            with torch.no_grad():
                try:
                    t0 = time.perf_counter()
                    opt = middleware.optimize(
                        model, device="cuda", example_inputs=(x,), cache_dir=cache
                    )
                    y, ref = opt(x), model(x)
                    row["optimize_s"] = round(time.perf_counter() - t0, 1)
                    err = ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
                    row["max_rel_err"] = f"{err:.1e}"
                    rep = opt.report()
                    row["generated_nodes"] = sum(r.runs_as == "generated" for r in rep.rows)
                    row["nodes"] = len(rep.rows)
                    fns["middleware"] = lambda o=opt, x=x: o(x)
                    try:  # the same plan replayed as one CUDA graph (opt-in runner)
                        from middleware.backends.cuda.graphs import GraphedPlan

                        graphed = GraphedPlan(opt.plan, (x,))
                        fns["mw_graph"] = lambda g=graphed, x=x: g.run((x,))
                    except Exception as exc:  # noqa: BLE001 - recorded in the table
                        row["mw_graph_note"] = "error"
                        row["mw_graph_error"] = f"{type(exc).__name__}: {exc}"[:1000]
                except Exception as exc:  # noqa: BLE001 - recorded in the table
                    row["middleware_note"] = "error"
                    row["middleware_error"] = f"{type(exc).__name__}: {exc}"[:2000]
                row["ms"].update(time_modes(fns, args.repeat, args.warmup))
            models[net] = (model, x, fns)
        except Exception as exc:  # noqa: BLE001
            row["note"] = f"error: {type(exc).__name__}: {exc}"[:2000]
        print(
            net, row.get("ms"), row.get("max_rel_err"), row.get("middleware_error", ""), flush=True
        )
        write(rows, args.out)

    for net in nets:  # pass 2: torch.compile while the budget lasts
        if net not in models:
            continue
        row = rows[net]
        if left() < args.compile_reserve_s:
            row["compile_note"] = "skipped: budget"
            continue
        model, x, fns = models[net]
        try:
            with torch.no_grad():
                t0 = time.perf_counter()
                compiled = torch.compile(model)
                compiled(x)
                row["compile_s"] = round(time.perf_counter() - t0, 1)
                # all modes again, interleaved with torch.compile's rounds
                fns = {**fns, "compile": lambda c=compiled, x=x: c(x)}
                row["ms"].update(time_modes(fns, args.repeat, args.warmup))
        except Exception as exc:  # noqa: BLE001
            row["compile_note"] = "error"
            row["compile_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        print(net, "compile", row["ms"].get("compile"), row.get("compile_s"), flush=True)
        write(rows, args.out)
    write(rows, args.out)
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
