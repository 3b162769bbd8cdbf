"""The host (Python) time of a step-by-step CUDA plan, measured without a GPU.

On a GPU a small plan is bound by the Python between ``opt(x)`` and the kernel launch
(``bench/gpu_overhead.py`` measures it there). This proxy builds the same plan the CUDA
backend builds (the passes, ``cuda/lower.py``, ``cuda_units`` with the kernels compiled for
the CPU emulation, the buffer plan) over CPU tensors, wraps it in an ``OptimizedModule``,
and replaces every generated kernel's launcher with a no-op: timing a call then measures
only the Python from the module's call to the launch (plus a CPU ``torch.empty`` where the
GPU's caching allocator would serve). Differences from the GPU path, kept small on purpose:

- the buffer plan is built for a CPU device, but with ``Recycled`` output buffers off (they
  apply on CPU only), so a graph output is allocated by the step as on CUDA;
- no stream query (the no-op launcher takes the place of ``loader.bind``'s launch).

Usage::

    python bench/host_overhead_proxy.py                  # 20k calls, median of 7 repeats
    python bench/host_overhead_proxy.py --calls 5000 --repeats 3 --shape 16,64,112,112

Prints microseconds per call of the module, of ``plan.run`` and of the generated step.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]
from cuda_cases import FAKE_GPU  # noqa: E402
from gpu_chain import Chain  # noqa: E402

import middleware  # noqa: E402
from middleware.backends.cuda.backend import CudaBackend  # noqa: E402
from middleware.backends.cuda.kernel import GeneratedKernel  # noqa: E402
from middleware.backends.cuda.units import cuda_units  # noqa: E402
from middleware.options import Options  # noqa: E402
from middleware.passes import run_passes  # noqa: E402
from middleware.runtime import planned_steps  # noqa: E402
from middleware.runtime.module import Compiled, OptimizedModule  # noqa: E402
from middleware.runtime.plan import build_plan  # noqa: E402
from middleware.runtime.report import make_report  # noqa: E402

# the tests' H100-like part, with an H100's 132 multiprocessors (launch grids as on the GPU)
GPU = dataclasses.replace(FAKE_GPU, name="proxy-gpu", cores=132)


class NoLaunch:
    """A launcher that launches nothing."""

    def launch(self, grid: int, block: int, ptrs: Any) -> None:
        return None


def emulated_compile(cache: Path):  # noqa: ANN201
    """A ``compile_fn`` for ``OptimizedModule``: the CUDA backend's plan over CPU tensors."""
    options = Options(device="cuda", cache_dir=cache, measure_hardware=False)
    backend = CudaBackend()

    def compile_fn(model: nn.Module, inputs: Any, _options: Options) -> Compiled:
        graph = middleware.trace(model, list(inputs))
        off = tuple(dict.fromkeys((*options.disable_passes, *backend.passes_off(options))))
        graph = run_passes(graph, dataclasses.replace(options, disable_passes=off), GPU)
        graph = backend.lower(graph, options)
        units = cuda_units(graph, options, GPU, torch.device("cpu"), emulate=True)
        applies = planned_steps.Recycled.applies
        planned_steps.Recycled.applies = classmethod(lambda cls, t, d: False)  # as on CUDA
        try:
            plan = build_plan(graph, torch.device("cpu"), units, plan_memory=True)
        finally:
            planned_steps.Recycled.applies = applies
        for st in plan.steps:
            if isinstance(st.fn, GeneratedKernel):
                st.fn.launcher = NoLaunch()  # (rebinds the kernel's launch)
        return Compiled(graph, plan, make_report(graph, plan, GPU))

    return compile_fn


def per_call_us(fn: Any, calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the microseconds per call of ``calls`` calls of ``fn``."""
    for _ in range(min(calls, 1000)):
        fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--shape", default="16,64,112,112")
    args = p.parse_args(argv)
    shape = tuple(int(s) for s in args.shape.split(","))
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Chain(shape[1]).eval()
    x = torch.randn(*shape)
    cache = Path(tempfile.mkdtemp(prefix="mw-host-proxy-"))
    opt = OptimizedModule(
        model, Options(device="cpu", cache_dir=cache), emulated_compile(cache), (x,)
    )
    plan = opt.plan
    assert plan is not None and plan.memory is not None
    steps = [st for st in plan.steps if isinstance(st.fn, GeneratedKernel)]
    print(f"plan: {len(plan.steps)} step(s), {len(steps)} generated")
    with torch.no_grad():
        opt(x)
        env = list(plan._template)
        env[plan.input_slots[0]] = x
        k = steps[0]
        ins = [env[i] for i in k.ins]
        rows = {
            "module opt(x)": lambda: opt(x),
            "plan.run([x])": lambda: plan.run([x]),
            "step kernel(*ins)": lambda: k.fn(*ins),
        }
        for name, fn in rows.items():
            print(f"  {name:20s} {per_call_us(fn, args.calls, args.repeats):7.2f} us/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
