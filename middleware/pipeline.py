"""The pipeline: framework model -> graph -> passes -> batch slicing -> the device's backend
(lowering, units) -> plan (+ report).

Every device runs through the same steps: the registry (``backends.backend_for``) names the
backend of ``options.device``, and the backend answers the device-specific ones.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from .backends import Backend, backend_for
from .backends.interface import same_device
from .backends.vendor import ALGORITHMS, tuning
from .backends.vendor.algorithms import AUTO, AUTOTUNE, DEFAULT, candidate_times
from .frontends import trace
from .graph import RELEASE_AS_BUILT, Graph, return_freed_memory
from .hardware import Hardware, for_options
from .options import Options
from .passes import DECOMPOSITIONS, run_passes
from .passes.batch_slice import batch_slice, split_graph
from .runtime.chunked import ChunkedPlan
from .runtime.module import Compiled
from .runtime.plan import Plan, build_plan
from .runtime.report import make_report
from .version import __version__


def compile_model(model: nn.Module, inputs: Sequence[torch.Tensor], options: Options) -> Compiled:
    """Trace ``model`` on ``inputs``, run the passes and build the plan for this signature
    (``algorithms={"conv2d": "autotune"}`` or ``"auto"`` on a backend that
    ``tunes_whole_plans``: the network's plan chosen as a whole too,
    :func:`network_choice`)."""
    graph = trace(model, inputs)
    sel = dict(options.algorithms).get("conv2d")
    backend = backend_for(torch.device(options.device))
    if sel in (AUTOTUNE, AUTO) and getattr(backend, "tunes_whole_plans", False):
        return network_choice(model, graph, inputs, options, sel)
    return compile_graph(graph, options, inputs)


# A static choice is timed against the per-layer tuned plan when the sum of its layers'
# tuned times is within this factor of the tuned plan's sum.
NETWORK_MARGIN = 1.25
NETWORK_ROUNDS = 5
NETWORK_PRUNING_SPEEDUP = 1.1
# Another plan replaces the default's only when its median time is below this share of
# the default's. Whole plans timed a few rounds each on this shared 2-core host spread
# 5-10%, and the plan that won by a hair flipped from process to process (densenet121 at
# batch 16: the oneDNN-everywhere plan in one process, the default in the next; the
# benchmark then measured the two 3-7% apart either way): the default's rule was measured
# over many runs, so a tie keeps it.
NETWORK_TIE = 0.97
TUNED = "tuned"  # the per-layer tuned plan, as a network-level candidate


def network_choice(
    model: nn.Module,
    graph: Graph,
    inputs: Sequence[torch.Tensor],
    options: Options,
    sel: str,
) -> Compiled:
    """The plan of ``sel`` ("autotune" or "auto") for conv2d, chosen as a whole as well as
    per layer. Per-layer tuning times each layer alone; inside the network a layer's
    neighbours share its caches and threads, so the per-layer picks can add up to a plan
    slower than one algorithm everywhere (measured: resnet50 at batch 16, 5% slower than
    Winograd F(4x4) on every layer it applies to). So "autotune" also builds the default
    plan and, per built-in algorithm, the plan running it on every layer where it was a
    checked, timed candidate (the default's choice elsewhere, as when one algorithm is named
    for every layer; an approximate algorithm rejected on a layer for its error stays off
    it) whose layers' tuned times add up to within
    ``NETWORK_MARGIN`` of the tuned plan's; runs each once (one that fails is dropped),
    times the distinct plans on the real inputs (:func:`tuning.best_of`'s rounds, each timed
    call after an untimed one, judged by the median round) and keeps the fastest, unless it
    is within ``NETWORK_TIE`` of the default's plan: then the default's. The decision, with
    the winner's algorithm per layer, is stored like a layer's (``tuning/decisions.json``,
    keyed by the traced graph's text, the inputs' shapes, ``winograd``, how plans are
    compared, the hardware and the version): a second process, and "auto", build the
    stored plan and time nothing; "auto" without one is the per-layer stored
    decisions, else the default. A graph without conv2d, or whose layers' tuning spent
    ``tune_budget_s``, gets no network-level timing."""
    if not any(n.op == "conv2d" for n in graph.nodes()):
        return compile_graph(graph, options, inputs)
    hardware = for_options(options)
    statics = [n for n, a in ALGORITHMS["conv2d"].items() if a.builtin]
    problem = {
        "network": hashlib.sha256(graph.text().encode()).hexdigest(),
        "inputs": [tuple(x.shape) for x in inputs if isinstance(x, torch.Tensor)],
        "winograd": options.winograd,  # off: no approximate algorithm from a stored plan
        # how whole plans are compared (decisions made another way retire)
        "choice": f"median of {NETWORK_ROUNDS}, a call before each; tie {NETWORK_TIE}",
    }
    key = tuning.decision_key(problem, [TUNED, DEFAULT, *statics], hardware.key())
    store = tuning.DecisionStore(options.cache_dir)
    record, whence = store.get(key)
    if record is not None:
        won, mapping = record["algorithm"], record.get("plan")
        # the tuned plan: the layers' own stored decisions (each row says so); a static
        # one: its algorithm per layer as stored
        name = sel if won == TUNED else DEFAULT
        compiled = compile_graph(
            graph, _conv_selection(options, name, None if won == TUNED else mapping), inputs
        )
        how = "cached" if whence == "cached" else "same network tuned before"
        return _noted(compiled, f"network-level choice: {how}; {record['summary']}")
    spent = tuning.seconds_spent()
    tuned = compile_graph(graph, options, inputs)
    budget = options.tune_budget_s
    if sel == AUTO or tuned.plan is None:
        return tuned
    # the budget bounds the layers' tuning, not the plan's build (a cold compile of
    # densenet121's kernels took 45 s of a 63 s optimize() on the Intel host)
    if budget is not None and tuning.seconds_spent() - spent >= budget:
        return _noted(
            tuned,
            f"network-level choice: not made: the tuning budget (tune_budget_s={budget:g}) "
            "was spent on the layers; the per-layer plan runs",
        )
    times = {r.node: candidate_times(r.reason) for r in tuned.report.rows if r.op == "conv2d"}
    picks = {n: a for n, a in _conv_plan(tuned) if a}
    built: dict[str, Compiled] = {TUNED: tuned}
    plans = {TUNED: _conv_plan(tuned)}
    same: dict[str, str] = {}

    def add(name: str, mapping: dict[str, str] | None) -> None:
        try:
            compiled = compile_graph(
                trace(model, inputs), _conv_selection(options, name, mapping), inputs
            )
            if compiled.plan is None:
                return
            _runner(compiled, inputs)()  # a plan that fails to run is not a candidate
        except Exception:  # noqa: BLE001 - a candidate that fails is not one
            return
        plan = _conv_plan(compiled)
        twin = next((k for k, p in plans.items() if p == plan), None)
        if twin is not None:
            same[name] = twin
        else:
            built[name], plans[name] = compiled, plan

    add(DEFAULT, None)
    # a static choice: the algorithm on every layer where it was a checked, timed candidate
    # (an approximate one beyond its error bound on a layer was rejected there, and never
    # appears in its times), the default's choice elsewhere (as one algorithm named for
    # every layer runs)
    fallback = {n: a for n, a in plans.get(DEFAULT, plans[TUNED]) if a}
    tuned_ms = sum(t[picks[n]] for n, t in times.items() if picks.get(n) in t)
    for s in statics:
        if not any(s in t for t in times.values()):
            continue
        mapping = {n: s if s in times.get(n, {}) else fallback.get(n, a) for n, a in picks.items()}
        est = sum(t[mapping[n]] if mapping[n] in t else t[picks[n]] for n, t in times.items()
                  if picks.get(n) in t)  # fmt: skip
        if est > NETWORK_MARGIN * tuned_ms:
            continue
        if mapping == picks:
            same[s] = TUNED
            continue
        add(s, mapping)
    if len(built) == 1:
        won, summary = TUNED, "the per-layer tuned plan (no other plan within reach)"
    else:
        outcome = tuning.best_of(
            {name: _runner(c, inputs) for name, c in built.items()},
            _after_a_call,
            rounds=NETWORK_ROUNDS,
            pruning_speedup=NETWORK_PRUNING_SPEEDUP,
            statistic="median",
        )
        won = outcome.best
        t = outcome.times
        ms = ", ".join(f"{n} {v * 1e3:.3g} ms" for n, v in sorted(t.items(), key=lambda p: p[1]))
        # the default's plan, under its own name or the one it was found equal to (a
        # pruned one was slower beyond the pruning factor: no tie)
        default = DEFAULT if DEFAULT in built else same.get(DEFAULT)
        if (
            default in t
            and default not in outcome.pruned
            and won != default
            and t[won] > NETWORK_TIE * t[default]
        ):
            faster = 1 - t[won] / t[default]
            summary = (
                f"{default} kept: {won} faster by only {faster:.1%} (a tie under "
                f"{1 - NETWORK_TIE:.0%}); {len(built)} plans (median of rounds): {ms}"
            )
            won = default
        else:
            summary = f"{won} best of {len(built)} plans (median of rounds): {ms}"
    if same:
        summary += "; same plan: " + ", ".join(f"{k} = {v}" for k, v in same.items())
    store.put(
        key,
        {
            "algorithm": won,
            "plan": None if won == DEFAULT else dict(plans[won]),
            "summary": summary,
            "problem": problem,
            "hardware": hardware.key(),
            "version": __version__,
        },
    )
    winner = built.pop(won)
    built.clear()
    return_freed_memory()
    return _noted(winner, f"network-level choice: {summary}")


def _conv_selection(options: Options, name: str, mapping: dict[str, str] | None = None) -> Options:
    """``options`` with conv2d's selection replaced: ``name``, or with ``mapping`` (conv2d
    node -> algorithm) each layer's algorithm by its node name."""
    pairs = dict(options.algorithms)
    if mapping is None:
        pairs["conv2d"] = name
    else:
        table = dict(mapping)
        pairs["conv2d"] = lambda layer: table.get(layer.name) or DEFAULT
    return dataclasses.replace(options, algorithms=tuple(pairs.items()))


def _conv_plan(compiled: Compiled) -> tuple[tuple[str, str], ...]:
    return tuple((r.node, r.algorithm) for r in compiled.report.rows if r.op == "conv2d")


def _after_a_call(name: str, run: Callable[[], Any]) -> float:
    """A whole plan's timed call, after an untimed one: repeated inference, as a user's
    loop meets it (the call after another plan's found caches, pages and threads that
    plan had left: densenet121 at batch 16 ran at 234 ms against 202 ms in a loop).
    ``tuning.TIMER`` is read at each call (tests replace it)."""
    run()
    return tuning.TIMER(name, run)


def _runner(compiled: Compiled, inputs: Sequence[torch.Tensor]) -> Any:
    plan = compiled.plan
    assert plan is not None

    def run() -> Any:
        with torch.inference_mode():
            return plan.run(inputs)

    return run


def _noted(compiled: Compiled, note: str) -> Compiled:
    report = dataclasses.replace(compiled.report, notes=(*compiled.report.notes, note))
    return dataclasses.replace(compiled, report=report)


def compile_graph(
    graph: Graph, options: Options, inputs: Sequence[torch.Tensor] | None = None
) -> Compiled:
    """Passes, batch-slicing cut, units and plan of ``graph`` on ``options.device``. With
    ``inputs`` given, the backend may finish the plan on them here (CUDA: capture it as a
    CUDA graph), so that the report says whether it could."""
    device = torch.device(options.device)
    backend = backend_for(device)
    hardware = for_options(options)
    # a backend registered before passes_off joined the interface turns nothing off
    passes_off = getattr(backend, "passes_off", None)
    off = passes_off(options) if passes_off is not None else ()
    if not options.fuse:
        # its pieces fuse or are slower than the one ATen call they replace
        off = (*off, *DECOMPOSITIONS)
    pass_options = (
        dataclasses.replace(
            options, disable_passes=tuple(dict.fromkeys((*options.disable_passes, *off)))
        )
        if off
        else options
    )
    graph = run_passes(graph, pass_options, hardware)
    return_freed_memory()  # the passes' temporaries (folding works in float64)
    graph = _fallbacks_on(graph, device)
    cut = batch_slice(graph, options, hardware, auto=backend.slices_batch)
    if cut is not None:
        pre, post = split_graph(graph, cut)
        # while the two plans build, the halves alone hold the weights they read, so that
        # a weight released as its call is built (RELEASE_AS_BUILT) is freed at once
        order = _lend_params(graph, (pre, post))
        try:
            plans = [
                _plan(backend, pre, options, hardware, device),
                _plan(backend, post, options, hardware, device, owned=cut.values),
            ]
        finally:
            _take_back_params(graph, (pre, post), order)
        plan = ChunkedPlan(graph, cut, plans[0], plans[1], device)
        graphs = [graph, pre, post]
    else:
        plans = [_plan(backend, graph, options, hardware, device)]
        plan, graphs = plans[0], [graph]
    plan = backend.finish(plan, options, inputs)
    report = make_report(graph, plan, hardware)
    graphs += [p.graph for p in plans]
    release_held_params(graphs, plans)
    for g in graphs:  # stand-ins left where the other half reads the weight: no value
        g.release_params([v for v in g.released() if v in g.params], "released while built")
    return_freed_memory()
    return Compiled(graph, plan, report)


def _lend_params(graph: Graph, halves: Sequence[Graph]) -> list[str]:
    """Take out of ``graph`` the parameters ``halves`` hold too; returns the order of all
    of ``graph``'s parameters, for :func:`_take_back_params`."""
    order = list(graph.params)
    for v in order:
        if any(v in h.params for h in halves):
            del graph.params[v]
    return order


def _take_back_params(graph: Graph, halves: Sequence[Graph], order: Sequence[str]) -> None:
    """Put back into ``graph`` (in ``order``) each lent parameter's array from a half that
    still holds it; one that every half released comes back as a stand-in."""
    params, stood = {}, []
    for v in order:
        if v in graph.params:
            params[v] = graph.params[v]
            continue
        held = [h for h in halves if v in h.params]
        real = [h.params[v] for h in held if v not in h.released()]
        if real or held:
            params[v] = real[0] if real else held[0].params[v]
            if not real:
                stood.append(v)
    graph.params = params
    graph.stand_in_params(stood, "released while built")


def release_held_params(graphs: Sequence[Graph], plans: Sequence[Plan]) -> list[str]:
    """Drop from ``graphs`` the arrays of the parameters that no step of ``plans`` reads
    (every step that takes one holds its own copy: a prepacked or Winograd-transformed
    weight, ``Plan.held_params``), so that a weight the passes derived (batch-norm folded)
    is not held a second time beside that copy. Returns the names released.

    Safe for later builds: a new input signature, changed weights or a switch to training
    trace the user's model again (``runtime.module``), never this graph; ``Graph.evaluate``
    on it raises for a released parameter."""
    held = {v for p in plans for v in p.held_params}
    read = {v for p in plans for v in p.graph.params if v not in p.held_params}
    released = sorted(held - read)
    if released:
        why = "the plan holds its own copy: a prepacked or transformed weight"
        for g in {id(g): g for g in graphs}.values():
            g.release_params(released, why)
    return released


def _plan(
    backend: Backend,
    graph: Graph,
    options: Options,
    hardware: Hardware,
    device: torch.device,
    owned: tuple[str, ...] = (),
) -> Plan:
    graph = backend.lower(graph, options)
    graph.meta[RELEASE_AS_BUILT] = True  # see middleware.graph
    try:
        units = backend.units(graph, options, hardware, device)
    finally:
        graph.meta.pop(RELEASE_AS_BUILT, None)
    return build_plan(
        graph,
        device,
        units,
        plan_memory=options.plan_memory,
        owned=owned,
        check_memory=options.check_memory,
        huge_pages=options.huge_pages,
        native=options.cache_dir if options.native_runner else None,
        native_call=options.native_call,
    )


def _fallbacks_on(graph: Graph, device: torch.device) -> Graph:
    """Fallback modules that live on another device than the plan run on a copy moved there
    (the user's model itself is never moved)."""
    for n in list(graph.nodes()):
        mod = n.payload
        if n.op == "fallback" and isinstance(mod, nn.Module):
            p = next(iter(mod.parameters()), None)
            if p is None:
                p = next(iter(mod.buffers()), None)
            if p is not None and not same_device(p.device, device):
                graph = graph.copy() if graph is not None else graph
                graph.replace_node(n.name, n.replace(payload=copy.deepcopy(mod).to(device)))
    return graph
