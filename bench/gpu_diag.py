"""Where the time goes on a GPU: for each network, the optimized plan's steps (synchronised
per step, so launch latency is included) and the CUDA kernels of eager channels_last and
of the middleware side by side (``torch.profiler``), at batch 16.

Usage: ``python bench/gpu_diag.py --nets vgg16,mobilenet_v3_small``
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_zoo import setup  # noqa: E402


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


class Affine(nn.Module):
    """Per-channel scale and shift as broadcast mul/add (a batch-norm already folded)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.rand(1, c, 1, 1) + 0.5)
        self.t = nn.Parameter(torch.randn(1, c, 1, 1))

    def forward(self, x):
        return x * self.s + self.t


def chain_variants(shape: tuple[int, ...], cache: Path) -> None:
    """Kernel-only time of the chain's generated kernel and of variants without parts of
    it, in both layouts, with one and two elements per thread per grid-stride iteration
    (``render.ILP``), to place the time inside the kernel."""
    from gpu_chain import Chain, _kernel_modes, copy_bandwidth, time_modes

    from middleware.backends.cuda import render

    default_ilp = render.ILP
    n, c, h, w = shape
    variants = {
        "bn_relu_pool": Chain(c),
        "affine_relu_pool": nn.Sequential(Affine(c), nn.ReLU(), nn.MaxPool2d(3, 2, 1)),
        "relu_pool": nn.Sequential(nn.ReLU(), nn.MaxPool2d(3, 2, 1)),
        "pool": nn.MaxPool2d(3, 2, 1),
        "bn_relu": nn.Sequential(nn.BatchNorm2d(c), nn.ReLU()),
    }
    x = torch.randn(n, c, h, w, device="cuda")
    gbs = copy_bandwidth()
    print(f"=== chain variants {shape}: copy {gbs:.0f} GB/s")
    with torch.no_grad():
        for name, m in variants.items():
            m = m.eval().cuda()
            for mod in m.modules():
                if isinstance(mod, nn.BatchNorm2d):
                    mod.running_var.uniform_(0.5, 2.0)
            fns = {}
            for ilp in (1, 2):  # elements per thread per grid-stride iteration (render.ILP)
                render.ILP = ilp
                fns.update({f"{k}_ilp{ilp}": f for k, f in _kernel_modes(m, x, cache).items()})
            render.ILP = default_ilp
            ms = time_modes(fns, 30, 5)
            moved = (x.numel() + m(x).numel()) * 4
            print(
                f"  {name:18s} "
                + "  ".join(
                    f"{k}: {v * 1e3:6.1f} us {moved / (v * 1e-3) / 1e9 / gbs * 100:5.1f}%"
                    for k, v in ms.items()
                ),
                flush=True,
            )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--nets", default="vgg16,mobilenet_v3_small")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--chain", default="16,64,112,112", help="chain variants shape ('' skips)")
    args = p.parse_args()
    import middleware

    torch.backends.cudnn.benchmark = True
    cache = Path(tempfile.mkdtemp(prefix="mw-diag-"))
    if args.chain:
        chain_variants(tuple(int(v) for v in args.chain.split(",")), cache)
    for net in [n for n in args.nets.split(",") if n]:
        model, x, model_cl, x_cl = setup(net, args.batch)
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
