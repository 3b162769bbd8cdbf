"""``python -m middleware profile MODEL``: peak memory and latency, original vs optimized.

MODEL is ``torchvision:NAME`` (random weights, eval mode; googlenet and inception_v3 without
auxiliary heads, inception_v3 at 299x299) or ``path/to/file.py:NAME`` where NAME is an
``nn.Module`` class (built with no arguments), an instance, or a function returning a
module or ``(module, input_shape)``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from .api import resolve_device
from .models import load_model
from .profiler import profile


def add_parser(subparsers: Any) -> None:
    """Declare the ``profile`` subcommand on argparse ``subparsers``; sets ``func=main``."""
    p = subparsers.add_parser(
        "profile",
        help="peak memory (parameters, I/O) and latency of a model and its optimized form",
        description=(
            "Optimize MODEL and measure the original and the optimized model side by side: "
            "parameter memory, peak I/O (activation) memory, peak total memory (measured: a "
            "live-storage tracker on the CPU, the allocator's statistics on CUDA), median "
            "latency, and time and bytes per step of the optimized plan."
        ),
        epilog="MODEL: torchvision:NAME (e.g. torchvision:resnet50) or path/to/file.py:NAME",
    )
    p.add_argument("model", metavar="MODEL", help="torchvision:NAME or path/to/file.py:NAME")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (default cpu)")
    p.add_argument("--plot", default=None, metavar="PNG", help="save the memory bar chart here")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per model (default 5)")
    p.add_argument(
        "--input-shape",
        default=None,
        metavar="C,H,W",
        help="one sample's shape (default 3,224,224; 3,299,299 for inception_v3)",
    )
    p.add_argument("--steps", action="store_true", help="also print the per-step table")
    p.add_argument(
        "--train",
        action="store_true",
        help="measure one training step (forward, backward, SGD step) instead of inference",
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run the ``profile`` subcommand; prints the side-by-side table, returns 0."""
    if args.batch < 1 or args.repeats < 1:
        print("error: --batch and --repeats must be at least 1", file=sys.stderr)
        return 2
    device = resolve_device(args.device)
    shape = _parse_shape(args.input_shape) if args.input_shape else None
    model, name, sample = load(args.model, shape)
    model = model.to(device)
    if args.train:
        model.train()
    torch.manual_seed(0)
    x = torch.randn(args.batch, *sample, device=device)
    what = ", one training step" if args.train else ""
    print(f"{name}: batch {args.batch}, input {'x'.join(map(str, sample))}, device {device}{what}")
    result = profile(model, x, repeats=args.repeats, train=args.train)
    text = str(result)
    if not args.steps:
        text = "\n".join(line for line in text.split("\n\n")[0].split("\n"))
        text += "".join("\n" + n for n in result.notes)
    print(text)
    if args.plot:
        try:
            path = result.plot(args.plot, title=name)
        except ImportError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"plot saved to {path}")
    return 0


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(s) for s in text.replace("x", ",").split(",") if s)
    except ValueError:
        raise SystemExit(f"error: not a shape: {text!r} (e.g. 3,224,224)") from None
    return dims


def load(spec: str, input_shape: tuple[int, ...] | None = None) -> tuple[Any, str, tuple[int, ...]]:
    """(model in eval mode, its name, one sample's input shape) for a MODEL spec."""
    loaded = load_model(spec, input_shape=input_shape)
    return loaded.model.eval(), loaded.name, tuple(loaded.input_shape)
