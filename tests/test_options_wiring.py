"""Options reach the stages that use them through ``optimize()``: ``Options(hardware=...)``
the classification (``compile_graph`` calls ``hardware.for_options``), the hardware
figures the report's notes, ``Options(check_memory=...)`` and its environment default
the buffer planner."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import middleware


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2))
    return m.eval(), torch.randn(2, 4, 8, 8)


def test_options_hardware_pin_reaches_the_classification(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MIDDLEWARE_HARDWARE", raising=False)
    m, x = _model()
    om = middleware.optimize(
        m, example_inputs=(x,), fuse=False, hardware={"peak_gflops": 40000, "bandwidth_gbs": 4}
    )
    assert {r.op: r.bound for r in om.report().rows}["conv2d"] == "io"


def test_report_shows_the_hardware_figures() -> None:
    m, x = _model()
    om = middleware.optimize(m, example_inputs=(x,), measure_hardware=False)
    assert any("GFLOP/s" in note and "classification" in note for note in om.report().notes)


def test_options_check_memory_reaches_the_planner(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MIDDLEWARE_CHECK_MEMORY", raising=False)
    m, x = _model()
    om = middleware.optimize(
        m, example_inputs=(x,), measure_hardware=False, fuse=False, check_memory=True
    )
    assert om.plan.arena is not None  # (the check has nothing to guard without an arena)
    assert any(getattr(step[0], "checks_memory", False) for step in om.plan._program)


def test_environment_check_memory_reaches_the_planner(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIDDLEWARE_CHECK_MEMORY", "1")
    m, x = _model()
    om = middleware.optimize(m, example_inputs=(x,), measure_hardware=False, fuse=False)
    assert om.plan.arena is not None
    assert any(getattr(step[0], "checks_memory", False) for step in om.plan._program)
    with torch.no_grad():
        torch.testing.assert_close(om(x), m(x), rtol=1e-5, atol=1e-5)
