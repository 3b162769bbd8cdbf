"""The runtime's per-call and per-step costs, measured.

``--mode python`` (the default): the runtime's Python overhead, resnet18 at batch 1,
optimized against eager, one process. Three figures, all medians of ``--repeat`` rounds after ``--warmup`` rounds; a round runs
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

``--mode micro`` (issue 13): what one step costs, piece by piece, each the median over
rounds of a tight loop of calls: a Python no-op; the plan loop per empty step (a plan of
identity steps); ``torch.empty`` of a small tensor; one tiny ATen op (the dispatcher's
floor); a ctypes call of an empty C function, with ``data_ptr()``; an OpenMP parallel
region of the thread count and of one thread (``if`` false), through ctypes; the tiny
vendor conv step (1x1 conv, 16 -> 16 channels, on 1x16x8x8 channels_last) the way the
middleware called it (``torch.ops.mkldnn._convolution_pointwise``, prepacked weight) at
the thread count and at one thread, against ``F.conv2d`` and ``torch.addmm`` on the same
problem; a tiny generated kernel (``relu(x * 2 + 1)`` on 1x16x8x8) through its step
function, into a preallocated output, and its plan step; and the vendor steps the
middleware runs now for the 1x1 conv on a 1x16x1x1 input (a squeeze-excitation FC).

``--mode steps``: one network's plan at ``--batch``, every step timed on its own
(``plan.step_times``), summed and summarised per kind (vendor, generated) and per step
function, plus the whole call against eager.

``--mode ab``: each network of ``--nets`` at each batch of ``--batches`` optimized twice in
one process, with the small-1x1-conv GEMM path (``calls.GEMM_1X1_MAX_ROWS``) off
("before") and on ("after"), plus eager channels_last; timed like ``bench/zoo.py`` (a new
seeded order per round, blocks whose first call is discarded), outputs checked against
eager.

``--mode call`` (issue 18): what the call itself costs around the native program, cold
(``--flush`` MiB read before every call, as a network's previous layer would) and warm:
``optimize()``'s module with its call as one C++ function (``native_call=True``) and with
the Python shortcut (``native_call=False``), ``Plan.run_native`` (the program and its output
buffer), the native program into a given output, and a Python no-op; medians of
``--repeat`` rounds, each round every engine once in a new random order, outputs checked
against eager. Two patterns: BN -> ReLU -> 3x3/2 max-pool on 1x64x56x56 channels_last
(the output, 200 KB, allocated per call) and concat -> 3x3/1 max-pool at batch 16
(bench/io_patterns.py's, 11 MB of output from the recycled pool).

Usage::

    python bench/overhead.py                    # resnet18, batch 1, 200 rounds
    python bench/overhead.py --mode call --repeat 100
    python bench/overhead.py --repeat 50 --model torchvision:mobilenet_v3_small
    python bench/overhead.py --mode micro
    python bench/overhead.py --mode steps --model torchvision:mobilenet_v3_small
    python bench/overhead.py --mode ab --nets mobilenet_v3_small,shufflenet_v2_x1_0
"""

from __future__ import annotations

import argparse
import collections
import copy
import ctypes
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
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
    parser.add_argument(
        "--mode", choices=("python", "micro", "steps", "ab", "call"), default="python"
    )
    parser.add_argument("--flush", type=int, default=128, help="--mode call: MiB read per call")
    parser.add_argument("--model", default="torchvision:resnet18")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--nets", default="mobilenet_v3_small,shufflenet_v2_x1_0,mobilenet_v2")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument(
        "--lever",
        default="gemm1x1",
        help="--mode ab: gemm1x1, dw_generated, onednn_primitives, native_call",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mode == "micro":
        micro()
        return
    if args.mode == "ab":
        ab(args.nets.split(","), [int(b) for b in args.batches.split(",")], args.lever)
        return
    if args.mode == "steps":
        steps(args.model, args.batch, max(5, args.repeat // 10))
        return
    if args.mode == "call":
        call(args.repeat, args.flush)
        return

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


# ------------------------------------------------------------------ --mode micro
OMP_SOURCE = r"""
#include <omp.h>
void empty(void *a) { (void)a; }
void parallel(void *a, int threads) {
  #pragma omp parallel num_threads(threads)
  { ((volatile float *)a)[omp_get_thread_num()] = 0.0f; }
}
void parallel_if(void *a, int threads, long work) {
  #pragma omp parallel num_threads(threads) if(work > 32768)
  { ((volatile float *)a)[omp_get_thread_num()] = 0.0f; }
}
"""


def per_call_us(fn: Callable[[], Any], calls: int = 1000, rounds: int = 7) -> float:
    """Median over ``rounds`` of the mean microseconds per call of ``calls`` calls."""
    for _ in range(min(100, calls)):
        fn()
    got = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        got.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(got)


def _omp_lib(folder: Path) -> ctypes.CDLL:
    src, lib = folder / "omp_micro.c", folder / "omp_micro.so"
    src.write_text(OMP_SOURCE)
    cmd = ["cc", "-O2", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(lib)]
    subprocess.run(cmd, check=True)
    so = ctypes.CDLL(str(lib))
    so.empty.argtypes, so.empty.restype = [ctypes.c_void_p], None
    so.parallel.argtypes, so.parallel.restype = [ctypes.c_void_p, ctypes.c_int], None
    so.parallel_if.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long]
    so.parallel_if.restype = None
    return so


def _identity_plan(n_steps: int) -> Any:
    """A plan of ``n_steps`` steps that each return their input (the plan loop alone)."""
    from middleware.enums import RunsAs
    from middleware.runtime.plan import Plan, Step

    def ident(x: Any) -> Any:
        return x

    steps = [Step(f"s{i}", RunsAs.GENERATED, ident, (i,), (i + 1,), ()) for i in range(n_steps)]
    plan = Plan.__new__(Plan)
    plan.steps, plan.n_slots, plan.input_slots = steps, n_steps + 1, (0,)
    plan._template, plan._single_out, plan.consumes_inputs = [None] * (n_steps + 1), n_steps, False
    plan._program = [(st.fn, st.ins, st.outs, False, st.frees) for st in steps]
    plan.memory = None
    return plan


def micro() -> None:
    """The per-step cost, piece by piece (see the module docstring)."""
    import torch.nn.functional as F

    threads = torch.get_num_threads()
    res: dict[str, float] = {}
    res["python no-op call"] = per_call_us(lambda: None, 20000)
    plan = _identity_plan(100)
    x0 = torch.zeros(1)
    res["plan loop, per empty step"] = (
        per_call_us(lambda: plan._run([x0], plan._program), 200) / 100
    )
    res["torch.empty(1x16x8x8, channels_last)"] = per_call_us(
        lambda: torch.empty((1, 16, 8, 8), memory_format=torch.channels_last), 5000
    )
    small = torch.randn(16)
    res["tiny ATen op (relu_ on 16 floats): dispatcher floor"] = per_call_us(
        lambda: torch.relu_(small), 5000
    )
    with tempfile.TemporaryDirectory() as tmp:
        so = _omp_lib(Path(tmp))
        buf = torch.zeros(64)
        p = buf.data_ptr()
        res["ctypes call, empty C function"] = per_call_us(lambda: so.empty(p), 20000)
        res["ctypes call + tensor.data_ptr()"] = per_call_us(
            lambda: so.empty(buf.data_ptr()), 20000
        )
        res[f"ctypes + OpenMP parallel region, {threads} threads"] = per_call_us(
            lambda: so.parallel(p, threads), 5000
        )
        res["ctypes + OpenMP parallel region, 1 thread"] = per_call_us(
            lambda: so.parallel(p, 1), 5000
        )
        res["ctypes + OpenMP parallel if(false)"] = per_call_us(
            lambda: so.parallel_if(p, threads, 1), 5000
        )
    x = torch.randn(1, 16, 8, 8).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(16, 16, 1, 1), torch.randn(16)
    geo = ([0, 0], [1, 1], [1, 1], 1)
    wp = torch.ops.mkldnn._reorder_convolution_weight(w, *geo, list(x.shape))
    conv = torch.ops.mkldnn._convolution_pointwise

    def onednn() -> Any:
        return conv(x, wp, b, *geo, "none", [], "")

    res[f"oneDNN conv 1x1 on 1x16x8x8 (prepacked, {threads} threads)"] = per_call_us(onednn, 500)
    torch.set_num_threads(1)
    res["oneDNN conv 1x1 on 1x16x8x8 (prepacked, 1 thread)"] = per_call_us(onednn, 500)
    torch.set_num_threads(threads)
    # the same convolution as a oneDNN primitive created once (vendor/onednn.py): the step
    # function the plan calls, output allocation included
    from middleware.backends.vendor.calls import vendor_kernel
    from middleware.graph import Graph, Node, TensorType
    from middleware.ops import infer_types
    from middleware.options import Options

    g = Graph()
    g.add_input("x", TensorType((1, 16, 8, 8), layout="nhwc"))
    g.add_param("w", w.numpy())
    g.add_param("b", b.numpy())
    node = Node(
        "c", "conv2d", ("x", "w", "b"), ("y",), dict(stride=1, padding=0, dilation=1, groups=1)
    )
    g.add_node(node, infer_types(g.values, node))
    prim = vendor_kernel(g, node, torch.device("cpu"), options=Options())
    if prim is not None and hasattr(prim, "primitives"):
        res[f"oneDNN conv 1x1 on 1x16x8x8 as a primitive created once, {threads} threads"] = (
            per_call_us(lambda: prim(x, w, b), 2000)
        )
        torch.set_num_threads(1)
        res["oneDNN conv 1x1 on 1x16x8x8 as a primitive created once, 1 thread"] = per_call_us(
            lambda: prim(x, w, b), 2000
        )
        torch.set_num_threads(threads)
    res["F.conv2d 1x1 on 1x16x8x8 channels_last"] = per_call_us(lambda: F.conv2d(x, w, b), 2000)
    wt = w.view(16, 16).t().contiguous()
    xv = x.permute(0, 2, 3, 1).reshape(64, 16)
    out = torch.empty(64, 16)
    res["torch.addmm (64x16 @ 16x16 + bias) into an output"] = per_call_us(
        lambda: torch.addmm(b, xv, wt, out=out), 5000
    )
    _generated(res)
    _se_fc(res)
    width = max(len(k) for k in res)
    print(f"per-call cost, {threads} threads, median of 7 rounds (microseconds)")
    for k, v in res.items():
        print(f"  {k:<{width}} {v:9.2f}")


def _generated(res: dict[str, float]) -> None:
    """A tiny generated kernel: relu(x * 2 + 1) on 1x16x8x8."""

    class Tiny(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x * 2.0 + 1.0)

    x = torch.randn(1, 16, 8, 8)
    opt = middleware.optimize(Tiny(), example_inputs=(x,))
    plan = opt.plan
    gen = [k for k, st in enumerate(plan.steps) if st.runs_as == "generated"]
    if len(gen) != 1:
        print(f"  (tiny generated kernel: expected one generated step, got {len(gen)})")
        return
    st = plan.steps[gen[0]]
    out = torch.empty(1, 16, 8, 8)
    unit_fn = st.fn
    out_fn = getattr(unit_fn, "out_fn", None)
    res["generated relu(2x+1) 1x16x8x8: step fn (allocates)"] = per_call_us(
        lambda: unit_fn(x), 5000
    )
    if out_fn is not None:
        res["generated relu(2x+1): into a preallocated output"] = per_call_us(
            lambda: out_fn(x, out), 5000
        )
    res["generated relu(2x+1): plan.run, one step"] = per_call_us(lambda: plan.run([x]), 5000)
    res["generated relu(2x+1): optimized(x), the user's call"] = per_call_us(lambda: opt(x), 5000)


def _se_fc(res: dict[str, float]) -> None:
    """The 1x1 conv on a 1x1-pixel input (a squeeze-excitation FC), as the middleware
    builds its step for it."""

    class Fc(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(96, 24, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.conv(x))

    torch.manual_seed(0)
    x = torch.randn(1, 96, 1, 1)
    opt = middleware.optimize(Fc().eval(), example_inputs=(x,))
    plan = opt.plan
    for st in plan.steps:
        if st.runs_as == "vendor":
            args = [x if i == plan.input_slots[0] else plan._template[i] for i in st.ins]
            name = getattr(st.fn, "__name__", "fn")
            res[f"SE FC relu(conv1x1 96->24) on 1x96x1x1: vendor step ({name})"] = per_call_us(
                lambda st=st, args=args: st.fn(*args), 2000
            )
    res["SE FC on 1x96x1x1: optimized(x)"] = per_call_us(lambda: opt(x), 2000)


# ------------------------------------------------------------------ --mode ab
def _lever(name: str) -> tuple[Any, str, Any, Any]:
    """(module, attribute, value before, value after) of a lever ``--mode ab`` compares."""
    from middleware.backends.cpu import units
    from middleware.backends.vendor import calls

    if name == "gemm1x1":  # small 1x1 convs as one addmm (the default after: on)
        return calls, "GEMM_1X1_MAX_ROWS", 0, calls.GEMM_1X1_MAX_ROWS
    if name == "dw_generated":  # depthwise convs generated at batch 1
        return units, "GENERATED_DEPTHWISE_MAX_BATCH", 0, 1
    if name == "onednn_primitives":  # an optimize() option: module None
        return None, "onednn_primitives", False, True
    if name == "native_call":  # the call as one C++ function (runtime/shortcut.cpp)
        from middleware.runtime import shortcut

        shortcut.extension(wait=True)  # built before anything is timed
        return None, "native_call", False, True
    raise SystemExit(
        f"unknown lever {name!r}: gemm1x1, dw_generated, onednn_primitives, native_call"
    )


def ab(nets: list[str], batches: list[int], lever: str = "gemm1x1") -> None:
    """Before/after of one lever, per network and batch."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import zoo

    module, attr, off, on = _lever(lever)
    default = getattr(module, attr) if module is not None else None
    print(f"{torch.get_num_threads()} threads; before: {attr} = {off}, after: {on}")
    for net in nets:
        for batch in batches:
            model, size = zoo.make_model(net)
            x = zoo.make_input(batch, size)
            fns = zoo.eager_runners(model, x)
            for label, value in (("before", off), ("after", on)):
                if module is None:  # an option of optimize()
                    opt = middleware.optimize(model, example_inputs=(x,), **{attr: value})
                    fns[label] = lambda opt=opt, x=x: opt(x)
                    continue
                setattr(module, attr, value)
                try:
                    opt = middleware.optimize(model, example_inputs=(x,))
                finally:
                    setattr(module, attr, default)
                fns[label] = lambda opt=opt, x=x: opt(x)
            ref = zoo.as_tensor(fns["eager"]())
            errs = {k: zoo.max_rel_err(zoo.as_tensor(fn()), ref) for k, fn in fns.items()}
            block = 5 if batch <= 2 else 2
            ms = zoo.timed_blocks(fns, 1, 3, block, seed=batch)
            print(
                f"{net} b{batch}: "
                + "  ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
                + f"  | after/before {ms['after'] / ms['before']:.2f}"
                + f"  | max rel. err {max(errs.values()):.1e}"
            )
            sys.stdout.flush()


# ------------------------------------------------------------------ --mode steps
def steps(model_name: str, batch: int, repeats: int) -> None:
    """Every step of one network's plan timed on its own, summarised."""
    loaded = load_model(model_name)
    model = loaded.model
    x = loaded.example(batch)
    opt = middleware.optimize(model, example_inputs=(x,))
    opt(x)
    plan = opt.plan
    if not hasattr(plan, "step_times"):
        print(f"{loaded.name}: the plan is a {type(plan).__name__} (no step_times)")
        return
    ms = plan.step_times([x], repeats)
    kinds: dict[str, list[float]] = collections.defaultdict(list)
    fns: dict[str, list[float]] = collections.defaultdict(list)
    for st, t in zip(plan.steps, ms, strict=True):
        kinds[str(st.runs_as)].append(t)
        fns[f"{st.runs_as}:{getattr(st.fn, '__name__', 'fn')}"].append(t)

    def whole(fn: Callable[[], Any]) -> float:
        return per_call_us(fn, 20, 7) / 1e3

    with torch.inference_mode():
        eager = whole(lambda: model(x))
    mw = whole(lambda: opt(x))
    print(
        f"{loaded.name}, batch {batch}, {torch.get_num_threads()} threads: {len(plan.steps)} "
        f"steps, sum of step medians {sum(ms):.2f} ms (median of {repeats} step-by-step runs); "
        f"whole call {mw:.2f} ms, eager {eager:.2f} ms"
    )
    for title, table in (("per kind", kinds), ("per step function", fns)):
        print(f"  {title}:")
        for k, v in sorted(table.items(), key=lambda kv: -sum(kv[1])):
            print(
                f"    {k:<34} {len(v):>4} steps  median {statistics.median(v) * 1e3:8.1f} us  "
                f"sum {sum(v):7.2f} ms"
            )
    print("  every step (us):")
    for st, t in zip(plan.steps, ms, strict=True):
        print(f"    {t * 1e3:8.1f}  {st.runs_as!s:<9} {st.name}  {st.algorithm}")
    sys.stdout.flush()


def call(rounds: int, flush_mib: int) -> None:
    """``--mode call``: the call path around the native program, cold and warm."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import io_patterns as iop  # the streaming harness's cache eviction and patterns

    from middleware.runtime import shortcut

    ext = shortcut.extension(wait=True)
    print(f"C++ call: {'loaded' if ext is not None else shortcut.why_not()}")
    torch.manual_seed(0)
    chain = torch.nn.Sequential(iop._bn(64), torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1))
    concat, shapes = iop.patterns(16)["concat_maxpool"]
    cases = {
        "chain 1x64x56x56 nhwc": (chain.eval(), [(1, 64, 56, 56)]),
        "concat_maxpool b16 nhwc": (concat().eval(), shapes),
    }
    cache = Path(tempfile.mkdtemp(prefix="mw-call-"))
    native = iop.Native(cache)
    print(f"medians of {rounds} rounds; microseconds per call")
    print(f"{'pattern':26s} {'cache':5s} " + " ".join(f"{k:>14s}" for k in _CALLS))
    for name, (model, shp) in cases.items():
        xs = [torch.randn(s).contiguous(memory_format=torch.channels_last) for s in shp]
        with torch.no_grad():
            want = model(*xs)
        engines = _call_engines(model, xs, want, cache, ext is not None)
        for cold in (True, False):
            native.set_flush(flush_mib if cold else 0)
            times = {k: [] for k in engines}
            with torch.no_grad():
                for r in range(rounds):
                    order = list(engines)
                    random.Random(r).shuffle(order)
                    for k in order:
                        native.evict()
                        t0 = time.perf_counter()
                        y = engines[k]()
                        times[k].append((time.perf_counter() - t0) * 1e6)
                        del y
            med = {k: statistics.median(v) for k, v in times.items()}
            print(
                f"{name:26s} {'cold' if cold else 'warm':5s} "
                + " ".join(f"{med[k]:14.1f}" for k in _CALLS)
            )


def _call_engines(
    model: torch.nn.Module, xs: list[torch.Tensor], want: torch.Tensor, cache: Path, built: bool
) -> dict[str, Callable[[], Any]]:
    """``--mode call``'s engines for one pattern (outputs checked against ``want``)."""
    engines: dict[str, Callable[[], Any]] = {}
    for on in (True, False):
        om = middleware.optimize(model, example_inputs=xs, cache_dir=cache, native_call=on)
        with torch.no_grad():
            for _ in range(3):
                torch.testing.assert_close(om(*xs), want, rtol=1e-4, atol=1e-4)
        assert (om._fast is not None) == (on and built)
        engines["C++ call" if on else "Python call"] = lambda om=om: om(*xs)
    plan = om.plan
    prog = plan.native
    assert prog is not None, "the pattern's plan does not run natively"
    out = prog(xs)
    engines["run_native"] = lambda: plan.run_native(xs)
    engines["program(out)"] = lambda: prog(xs, out)
    engines["no-op"] = lambda: None
    return engines


_CALLS = ("C++ call", "Python call", "run_native", "program(out)", "no-op")


if __name__ == "__main__":
    main()
