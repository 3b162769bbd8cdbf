"""Bias add + softmax over attention-score shapes: the decomposed, generated softmax
(``passes/decompose_softmax.py``) against the same plan with ATen's softmax
(``disable_passes=("decompose_softmax",)``) and eager PyTorch, in one process.

    python bench/softmax.py --repeat 15 [--out bench/results/softmax_cpu.md]

Each engine's output is checked against eager (relative to the output's scale) before
timing; rounds run every engine in a new seeded order (``zoo.timed_blocks``), medians.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zoo  # noqa: E402

import middleware  # noqa: E402

# (label, scores shape, bias shape)
SHAPES = [
    ("swin_t window b1", (64, 3, 49, 49), (3, 49, 49)),
    ("swin_t window b16", (1024, 3, 49, 49), (3, 49, 49)),
    ("vit_b_16 b1", (1, 12, 197, 197), (197,)),
    ("vit_b_16 b16", (16, 12, 197, 197), (197,)),
    ("maxvit_t b1 (rank 5)", (1, 64, 2, 49, 49), (1, 2, 49, 49)),
]


class BiasSoftmax(nn.Module):
    def forward(self, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x + b, -1)


def _timed(model, aten, gen, x, b, repeat: int) -> dict[str, float]:  # noqa: ANN001
    return zoo.timed_blocks(
        {"eager": lambda: model(x, b), "aten": lambda: aten(x, b), "gen": lambda: gen(x, b)},
        warmup=1,
        repeat=repeat,
        block=3,
        seed=0,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = BiasSoftmax().eval()
    lines = [
        f"Bias add + softmax, CPU, {torch.get_num_threads()} threads; median ms of "
        f"{args.repeat} interleaved rounds (`python bench/softmax.py --repeat {args.repeat}`)",
        "",
        "| shape | scores | eager | middleware, ATen softmax | middleware, generated | "
        "generated / ATen softmax | max rel err |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for label, shape, bias in SHAPES:
        x, b = torch.randn(shape) * 3, torch.randn(bias)
        gen = middleware.optimize(model, example_inputs=(x, b))
        aten = middleware.optimize(
            model, example_inputs=(x, b), disable_passes=("decompose_softmax",)
        )
        assert not [r for r in gen.report().rows if r.op == "softmax"], "not decomposed"
        with torch.no_grad():
            want = model(x, b)
            errs = []
            for f in (gen, aten):
                err = float((f(x, b) - want).abs().max() / want.abs().max())
                assert err < 1e-5, (label, err)
                errs.append(err)
            t = _timed(model, aten, gen, x, b, args.repeat)
        row = (
            f"| {label} | {'x'.join(map(str, shape))} | {t['eager']:.3f} | {t['aten']:.3f} | "
            f"{t['gen']:.3f} | {t['gen'] / t['aten']:.2f} | {max(errs):.1e} |"
        )
        print(row, flush=True)
        lines.append(row)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
