"""The chain micro-benchmark on a GPU: batch-norm -> ReLU -> 3x3/2 max-pool (pad 1) on
16x64x112x112 fp32, against the GPU's device-to-device copy bandwidth, all in one process.

Modes (CUDA events, median of ``--repeat`` timed calls after warm-up, each mode's calls
interleaved round by round):

- ``eager`` / ``eager_cl``: PyTorch eager (cudnn.benchmark=True), NCHW / channels_last;
- ``compile`` / ``compile_cl``: ``torch.compile`` of the same module, NCHW / channels_last;
- ``middleware``: ``middleware.optimize(model, device="cuda", cuda_graphs=False)`` on the
  NCHW input, its plan run step by step;
- ``middleware_graph``: ``middleware.optimize(model, device="cuda", cuda_graphs=True)``
  (the plan replayed as one CUDA graph: the input copied in, the output cloned for the
  caller);
- ``middleware_default``: ``middleware.optimize(model, device="cuda")`` (the default
  ``cuda_graphs="auto"``: whichever of the two measured faster at build time);
- ``middleware_cl``: the same on channels_last input and model, step by step;
- ``middleware_flat``: step by step with the window kernel in its flat form (one thread
  per output, ``render.TILED = False``) instead of shared-memory tiles;
- ``mw_kernel`` / ``mw_kernel_cl``: the group's generated kernel (shared-memory tiles,
  ``backends/cuda/tiles.py``) called directly on the NCHW / channels_last graph (without
  the plan's Python); ``mw_flat`` / ``mw_flat_cl`` the flat form. (Session 6's tiled
  variant, the CPU schedule's tiles one per thread, measured slower than the flat form and
  was removed; the tiles of ``tiles.py`` are a block's, loaded cooperatively.)

Effective bandwidth = (input bytes + output bytes) / time; the copy bandwidth counts the
bytes read and written by ``dst.copy_(src)`` on a 1 GiB tensor. Results go to
``--out`` (JSON) and stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import cuda_medians  # noqa: E402


class Chain(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(c)
        self.pool = nn.MaxPool2d(3, 2, 1)

    def forward(self, x):
        return self.pool(torch.relu(self.bn(x)))


def time_modes(fns: dict, repeat: int, warmup: int, inner: int = 10) -> dict[str, float]:
    """Median milliseconds per call of each mode, modes interleaved in every round; a round
    times ``inner`` back-to-back calls between two events (hides the launch latency)."""
    return cuda_medians(fns, repeat, warmup, inner)


def copy_bandwidth(nbytes: int = 1 << 30, repeat: int = 20) -> float:
    """GB/s moved (read + written) by a device-to-device tensor copy."""
    src = torch.empty(nbytes // 4, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = time_modes({"copy": lambda: dst.copy_(src)}, repeat, 3, inner=1)["copy"]
    return 2 * nbytes / (ms * 1e-3) / 1e9


@contextlib.contextmanager
def tiled(flag: bool):
    """Render window kernels in the shared-memory tiled form (``render.TILED``) or flat."""
    from middleware.backends.cuda import render

    old = render.TILED
    render.TILED = flag
    try:
        yield
    finally:
        render.TILED = old


def _kernel_modes(model: nn.Module, x: torch.Tensor, cache: Path) -> dict:
    """The generated kernel of the chain's group, NCHW and channels_last, called directly:
    ``mw_kernel*`` the default (shared-memory tiles), ``mw_flat*`` one thread per output."""
    out = {}
    for flag in (True, False):
        with tiled(flag):
            for k, fn in _kernels(model, x, cache).items():
                out[k if flag else k.replace("mw_kernel", "mw_flat")] = fn
    return out


def _kernels(model: nn.Module, x: torch.Tensor, cache: Path) -> dict:
    import middleware
    from middleware.backends.cuda.kernel import compile_schedule
    from middleware.graph import TensorType
    from middleware.hardware import detect_cuda
    from middleware.passes.schedule import schedule_group

    hw = detect_cuda(None, measure=False)
    out = {}
    for layout in ("nchw", "nhwc"):
        graph = middleware.trace(model, x)
        if layout == "nhwc":
            for v, t in list(graph.values.items()):
                if t.rank == 4:
                    graph.values[v] = TensorType(t.shape, t.dtype, "nhwc")
        names = [n.name for n in graph.nodes()]
        kernel = compile_schedule(
            schedule_group(graph, names, hw), hw, cache, torch.cuda.current_device()
        )
        env = {p: torch.from_numpy(a).to(x.device) for p, a in graph.params.items()}
        xin = x.contiguous(memory_format=torch.channels_last) if layout == "nhwc" else x
        args = [xin if v == graph.inputs[0] else env[v] for v in kernel.rendered.inputs]
        y = kernel(*args)
        torch.testing.assert_close(y, model(x), rtol=1e-5, atol=1e-5)
        outbuf = torch.empty_like(y)
        key = "mw_kernel" + ("_cl" if layout == "nhwc" else "")
        out[key] = lambda k=kernel, a=args, o=outbuf: k.out(*a, o)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="BN -> ReLU -> MaxPool chain on a GPU")
    p.add_argument("--shape", default="16,64,112,112")
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    import middleware

    torch.backends.cudnn.benchmark = True
    n, c, h, w = (int(s) for s in args.shape.split(","))
    torch.manual_seed(0)
    model = Chain(c).eval().cuda()
    with torch.no_grad():
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2.0)
        model.bn.weight.normal_()
        model.bn.bias.normal_()
    model_cl = Chain(c).eval().cuda().to(memory_format=torch.channels_last)
    model_cl.load_state_dict(model.state_dict())
    x = torch.randn(n, c, h, w, device="cuda")
    x_cl = x.contiguous(memory_format=torch.channels_last)
    cache = Path(tempfile.mkdtemp(prefix="mw-gpu-chain-"))

    fns: dict = {}
    info: dict = {"device": torch.cuda.get_device_name(), "shape": [n, c, h, w]}
    with torch.no_grad():
        fns["eager"] = lambda: model(x)
        fns["eager_cl"] = lambda: model_cl(x_cl)
        if not args.no_compile:
            try:
                t0 = time.perf_counter()
                compiled = torch.compile(model)
                compiled(x)
                compiled_cl = torch.compile(model_cl)
                compiled_cl(x_cl)
                info["compile_seconds"] = round(time.perf_counter() - t0, 1)
                fns["compile"] = lambda: compiled(x)
                fns["compile_cl"] = lambda: compiled_cl(x_cl)
            except Exception as exc:  # noqa: BLE001 - record and go on with the other modes
                info["compile_error"] = f"{type(exc).__name__}: {exc}"[:2000]

        def steps(m: nn.Module, inp: torch.Tensor) -> nn.Module:
            """``m`` optimized for ``inp``, its plan run step by step."""
            return middleware.optimize(
                m, device="cuda", example_inputs=(inp,), cache_dir=cache, cuda_graphs=False
            )

        try:  # step by step, and (the default) replayed as one CUDA graph
            t0 = time.perf_counter()
            opt = steps(model, x)
            torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
            info["optimize_seconds"] = round(time.perf_counter() - t0, 1)
            info["report"] = str(opt.report())
            fns["middleware"] = lambda: opt(x)
            graphed = middleware.optimize(
                model, device="cuda", example_inputs=(x,), cache_dir=cache, cuda_graphs=True
            )
            torch.testing.assert_close(graphed(x), model(x), rtol=1e-5, atol=1e-5)
            info["graph_notes"] = list(graphed.report().notes)
            fns["middleware_graph"] = lambda: graphed(x)
            auto = middleware.optimize(model, device="cuda", example_inputs=(x,), cache_dir=cache)
            torch.testing.assert_close(auto(x), model(x), rtol=1e-5, atol=1e-5)
            info["default_notes"] = list(auto.report().notes)
            info["default_chose"] = getattr(auto.plan, "chosen", None)
            fns["middleware_default"] = lambda: auto(x)
            opt_cl = steps(model_cl, x_cl)
            torch.testing.assert_close(opt_cl(x_cl), model(x), rtol=1e-5, atol=1e-5)
            fns["middleware_cl"] = lambda: opt_cl(x_cl)
            with tiled(False):  # the flat kernel (one thread per output) through optimize()
                flat = steps(model, x)
            torch.testing.assert_close(flat(x), model(x), rtol=1e-5, atol=1e-5)
            fns["middleware_flat"] = lambda: flat(x)
        except Exception as exc:  # noqa: BLE001
            info["middleware_error"] = f"{type(exc).__name__}: {exc}"[:4000]
        try:
            fns.update(_kernel_modes(model, x, cache))
        except Exception as exc:  # noqa: BLE001
            info["kernel_error"] = f"{type(exc).__name__}: {exc}"[:4000]
        ms = time_modes(fns, args.repeat, args.warmup)
    moved = (x.numel() + model(x).numel()) * 4
    gbs = copy_bandwidth()
    rows = {
        k: {
            "ms": round(v, 4),
            "GB/s": round(moved / (v * 1e-3) / 1e9, 1),
            "of_copy": round(moved / (v * 1e-3) / 1e9 / gbs, 3),
        }
        for k, v in ms.items()
    }
    fastest_torch = min(v for k, v in ms.items() if k.startswith(("eager", "compile")))
    mw = [r["of_copy"] for k, r in rows.items() if k.startswith(("mw", "middleware"))]
    result = {
        **info,
        "bytes_moved": moved,
        "copy_GBs": round(gbs, 1),
        "modes": rows,
        "middleware_speedup_vs_fastest_torch": (
            round(fastest_torch / ms["middleware"], 3) if "middleware" in ms else None
        ),
        "best_middleware_of_copy": max(mw) if mw else None,
    }
    for key in ("compile_error", "middleware_error", "kernel_error"):
        if key in info:
            print(f"{key}: {info[key]}")
    if "default_chose" in info:
        print(f"default (cuda_graphs='auto') chose: {info['default_chose']}")
    print(f"device: {info['device']}   copy bandwidth {gbs:.0f} GB/s (read+write)")
    for k, r in rows.items():
        print(
            f"  {k:14s} {r['ms']:8.4f} ms  {r['GB/s']:8.1f} GB/s  {100 * r['of_copy']:5.1f}% of copy"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
