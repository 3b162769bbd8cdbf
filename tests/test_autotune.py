"""Autotuning's mechanics (backends/vendor/tuning.py, algorithms.tuned_choice): pruning
with a fake timer, identical problem sizes tuned once, decisions persisted and reused by a
cleared memo and by a fresh process without timing, approximate candidates checked against
the vendor result. No test asserts a measured time; the outputs are compared against the
original module with a tolerance relative to the output's scale."""

from __future__ import annotations

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

ROOT = Path(__file__).resolve().parents[1]
FAKE_TIMES = {"im2col_gemm": 1.0, "vendor": 2.0, "winograd_f4x4": 10.0}


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
    assert len(tuned) == 3  # c2 and c3 are one problem
    assert all(r.reason.startswith("tuned: ") for r in rows)
    assert "same problem tuned before" in rows[2].reason
    assert "winograd_f4x4" in rows[1].reason and "pruned after round" in rows[1].reason
    stored = json.loads((tmp_path / "tuning" / "decisions.json").read_text())
    assert len(stored) == 3 and {d["algorithm"] for d in stored.values()} == {"im2col_gemm"}
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
    assert "3 tuning decision(s)" in out
    assert "conv2d 2x16x12x10 -> 2x16x12x10 w 16x16x3x3 float32 nhwc: im2col_gemm" in out
    assert main(["cache", "--cache-dir", str(tmp_path), "--clear-tuning"]) == 0
    assert "cleared 3 tuning decision(s)" in capsys.readouterr().out
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
        algorithms={"conv2d": "autotune"}, max_extra_bytes=0,
    )  # fmt: skip
    with torch.inference_mode():
        _close(opt(x), m(x))
    assert {r.algorithm for r in opt.report().rows if r.op == "conv2d"} == {"vendor"}
