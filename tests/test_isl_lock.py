"""islpy's shared context is not thread-safe: every backend entry point that schedules
(``can_run`` as well as ``build``) holds the one schedule lock while islpy runs."""

from __future__ import annotations

from typing import Any

import pytest
from fusion_helpers import bn, build_chain, hardware

from middleware.backends.x86 import backend as x86
from middleware.backends.x86.backend import IspcBackend, X86Backend
from middleware.options import Options


def _locked_schedule(seen: list[bool], real: Any) -> Any:
    def schedule(self: Any, *args: Any) -> Any:
        # RLock._is_owned: held by this thread (what a concurrent caller would wait on)
        seen.append(x86._SCHEDULE_LOCK._is_owned())
        return real(self, *args)

    return schedule


def test_x86_can_run_schedules_under_the_lock(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    g = build_chain((1, 3, 6, 6), "nchw", [bn(), ("relu", {})])
    seen: list[bool] = []
    monkeypatch.setattr(X86Backend, "schedule", _locked_schedule(seen, X86Backend.schedule))
    names = [n.name for n in g.nodes()]
    # no options: the index is not consulted, so can_run schedules
    assert X86Backend().can_run(g, names, hardware()) == (True, "")
    assert X86Backend().can_run(g, names, hardware(), Options(cache_dir=tmp_path))[0]
    assert seen and all(seen), seen


def test_ispc_can_run_schedules_under_the_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    g = build_chain((1, 3, 6, 6), "nchw", [bn(), ("relu", {})])
    seen: list[bool] = []
    monkeypatch.setattr(X86Backend, "schedule", _locked_schedule(seen, X86Backend.schedule))
    monkeypatch.setattr(x86.shutil, "which", lambda name: "/usr/bin/ispc")
    names = [n.name for n in g.nodes()]
    IspcBackend().can_run(g, names, hardware())
    assert len(seen) >= 2 and all(seen), seen
