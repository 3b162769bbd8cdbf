"""Peak GPU memory of one network per mode, each (network, mode) in a process of its own.

The in-process figures of ``gpu_zoo.py`` measure what a mode adds over what earlier modes
left allocated; ``torch.compile``'s CUDA-graph pools and caches make those figures
unreliable (the same 196.1 MiB for most networks under ``reduce-overhead``). Here each
child process loads the model onto the GPU, builds one mode, runs it three times and
reports the allocator's peak over the whole process (``torch.cuda.max_memory_allocated``:
the model's own weights included, the same for every mode) and what the mode added over the
model and its input.

Usage (on a machine with a GPU)::

    python bench/gpu_memory.py --nets vgg16,resnet50 --modes eager_cl,compile_ro,mw_graph \\
        --out $OUT/gpu_memory.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("eager", "eager_cl", "compile", "compile_ro", "middleware", "mw_graph", "mw_default")


def child(net: str, mode: str, batch: int) -> dict:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_zoo import setup

    torch.backends.cudnn.benchmark = True
    model, x, model_cl, x_cl = setup(net, batch)
    if mode == "eager_cl":
        del model
        model, x = model_cl, x_cl
    else:
        del model_cl, x_cl
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        if mode.startswith("compile"):
            fn = torch.compile(model, mode="reduce-overhead" if mode == "compile_ro" else None)
        elif mode.startswith("mw") or mode == "middleware":
            import middleware

            graphs = {"middleware": False, "mw_graph": True, "mw_default": "auto"}[mode]
            fn = middleware.optimize(
                model,
                device="cuda",
                example_inputs=(x,),
                cache_dir=Path(tempfile.mkdtemp(prefix="mw-mem-")),
                cuda_graphs=graphs,
            )
        else:
            fn = model
        for _ in range(3):
            y = fn(x)
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return {
        "net": net,
        "mode": mode,
        "model_and_input_mib": round(base / 2**20, 1),
        "peak_mib": round(peak / 2**20, 1),
        "added_mib": round((peak - base) / 2**20, 1),
        "out_shape": list(y.shape),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nets", default="alexnet,vgg16,resnet50,inception_v3")
    p.add_argument("--modes", default="eager_cl,compile_ro,mw_graph,mw_default")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument("--out", type=Path)
    p.add_argument("--child", nargs=2, metavar=("NET", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.batch)))
        return 0
    t0 = time.perf_counter()
    rows = []
    for net in [n for n in args.nets.split(",") if n]:
        for mode in [m for m in args.modes.split(",") if m]:
            left = args.budget_s - (time.perf_counter() - t0)
            if left < 20:
                rows.append({"net": net, "mode": mode, "note": "skipped: budget"})
                continue
            cmd = [sys.executable, __file__, "--batch", str(args.batch), "--child", net, mode]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
                line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
                row = json.loads(line) if r.returncode == 0 and line else None
                rows.append(
                    row or {"net": net, "mode": mode, "error": (r.stderr or r.stdout)[-1500:]}
                )
            except subprocess.TimeoutExpired:
                rows.append({"net": net, "mode": mode, "note": "timed out"})
            print(json.dumps(rows[-1]), flush=True)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(rows, indent=1))
    print("| network | " + " | ".join(args.modes.split(",")) + " |")
    for net in [n for n in args.nets.split(",") if n]:
        cells = []
        for mode in args.modes.split(","):
            r = next((r for r in rows if r["net"] == net and r["mode"] == mode), {})
            cells.append(str(r.get("peak_mib", r.get("note", "error"))))
        print(f"| {net} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
