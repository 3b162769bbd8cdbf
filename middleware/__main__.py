"""The command line: ``python -m middleware COMMAND ...`` (console script ``middleware``).

Each subcommand is one ``add_<command>(subparsers)`` function that declares its arguments
and sets ``func`` (a function of the parsed arguments returning the exit status); it is
listed in ``COMMANDS``. Adding a command means adding one such function to that list.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from . import cli_profile
from .api import optimize, resolve_device
from .backends.vendor.tuning import DecisionStore
from .errors import MiddlewareError
from .models import ModelSpecError, load_model
from .options import default_cache_dir
from .runtime.memtrack import measure_peak
from .version import __version__

AddCommand = Callable[[Any], None]  # takes argparse's subparsers object


# ------------------------------------------------------------------------------- run
def add_run(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run",
        help="optimize a model, check it against PyTorch, print latency and peak memory",
        description=(
            "Build MODEL, optimize it with middleware.optimize(), check that its outputs match "
            "PyTorch, then time eager PyTorch, (with --compile) torch.compile, and the "
            "middleware on the same input, interleaved in this process, and print the median "
            "latency, the ratios to eager and the peak memory of one call."
        ),
        epilog=(
            "MODEL is torchvision:NAME (random weights, eval mode; e.g. torchvision:resnet18) "
            "or path/to/file.py:NAME, where NAME is an nn.Module instance or class, or a "
            "function returning a module or (module, input_shape). Peak memory is what one "
            "call allocates beyond what was live before it (activations and workspace; "
            "parameters excluded): torch.cuda.max_memory_allocated on CUDA, a live-storage "
            "tracker on the CPU."
        ),
    )
    p.add_argument("model", metavar="MODEL", help="torchvision:NAME or path/to/file.py:NAME")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (default cpu)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile(model)")
    p.add_argument("--repeat", type=int, default=10, help="timed rounds (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    p.add_argument(
        "--input-shape",
        type=_shape,
        default=None,
        metavar="C,H,W",
        help="one sample's shape (default 3,224,224; 3,299,299 for inception_v3)",
    )
    p.add_argument(
        "--cache-dir", default=None, help="kernel cache folder (default: ~/.cache/middleware)"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: PyTorch's)"
    )
    p.add_argument("--report", action="store_true", help="also print optimized.report()")
    p.set_defaults(func=cmd_run)


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(s) for s in text.replace("x", ",").split(",") if s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a shape: {text!r} (e.g. 3,224,224)") from None
    if not dims or min(dims) <= 0:
        raise argparse.ArgumentTypeError(f"not a shape: {text!r} (e.g. 3,224,224)")
    return dims


def cmd_run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batch < 1 or args.repeat < 1 or args.warmup < 0:
        print(
            "error: --batch and --repeat must be at least 1, --warmup at least 0", file=sys.stderr
        )
        return 2
    device = resolve_device(args.device)
    loaded = load_model(args.model, input_shape=args.input_shape)
    model = loaded.model.to(device)
    x = loaded.example(args.batch, device)
    shape = "x".join(map(str, loaded.input_shape))
    print(
        f"{loaded.name}: batch {args.batch}, input {shape}, device {device}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )

    with torch.inference_mode():
        expected = model(x)

    t0 = time.perf_counter()
    optimized = optimize(model, device=device, example_inputs=(x,), cache_dir=args.cache_dir)
    got = optimized(x)
    _sync(device)
    optimize_s = time.perf_counter() - t0
    ok, detail = _compare(got, expected)
    report = optimized.report()
    print(f"optimize() + first call: {optimize_s:.2f} s; {_counts(report)}")
    print(f"outputs match PyTorch: {'yes' if ok else 'NO'} ({detail})")
    if args.report:
        print(report)
    runners: dict[str, Callable[[], Any]] = {"eager": _eager(model, x)}
    if args.compile:
        t0 = time.perf_counter()
        compiled = torch.compile(model)
        with torch.inference_mode():
            compiled(x)
        _sync(device)
        print(f"torch.compile + first call: {time.perf_counter() - t0:.2f} s")
        runners["torch.compile"] = _eager(compiled, x)
    runners["middleware"] = _call(optimized, x)

    times = _time_interleaved(runners, args.warmup, args.repeat, device)
    peaks = {name: measure_peak(fn, device) for name, fn in runners.items()}
    print()
    print(_table(times, peaks, args.repeat))
    return 0 if ok else 1


def _eager(model: Any, x: Any) -> Callable[[], Any]:
    def run() -> Any:
        with torch.inference_mode():
            return model(x)

    return run


def _call(optimized: Any, x: Any) -> Callable[[], Any]:
    def run() -> Any:
        return optimized(x)

    return run


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _time_interleaved(
    runners: dict[str, Callable[[], Any]], warmup: int, repeat: int, device: str
) -> dict[str, list[float]]:
    """Each round calls every runner once, in turn, so that drift hits all alike; every
    other round runs them in reverse order, so that no runner always follows the same one
    (seconds)."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    order = list(runners.items())
    for i in range(warmup + repeat):
        for name, fn in order if i % 2 == 0 else order[::-1]:
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def _compare(got: Any, expected: Any, rtol: float = 1e-4, atol: float = 1e-4) -> tuple[bool, str]:
    """Same structure, and every tensor within rtol and atol times its scale."""
    g, g_spec = tree_flatten(got)
    e, e_spec = tree_flatten(expected)
    if g_spec != e_spec:
        return False, f"output structure differs: {g_spec} vs {e_spec}"
    worst = 0.0
    for a, b in zip(g, e, strict=True):
        if not isinstance(b, torch.Tensor):
            if a != b:
                return False, f"{a!r} != {b!r}"
            continue
        if a.shape != b.shape:
            return False, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
        scale = max(float(b.abs().max()), 1e-30) if b.numel() else 1.0
        diff = float((a.double() - b.double()).abs().max()) if b.numel() else 0.0
        worst = max(worst, diff / scale)
        if not torch.allclose(a, b, rtol=rtol, atol=atol * scale):
            return False, f"max |diff| {diff:.3g} at scale {scale:.3g}"
    return True, f"max |diff| / scale {worst:.2g}; tolerance rtol {rtol:g}, atol {atol:g} x scale"


def _counts(report: Any) -> str:
    counts = report.counts()
    return f"{len(report.rows)} nodes: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))


def _table(times: dict[str, list[float]], peaks: dict[str, int], repeat: int) -> str:
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    lines = [
        f"{'':<14} {'latency ms':>11} {'speedup':>8} {'peak MiB':>9} {'memory':>8}",
        f"{'':<14} {f'(median {repeat})':>11} {'vs eager':>8} {'(1 call)':>9} {'vs eager':>8}",
    ]
    for name in times:
        mem_ratio = peaks[name] / peaks["eager"] if peaks["eager"] else float("nan")
        lines.append(
            f"{name:<14} {med[name]:>11.2f} {med['eager'] / med[name]:>7.2f}x "
            f"{peaks[name] / 2**20:>9.1f} {mem_ratio:>7.2f}x"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------- the parser
def add_profile(subparsers: Any) -> None:
    cli_profile.add_parser(subparsers)


# ----------------------------------------------------------------------------- cache
def add_cache(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "cache",
        help="list the cache's kernels and tuning decisions; --clear-tuning forgets the latter",
        description=(
            "Count the compiled kernels and list the autotuning decisions "
            "(algorithms={'conv2d': 'autotune'}) kept in the cache directory: one line per "
            "problem (op, input -> output shape, weight shape, dtype, layout) with the "
            "algorithm chosen, and one per network with the plan chosen as a whole (the "
            "per-layer tuned one, the default or one algorithm everywhere). --clear-tuning deletes the decisions, so that the next "
            "optimize() measures again."
        ),
    )
    p.add_argument("--cache-dir", default=None, help="default: ~/.cache/middleware")
    p.add_argument("--clear-tuning", action="store_true", help="forget every tuning decision")
    p.set_defaults(func=cmd_cache)


def cmd_cache(args: argparse.Namespace) -> int:
    root = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    kernels = root / "kernels"
    n_kernels = sum(1 for _ in kernels.iterdir()) if kernels.is_dir() else 0
    store = DecisionStore(root)
    entries = store.entries()
    print(f"{root}: {n_kernels} kernel(s), {len(entries)} tuning decision(s)")
    for key, d in sorted(entries.items(), key=lambda kv: str(kv[1].get("problem"))):
        p = d.get("problem", {}) if isinstance(d, dict) else {}
        if "network" in p:  # a whole network's plan (pipeline.network_choice)
            ins = ", ".join("x".join(map(str, s)) for s in p.get("inputs", ()))
            print(f"  {key[:12]} network {p['network'][:12]} inputs {ins}: {d.get('algorithm')}")
            continue
        shape = "x".join(map(str, p.get("input_shape", ())))
        out = "x".join(map(str, p.get("output_shape", ())))
        w = "x".join(map(str, p.get("weight_shape", ())))
        print(
            f"  {key[:12]} {p.get('op', '?')} {shape} -> {out} w {w} {p.get('dtype', '')} "
            f"{p.get('layout', '')}: {d.get('algorithm')}"
        )
    if args.clear_tuning:
        print(f"cleared {store.clear()} tuning decision(s)")
    return 0


COMMANDS: list[AddCommand] = [add_run, add_profile, add_cache]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="middleware",
        description=(
            "A depth-first-fusion compiler middleware for PyTorch CNNs: "
            "optimized = middleware.optimize(model, device='cpu')."
        ),
    )
    parser.add_argument("--version", action="version", version=f"middleware {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the command, return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except (MiddlewareError, ModelSpecError) as e:  # bad model spec or device: no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
