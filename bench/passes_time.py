"""Time of the whole pass pipeline on a torchvision network (default densenet121).

    python bench/passes_time.py [--model densenet121] [--repeat 5] [--size 224]

Traces the network once (batch 1), then runs ``run_passes`` ``--repeat`` times with the
documented CPU hardware defaults and prints the median total and the median per pass.
The target for densenet121 is under 1 s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torchvision.models as tvm

from middleware import trace
from middleware.options import Options
from middleware.passes import DEFAULT_HARDWARE, run_passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="densenet121")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--size", type=int, default=224)
    args = ap.parse_args()
    torch.manual_seed(0)
    kw = (
        {"aux_logits": False, "init_weights": False}
        if args.model in ("googlenet", "inception_v3")
        else {}
    )
    model = getattr(tvm, args.model)(weights=None, **kw).eval()
    x = torch.randn(1, 3, args.size, args.size)
    t0 = time.perf_counter()
    graph = trace(model, (x,))
    t_trace = time.perf_counter() - t0
    totals: list[float] = []
    per_pass: dict[str, list[float]] = {}
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        out = run_passes(graph, Options(), DEFAULT_HARDWARE)
        totals.append(time.perf_counter() - t0)
        for name, t in out.meta["pass_times"].items():
            per_pass.setdefault(name, []).append(t)
    groups = len({n.group for n in out.nodes()})
    print(
        f"{args.model} batch 1 {args.size}x{args.size}: {len(graph)} nodes -> {len(out)} nodes, "
        f"{groups} groups; trace {t_trace * 1e3:.0f} ms"
    )
    print(
        f"pass pipeline: median {statistics.median(totals) * 1e3:.1f} ms "
        f"(min {min(totals) * 1e3:.1f}, max {max(totals) * 1e3:.1f}) over {args.repeat} runs"
    )
    for name, ts in per_pass.items():
        print(f"  {name:<22} {statistics.median(ts) * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
