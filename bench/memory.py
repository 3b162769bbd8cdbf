"""Peak I/O memory of the original and the optimized network, per network, as markdown.

    python bench/memory.py                      # the eleven networks at batch 16
    python bench/memory.py resnet18 googlenet --batch 16 --plot memory.png

Each row is one ``middleware.profile(model, x)`` (random weights, eval mode, seeded input;
googlenet and inception_v3 without auxiliary heads, inception_v3 at 299x299). Peak I/O
memory counts the input, every activation and the optimized plan's arena, measured by a
live-storage tracker (CPU) or the allocator statistics (CUDA); parameters are listed apart.
The last row is the geometric mean of the optimized/original ratios.

``--rss``: the peak resident memory of a process that runs one forward
after one warm-up forward, each engine in a process of its own, as a user of that engine
would run it (``VmHWM``): ``eager`` (``torch.inference_mode()``), ``middleware`` (``optimize()`` then
the calls), and, where the ``bench`` extra is installed, ``onnxruntime`` and ``openvino``
(the ONNX file exported beforehand by this process; their processes import neither torch
nor torchvision: ``import torch, torchvision`` alone peaks at about 690 MiB with the
torch 2.14.1+cu130 wheel on this host, ``import onnxruntime`` at about 50 MiB, so that a
torch-based engine starts far behind). Every engine's output is checked against eager's (max difference over
the output's scale), from the same seeded input::

    python bench/memory.py --rss resnet50 vgg16 densenet121 --batch 16
    python bench/memory.py --rss resnet50 --engines eager middleware   # while iterating
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
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


RSS_ENGINES = ("eager", "middleware", "onnxruntime", "openvino")


def _input(batch: int, shape: tuple[int, int, int]) -> np.ndarray:
    return np.random.default_rng(1).standard_normal((batch, *shape)).astype(np.float32)


def _peak_mib() -> float:
    """This process's peak resident memory: VmHWM (ru_maxrss would carry the parent's high
    water mark across fork and exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status")


def rss_child(engine: str, name: str, batch: int, onnx_path: str, out_path: str) -> None:
    """One engine in this process: warm-up forward, timed-free forward, peak RSS and the
    output (saved as .npy for the parent's check)."""
    shape = (3, 299, 299) if name == "inception_v3" else (3, 224, 224)
    x = _input(batch, shape)
    if engine in ("eager", "middleware"):
        import torch as th

        th.manual_seed(0)
        model, _ = build(name)
        xt = th.from_numpy(x)
        if engine == "middleware":
            import middleware

            model = middleware.optimize(model, example_inputs=[xt])
        with th.inference_mode():
            model(xt)
            y = model(xt).numpy()
    elif engine == "onnxruntime":
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = os.cpu_count() or 1
        sess = ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])
        feed = {sess.get_inputs()[0].name: x}
        sess.run(None, feed)
        y = sess.run(None, feed)[0]
    elif engine == "openvino":
        import openvino as ov

        core = ov.Core()
        compiled = core.compile_model(
            onnx_path,
            "CPU",
            {
                "INFERENCE_NUM_THREADS": os.cpu_count() or 1,
                "INFERENCE_PRECISION_HINT": "f32",
                "PERFORMANCE_HINT": "LATENCY",
            },
        )
        compiled([x])
        y = next(iter(compiled([x]).values()))
    else:
        raise SystemExit(f"unknown engine {engine}")
    np.save(out_path, np.asarray(y))
    print(json.dumps({"peak_mib": _peak_mib()}))


def rss_table(networks: list[str], batch: int, only: list[str] | None = None) -> str:
    """Peak RSS per network and engine, each in its own process (see the docstring);
    ``only``: these engines alone (``--engines``)."""
    import importlib.util

    wanted = [e for e in RSS_ENGINES if only is None or e in only]
    engines = [
        e for e in wanted if e in ("eager", "middleware") or importlib.util.find_spec(e) is not None
    ]
    missing = sorted(set(wanted) - set(engines))
    lines = [
        f"Peak RSS (MiB) of one process per engine: one warm-up forward, one forward, batch "
        f"{batch}; {os.cpu_count()} cores"
        + (f"; not installed: {', '.join(missing)}" if missing else "")
        + ". 'err': max |y - eager| over max |eager|.",
        "",
        "| network | " + " | ".join(engines) + " | middleware / eager | middleware / best peer |",
        "|---|" + "---:|" * (len(engines) + 2),
    ]
    with tempfile.TemporaryDirectory(prefix="rss-") as tmp:
        for name in networks:
            onnx_path = str(Path(tmp) / f"{name}.onnx")
            if any(e in engines for e in ("onnxruntime", "openvino")):
                torch.manual_seed(0)
                model, shape = build(name)
                x = torch.from_numpy(_input(batch, shape))
                torch.onnx.export(model, (x,), onnx_path, opset_version=17, dynamo=False)
            peak, outs = {}, {}
            for e in engines:
                out = str(Path(tmp) / f"{name}-{e}.npy")
                proc = subprocess.run(
                    [sys.executable, __file__, "--rss-child", e, name, str(batch), onnx_path, out],
                    capture_output=True,
                    text=True,
                    timeout=1800,
                )
                if proc.returncode != 0:
                    print(f"{name} {e} failed: {proc.stderr[-800:]}", file=sys.stderr)
                    continue
                peak[e] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_mib"]
                outs[e] = np.load(out)
            ref = outs.get("eager")
            cells = []
            for e in engines:
                if e not in peak:
                    cells.append("failed")
                    continue
                err = ""
                if ref is not None and e != "eager":
                    rel = float(np.abs(outs[e] - ref).max()) / max(1e-30, float(np.abs(ref).max()))
                    err = f" (err {rel:.0e})"
                cells.append(f"{peak[e]:.0f}{err}")
            peers = [peak[e] for e in ("onnxruntime", "openvino") if e in peak]
            mw = peak.get("middleware")
            ratio_e = f"{mw / peak['eager']:.2f}" if mw and "eager" in peak else "-"
            ratio_p = f"{mw / min(peers):.2f}" if mw and peers else "-"
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {ratio_e} | {ratio_p} |")
            print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rss-child"]:
        engine, name, batch, onnx_path, out = argv[1:6]
        rss_child(engine, name, int(batch), onnx_path, out)
        return 0
    if "--rss" in argv:
        ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        ap.add_argument("--rss", action="store_true")
        ap.add_argument("networks", nargs="*", default=["resnet50", "vgg16", "densenet121"])
        ap.add_argument("--batch", type=int, default=16)
        ap.add_argument("--out", type=Path, default=None)
        ap.add_argument(
            "--engines",
            nargs="+",
            choices=RSS_ENGINES,
            default=None,
            help="run only these engines (default: all installed)",
        )
        args = ap.parse_args(argv)
        text = rss_table(args.networks, args.batch, args.engines)
        print(text)
        if args.out:
            args.out.write_text(text)
        return 0
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
