"""The runtime's Python overhead: resnet18 at batch 1, optimized against eager, one process.

Three figures, all medians of ``--repeat`` rounds after ``--warmup`` rounds; a round runs
every mode once, in turn (every other round in reverse order), so that the host's drift
hits all modes alike:

- ``eager``: ``model(x)`` under ``torch.no_grad()``; ``eager_inference``: the same under
  ``torch.inference_mode()``;
- ``middleware``: ``optimized(x)`` (the plain call a user makes);
- ``runtime overhead``: ``optimized(x)`` with every step's call replaced by one that returns
  the result recorded from a real run, i.e. everything the runtime does per call except
  the ATen/oneDNN work: signature lookup, grad-mode switch, the plan loop (argument
  gathering, slot writes, frees) and rebuilding the output structure.

The target (issue 2): ``middleware`` no slower than ``eager`` by more than 10%.

Usage::

    python bench/overhead.py                    # resnet18, batch 1, 200 rounds
    python bench/overhead.py --repeat 50 --model torchvision:mobilenet_v3_small
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import middleware
from middleware.models import load_model


def _null_program(plan: Any, x: torch.Tensor) -> list[tuple[Any, ...]] | None:
    """The plan's program with each step's call replaced by "return what it returned".

    Reads the plan's internal ``_program`` (fn, ins, outs, multi, frees); None when the
    plan has another shape.
    """
    program = getattr(plan, "_program", None)
    if not program or len(program[0]) != 5:
        return None
    recorded: list[Any] = []

    def recording(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            out = fn(*args)
            recorded.append(out)
            return out

        return call

    plan._program = [(recording(fn), *rest) for fn, *rest in program]
    try:
        with torch.no_grad():
            plan.run([x])
    finally:
        plan._program = program

    def constant(value: Any) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            return value

        return call

    return [(constant(r), *rest) for r, (_, *rest) in zip(recorded, program, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="torchvision:resnet18")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(args.model)
    model = loaded.model
    x = loaded.example(args.batch)
    optimized = middleware.optimize(model, example_inputs=(x,))
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x), rtol=1e-4, atol=1e-4)

    # the same module object with its plan's calls replaced by recorded results
    hollow = copy.copy(optimized)
    plan = copy.copy(optimized.plan)
    null = _null_program(plan, x)
    if null is not None:
        plan._program = null
        hollow._plans = {sig: copy.copy(entry) for sig, entry in optimized._plans.items()}
        for entry in hollow._plans.values():
            entry.plan = plan

    def eager() -> Any:
        with torch.no_grad():
            return model(x)

    def eager_inference() -> Any:
        with torch.inference_mode():
            return model(x)

    modes: dict[str, Callable[[], Any]] = {
        "eager": eager,
        "eager_inference": eager_inference,
        "middleware": lambda: optimized(x),
    }
    if null is not None:
        modes["runtime overhead"] = lambda: hollow(x)

    times: dict[str, list[float]] = {m: [] for m in modes}
    order = list(modes.items())
    for i in range(args.warmup + args.repeat):
        for name, fn in order if i % 2 == 0 else order[::-1]:  # no fixed predecessor
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                times[name].append(dt)

    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    n_steps = len(optimized.plan.steps)
    print(
        f"{loaded.name}, batch {args.batch}, {torch.get_num_threads()} threads, "
        f"{n_steps} plan steps, median of {args.repeat} interleaved rounds"
    )
    for name, ms in med.items():
        extra = ""
        if name == "middleware":
            extra = f"  ({ms / med['eager']:.3f}x eager, {ms / med['eager_inference']:.3f}x eager_inference)"
        if name == "runtime overhead":
            extra = (
                f"  ({ms * 1e3 / n_steps:.2f} us per step, "
                f"{100 * ms / med['middleware']:.1f}% of the middleware call)"
            )
        print(f"  {name:<18} {ms:8.3f} ms{extra}")
    ratio = med["middleware"] / med["eager"]
    verdict = "within" if ratio <= 1.10 else "NOT within"
    print(f"middleware / eager = {ratio:.3f}: {verdict} the 10% target")


if __name__ == "__main__":
    main()
