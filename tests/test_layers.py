"""The package's layering (pyproject.toml [tool.importlinter]) and the backend registry the
pipeline asks instead of branching on the device."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from middleware import backends
from middleware.backends.interface import Backend, Unit
from middleware.backends.x86 import IspcBackend, X86Backend
from middleware.enums import Bound, RunsAs
from middleware.graph import Node

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter not installed")
def test_import_contracts_hold() -> None:
    """Layers (each stage imports only those below it) and no cycle between siblings."""
    r = subprocess.run(["lint-imports"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_the_pipeline_asks_the_registry_not_the_device() -> None:
    source = (ROOT / "middleware" / "pipeline.py").read_text()
    for branch in ('"cuda"', '"cpu"', ".type ==", ".type !=", ".type in"):
        assert branch not in source, branch
    assert "backend_for(device)" in source


def test_registry_by_name_and_device() -> None:
    assert isinstance(backends.get_backend("x86"), X86Backend)
    assert isinstance(backends.get_backend("ispc"), IspcBackend)
    cpu = backends.backend_for("cpu")
    assert isinstance(cpu, X86Backend) and isinstance(cpu, Backend)
    assert (cpu.device_type, cpu.slices_batch) == ("cpu", True)
    with pytest.raises(ValueError, match="no backend runs on device 'meta'"):
        backends.backend_for("meta")
    with pytest.raises(ValueError, match="unknown backend 'nope'; backends are: .*x86"):
        backends.get_backend("nope")


def test_register_backend_makes_a_device_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "BACKENDS", dict(backends.BACKENDS))
    monkeypatch.setattr(backends, "DEVICE_DEFAULTS", dict(backends.DEVICE_DEFAULTS))

    class Other(X86Backend):
        name = "other"

    backends.register_backend("other", Other, device_type="cpu")
    assert type(backends.backend_for(torch.device("cpu"))) is Other
    assert isinstance(backends.get_backend("x86"), X86Backend)


def test_records_hold_enums_and_compare_as_strings() -> None:
    n = Node("a", "relu", ("x",), ("y",), bound="io")
    assert n.bound is Bound.IO and n.bound == "io" and f"{n.bound:<4}|" == "io  |"
    u = Unit("a", "generated", abs, ("x",), ("y",), ("a",))
    assert u.runs_as is RunsAs.GENERATED and u.runs_as == "generated"
    with pytest.raises(ValueError):
        Node("b", "relu", ("x",), ("z",), bound="fast")


def test_cuda_backend_wraps_lowering_and_graph_replay() -> None:
    """The CUDA backend through the interface, without a GPU: its lowering (batch norms
    as a multiply-add), no "auto" batch slicing, and the plan wrapped for CUDA-graph replay
    only when Options(cuda_graphs=True) (captured later: no inputs given here)."""
    from fusion_helpers import bn, build_chain

    from middleware.backends.cuda.graphs import CudaGraphPlan
    from middleware.options import Options

    cuda = backends.backend_for("cuda:0")
    assert isinstance(cuda, Backend) and (cuda.name, cuda.slices_batch) == ("cuda", False)
    g = build_chain((2, 4, 5, 5), "nchw", [bn(), ("relu", {})], seed=1)
    lowered = cuda.lower(g, Options(device="cuda"))
    assert [n.op for n in lowered.nodes()] == ["mul", "add", "relu"]
    x = torch.randn(2, 4, 5, 5)
    torch.testing.assert_close(lowered.evaluate(x), g.evaluate(x), rtol=1e-5, atol=1e-5)
    plan = object()
    assert cuda.finish(plan, Options(device="cuda", cuda_graphs=False), None) is plan
    wrapped = cuda.finish(plan, Options(device="cuda"), None)
    assert isinstance(wrapped, CudaGraphPlan) and wrapped.plan is plan and wrapped.graphed is None
