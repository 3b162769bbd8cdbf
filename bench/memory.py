"""Peak I/O memory of the original and the optimized network, per network, as markdown.

    python bench/memory.py                      # the eleven networks at batch 16
    python bench/memory.py resnet18 googlenet --batch 16 --plot memory.png

Each row is one ``middleware.profile(model, x)`` (random weights, eval mode, seeded input;
googlenet and inception_v3 without auxiliary heads, inception_v3 at 299x299). Peak I/O
memory counts the input, every activation and the optimized plan's arena, measured by a
live-storage tracker (CPU) or the allocator statistics (CUDA); parameters are listed apart.
The last row is the geometric mean of the optimized/original ratios.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

MIB = 2**20


def build(name: str) -> tuple[torch.nn.Module, tuple[int, int, int]]:
    import torchvision.models as tvm

    kw = (
        {"aux_logits": False, "init_weights": False}
        if name in ("googlenet", "inception_v3")
        else {}
    )
    model = tvm.get_model(name, weights=None, **kw).eval()
    return model, (3, 299, 299) if name == "inception_v3" else (3, 224, 224)


def main(argv: list[str] | None = None) -> int:
    import middleware
    from middleware.models import NETWORKS
    from middleware.profiler import plot_results

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("networks", nargs="*", default=list(NETWORKS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--plot", default=None, help="save the stacked bar chart of all rows here")
    args = ap.parse_args(argv)

    print(
        f"batch {args.batch}, device {args.device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads\n"
    )
    print(
        "| network | params MiB original / optimized | original peak I/O MiB | optimized peak I/O MiB | ratio "
        "| plan: arena / predicted MiB | original ms | optimized ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    results, ratios = {}, []
    for name in args.networks:
        torch.manual_seed(0)
        model, shape = build(name)
        x = torch.randn(args.batch, *shape, device=args.device)
        model = model.to(args.device)
        t0 = time.perf_counter()
        r = middleware.profile(model, x, repeats=args.repeats)
        results[name] = r
        ratios.append(r.io_ratio)
        o, p = r.original, r.optimized
        planned = (
            f"{r.arena_bytes / MIB:.1f} / {r.planned_peak_io_bytes / MIB:.1f}"
            if r.planned_peak_io_bytes is not None
            else "-"
        )
        print(
            f"| {name} | {o.param_bytes / MIB:.1f} / {p.param_bytes / MIB:.1f} | "
            f"{o.peak_io_bytes / MIB:.1f} | "
            f"{p.peak_io_bytes / MIB:.1f} | {r.io_ratio:.2f} | {planned} | "
            f"{o.latency_ms:.0f} | {p.latency_ms:.0f} |",
            flush=True,
        )
        print(f"<!-- {name}: {time.perf_counter() - t0:.0f} s -->", file=sys.stderr)
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"| geometric mean | | | | {geo:.2f} | | | |")
    if args.plot:
        print(f"\nplot: {plot_results(results, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
