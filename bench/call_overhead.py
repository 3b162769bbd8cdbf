"""Host time per call of a one-step plan whose steps run from Python (the native runner
off, as every CUDA plan runs): the optimized module's call against ``Plan.run`` alone, so
that the module's own overhead per call shows. Interleaved rounds, medians.

Usage: ``python bench/call_overhead.py [--rounds 15] [--calls 2000]``
(session 24, Intel host, two alternated runs each: module overhead 13.2-13.7 us per call
through ``nn.Module``'s call, 5.2-8.0 us with ``OptimizedModule.__call__``'s shortcut for
such plans).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args(argv)
    import middleware

    torch.set_num_threads(1)
    model = nn.Sequential(nn.ReLU()).eval()
    x = torch.randn(1, 4, 2, 2)
    opt = middleware.optimize(
        model, example_inputs=(x,), native_runner=False, cache_dir=tempfile.mkdtemp()
    )
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
    for _ in range(100):
        opt(x)
    plan = opt._latest.plan
    fns = {"module": lambda: opt(x), "plan.run": lambda: plan.run([x])}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(args.rounds):
        order = list(fns)
        random.shuffle(order)
        for k in order:
            fn = fns[k]
            t0 = time.perf_counter_ns()
            for _ in range(args.calls):
                fn()
            times[k].append((time.perf_counter_ns() - t0) / args.calls / 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:10s} {v:7.2f} us per call")
    print(f"module overhead {med['module'] - med['plan.run']:.2f} us per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
