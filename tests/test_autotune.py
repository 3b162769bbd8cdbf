"""Autotuning's mechanics (backends/vendor/tuning.py, algorithms.tuned_choice): pruning
with a fake timer, identical problem sizes tuned once, decisions persisted and reused by a
cleared memo and by a fresh process without timing, approximate candidates checked against
the vendor result. No test asserts a measured time; the outputs are compared against the
original module with a tolerance relative to the output's scale."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import middleware
from middleware.__main__ import main
from middleware.backends.vendor import algorithms as alg
from middleware.backends.vendor import tuning
from middleware.options import Options

# the default's Winograd rule of a non-AMD CPU whatever the host (conftest.py)
pytestmark = pytest.mark.usefixtures("winograd_generic_rule")

ROOT = Path(__file__).resolve().parents[1]
# layer candidates, and the per-layer tuned plan as a whole (faster than the default's
# beyond the tie that keeps the default: pipeline.NETWORK_TIE)
FAKE_TIMES = {"im2col_gemm": 1.0, "vendor": 2.0, "winograd_f4x4": 10.0, "tuned": 0.5}


def _close(y: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> None:
    scale = max(1e-12, float(ref.abs().max()))
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol * scale)


def test_best_of_prunes_slow_candidates_after_the_minimum_rounds():
    timed: list[str] = []
    warm: list[str] = []
    times = {"a": 1.0, "b": 1.2, "c": 5.0}

    def timer(name, run):
        timed.append(name)
        run()
        return times[name]

    out = tuning.best_of(
        {n: (lambda n=n: warm.append(n)) for n in times},
        timer,
        rounds=5,
        prune_after_round=2,
        pruning_speedup=1.5,
    )
    assert out.best == "a" and out.pruned == {"c": 2} and out.rounds == 5
    assert timed.count("c") == 2 and timed.count("a") == 5 and timed.count("b") == 5
    assert warm.count("c") == 3  # one untimed warm-up call, then the timed ones
    assert out.times == times


def test_best_of_stops_when_one_survives():
    timed: list[str] = []

    def timer(name, run):
        timed.append(name)
        return {"a": 1.0, "b": 3.0}[name]

    out = tuning.best_of({"a": lambda: None, "b": lambda: None}, timer, rounds=9)
    assert out.best == "a" and out.pruned == {"b": 2} and len(timed) == 4


def test_decision_key_covers_problem_candidates_hardware_and_version(monkeypatch):
    p = {"input_shape": (1, 16, 8, 8)}
    k = tuning.decision_key(p, ["vendor", "im2col_gemm"], "cpu:x:2")
    assert k == tuning.decision_key(p, ["im2col_gemm", "vendor"], "cpu:x:2")
    assert k != tuning.decision_key(
        {"input_shape": (2, 16, 8, 8)}, ["vendor", "im2col_gemm"], "cpu:x:2"
    )
    assert k != tuning.decision_key(p, ["vendor"], "cpu:x:2")
    assert k != tuning.decision_key(p, ["vendor", "im2col_gemm"], "cpu:y:2")
    monkeypatch.setattr(tuning, "__version__", "9.9.9")
    assert k != tuning.decision_key(p, ["vendor", "im2col_gemm"], "cpu:x:2")


MODEL_SRC = textwrap.dedent(
    """
    import torch
    import torch.nn as nn

    class Net(nn.Module):
        # a stem, two identical 16->16 3x3 convs (one problem), a 1x1 conv
        def __init__(self):
            super().__init__()
            self.c1 = nn.Conv2d(3, 16, 3, padding=1)
            self.c2 = nn.Conv2d(16, 16, 3, padding=1)
            self.c3 = nn.Conv2d(16, 16, 3, padding=1)
            self.c4 = nn.Conv2d(16, 32, 1)

        def forward(self, x):
            x = torch.relu(self.c1(x))
            x = torch.relu(self.c2(x))
            x = torch.relu(self.c3(x))
            return self.c4(x)

    def make():
        torch.manual_seed(0)
        m = Net()
        with torch.no_grad():
            for c in (m.c1, m.c2, m.c3, m.c4):
                nn.init.kaiming_normal_(c.weight, nonlinearity="relu")
                c.bias.uniform_(-0.1, 0.1)
        return m.eval()
    """
)
_ns: dict = {}
exec(compile(MODEL_SRC, "<autotune model>", "exec"), _ns)  # noqa: S102 - the one model text


def _fake_timer(name, run):
    run()
    return FAKE_TIMES.get(name, 3.0)


def _no_timing(name, run):
    raise AssertionError(f"{name} was timed although a decision was stored")


def _optimize(tmp_path):
    m = _ns["make"]()
    torch.manual_seed(1)
    x = torch.randn(2, 3, 12, 10)
    opt = middleware.optimize(
        m, example_inputs=[x], cache_dir=tmp_path, measure_hardware=False,
        algorithms={"conv2d": "autotune"},
    )  # fmt: skip
    with torch.inference_mode():
        ref = m(x)
    _close(opt(x), ref)
    return [r for r in opt.report().rows if r.op == "conv2d"]


@pytest.fixture(autouse=True)
def _fresh_memo():
    tuning.clear_memo()
    yield
    tuning.clear_memo()


def test_tunes_each_problem_once_and_reuses_the_stored_decisions(monkeypatch, tmp_path):
    tuned = []
    real_best_of = tuning.best_of

    def counting_best_of(candidates, *a, **k):
        tuned.append(sorted(candidates))
        return real_best_of(candidates, *a, **k)

    monkeypatch.setattr(tuning, "best_of", counting_best_of)
    monkeypatch.setattr(tuning, "TIMER", _fake_timer)
    rows = _optimize(tmp_path)
    assert [r.algorithm for r in rows] == ["im2col_gemm"] * 4
    assert tuned.pop() == ["default", "tuned"]  # the whole plans, last (network_choice)
    assert len(tuned) == 3  # c2 and c3 are one problem
    assert all(r.reason.startswith("tuned: ") for r in rows)
    assert "same problem tuned before" in rows[2].reason
    assert "winograd_f4x4" in rows[1].reason and "pruned after round" in rows[1].reason
    stored = json.loads((tmp_path / "tuning" / "decisions.json").read_text())
    layers = {k: d for k, d in stored.items() if "network" not in d["problem"]}
    assert len(stored) == 4 and len(layers) == 3  # and the whole network's choice
    assert {d["algorithm"] for d in layers.values()} == {"im2col_gemm"}
    assert all(d["hardware"] and d["version"] == middleware.__version__ for d in stored.values())

    tuning.clear_memo()  # as a new process would start: only the file
    monkeypatch.setattr(tuning, "TIMER", _no_timing)
    tuned.clear()
    rows = _optimize(tmp_path)
    assert tuned == [] and [r.algorithm for r in rows] == ["im2col_gemm"] * 4
    assert all(r.reason.startswith("tuned: cached") for r in [rows[0], rows[1], rows[3]])


def test_a_fresh_process_times_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(tuning, "TIMER", _fake_timer)
    first = _optimize(tmp_path)
    script = MODEL_SRC + textwrap.dedent(
        f"""
        import middleware
        from middleware.backends.vendor import tuning

        def no_timing(name, run):
            raise SystemExit("timed " + name)

        tuning.TIMER = no_timing
        torch.manual_seed(1)
        x = torch.randn(2, 3, 12, 10)
        opt = middleware.optimize(
            make(), example_inputs=[x], cache_dir={str(tmp_path)!r}, measure_hardware=False,
            algorithms={{"conv2d": "autotune"}}, strict=True,
        )
        opt(x)
        for r in opt.report().rows:
            if r.op == "conv2d":
                print(r.algorithm, "|", r.reason)
        """
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert [ln.split(" | ")[0] for ln in lines] == [r.algorithm for r in first]
    assert all(ln.split(" | ")[1].startswith("tuned: ") for ln in lines)
    assert sum("tuned: cached" in ln for ln in lines) == 3


@pytest.fixture
def off_by_one_percent():
    def scaled(x, weight, bias, stride, padding, dilation, groups):
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups) * 1.01

    middleware.register_algorithm(
        "conv2d", "sloppy", scaled, exact=False, error_bound=1e-3, description="1% off"
    )
    yield
    middleware.unregister_algorithm("conv2d", "sloppy")


def test_an_approximate_candidate_beyond_its_bound_is_rejected(
    monkeypatch, tmp_path, off_by_one_percent
):
    monkeypatch.setattr(tuning, "TIMER", lambda name, run: 0.1 if name == "sloppy" else 1.0)
    rows = _optimize(tmp_path)  # compares with the original: sloppy never ran
    assert "sloppy" not in {r.algorithm for r in rows}
    assert all("sloppy rejected (error 1.0e-02 of scale)" in r.reason for r in rows)


def test_autotune_is_a_known_name_and_not_registrable():
    assert "autotune" in alg.algorithm_names("conv2d")
    with pytest.raises(middleware.OptionsError):
        middleware.register_algorithm("conv2d", "autotune", F.conv2d)


def test_the_cache_command_lists_and_clears_the_decisions(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tuning, "TIMER", _fake_timer)
    _optimize(tmp_path)
    assert main(["cache", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "4 tuning decision(s)" in out and " network " in out  # 3 layers, 1 network
    assert "conv2d 2x16x12x10 -> 2x16x12x10 w 16x16x3x3 float32 nhwc: im2col_gemm" in out
    assert main(["cache", "--cache-dir", str(tmp_path), "--clear-tuning"]) == 0
    assert "cleared 4 tuning decision(s)" in capsys.readouterr().out
    assert not (tmp_path / "tuning" / "decisions.json").exists()
    monkeypatch.setattr(tuning, "TIMER", _no_timing)
    with pytest.warns(UserWarning, match="was timed"):  # memo cleared too: it measures again
        _optimize(tmp_path)


def test_autotune_respects_the_memory_cap(monkeypatch, tmp_path):
    monkeypatch.setattr(tuning, "TIMER", _fake_timer)
    m = _ns["make"]()
    x = torch.randn(2, 3, 12, 10)
    opt = middleware.optimize(
        m, example_inputs=[x], cache_dir=tmp_path, measure_hardware=False,
        algorithms={"conv2d": "autotune"}, max_extra_param_bytes=0,
    )  # fmt: skip
    with torch.inference_mode():
        _close(opt(x), m(x))
    assert {r.algorithm for r in opt.report().rows if r.op == "conv2d"} == {"vendor"}


def _optimized_report(tmp_path, selector, **options):
    """The test model optimized with ``selector`` for conv2d (and ``options``), checked
    against the original; its report."""
    m = _ns["make"]()
    torch.manual_seed(1)
    x = torch.randn(2, 3, 12, 10)
    opt = middleware.optimize(
        m, example_inputs=[x], cache_dir=tmp_path, measure_hardware=False,
        algorithms={"conv2d": selector}, **options,
    )  # fmt: skip
    with torch.inference_mode():
        _close(opt(x), m(x))
    return opt.report()


def _optimize_with(tmp_path, selector):
    return [r for r in _optimized_report(tmp_path, selector).rows if r.op == "conv2d"]


def test_auto_without_stored_decisions_is_the_default_and_times_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(tuning, "TIMER", _no_timing)
    monkeypatch.setattr(tuning, "best_of", lambda *a, **k: pytest.fail("auto tuned"))
    rows = _optimize_with(tmp_path, "auto")
    default = _optimize_with(tmp_path / "default", "default")
    assert [r.algorithm for r in rows] == [r.algorithm for r in default] == ["vendor"] * 4
    for r in rows:
        assert (
            r.reason
            == "auto: no stored tuning decision for this problem size; the default rule: vendor"
        )
    assert not (tmp_path / "tuning" / "decisions.json").exists()


def test_auto_uses_the_stored_decision_per_problem_else_the_default(monkeypatch, tmp_path):
    """After autotuning (the fake timer makes im2col_gemm the fastest), "auto" in a new
    process takes each stored decision without timing; a problem whose decision is gone
    gets the default rule, and its row says so."""
    monkeypatch.setattr(tuning, "TIMER", _fake_timer)
    tuned = _optimize(tmp_path)
    assert [r.algorithm for r in tuned] == ["im2col_gemm"] * 4
    path = tmp_path / "tuning" / "decisions.json"
    stored = json.loads(path.read_text())
    # forget the 1x1 conv's decision (c4: 16 -> 32 channels)
    (one_by_one,) = [
        k for k, d in stored.items() if d["problem"].get("weight_shape", [0] * 4)[2:] == [1, 1]
    ]
    del stored[one_by_one]
    path.write_text(json.dumps(stored))
    tuning.clear_memo()  # as a new process would start: only the file
    monkeypatch.setattr(tuning, "TIMER", _no_timing)
    rows = _optimize_with(tmp_path, "auto")
    assert [r.algorithm for r in rows] == ["im2col_gemm"] * 3 + ["vendor"]
    for r in rows[:2]:
        assert r.reason.startswith("auto: stored decision (in the cache directory): "), r
    # c3 is c2's problem: the decision c2 read from the file is answered from the memo
    assert rows[2].reason.startswith("auto: stored decision (in this process): ")
    assert all("im2col_gemm best of" in r.reason for r in rows[:3])
    assert rows[3].reason.startswith("auto: no stored tuning decision for this problem size")
    assert json.loads(path.read_text()).keys() == stored.keys()  # auto stores nothing
    # within the process the memo answers: same algorithms, "in this process"
    rows = _optimize_with(tmp_path, "auto")
    assert rows[0].reason.startswith("auto: stored decision (in this process): ")


def test_auto_is_a_known_name_and_not_registrable():
    assert "auto" in alg.algorithm_names("conv2d")
    with pytest.raises(middleware.OptionsError):
        middleware.register_algorithm("conv2d", "auto", F.conv2d)


def test_auto_falls_back_to_the_default_rule_within_the_memory_cap(monkeypatch, tmp_path):
    """No decision stored: the default's measured rule decides (Winograd F(4x4) on a 64->64
    layer once its pixel threshold is met), and max_extra_param_bytes keeps it out as it does for
    the default."""
    from fusion_helpers import conv_graph, hardware

    from middleware.backends.vendor import winograd as wg
    from middleware.options import Options

    monkeypatch.setattr(tuning, "TIMER", _no_timing)
    monkeypatch.setattr(wg, "MIN_PIXELS", 1)
    g, node = conv_graph((1, 64, 8, 8), (64, 64, 3, 3), "nhwc", padding=1, activation="relu")
    cpu = torch.device("cpu")
    opts = Options(cache_dir=tmp_path, algorithms={"conv2d": "auto"})
    choice = alg.choose(g, node, cpu, opts, hardware())
    assert choice.algorithm == "winograd_f4x4"
    assert choice.reason == (
        "auto: no stored tuning decision for this problem size; "
        "the default rule: winograd F(4x4,3x3)"
    )
    capped = Options(cache_dir=tmp_path, algorithms={"conv2d": "auto"}, max_extra_param_bytes=0)
    choice = alg.choose(g, node, cpu, capped, hardware())
    assert choice.algorithm == "vendor" and choice.reason.endswith("the default rule: vendor")


@pytest.fixture
def wrong_but_exact():
    """A user algorithm that claims to be exact and is 1% off: tuning must never pick it."""

    def scaled(x, weight, bias, stride, padding, dilation, groups):
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups) * 1.01

    middleware.register_algorithm("conv2d", "wrong", scaled, description="claims exact")
    yield
    middleware.unregister_algorithm("conv2d", "wrong")


def test_an_exact_candidate_that_disagrees_with_the_vendor_is_rejected(
    monkeypatch, tmp_path, wrong_but_exact
):
    monkeypatch.setattr(tuning, "TIMER", lambda name, run: 0.1 if name == "wrong" else 1.0)
    rows = _optimize(tmp_path)  # compares with the original: "wrong" never ran
    assert "wrong" not in {r.algorithm for r in rows}
    assert all("wrong rejected (error 1.0e-02 of scale)" in r.reason for r in rows)


def test_the_tuning_budget_stops_timing_and_the_rest_take_the_default(monkeypatch, tmp_path):
    timed = []

    def slow_timer(name, run):
        run()
        timed.append(name)
        return 1.0

    clock = [0.0]

    def fake_clock():  # every call of perf_counter advances 0.2 s
        clock[0] += 0.2
        return clock[0]

    monkeypatch.setattr(tuning, "TIMER", slow_timer)
    monkeypatch.setattr(alg.time, "perf_counter", fake_clock)
    m = _ns["make"]()
    x = torch.randn(2, 3, 12, 10)
    opt = middleware.optimize(
        m, example_inputs=[x], cache_dir=tmp_path, measure_hardware=False,
        algorithms={"conv2d": "autotune"}, tune_budget_s=0.1,
    )  # fmt: skip
    with torch.inference_mode():
        _close(opt(x), m(x))
    rows = [r for r in opt.report().rows if r.op == "conv2d"]
    assert rows[0].reason.startswith("tuned: ")  # the first layer spends the budget
    for r in rows[1:]:
        assert "not tuned: the tuning budget (tune_budget_s=0.1) was spent" in r.reason
        assert r.algorithm in ("vendor", "winograd_f4x4")
    stored = json.loads((tmp_path / "tuning" / "decisions.json").read_text())
    assert len(stored) == 1  # only the tuned layer's decision is kept
    with pytest.raises(middleware.OptionsError, match="tune_budget_s=-1"):
        middleware.optimize(m, cache_dir=tmp_path, tune_budget_s=-1)


def test_the_session_counts_the_layers_to_tune(tmp_path):
    from fusion_helpers import conv_graph

    g, _ = conv_graph((1, 3, 8, 8), (4, 3, 3, 3), "nhwc", padding=1)
    opts = Options(cache_dir=tmp_path, algorithms={"conv2d": "autotune"})
    assert alg._layers_to_tune(g, opts) == 1
    assert alg._layers_to_tune(g, Options(algorithms={"conv2d": ["autotune"]})) == 1
    assert alg._layers_to_tune(g, Options(algorithms={"conv2d": ["vendor"]})) == 0
    assert alg._layers_to_tune(g, Options(algorithms={"conv2d": lambda layer: "autotune"})) == 0
    s = tuning.Session(budget_s=1.0, layers=2)
    s.tuned(0.6, "a")
    assert not s.over_budget()
    s.tuned(0.6, "b")
    assert s.over_budget() and s.done == 2


def test_the_default_takes_stored_decisions_and_times_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(tuning, "TIMER", _fake_timer)  # im2col_gemm wins every layer
    tuned = _optimize(tmp_path)
    assert {r.algorithm for r in tuned} == {"im2col_gemm"}
    tuning.clear_memo()
    monkeypatch.setattr(tuning, "TIMER", _no_timing)
    m = _ns["make"]()
    x = torch.randn(2, 3, 12, 10)
    opt = middleware.optimize(m, example_inputs=[x], cache_dir=tmp_path, measure_hardware=False)
    with torch.inference_mode():
        _close(opt(x), m(x))
    rows = [r for r in opt.report().rows if r.op == "conv2d"]
    assert [r.algorithm for r in rows] == ["im2col_gemm"] * 4
    assert all(r.reason.startswith("default: stored tuning decision") for r in rows)
    # another cache directory has no decisions: the rule (here, the vendor call)
    fresh = middleware.optimize(
        m, example_inputs=[x], cache_dir=tmp_path / "other", measure_hardware=False
    )
    assert {r.algorithm for r in fresh.report().rows if r.op == "conv2d"} == {"vendor"}


def test_a_stored_approximate_decision_respects_winograd_off(monkeypatch, tmp_path):
    monkeypatch.setattr(
        tuning, "TIMER", lambda name, run: 0.1 if name in ("winograd_f4x4", "tuned") else 1.0
    )
    tuned = _optimize(tmp_path)
    assert "winograd_f4x4" in {r.algorithm for r in tuned}
    tuning.clear_memo()
    monkeypatch.setattr(tuning, "TIMER", _no_timing)
    m = _ns["make"]()
    x = torch.randn(2, 3, 12, 10)
    opt = middleware.optimize(
        m, example_inputs=[x], cache_dir=tmp_path, measure_hardware=False, winograd=False
    )
    rows = [r for r in opt.report().rows if r.op == "conv2d"]
    assert "winograd_f4x4" not in {r.algorithm for r in rows}
    with torch.inference_mode():
        _close(opt(x), m(x))


def test_a_stored_user_algorithm_is_not_the_default(monkeypatch, tmp_path, wrong_but_exact):
    import torch.nn.functional as F_

    def fast(x, weight, bias, stride, padding, dilation, groups):
        return F_.conv2d(x, weight, bias, stride, padding, dilation, groups)

    middleware.register_algorithm("conv2d", "fast_user", fast)
    try:
        monkeypatch.setattr(
            tuning, "TIMER", lambda name, run: 0.1 if name in ("fast_user", "tuned") else 1.0
        )
        tuned = _optimize(tmp_path)
        assert {r.algorithm for r in tuned} == {"fast_user"}
        tuning.clear_memo()
        m = _ns["make"]()
        x = torch.randn(2, 3, 12, 10)
        opt = middleware.optimize(m, example_inputs=[x], cache_dir=tmp_path, measure_hardware=False)
        assert "fast_user" not in {r.algorithm for r in opt.report().rows if r.op == "conv2d"}
    finally:
        middleware.unregister_algorithm("conv2d", "fast_user")


def test_best_of_runs_before_ahead_of_every_timed_call():
    events: list[str] = []

    def timer(name, run):
        events.append(f"time {name}")
        return {"a": 1.0, "b": 1.1}[name]

    tuning.best_of(
        {"a": lambda: None, "b": lambda: None},
        timer,
        rounds=3,
        before=lambda: events.append("before"),
    )
    timed = [i for i, e in enumerate(events) if e.startswith("time")]
    assert len(timed) == 6 and all(events[i - 1] == "before" for i in timed)


def test_cpu_tuning_times_each_candidate_with_cold_weights_and_warm_inputs(monkeypatch, tmp_path):
    """tuned_choice evicts the private caches and reads the layer's inputs before every
    timed call (cpu_context), as the network runs the layer: weights timed back to back
    stay in L2 and favour the candidate with the largest transformed weights."""
    contexts: list[tuple[int, tuple]] = []
    calls = {"before": 0, "timed": 0}
    real = tuning.cpu_context

    def spy(nbytes, inputs):
        contexts.append((nbytes, inputs))
        hook = real(nbytes, inputs)

        def before():
            calls["before"] += 1
            hook()

        return before

    whole = {"plans": False}
    real_best_of = tuning.best_of

    def best_of(candidates, *a, **k):  # the network-level choice times whole plans
        whole["plans"] = "tuned" in candidates
        return real_best_of(candidates, *a, **k)

    def timer(name, run):
        calls["timed"] += not whole["plans"]
        return _fake_timer(name, run)

    monkeypatch.setattr(tuning, "best_of", best_of)
    monkeypatch.setattr(tuning, "cpu_context", spy)
    monkeypatch.setattr(tuning, "TIMER", timer)
    rows = _optimize(tmp_path)
    assert [r.algorithm for r in rows] == ["im2col_gemm"] * 4
    assert len(contexts) == 3  # one per distinct problem
    hw = middleware.hardware.detect("cpu", tmp_path, measure=False)
    for nbytes, inputs in contexts:
        assert nbytes == hw.l2_bytes * hw.cores
        # the activation only (batch 2): the weights are to stay beyond L2
        assert len(inputs) == 1 and tuple(inputs[0].shape[:1]) == (2,)
    assert calls["before"] == calls["timed"] > 0


def test_the_timing_method_is_part_of_the_decision_key(monkeypatch):
    p = {"input_shape": (1, 16, 8, 8)}
    k = tuning.decision_key(p, ["vendor"], "cpu:x:2")
    monkeypatch.setattr(tuning, "METHOD", "back-to-back")
    assert k != tuning.decision_key(p, ["vendor"], "cpu:x:2")


NETWORK_TIMES = {"tuned": 5.0, "default": 1.0}


def _network_timer(name, run):
    """Layer candidates as FAKE_TIMES; whole plans: the per-layer tuned plan slower than
    the default's, as on a network whose isolated layer timings mislead."""
    run()
    return NETWORK_TIMES.get(name, FAKE_TIMES.get(name, 3.0))


def test_autotune_keeps_the_faster_whole_plan_and_stores_the_choice(monkeypatch, tmp_path):
    timed: list[list[str]] = []
    real_best_of = tuning.best_of

    def recording_best_of(candidates, *a, **k):
        timed.append(sorted(candidates))
        return real_best_of(candidates, *a, **k)

    monkeypatch.setattr(tuning, "best_of", recording_best_of)
    monkeypatch.setattr(tuning, "TIMER", _network_timer)
    report = _optimized_report(tmp_path, "autotune")
    # per layer im2col_gemm wins; as a whole the default's plan does, so it runs
    assert ["default", "tuned"] in timed
    assert [r.algorithm for r in report.rows if r.op == "conv2d"] != ["im2col_gemm"] * 4
    note = next(n for n in report.notes if n.startswith("network-level choice"))
    assert (
        "default best of 2 plans (median of rounds)" in note
        and "same plan: im2col_gemm = tuned" in note
    )
    winner = [r.algorithm for r in report.rows if r.op == "conv2d"]

    # a new process (the memo cleared), autotune or auto: the stored winner, nothing timed
    for sel in ("autotune", "auto"):
        tuning.clear_memo()
        monkeypatch.setattr(tuning, "TIMER", _no_timing)
        timed.clear()
        again = _optimized_report(tmp_path, sel)
        assert timed == [] and [r.algorithm for r in again.rows if r.op == "conv2d"] == winner
        assert any("network-level choice: cached; default best of" in n for n in again.notes)


def test_autotune_keeps_the_tuned_plan_when_it_is_faster_as_a_whole(monkeypatch, tmp_path):
    monkeypatch.setattr(tuning, "TIMER", _network_timer)
    monkeypatch.setitem(NETWORK_TIMES, "tuned", 0.5)
    report = _optimized_report(tmp_path, "autotune")
    assert [r.algorithm for r in report.rows if r.op == "conv2d"] == ["im2col_gemm"] * 4
    assert any(
        "network-level choice: tuned best of 2 plans (median of rounds)" in n for n in report.notes
    )


def test_a_plan_within_the_tie_of_the_default_does_not_replace_it(monkeypatch, tmp_path):
    """Whole plans spread 5-10% from process to process on a shared host: a plan faster
    than the default's by less than ``NETWORK_TIE`` leaves the default's running; one
    faster by more replaces it."""
    from middleware import pipeline

    monkeypatch.setattr(tuning, "TIMER", _network_timer)
    monkeypatch.setitem(NETWORK_TIMES, "tuned", pipeline.NETWORK_TIE * 1.0 + 0.01)
    report = _optimized_report(tmp_path, "autotune")
    assert [r.algorithm for r in report.rows if r.op == "conv2d"] != ["im2col_gemm"] * 4
    note = next(n for n in report.notes if n.startswith("network-level choice"))
    assert "default kept: tuned faster by only" in note and "2 plans (median" in note
    kept = [r.algorithm for r in report.rows if r.op == "conv2d"]
    # a new process builds the kept default from the stored decision, timing nothing
    tuning.clear_memo()
    monkeypatch.setattr(tuning, "TIMER", _no_timing)
    again = _optimized_report(tmp_path, "autotune")
    assert [r.algorithm for r in again.rows if r.op == "conv2d"] == kept
    assert any("network-level choice: cached; default kept" in n for n in again.notes)

    monkeypatch.setattr(tuning, "TIMER", _network_timer)
    tuning.clear_memo()
    monkeypatch.setitem(NETWORK_TIMES, "tuned", pipeline.NETWORK_TIE * 1.0 - 0.01)
    report = _optimized_report(tmp_path / "again", "autotune")
    assert [r.algorithm for r in report.rows if r.op == "conv2d"] == ["im2col_gemm"] * 4
    assert not any("the default kept" in n for n in report.notes)


def test_the_tie_keeps_the_default_plan_found_equal_to_the_tuned_one(monkeypatch, tmp_path):
    """Per layer the vendor call wins, so the tuned plan is the default's (stored under
    "tuned"); im2col_gemm on every layer is timed as a whole 2% faster: a tie, so the
    default's plan runs, and a new process rebuilds it from the stored decision."""
    whole = {"on": False}

    def timer(name, run):
        run()
        if name == "tuned":  # the whole plans are timed last
            whole["on"] = True
        if whole["on"]:
            return {"tuned": 1.0, "im2col_gemm": 0.98}.get(name, 3.0)
        return {"vendor": 1.0, "im2col_gemm": 1.02}.get(name, 3.0)

    monkeypatch.setattr(tuning, "TIMER", timer)
    report = _optimized_report(tmp_path, "autotune")
    rows = [r.algorithm for r in report.rows if r.op == "conv2d"]
    assert "im2col_gemm" not in rows
    note = next(n for n in report.notes if n.startswith("network-level choice"))
    assert "tuned kept: im2col_gemm faster by only 2.0%" in note
    assert "same plan: default = tuned" in note
    tuning.clear_memo()
    monkeypatch.setattr(tuning, "TIMER", _no_timing)
    again = _optimized_report(tmp_path, "autotune")
    assert [r.algorithm for r in again.rows if r.op == "conv2d"] == rows


def test_best_of_by_median_does_not_crown_a_lucky_round():
    """A candidate fast once and slow otherwise wins by its best time, not by its
    median (the statistic whole plans are judged by)."""
    times = {"steady": iter([1.0] * 5), "lucky": iter([0.5, 1.4, 1.5, 1.4, 1.6])}

    def timer(name, run):
        return next(times[name])

    cands = {"steady": lambda: None, "lucky": lambda: None}
    out = tuning.best_of(cands, timer, rounds=5, pruning_speedup=9.0, statistic="median")
    assert out.best == "steady" and out.times == {"steady": 1.0, "lucky": 1.4}
    times = {"steady": iter([1.0] * 5), "lucky": iter([0.5, 1.4, 1.5, 1.4, 1.6])}
    assert tuning.best_of(cands, timer, rounds=5, pruning_speedup=9.0).best == "lucky"
    with pytest.raises(ValueError, match="statistic"):
        tuning.best_of(cands, timer, statistic="mean")


def test_best_of_by_median_prunes_by_the_best_time():
    """After two rounds a median is a mean: one slow first round must not prune the
    candidate that is fastest in every later round."""
    times = {
        "default": iter([1.3, 0.95, 0.95, 0.95, 0.95]),
        "vendor": iter([1.0] * 5),
        "f2": iter([1.0, 1.0, 1.2, 1.2, 1.2]),
    }
    out = tuning.best_of(
        {n: (lambda: None) for n in times},
        lambda name, run: next(times[name]),
        rounds=5,
        prune_after_round=2,
        pruning_speedup=1.1,
        statistic="median",
    )
    assert out.best == "default" and "default" not in out.pruned
    assert out.times["default"] == 0.95 and out.times["f2"] == 1.2


def test_static_choices_far_from_the_tuned_estimate_are_not_built(monkeypatch, tmp_path):
    from middleware import pipeline

    built: list[str] = []
    real = pipeline._conv_selection

    def spy(options, name, mapping=None):
        built.append(name if mapping is None else sorted(set(mapping.values())))
        return real(options, name, mapping)

    monkeypatch.setattr(pipeline, "_conv_selection", spy)
    monkeypatch.setattr(tuning, "TIMER", _network_timer)
    _optimized_report(tmp_path, "autotune")
    # vendor (2x im2col_gemm's layer times) and winograd_f4x4 (10x) are beyond the margin;
    # im2col_gemm everywhere is the tuned plan itself (not built again)
    assert built == ["default"]


def test_a_static_candidate_keeps_an_approximate_algorithm_off_the_layers_it_failed(
    monkeypatch, tmp_path
):
    """winograd_f4x4 rejected on a layer for its error (its bound made 0 here) must not run
    there in the plan "winograd_f4x4 everywhere", even where that plan wins as a whole."""
    monkeypatch.setattr(tuning, "TIMER", _network_timer)
    monkeypatch.setitem(FAKE_TIMES, "winograd_f4x4", 1.05)  # within the margin
    monkeypatch.setitem(NETWORK_TIMES, "winograd_f4x4", 0.1)  # and the fastest plan
    strict = dataclasses.replace(alg.WINOGRAD_F4X4, error_bound=0.0)  # rejected everywhere
    monkeypatch.setitem(alg.ALGORITHMS["conv2d"], "winograd_f4x4", strict)
    report = _optimized_report(tmp_path, "autotune")
    rows = [r for r in report.rows if r.op == "conv2d"]
    assert "winograd_f4x4" not in [r.algorithm for r in rows]
    # rejected on every layer: no layer of any candidate plan runs it
    assert not any("winograd_f4x4" in n for n in report.notes), report.notes


def test_a_network_without_conv2d_times_no_plans(monkeypatch, tmp_path):
    monkeypatch.setattr(tuning, "TIMER", _no_timing)
    m = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.MaxPool2d(2)).eval()
    x = torch.randn(2, 3, 8, 8)
    opt = middleware.optimize(
        m, example_inputs=[x], cache_dir=tmp_path, measure_hardware=False,
        algorithms={"conv2d": "autotune"},
    )  # fmt: skip
    _close(opt(x), m(x))
    assert not any("network-level" in n for n in opt.report().notes)
    assert not (tmp_path / "tuning" / "decisions.json").exists()


def test_a_candidate_plan_that_fails_to_run_is_dropped(monkeypatch, tmp_path):
    from middleware import pipeline

    real = pipeline._runner

    def runner(compiled, inputs):
        run = real(compiled, inputs)
        if any(r.algorithm == "vendor" for r in compiled.report.rows if r.op == "conv2d"):

            def broken():
                raise RuntimeError("a candidate that cannot run")

            return broken
        return run

    monkeypatch.setattr(pipeline, "_runner", runner)
    monkeypatch.setattr(tuning, "TIMER", _network_timer)
    report = _optimized_report(tmp_path, "autotune")  # the default plan (vendor) fails
    assert [r.algorithm for r in report.rows if r.op == "conv2d"] == ["im2col_gemm"] * 4
    assert any("network-level choice: the per-layer tuned plan" in n for n in report.notes)


def test_winograd_off_is_part_of_the_network_decision(monkeypatch, tmp_path):
    monkeypatch.setattr(tuning, "TIMER", _network_timer)
    _optimized_report(tmp_path, "autotune")
    stored = json.loads((tmp_path / "tuning" / "decisions.json").read_text())
    (net,) = [d for d in stored.values() if "network" in d["problem"]]
    assert net["problem"]["winograd"] is True and net["plan"] is None  # the default won


def test_building_the_plan_does_not_spend_the_tuning_budget(monkeypatch, tmp_path):
    """``tune_budget_s`` bounds the seconds spent tuning layers, not the plan's build: a
    build that outlasts the budget (densenet121 at batch 1 on the Intel host: 45 s of cold
    kernel compiles and 18 s of tuning against the 60 s default) still gets its
    network-level choice, so that a second process reads it and times nothing. The clock
    jumps 1000 s once the tuned plan is built, as after a long compile."""
    import time

    from middleware import pipeline

    monkeypatch.setattr(tuning, "TIMER", _network_timer)
    real_build, real_clock = pipeline.compile_graph, time.perf_counter
    jump = [0.0]

    def long_build(*args, **kwargs):
        compiled = real_build(*args, **kwargs)
        jump[0] = 1000.0
        return compiled

    monkeypatch.setattr(pipeline, "compile_graph", long_build)
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + jump[0])
    report = _optimized_report(tmp_path, "autotune", tune_budget_s=60.0)
    note = next(n for n in report.notes if n.startswith("network-level choice"))
    assert "default best of 2 plans" in note, note
