"""The group index (backends/x86/index.py): a warm build in a new process loads every
generated kernel without scheduling or compiling and matches PyTorch; the key changes with a
batch-norm parameter's value, an attribute or a shape (no stale kernel); a corrupt index
entry falls back to the full path and is rewritten."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from fusion_helpers import bn, build_chain, hardware, maxpool, random_inputs

import middleware
from middleware.backends.x86 import X86Backend, index
from middleware.options import Options

ATOL = RTOL = 1e-5

MODEL = """
import torch, torch.nn as nn

def model():
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(8, 8, 1), nn.ReLU(), nn.BatchNorm2d(8), nn.Hardtanh(), nn.AvgPool2d(2),
    )
    with torch.no_grad():
        for bn in (m[2], m[7]):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-1, 1)
    return m.eval()
"""

CHILD = """
import sys, torch
import middleware
import middleware.passes.schedule as sched
import middleware.backends.x86.backend as backend
from middleware.backends.cache import KernelCache

def refuse(*a, **k):
    raise AssertionError("warm build scheduled or compiled")

sched.schedule_group = backend.schedule_group = refuse
KernelCache._compile = refuse
ns = {}
exec(open(sys.argv[2]).read(), ns)
m = ns["model"]()
x = torch.randn(2, 3, 17, 19, generator=torch.Generator().manual_seed(1))
opt = middleware.optimize(m, "cpu", example_inputs=(x,), cache_dir=sys.argv[1], strict=True, measure_hardware=False)
with torch.no_grad():
    ref, got = m(x), opt(x)
torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
print("ok")
"""


def _model():
    ns: dict = {}
    exec(MODEL, ns)
    return ns["model"]()


def test_warm_build_in_new_process_neither_schedules_nor_compiles(tmp_path):
    cache = tmp_path / "cache"
    m = _model()
    x = torch.randn(2, 3, 17, 19, generator=torch.Generator().manual_seed(1))
    opt = middleware.optimize(
        m, "cpu", example_inputs=(x,), cache_dir=cache, strict=True, measure_hardware=False
    )
    with torch.no_grad():
        torch.testing.assert_close(opt(x), m(x), atol=ATOL, rtol=RTOL)
    records = [json.loads(p.read_text()) for p in (cache / "index").glob("*.json")]
    assert any(r["kind"] == "kernel" for r in records)
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "child.py").write_text(CHILD)
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "child.py"), str(cache), str(tmp_path / "model.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def _key(g, opts=None):
    opts = opts or Options(cache_dir=Path("/nonexistent"))
    return index.group_key(g, [n.name for n in g.nodes()], opts, hardware())


STEPS = [bn(), ("leaky_relu", {"negative_slope": 0.1}), maxpool(3, 2, 1)]


def test_key_changes_with_param_value_attr_shape_and_options():
    base = build_chain((2, 5, 9, 7), "nhwc", STEPS)
    k0 = _key(base)
    assert k0 == _key(build_chain((2, 5, 9, 7), "nhwc", STEPS))  # deterministic
    changed = build_chain((2, 5, 9, 7), "nhwc", STEPS)
    p = "layer0_batch_norm.weight"
    changed.params[p] = changed.params[p].copy()
    changed.params[p][3] += np.float32(1e-3)
    assert _key(changed) != k0
    attr = [bn(), ("leaky_relu", {"negative_slope": 0.2}), maxpool(3, 2, 1)]
    assert _key(build_chain((2, 5, 9, 7), "nhwc", attr)) != k0
    assert _key(build_chain((2, 5, 9, 8), "nhwc", STEPS)) != k0
    assert _key(build_chain((2, 5, 9, 7), "nchw", STEPS)) != k0
    other = Options(cache_dir=Path("/nonexistent"), layout="nchw")
    if other.codegen_key() != Options(cache_dir=Path("/nonexistent")).codegen_key():
        assert _key(base, other) != k0


def _run(g, cache):
    be = X86Backend()
    k = be.build(g, [n.name for n in g.nodes()], Options(cache_dir=cache), hardware())
    xs = random_inputs(g)
    ref = g.evaluate(*xs)
    ref = ref[0] if isinstance(ref, tuple | list) else ref
    torch.testing.assert_close(k.fn(*xs), ref, atol=ATOL, rtol=RTOL)
    return k


def test_changed_param_gets_its_own_kernel(tmp_path):
    g = build_chain((2, 5, 9, 7), "nhwc", STEPS)
    first = _run(g, tmp_path)
    assert first.schedule is not None
    assert _run(g, tmp_path).schedule is None  # indexed
    g2 = build_chain((2, 5, 9, 7), "nhwc", STEPS)
    p = "layer0_batch_norm.bias"
    g2.params[p] = g2.params[p] + np.float32(0.5)
    k2 = _run(g2, tmp_path)  # compared with the reference: a stale kernel would fail
    assert k2.schedule is not None and k2.source_path != first.source_path


def test_corrupt_index_entry_falls_back_to_full_path(tmp_path):
    g = build_chain((2, 5, 9, 7), "nhwc", STEPS)
    _run(g, tmp_path)
    (entry,) = (tmp_path / "index").glob("*.json")
    key = entry.stem
    for garbage in ("{not json", json.dumps({"format": 1, "key": key, "kind": "kernel"})):
        entry.write_text(garbage)
        index.forget(tmp_path, key)
        k = _run(g, tmp_path)
        assert k.schedule is not None  # the full path ran
        assert json.loads(entry.read_text())["kind"] == "kernel"  # and rewrote the entry
    # a record whose binary fails verification is not used either
    rec = json.loads(entry.read_text())
    rec["cache_key"] = "0" * 64
    entry.write_text(json.dumps(rec))
    index.forget(tmp_path, key)
    assert _run(g, tmp_path).schedule is not None
    assert _run(g, tmp_path).schedule is None
