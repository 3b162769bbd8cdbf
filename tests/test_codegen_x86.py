"""The x86 backend's stages and its integration in the compiler: generated source
structure, backend registry, ``optimize()`` running io groups as generated kernels, the
compile-failure path (fallback + warning + report reason; ``strict=True`` raises)."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
import torch.nn as nn
from fusion_helpers import bn, build_chain, check_reference, hardware, maxpool, random_inputs

import middleware
from middleware.backends import get_backend
from middleware.backends.x86 import X86Backend
from middleware.errors import CompileError
from middleware.options import Options


@pytest.fixture
def chain_graph():
    # a 3x3/1 window: its producer (batch-norm + ReLU) is materialised in per-tile scratch
    return build_chain((2, 5, 9, 7), "nhwc", [bn(), ("relu", {}), maxpool(3, 1, 0)])


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
    with torch.no_grad():
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2)
    return m.eval()


def test_source_header_names_layers_and_shapes(chain_graph):
    be = X86Backend()
    s = be.schedule(chain_graph, [n.name for n in chain_graph.nodes()], hardware())
    src = be.render(s)
    header = src.split("*/", 1)[0]
    for n in chain_graph.nodes():
        assert n.name.split("_")[0] in header or n.outputs[0] in header
        assert n.op in header
    assert "float32[2x5x9x7,nhwc]" in header
    assert "float32[2x5x7x5,nhwc]" in header
    assert "#pragma omp parallel" in src
    assert re.search(r"#pragma omp for collapse\(\d\)", src)
    # every innermost loop is a SIMD loop over the contiguous dim (c in NHWC)
    assert src.count("#pragma omp simd") >= len(s.stages)
    for m in re.finditer(r"#pragma omp simd\n\s*for \(int (\w+) =", src):
        assert m.group(1) == "c"
    assert "restrict" in src
    # scratch buffers are per thread and per tile, never the full intermediate
    scratch = [b for b in s.buffers if b.role == "scratch"]
    assert scratch and all(b.elements < 2 * 5 * 9 * 7 for b in scratch)
    # BN is folded into per-channel scale/shift constants named after the layer
    assert "layer0_batch_norm_scale" in src and "layer0_batch_norm_shift" in src


def test_nchw_simd_over_w():
    g = build_chain((2, 5, 9, 7), "nchw", [bn(), ("relu", {}), maxpool(3, 2, 1)])
    src = X86Backend().render(X86Backend().schedule(g, [n.name for n in g.nodes()], hardware()))
    loops = re.findall(r"#pragma omp simd\n\s*for \(int (\w+) =", src)
    assert loops and set(loops) == {"w"}


def test_registry_lists_backends():
    assert isinstance(get_backend("x86"), X86Backend)
    with pytest.raises(ValueError, match="x86"):
        get_backend("no-such-backend")


def test_cache_reuses_binary(chain_graph, tmp_path):
    be, hw = X86Backend(), hardware()
    names = [n.name for n in chain_graph.nodes()]
    k1 = be.build(chain_graph, names, Options(cache_dir=tmp_path), hw)
    k2 = be.build(chain_graph, names, Options(cache_dir=tmp_path), hw)
    assert k1.compiled and not k2.compiled
    assert k1.source_path == k2.source_path and k1.source_path.read_text().startswith("/*")


def test_optimize_runs_io_group_generated(tmp_path):
    m = _model()
    x = torch.randn(2, 3, 20, 17)
    opt = middleware.optimize(m, device="cpu", example_inputs=[x], cache_dir=tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), m(x), atol=1e-5, rtol=1e-5)
    # after the passes (batch-norm folded into the conv, ReLU merged into the max-pool) every
    # remaining I/O-bound node runs in a generated kernel; the conv runs in the vendor library
    # (the small 3->8 conv may itself be classified io: oneDNN runs it either way)
    rows = opt.report().rows
    io_rows = [r for r in rows if r.bound == "io" and r.op != "conv2d"]
    assert io_rows and all(r.runs_as == "generated" for r in io_rows), rows
    assert all(r.runs_as != "generated" for r in rows if r.op == "conv2d")


def test_fuse_false_turns_generation_off(tmp_path):
    m = _model()
    x = torch.randn(1, 3, 12, 12)
    opt = middleware.optimize(m, device="cpu", example_inputs=[x], cache_dir=tmp_path, fuse=False)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), m(x), atol=1e-5, rtol=1e-5)
    assert all(r.runs_as != "generated" for r in opt.report().rows)


@pytest.fixture
def broken_render(monkeypatch):
    original = X86Backend.render

    def render(self, schedule, hardware=None):
        return original(self, schedule, hardware) + "\n#error deliberately broken kernel\n"

    monkeypatch.setattr(X86Backend, "render", render)


def test_compile_failure_falls_back_with_warning(tmp_path, broken_render):
    m = _model()
    x = torch.randn(2, 3, 14, 11)
    with pytest.warns(RuntimeWarning, match=r"group .* failed to compile; source: .*kernel\.c"):
        opt = middleware.optimize(m, device="cpu", example_inputs=[x], cache_dir=tmp_path)
        with torch.no_grad():
            got = opt(x)
    with torch.no_grad():
        torch.testing.assert_close(got, m(x), atol=1e-5, rtol=1e-5)
    # after the passes the I/O-bound groups are the layout conversions and the merged
    # max-pool+ReLU; every one of them failed to compile and runs through the framework
    # (the small conv, io or not, runs in oneDNN and is not part of a group)
    rows = [r for r in opt.report().rows if r.bound == "io" and r.op != "conv2d"]
    assert any(r.op == "maxpool_relu" for r in rows), rows
    assert all(r.runs_as == "fallback" for r in rows)
    assert all("deliberately broken kernel" in r.reason for r in rows)


def test_strict_raises_compile_error(tmp_path, broken_render):
    m = _model()
    x = torch.randn(2, 3, 14, 11)
    with pytest.raises(CompileError) as info, torch.no_grad():
        opt = middleware.optimize(
            m, device="cpu", example_inputs=[x], cache_dir=tmp_path, strict=True
        )
        opt(x)
    e = info.value
    assert "deliberately broken kernel" in e.stderr
    assert "-fopenmp" in e.command and any(c.endswith("kernel.c") for c in e.command)
    assert e.source_path and e.source_path.endswith("kernel.c")


@pytest.mark.skipif(shutil.which("ispc") is None, reason="no ispc binary on PATH")
def test_ispc_backend(chain_graph, tmp_path):  # pragma: no cover - needs ispc
    be = get_backend("ispc")
    xs = random_inputs(chain_graph)
    k = be.build(
        chain_graph, [n.name for n in chain_graph.nodes()], Options(cache_dir=tmp_path), hardware()
    )
    ref = chain_graph.evaluate(*xs)
    torch.testing.assert_close(k.fn(*xs), ref, atol=1e-5, rtol=1e-5)
    schedule = k.schedule or be.schedule(
        chain_graph, [n.name for n in chain_graph.nodes()], hardware()
    )
    check_reference(schedule, dict(zip(chain_graph.inputs, xs, strict=True)), ref)


def test_c_kernel_and_reference_backend_agree(chain_graph, tmp_path):
    """The generated C and the reference backend run the same schedule (scratch with a
    halo, several tiles) to the same result as PyTorch."""
    names = [n.name for n in chain_graph.nodes()]
    be = X86Backend()
    s = be.schedule(chain_graph, names, hardware())
    assert len(s.stages) == 2
    k = be.build(chain_graph, names, Options(cache_dir=tmp_path), hardware())
    xs = random_inputs(chain_graph)
    ref = chain_graph.evaluate(*xs)
    got = k.fn(*xs)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        check_reference(s, dict(zip(chain_graph.inputs, xs, strict=True)), ref), got,
        atol=1e-6, rtol=1e-6,
    )  # fmt: skip


def test_ispc_source_structure(chain_graph):
    """The ISPC rendering (checked without an ispc binary): a per-tile export function with
    foreach over the contiguous dim, and OpenMP C glue over the tiles."""
    from middleware.backends.x86 import IspcBackend

    be = IspcBackend()
    s = be.schedule(chain_graph, [n.name for n in chain_graph.nodes()], hardware())
    ispc, glue = be.render(s)
    assert f"export void {s.name}_tile(" in ispc
    assert "foreach (c = " in ispc and "uniform int" in ispc
    assert "#pragma omp for collapse" in glue and f"{s.name}_tile(" in glue
    if shutil.which("ispc") is None:
        ok, why = be.can_run(chain_graph, [n.name for n in chain_graph.nodes()], hardware())
        assert not ok and "ispc" in why


def test_group_with_two_outputs_is_split(tmp_path):
    """A group whose intermediate is also read outside runs as two generated pieces."""
    from fusion_helpers import add

    from middleware.graph import Graph, TensorType
    from middleware.pipeline import compile_graph

    g = Graph()
    x = g.add_input("x", TensorType((2, 5, 8, 7), "float32", "nhwc"))
    a = add(g, "relu", [x])
    b = add(g, "max_pool2d", [a], **maxpool(3, 2, 1)[1])
    c = add(g, "add", [b], scalar=1.0)
    g.set_outputs((a, c))
    compiled = compile_graph(g, Options(cache_dir=tmp_path, measure_hardware=False))
    assert all(r.runs_as == "generated" for r in compiled.report.rows)
    assert len([s for s in compiled.plan.steps if s.runs_as == "generated"]) == 2
    (xs,) = random_inputs(g)
    got, ref = compiled.plan.run([xs]), g.evaluate(xs)
    for u, v in zip(got, ref, strict=True):
        torch.testing.assert_close(u, v, atol=1e-6, rtol=1e-6)
