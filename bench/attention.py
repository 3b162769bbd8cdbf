"""Attention on the CPU: ATen's scaled_dot_product_attention (the middleware's default, its
"vendor" algorithm) against the generated flash kernel (``algorithms={"sdpa": "flash"}``),
both through ``optimize()``, on the attention shapes of common models and long sequences.

Every round calls each engine in a new random order, one discarded call then one timed
(``zoo.timed_blocks``; median of ``--repeat`` rounds after ``--warmup``); every engine's
output is checked against ``F.scaled_dot_product_attention`` (max abs error over the
reference's max magnitude). Two threads unless ``--threads`` says otherwise.

Usage: ``python bench/attention.py [--repeat 15] [--out bench/results/attention_cpu.md]``
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

SDPA = "scaled_dot_product_attention"
# (name, batch, heads, query length, key length, head dim, causal)
SHAPES = [
    ("vit_b_16 b1", 1, 12, 197, 197, 64, False),
    ("vit_b_16 b16", 16, 12, 197, 197, 64, False),
    ("swin_t window b1", 64, 3, 49, 49, 32, False),
    ("decoder 1024 causal", 1, 8, 1024, 1024, 64, True),
    ("seq 4096 head 64", 1, 1, 4096, 4096, 64, False),
    ("head 80, odd lengths", 2, 4, 333, 517, 80, False),
]


class Attn(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from zoo import max_rel_err, timed_blocks

    import middleware

    torch.set_num_threads(args.threads)
    cache = Path(tempfile.mkdtemp(prefix="mw-attention-"))
    lines = [
        f"Attention, CPU, {args.threads} threads; median ms of {args.repeat} interleaved rounds "
        f"(`python bench/attention.py --repeat {args.repeat}`)",
        "",
        "| shape | B x H x L x S x D | eager SDPA | middleware default (vendor) | flash "
        "(generated) | flash / vendor | max rel err (vendor, flash) |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    torch.manual_seed(0)
    for name, b, h, lq, ls, d, causal in SHAPES:
        q, k, v = torch.randn(b, h, lq, d), torch.randn(b, h, ls, d), torch.randn(b, h, ls, d)
        model = Attn(causal).eval()
        engines = {
            "eager": model,
            "vendor": middleware.optimize(model, example_inputs=(q, k, v), cache_dir=cache),
            "flash": middleware.optimize(
                model, example_inputs=(q, k, v), cache_dir=cache, algorithms={SDPA: "flash"}
            ),
        }
        with torch.no_grad():
            ref = model(q, k, v)
            errs = {key: max_rel_err(fn(q, k, v), ref) for key, fn in engines.items()}
            calls = {key: functools.partial(fn, q, k, v) for key, fn in engines.items()}
            ms = timed_blocks(calls, args.warmup, args.repeat, block=1, seed=0)
        line = (
            f"| {name} | {b}x{h}x{lq}x{ls}x{d}{' causal' if causal else ''} | "
            f"{ms['eager']:.3f} | {ms['vendor']:.3f} | {ms['flash']:.3f} | "
            f"{ms['flash'] / ms['vendor']:.2f} | {errs['vendor']:.1e}, {errs['flash']:.1e} |"
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
