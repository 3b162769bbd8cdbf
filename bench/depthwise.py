"""Depthwise convolutions: oneDNN (``algorithms={"conv2d": <vendor for depthwise
layers>}``) against the generated direct kernel (``<direct for depthwise layers>``; every
other layer takes the default either way) on the networks made of them, whole networks
through ``optimize()``, every engine in a new random order each round
(``zoo.timed_blocks``: one discarded call, then one timed), medians, outputs checked
against eager (variance-keeping weights).

Usage: ``python bench/depthwise.py [--rounds 15] [--batch 1,16] [--out FILE]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

NETS = ("mobilenet_v2", "mobilenet_v3_small", "shufflenet_v2_x1_0")


def _depthwise(layer) -> bool:  # noqa: ANN001 - a middleware Layer
    return layer.groups > 1 and layer.groups == layer.input_shape[1]


def direct_for_depthwise(layer) -> str:  # noqa: ANN001
    return "direct" if _depthwise(layer) else "default"


def vendor_for_depthwise(layer) -> str:  # noqa: ANN001
    return "vendor" if _depthwise(layer) else "default"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", default="1,16")
    p.add_argument("--nets", default=",".join(NETS))
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    sys.path.insert(0, str(root / "bench"))
    import torchvision
    from coverage import variance_keeping
    from zoo import max_rel_err, timed_blocks

    import middleware

    cache = Path(tempfile.mkdtemp(prefix="mw-depthwise-"))
    lines = [
        f"Depthwise layers: oneDNN vs the generated direct kernel, {torch.get_num_threads()} "
        f"threads, median ms of {args.rounds} interleaved rounds "
        f"(`python bench/depthwise.py --rounds {args.rounds}`)",
        "",
        "| network | batch | eager channels_last | oneDNN depthwise | direct depthwise | "
        "direct / oneDNN | max rel err (default, direct) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for net in [n for n in args.nets.split(",") if n]:
        for batch in [int(b) for b in args.batch.split(",")]:
            torch.manual_seed(0)
            model = variance_keeping(getattr(torchvision.models, net)())
            x = torch.randn(batch, 3, 224, 224)
            model_cl = model.to(memory_format=torch.channels_last)
            x_cl = x.contiguous(memory_format=torch.channels_last)
            engines = {
                "eager_cl": lambda m=model_cl, x=x_cl: m(x),
            }
            opt = middleware.optimize(
                model,
                example_inputs=(x,),
                cache_dir=cache,
                algorithms={"conv2d": vendor_for_depthwise},
            )
            dw = middleware.optimize(
                model,
                example_inputs=(x,),
                cache_dir=cache,
                algorithms={"conv2d": direct_for_depthwise},
            )
            engines["default"] = lambda o=opt, x=x: o(x)
            engines["direct"] = lambda o=dw, x=x: o(x)
            with torch.inference_mode():
                ref = model(x)
                err = {k: max_rel_err(engines[k](), ref) for k in ("default", "direct")}
                ms = timed_blocks(engines, args.warmup, args.rounds, block=1, seed=0)
            line = (
                f"| {net} | {batch} | {ms['eager_cl']:.2f} | {ms['default']:.2f} | "
                f"{ms['direct']:.2f} | {ms['direct'] / ms['default']:.2f} | "
                f"{err['default']:.1e}, {err['direct']:.1e} |"
            )
            lines.append(line)
            print(line, flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
