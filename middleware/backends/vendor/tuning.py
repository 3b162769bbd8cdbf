"""Autotuning: the best of a layer's candidate calls, measured, and decisions kept on disk.

:func:`best_of` (BestOf's rounds): every candidate runs once untimed (one-time costs:
lazy initialisation, first-touch of its buffers), then up to ``rounds`` timed rounds; after
``prune_after_round`` rounds every candidate whose best time is slower than the best
candidate's by more than ``pruning_speedup`` is dropped; the fastest survivor wins, by its
best time or (whole plans) by its median round.

:class:`DecisionStore`: decisions as JSON in ``<cache_dir>/tuning/decisions.json``, keyed
by a digest of the problem (shapes, geometry, epilogue, dtype, layouts), the candidate
set, the hardware description (``Hardware.key()``) and the package version; written
atomically (a temporary file and ``os.replace``) after merging what another process wrote
meanwhile, and memoised in this process (:func:`clear_memo` forgets the memo), so that
identical problem sizes are tuned once and a second process times nothing.

:class:`Session`: one graph's tuning, timed against ``Options.tune_budget_s`` (once spent,
the remaining layers take a stored decision or the default, and say so), with a progress
bar over the layers to tune.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ...version import __version__

ROUNDS = 5
PRUNE_AFTER_ROUND = 2
PRUNING_SPEEDUP = 1.5
# How candidates are timed, and a revision of the built-in algorithms' implementations;
# part of every decision's key, so that a change of either re-tunes instead of reusing
# decisions measured the old way ("cold-weights": each timed call after
# :func:`cpu_context`'s eviction on the CPU; "wino-onednn": Winograd's product on oneDNN
# matmul primitives, session 20, 2.2x faster than the torch.bmm it was timed with before).
METHOD = "cold-weights;wino-onednn"

# (candidate name, a call running it once) -> seconds
Timer = Callable[[str, Callable[[], Any]], float]


def wall_timer(name: str, run: Callable[[], Any]) -> float:
    """Seconds of one call of ``run`` (wall clock)."""
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


# The timer tuning uses (tests replace it with a fake one).
TIMER: Timer = wall_timer


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The winner, each candidate's time (the statistic of its rounds: best or median),
    and the round after which each pruned candidate was dropped."""

    best: str
    times: dict[str, float]
    pruned: dict[str, int]
    rounds: int


def best_of(
    candidates: Mapping[str, Callable[[], Any]],
    timer: Timer | None = None,
    rounds: int = ROUNDS,
    prune_after_round: int = PRUNE_AFTER_ROUND,
    pruning_speedup: float = PRUNING_SPEEDUP,
    before: Callable[[], Any] | None = None,
    statistic: str = "min",
) -> Outcome:
    """The fastest of ``candidates`` (name -> a call), by BestOf's rounds and pruning;
    ``before`` (untimed) runs before every timed call (:func:`cpu_context`). A candidate's
    time is the ``statistic`` of its rounds: "min" (BestOf's best time) or "median" (a
    candidate whose times spread wide is not judged by its luckiest round: whole plans,
    whose times on a shared host spread 5-10%)."""
    if statistic not in ("min", "median"):
        raise ValueError(f"statistic must be 'min' or 'median', not {statistic!r}")
    if not candidates:
        raise ValueError("best_of needs at least one candidate")
    timer = timer or TIMER
    alive = list(candidates)
    if len(alive) == 1:
        return Outcome(alive[0], {}, {}, 0)
    for name in alive:  # untimed: one-time costs
        candidates[name]()
    seen: dict[str, list[float]] = {name: [] for name in alive}
    pruned: dict[str, int] = {}
    done = 0
    for r in range(1, rounds + 1):
        done = r
        for name in alive:
            if before is not None:
                before()
            seen[name].append(float(timer(name, candidates[name])))
        if r >= prune_after_round:
            # pruned by the best time whatever the statistic: after two rounds a median is
            # a mean, and one slow first round would drop the faster candidate
            fastest = min(min(seen[n]) for n in alive)
            for name in alive:
                if min(seen[name]) > pruning_speedup * fastest:
                    pruned[name] = r
            alive = [n for n in alive if n not in pruned]
            if len(alive) == 1:
                break
    pick = min if statistic == "min" else statistics.median
    times = {name: float(pick(v)) for name, v in seen.items()}
    winner = min(alive, key=lambda n: times[n])
    return Outcome(winner, times, pruned, done)


def cpu_context(private_cache_bytes: int, inputs: tuple[Any, ...]) -> Callable[[], None]:
    """A ``before`` hook for :func:`best_of` that puts the caches in the state a layer
    meets inside the network: twice ``private_cache_bytes`` (every core's L2) of scratch
    written, so that the candidate's weights, transformed weights and workspaces come from
    the shared cache or memory, as they do when the layers before it ran in between; then
    the layer's activation inputs read, as the layer before it just wrote them (give the
    activations only: the weights are to stay beyond L2). The scratch lives as long as the
    hook. Timed back to back
    instead, a candidate whose transformed weights fit in L2 (Winograd F(4x4)'s, 4x the
    layer's) looked faster than it is in the network: googlenet at batch 16 tuned
    that way ran 19% slower than Winograd F(2x2) on every layer it applies to."""
    import torch

    scratch = torch.empty(max(1, 2 * private_cache_bytes // 4))
    tensors = [a for a in inputs if isinstance(a, torch.Tensor)]

    def before() -> None:
        with torch.inference_mode():
            scratch.fill_(0.0)
            for t in tensors:
                t.amax() if t.is_floating_point() else t.sum()

    return before


def decision_key(problem: Mapping[str, Any], candidates: list[str], hardware_key: str) -> str:
    """The digest a decision is stored under: problem, candidate set, hardware, version."""
    blob = json.dumps(
        {
            "problem": problem,
            "candidates": sorted(candidates),
            "hardware": hardware_key,
            "version": __version__,
            "method": METHOD,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class Session:
    """The tuning of one graph (one ``optimize()`` compile): seconds spent timing against
    ``budget_s`` (None: no cap), and a progress bar over the layers left to tune (shown
    where more than ``PROGRESS_AFTER`` layers are tuned)."""

    def __init__(self, budget_s: float | None, layers: int) -> None:
        self.budget_s = budget_s
        self.spent_s = 0.0
        self.layers = layers
        self.done = 0
        self._bar: Any = None

    def over_budget(self) -> bool:
        return self.budget_s is not None and self.spent_s >= self.budget_s

    def tuned(self, seconds: float, label: str) -> None:
        """One layer done (``seconds`` of it spent timing; 0 where nothing was timed)."""
        self.spent_s += seconds
        with _LOCK:
            _SPENT[0] += seconds
        self.done += 1
        if self._bar is None and self.layers > PROGRESS_AFTER and self.done < self.layers:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.layers, desc="tuning layers", unit="layer", leave=False)
            self._bar.update(self.done - 1)
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(1)
            if self.done >= self.layers:
                self._bar.close()
                self._bar = None


PROGRESS_AFTER = 3
_SPENT = [0.0]  # seconds this process's sessions spent tuning layers


def seconds_spent() -> float:
    """Seconds every tuning session of this process has spent on its layers so far (the
    difference over a compile is what that compile spent, its kernels' compilation not
    counted)."""
    with _LOCK:
        return _SPENT[0]

_SESSIONS: weakref.WeakKeyDictionary[Any, Session] = weakref.WeakKeyDictionary()


def session(graph: Any, budget_s: float | None, count_layers: Callable[[], int]) -> Session:
    """The tuning session of ``graph`` (created on its first tuned layer; it lives as long
    as the graph object)."""
    with _LOCK:
        s = _SESSIONS.get(graph)
        if s is None:
            s = _SESSIONS[graph] = Session(budget_s, count_layers())
        return s


_MEMO: dict[tuple[str, str], dict[str, Any]] = {}
_LOCK = threading.Lock()


def clear_memo() -> None:
    """Forget this process's decisions (the file keeps them)."""
    with _LOCK:
        _MEMO.clear()


class DecisionStore:
    """Tuning decisions of one cache directory (see the module docstring)."""

    def __init__(self, cache_dir: Path | str) -> None:
        self.path = Path(cache_dir) / "tuning" / "decisions.json"

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> tuple[dict[str, Any] | None, str]:
        """(the decision or None, where it came from: "memo", "cached" or "")."""
        with _LOCK:
            hit = _MEMO.get((str(self.path), key))
            if hit is not None:
                return hit, "memo"
            record = self._read().get(key)
            if isinstance(record, dict) and "algorithm" in record:
                _MEMO[(str(self.path), key)] = record
                return record, "cached"
        return None, ""

    def put(self, key: str, record: dict[str, Any]) -> None:
        """Keep ``record`` in the memo and write it to the file (merged, atomically; a
        write that fails leaves the memo only)."""
        with _LOCK:
            _MEMO[(str(self.path), key)] = record
            data = self._read()
            data[key] = record
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
                os.replace(tmp, self.path)
            except OSError:
                pass

    def entries(self) -> dict[str, Any]:
        """Every decision in the file."""
        return self._read()

    def clear(self) -> int:
        """Forget every decision of this cache directory (file and memo); how many the
        file held."""
        with _LOCK:
            n = len(self._read())
            for key in [k for k in _MEMO if k[0] == str(self.path)]:
                del _MEMO[key]
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        return n
