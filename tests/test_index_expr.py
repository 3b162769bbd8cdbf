"""Index trees (middleware/index_expr.py): the C printer and the evaluator agree.

Random trees over the whole vocabulary are printed as C, compiled with gcc in one program
and evaluated at random variable values; the same trees are evaluated in Python. A wrong
precedence, a missing parenthesis (``--h`` is C's decrement) or a floor/truncation mix-up
makes some tree disagree."""

from __future__ import annotations

import random
import shutil
import subprocess

import pytest

from middleware import index_expr as ix

VARS = ("n", "c", "h", "w")


def _tree(rng: random.Random, depth: int) -> ix.Ix:
    if depth == 0 or rng.random() < 0.25:
        return ix.Var(rng.choice(VARS)) if rng.random() < 0.6 else ix.Int(rng.randint(-7, 9))
    kind = rng.choice(
        ["add", "sub", "mul", "neg", "min", "max", "select", "floordiv", "mod", "div", "cmp"]
    )
    sub = lambda: _tree(rng, depth - 1)  # noqa: E731
    if kind == "neg":
        return ix.op("neg", sub())
    if kind == "mul":  # by constants only: values stay far from int overflow
        return ix.Op("mul", (sub(), ix.Int(rng.randint(-4, 5)), ix.Int(rng.randint(1, 3))))
    if kind in ("add", "min", "max"):
        return ix.Op(kind, tuple(sub() for _ in range(rng.randint(2, 3))))
    if kind == "select":
        cond = ix.op(rng.choice(["lt", "le", "gt", "ge", "eq"]), sub(), sub())
        if rng.random() < 0.3:
            cond = ix.op(rng.choice(["and", "or"]), cond, ix.op("lt", sub(), sub()))
        return ix.op("select", cond, sub(), sub())
    if kind == "floordiv":  # any numerator, positive divisor
        return ix.op("floordiv", sub(), ix.Int(rng.randint(1, 5)))
    if kind in ("mod", "div"):  # the vocabulary's contract: a non-negative numerator
        return ix.op(kind, ix.Var(rng.choice(VARS)), ix.Int(rng.randint(1, 5)))
    return ix.op("sub", sub(), sub())


def test_double_negation_is_not_a_decrement() -> None:
    text = ix.to_c(ix.op("neg", ix.op("neg", ix.Var("h"))))
    assert "--" not in text and ix.evaluate(ix.op("neg", ix.op("neg", ix.Var("h"))), {"h": 3}) == 3


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
def test_c_printer_agrees_with_evaluate(tmp_path) -> None:  # noqa: ANN001
    rng = random.Random(12)
    trees = [_tree(rng, rng.randint(1, 5)) for _ in range(400)]
    points = [{v: rng.randint(0, 12) for v in VARS} for _ in range(6)]
    helpers = (
        "static inline int min(int a, int b) { return a < b ? a : b; }\n"
        "static inline int max(int a, int b) { return a > b ? a : b; }\n"
        "static inline int floord(int n, int d) { return n >= 0 ? n / d : -((-n + d - 1) / d); }\n"
    )
    body = []
    for p in points:
        body.append("{ " + " ".join(f"int {v} = {p[v]};" for v in VARS))
        body += [f'printf("%d\\n", (int)({ix.to_c(t)}));' for t in trees]
        body.append("}")
    src = tmp_path / "ix.c"
    src.write_text(
        "#include <stdio.h>\n"
        + helpers
        + "int main(void) {\n"
        + "\n".join(body)
        + "\nreturn 0; }\n"
    )
    exe = tmp_path / "ix"
    subprocess.run(["gcc", "-O0", "-w", "-o", str(exe), str(src)], check=True)
    got = [
        int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True).stdout.split()
    ]
    want = [int(ix.evaluate(t, p)) for p in points for t in trees]
    assert len(got) == len(want)
    pairs = enumerate(zip(got, want, strict=True))
    bad = [(ix.to_c(trees[i % len(trees)]), g, w) for i, (g, w) in pairs if g != w]
    assert not bad, bad[:5]
