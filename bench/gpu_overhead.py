"""Where the host time of an optimized CUDA module goes: per call, the host (CPU) time of
``opt(x)`` issued back to back against the GPU time of the same calls, the parts of one
generated step (output allocation, stream query, launch) and a ``cProfile`` of the calls.

A step-by-step plan is only as fast as its host path: when the host needs longer per call
than the GPU, the GPU waits. Usage (on a machine with a GPU)::

    python bench/gpu_overhead.py                     # the chain and mobilenet_v3_small
    python bench/gpu_overhead.py --nets ""           # the chain only
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_chain import Chain  # noqa: E402
from gpu_timing import cuda_medians  # noqa: E402


def host_us(fn, calls: int = 300) -> float:  # noqa: ANN001
    """Host microseconds per call of ``fn`` issued back to back (no synchronisation inside)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return t


def profile_top(fn, calls: int = 300, rows: int = 18) -> str:  # noqa: ANN001
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(rows)
    return s.getvalue()


def report(name: str, opt, x: torch.Tensor) -> None:  # noqa: ANN001
    gpu = cuda_medians({"opt": lambda: opt(x)}, 20, 3, inner=10)["opt"]
    plan = opt._latest.plan
    steps = len(getattr(plan, "steps", []))
    print(f"=== {name}: {steps} steps")
    print(f"  host {host_us(lambda: opt(x)):8.1f} us/call   back-to-back {1e3 * gpu:8.1f} us/call")
    print(f"  host of plan.run alone {host_us(lambda: plan.run([x])):8.1f} us/call")
    print(profile_top(lambda: opt(x)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nets", default="mobilenet_v3_small")
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args(argv)
    import middleware

    cache = Path(tempfile.mkdtemp(prefix="mw-gpu-overhead-"))
    torch.manual_seed(0)
    model = Chain(64).eval().cuda()
    x = torch.randn(16, 64, 112, 112, device="cuda")
    with torch.no_grad():
        opt = middleware.optimize(
            model, device="cuda", example_inputs=(x,), cache_dir=cache, cuda_graphs=False
        )
        opt(x)
        report("chain 16x64x112x112", opt, x)
        plan = opt._latest.plan
        step = plan.steps[0]
        kernel = step.fn
        # the step's arguments as the plan passes them: the input, and constants (the batch
        # norm's folded scale and shift) from the plan's slot template
        env = list(plan._template)
        env[plan.input_slots[0]] = x
        step_args = [env[i] for i in step.ins]
        y = kernel(*step_args)
        launch = getattr(kernel, "launcher", None)
        parts = {
            "step fn (alloc + launch)": lambda: kernel(*step_args),
            "torch.empty_like(out)": lambda: torch.empty_like(y),
            "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(0).cuda_stream,
        }
        if hasattr(kernel, "out"):
            parts["kernel.out (launch only)"] = lambda: kernel.out(*step_args, y)
        if launch is not None:
            ptrs = [a.data_ptr() for a in step_args] + [y.data_ptr()]
            parts["launcher.launch"] = lambda: launch.launch(kernel._grid, kernel._block, ptrs)
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            parts["_cuda_getCurrentRawStream"] = lambda: raw(0)
        for k, fn in parts.items():
            print(f"  {k:32s} {host_us(fn):8.2f} us")
        for net in [n for n in args.nets.split(",") if n]:
            import torchvision

            m = getattr(torchvision.models, net)().eval().cuda()
            xi = torch.randn(args.batch, 3, 224, 224, device="cuda")
            o = middleware.optimize(
                m, device="cuda", example_inputs=(xi,), cache_dir=cache, cuda_graphs=False
            )
            o(xi)
            report(f"{net} b{args.batch}", o, xi)
    return 0


if __name__ == "__main__":
    sys.exit(main())
