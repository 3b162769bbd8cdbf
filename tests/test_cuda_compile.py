"""Every generated ``.cu`` compiles with nvcc for sm_80 and sm_90 (and with NVRTC where
cuda-python has it), through the kernel cache; and checks on the generated source."""

from __future__ import annotations

import re

import pytest
from cuda_cases import CASES, FAKE_GPU, LAYOUTS, schedule_of

from middleware.backends.cuda.build import build, cubin_request, find_nvcc, nvrtc_available
from middleware.backends.cuda.render import launch_config, render_cuda, render_schedule

NVCC = find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) is not installed")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cuda-compile-cache")


def _all_kernels(layout: str) -> tuple[str, list[str]]:
    """Every case's kernel in ``layout`` as one translation unit (each in its own namespace,
    so that the helpers of different kernels keep apart), and the kernel names."""
    parts, kernels = [], []
    for i, case in enumerate(sorted(CASES)):
        graph, names = CASES[case](layout)
        rendered = render_schedule(
            schedule_of(graph, names), FAKE_GPU, emulate=False, name=f"{case}_{layout}"
        )
        parts.append(f"namespace case{i} {{\n{rendered.source}}}  // namespace case{i}\n")
        kernels.append(rendered.name)
    return "\n".join(parts), kernels


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_kernel_compiles_with_nvcc(arch, layout, cache_dir):
    source, kernels = _all_kernels(layout)
    req = cubin_request(f"all_{layout}", source, arch, compiler="nvcc")
    data = build(req, cache_dir).read_bytes()
    assert data[:4] == b"\x7fELF"
    for name in kernels:
        assert name.encode() in data, name


@needs_nvcc
def test_one_kernel_per_file_through_the_cache(cache_dir):
    """The way the backend builds: one source, one cubin, named after the group."""
    graph, names = CASES["bn_relu_maxpool"]("nchw")
    rendered = render_schedule(schedule_of(graph, names), FAKE_GPU, emulate=False)
    req = cubin_request(rendered.name, rendered.source, "sm_90", compiler="nvcc")
    binary = build(req, cache_dir)
    assert binary.name == "kernel.cubin" and (binary.parent / "kernel.cu").read_text() == (
        rendered.source
    )
    assert rendered.name.encode() in binary.read_bytes()


@pytest.mark.skipif(not nvrtc_available(), reason="cuda-python's NVRTC is not installed")
def test_nvrtc_compiles_a_kernel(cache_dir):
    graph, names = CASES["bn_relu_maxpool"]("nhwc")
    rendered = render_schedule(schedule_of(graph, names), FAKE_GPU, emulate=False)
    req = cubin_request(rendered.name, rendered.source, "sm_90", compiler="nvrtc")
    assert req.command[1:3] == ("-m", "middleware.backends.cuda.nvrtc")
    data = build(req, cache_dir).read_bytes()
    assert data[:4] == b"\x7fELF"


@needs_nvcc
def test_cache_key_holds_the_architecture(cache_dir):
    graph, names = CASES["relu"]("nchw")
    src = render_cuda(schedule_of(graph, names), FAKE_GPU)
    a = build(cubin_request("k", src, "sm_80", compiler="nvcc"), cache_dir)
    b = build(cubin_request("k", src, "sm_90", compiler="nvcc"), cache_dir)
    assert a != b and a.parent != b.parent
    meta = a.parent / "meta.json"  # written by the shared kernel cache
    assert not meta.exists() or "sm_80" in meta.read_text()


def test_generated_source_is_sync_free_and_coalesced(monkeypatch):
    """The flat form: no barriers or shared memory; each output is walked in its memory
    order (the contiguous dim is the fastest-varying index of consecutive threads)."""
    from middleware.backends.cuda import render

    monkeypatch.setattr(render, "ILP", 2)  # the two-element form (gpu_diag's variant)
    monkeypatch.setattr(render, "TILED", False)  # the window's shared-memory form off
    for layout, inner in (("nchw", 3), ("nhwc", 1)):
        graph, names = CASES["bn_relu_maxpool"](layout)
        src = render_schedule(schedule_of(graph, names), FAKE_GPU).source
        assert "__syncthreads" not in src and "__shared__" not in src
        # a window kernel: ILP elements a grid stride apart, each decomposed the same way
        decomp = re.findall(r"const int ([nchw])0 = \(int\)\((.*?)\);", src)
        assert decomp[-1][0] == "nchw"[inner] and decomp[-1][1] == "(r0) % " + str(
            graph.values[graph.output_values()[0]].shape[inner]
        )
        assert "q += 2 * step" in src and "r1 = q + 1 * step" in src


def test_launch_config_comes_from_the_hardware():
    cfg = launch_config(10_000_000, FAKE_GPU)
    assert cfg.block == FAKE_GPU.warp_size * 8
    assert cfg.grid == FAKE_GPU.cores * 32
    small = launch_config(100, FAKE_GPU)
    assert small.grid == 1 and small.total == 100


def test_group_without_loop_semantics_is_refused_with_the_reason():
    from middleware.backends.cuda.units import why_unsupported
    from middleware.graph import Graph, Node, TensorType
    from middleware.ops import infer_types

    g = Graph()
    x = g.add_input("x", TensorType((2, 3)))
    w = g.add_param("w", __import__("numpy").ones((4, 3), dtype="float32"))
    n = Node("fc", "linear", (x, w), ("y",), {})
    g.add_node(n, infer_types(g.values, n))
    g.set_outputs("y")
    reason = why_unsupported(g, ["fc"], FAKE_GPU)
    assert "linear" in reason and "no loop semantics" in reason
    graph, names = CASES["bn_relu_maxpool"]("nchw")
    assert why_unsupported(graph, names, FAKE_GPU) == ""


def test_kernel_is_rendered_from_the_shared_schedule():
    """Every element function comes from a stage of the schedule: the stages' values are
    the functions, the expressions are the loop semantics printed with the CUDA table (no
    op is spelled by the backend)."""
    graph, names = CASES["cat_pool"]("nhwc")
    schedule = schedule_of(graph, names)
    src = render_cuda(schedule, FAKE_GPU)
    for st in schedule.stages:
        assert f"e_{st.target}(" in src
    assert sum(st.covers is not None for st in schedule.stages) == 2  # the concat's slices
    assert src.count("if (") >= 2 and "mw_max(acc" in src and "mw_sigmoid(" in src


def test_nan_propagating_max_is_used_for_relu_and_pooling():
    """relu is max(x, 0) of the loop semantics, spelled mw_max (a NaN operand wins), as
    max-pooling's reduction: never fmaxf, which drops a NaN."""
    graph, names = CASES["bn_relu_maxpool"]("nchw")
    src = render_cuda(schedule_of(graph, names), FAKE_GPU)
    assert "fmaxf" not in src and src.count("mw_max(") >= 3


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_epilogues_and_four_wide_kernels_compile_with_nvcc(arch, cache_dir):
    """The convolution epilogues (float4 and scalar, both layouts, every activation) and a
    kernel computing 4 elements per thread (float4 stores) compile for the device."""
    from middleware.backends.cuda.epilogue import Epilogue, render_epilogue
    from middleware.backends.cuda.render import vector_width

    parts, names = [], []
    from cuda_cases import REGISTRY_ACTIVATIONS

    from middleware.ops import CATALOGUE

    acts = {None: ()} | {a: tuple(CATALOGUE[a].defaults.items()) for a in REGISTRY_ACTIVATIONS}
    for i, (act, attrs) in enumerate(acts.items()):
        for layout, shape in (("nhwc", (2, 8, 5, 5)), ("nchw", (2, 3, 5, 5))):
            ep = Epilogue(shape, layout, True, i % 2 == 0, act, attrs)
            parts.append(f"namespace e{len(parts)} {{\n{render_epilogue(ep, FAKE_GPU)}}}\n")
            names.append(ep.name())
    source = "\n".join(parts)
    data = build(cubin_request(f"epilogues_{arch}", source, arch, compiler="nvcc"), cache_dir)
    blob = data.read_bytes()
    for name in names:
        assert name.encode() in blob, name
    # a 4-wide generated kernel: 8 channels innermost in channels_last
    from cuda_cases import Builder

    b = Builder("nhwc")
    x = b.input("x", (2, 8, 9, 7))
    y = b.node("relu", (b.bn(x),))
    g, ns = b.done(y)
    wide = render_schedule(schedule_of(g, ns), FAKE_GPU, emulate=False, name="wide")
    assert vector_width(schedule_of(g, ns)) == 4 and "float4" in wide.source
    cubin = build(cubin_request(f"wide_{arch}", wide.source, arch, compiler="nvcc"), cache_dir)
    assert wide.name.encode() in cubin.read_bytes()


def test_short_windows_have_a_constant_trip_count():
    """A 3x3 pooling window (clipped at the border) is a constant 3-tap loop nvcc unrolls,
    skipping the taps outside the point's window; an adaptive window, whose taps move with
    the point, keeps its per-point bounds."""
    graph, names = CASES["bn_relu_maxpool"]("nchw")
    src = render_cuda(schedule_of(graph, names), FAKE_GPU)
    assert src.count("#pragma unroll") == 2
    assert "for (int k_h = 0; k_h <= 2; ++k_h)" in src and "continue;" in src
    graph, names = CASES["adaptive_avg_3x2"]("nchw")
    src = render_cuda(schedule_of(graph, names), FAKE_GPU)
    assert "#pragma unroll" not in src and "for (int k_h = (2 * h); k_h <= (2 * h + 2)" in src
