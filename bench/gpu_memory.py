"""Peak GPU memory of one network per mode, each (network, mode) in a process of its own.

The in-process figures of ``gpu_zoo.py`` measure what a mode adds over what earlier modes
left allocated; ``torch.compile``'s CUDA-graph pools and caches make those figures
unreliable (the same 196.1 MiB for most networks under ``reduce-overhead``). Here each
child process loads the model onto the GPU, builds one mode, runs it three times and
reports the allocator's peak over the whole process (``torch.cuda.max_memory_allocated``:
the model's own weights included, the same for every mode), what the mode added over the
model and its input, where the peak happens (while the mode is built, or in its first three
calls; what it holds after each), and the steady-state peak (the peak counter reset after those calls,
then three more: without cuDNN's benchmark-mode trials and compilation); for the
middleware, the bytes of weight copies its plan holds beside the model's own. Children
may run side by side (``--jobs``): memory is per process, and no time is taken.

Usage (on a machine with a GPU)::

    python bench/gpu_memory.py --nets vgg16,resnet50 --modes eager_cl,compile_ro,mw_graph \\
        --out $OUT/gpu_memory.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = (
    "eager",
    "eager_cl",
    "compile",
    "compile_ro",
    "middleware",
    "mw_graph",
    "mw_default",
    "mw_share",
    "mw_graph_late",
)
# the middleware's modes: (cuda_graphs, cuda_weights)
MW_MODES = {
    "middleware": (False, "copy"),
    "mw_graph": (True, "copy"),
    "mw_default": ("auto", "copy"),
    "mw_share": (True, "share"),
    # mw_graph with cuDNN's algorithm search on the plan's first run instead of while it
    # is built (backends/cuda/trials.py PRETRIAL off): the A/B of that change
    "mw_graph_late": (True, "copy"),
}


def child(net: str, mode: str, batch: int) -> dict:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_zoo import setup

    torch.backends.cudnn.benchmark = True
    if mode == "mw_graph_late":
        from middleware.backends.cuda import trials

        trials.PRETRIAL = False
    model, x, model_cl, x_cl = setup(net, batch)
    if mode == "eager_cl":
        del model
        model, x = model_cl, x_cl
    else:
        del model_cl, x_cl
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # setup's freed blocks out of the reserved figures
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        if mode.startswith("compile"):
            fn = torch.compile(model, mode="reduce-overhead" if mode == "compile_ro" else None)
        elif mode in MW_MODES:
            import middleware

            graphs, weights = MW_MODES[mode]
            fn = middleware.optimize(
                model,
                device="cuda",
                example_inputs=(x,),
                cache_dir=Path(tempfile.mkdtemp(prefix="mw-mem-")),
                cuda_graphs=graphs,
                cuda_weights=weights,
            )
        else:
            fn = model
        # where the peak happens: building the mode (optimize(): weight copies, its own
        # trial runs) or its first calls (cuDNN's benchmark trials, graph capture)
        torch.cuda.synchronize()
        build_peak = torch.cuda.max_memory_allocated()
        build_reserved = torch.cuda.max_memory_reserved()
        built = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            y = fn(x)
        torch.cuda.synchronize()
        calls_peak = torch.cuda.max_memory_allocated()
        calls_reserved = torch.cuda.max_memory_reserved()
        peak = max(build_peak, calls_peak)
        held = torch.cuda.memory_allocated() - y.numel() * y.element_size()
        # in steady state: cuDNN's benchmark-mode trials (large transient workspaces, in
        # every mode that calls cuDNN) and compilation are over; what the process holds
        # and the most it reaches during three more calls
        del y
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            y = fn(x)
        torch.cuda.synchronize()
        steady = torch.cuda.max_memory_allocated()
        steady_reserved = torch.cuda.max_memory_reserved()
    extra = {}
    if mode in MW_MODES:  # what the plan holds beside the model's own weights
        plan = fn._latest.plan
        plan = getattr(plan, "plan", plan)  # a CUDA-graph plan wraps the step plan
        own = {p.data_ptr() for p in model.parameters()} | {b.data_ptr() for b in model.buffers()}
        copies = [t for t in plan.param_tensors() if t.data_ptr() not in own]
        extra["plan_weight_copies_mib"] = round(
            sum(t.numel() * t.element_size() for t in copies) / 2**20, 1
        )
    return {
        **extra,
        "net": net,
        "mode": mode,
        "model_and_input_mib": round(base / 2**20, 1),
        "peak_mib": round(peak / 2**20, 1),
        "steady_peak_mib": round(steady / 2**20, 1),
        "added_mib": round((peak - base) / 2**20, 1),
        "build_peak_mib": round(build_peak / 2**20, 1),
        "held_after_build_mib": round(built / 2**20, 1),
        "first_calls_peak_mib": round(calls_peak / 2**20, 1),
        "held_after_calls_mib": round(held / 2**20, 1),
        # the allocator's reserved bytes (what the process takes from the device: blocks
        # cached after use, CUDA-graph pools, whose freed blocks memory_allocated no longer
        # counts, and fragmentation included): peak over the whole process, and in steady
        # state
        "peak_reserved_mib": round(max(build_reserved, calls_reserved) / 2**20, 1),
        "build_reserved_mib": round(build_reserved / 2**20, 1),
        "steady_reserved_mib": round(steady_reserved / 2**20, 1),
        "out_shape": list(y.shape),
    }


def order_work(nets: list[str], modes: list[str]) -> list[tuple[str, str]]:
    """(network, mode) in the order the children start: the slow torch.compile children
    first, then the other modes network by network, so that a budget that runs out cuts
    whole networks rather than a whole mode (run 2 of session 9 lost every ``mw_share``
    child, which came last after ``mw_graph`` on all eleven)."""
    slow = [m for m in modes if m.startswith("compile")]
    rest = [m for m in modes if m not in slow]
    return [(n, m) for m in slow for n in nets] + [(n, m) for n in nets for m in rest]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nets", default="alexnet,vgg16,resnet50,inception_v3")
    p.add_argument("--modes", default="eager_cl,compile_ro,mw_graph,mw_default")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument("--out", type=Path)
    p.add_argument("--jobs", type=int, default=1, help="children at a time (memory only)")
    p.add_argument("--child", nargs=2, metavar=("NET", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.batch)))
        return 0
    t0 = time.perf_counter()
    rows = []
    nets = [n for n in args.nets.split(",") if n]
    modes = [m for m in args.modes.split(",") if m]
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS=str(max(1, 16 // args.jobs)))

    def run(net: str, mode: str) -> dict:
        left = args.budget_s - (time.perf_counter() - t0)
        if left < 20:
            return {"net": net, "mode": mode, "note": "skipped: budget"}
        cmd = [sys.executable, __file__, "--batch", str(args.batch), "--child", net, mode]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=left, env=env)
        except subprocess.TimeoutExpired:
            return {"net": net, "mode": mode, "note": "timed out"}
        line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
        row = json.loads(line) if r.returncode == 0 and line else None
        return row or {"net": net, "mode": mode, "error": (r.stderr or r.stdout)[-1500:]}

    # peak memory is per process: children may run side by side (their timings are not
    # taken)
    work = order_work(nets, modes)
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for row in pool.map(lambda nm: run(*nm), work):
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(rows, indent=1))
    print("\npeak allocated / steady-state allocated; reserved peak / steady-state reserved (MiB)")
    print("| network | " + " | ".join(modes) + " |")
    for net in nets:
        cells = []
        for mode in modes:
            r = next((r for r in rows if r["net"] == net and r["mode"] == mode), {})
            cells.append(
                f"{r['peak_mib']} / {r['steady_peak_mib']}; "
                f"{r.get('peak_reserved_mib')} / {r.get('steady_reserved_mib')}"
                if "peak_mib" in r
                else str(r.get("note", "error"))
            )
        print(f"| {net} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
