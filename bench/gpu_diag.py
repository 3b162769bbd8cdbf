"""Where the time goes on a GPU: for each network, the optimized plan's steps (synchronised
per step, so launch latency is included) and the CUDA kernels of eager channels_last and
of the middleware side by side (``torch.profiler``), at batch 16.

Usage: ``python bench/gpu_diag.py --nets vgg16,mobilenet_v3_small``
"""

from __future__ import annotations

import argparse
import collections
import copy
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_zoo import NETWORKS, make  # noqa: E402


def kernel_table(fn, calls: int = 5, rows: int = 14) -> str:
    """The CUDA kernels of ``calls`` calls of ``fn``, most expensive first (ms per call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.Counter()
    counts: dict[str, int] = collections.Counter()
    for ev in prof.events():
        t = getattr(ev, "device_time", 0.0)
        if t:
            totals[ev.name[:90]] += t / 1e3 / calls
            counts[ev.name[:90]] += 1
    lines = [
        f"  total {sum(totals.values()):.3f} ms/call in {sum(counts.values()) // calls} kernels"
    ]
    for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:rows]:
        lines.append(f"  {ms:8.3f} ms  x{counts[name] // calls:<3d} {name}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--nets", default="vgg16,mobilenet_v3_small")
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()
    import middleware

    torch.backends.cudnn.benchmark = True
    cache = Path(tempfile.mkdtemp(prefix="mw-diag-"))
    for net in args.nets.split(","):
        torch.manual_seed(0)
        model = make(net).eval().cuda()
        res = NETWORKS[net]
        x = torch.randn(args.batch, 3, res, res, device="cuda")
        model_cl = copy.deepcopy(model).to(memory_format=torch.channels_last)
        x_cl = x.contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            opt = middleware.optimize(model, device="cuda", example_inputs=(x,), cache_dir=cache)
            opt(x)
            plan = opt.plan
            times = plan.step_times((x,), 5)
            print(f"=== {net}: {len(plan.steps)} steps, synchronised sum {sum(times):.3f} ms")
            by_kind: dict[str, float] = collections.Counter()
            for st, t in zip(plan.steps, times, strict=True):
                by_kind[st.runs_as] += t
            print("  by kind:", {k: round(v, 3) for k, v in by_kind.items()})
            order = sorted(range(len(times)), key=lambda i: -times[i])[:14]
            for i in order:
                st = plan.steps[i]
                print(f"  {times[i]:7.3f} ms  {st.runs_as:9s} {st.name[:60]}  {st.reason[:60]}")
            print(f"--- {net} eager_cl kernels")
            print(kernel_table(lambda m=model_cl, xc=x_cl: m(xc)))
            print(f"--- {net} middleware kernels")
            print(kernel_table(lambda o=opt, xx=x: o(xx)))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
