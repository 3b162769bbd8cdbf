"""Every generated ``.cu`` compiles with nvcc for sm_80 and sm_90 (and with NVRTC where
cuda-python has it), through the kernel cache; and checks on the generated source."""

from __future__ import annotations

import re

import pytest
from cuda_cases import CASES, FAKE_GPU, LAYOUTS
from middleware.backends.cuda.build import build, cubin_request, find_nvcc, nvrtc_available
from middleware.backends.cuda.group import group_from_nodes
from middleware.backends.cuda.render import launch_config, render_cuda, render_group

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
        group = group_from_nodes(graph, names, name=f"{case}_{layout}")
        rendered = render_group(group, FAKE_GPU, emulate=False)
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
    rendered = render_group(group_from_nodes(graph, names), FAKE_GPU, emulate=False)
    req = cubin_request(rendered.name, rendered.source, "sm_90", compiler="nvcc")
    binary = build(req, cache_dir)
    assert binary.name == "kernel.cubin" and (binary.parent / "kernel.cu").read_text() == (
        rendered.source
    )
    assert rendered.name.encode() in binary.read_bytes()


@pytest.mark.skipif(not nvrtc_available(), reason="cuda-python's NVRTC is not installed")
def test_nvrtc_compiles_a_kernel(cache_dir):
    graph, names = CASES["bn_relu_maxpool"]("nhwc")
    rendered = render_group(group_from_nodes(graph, names), FAKE_GPU, emulate=False)
    req = cubin_request(rendered.name, rendered.source, "sm_90", compiler="nvrtc")
    assert req.command[1:3] == ("-m", "middleware.backends.cuda.nvrtc")
    data = build(req, cache_dir).read_bytes()
    assert data[:4] == b"\x7fELF"


@needs_nvcc
def test_cache_key_holds_the_architecture(cache_dir):
    graph, names = CASES["relu"]("nchw")
    src = render_cuda(group_from_nodes(graph, names), FAKE_GPU)
    a = build(cubin_request("k", src, "sm_80", compiler="nvcc"), cache_dir)
    b = build(cubin_request("k", src, "sm_90", compiler="nvcc"), cache_dir)
    assert a != b and a.parent != b.parent
    meta = a.parent / "meta.json"  # written by the shared kernel cache
    assert not meta.exists() or "sm_80" in meta.read_text()


def test_generated_source_is_sync_free_and_coalesced():
    """No barriers or shared memory; each output is walked in its memory order (the
    contiguous dim is the fastest-varying index of consecutive threads)."""
    for layout, inner in (("nchw", "i3"), ("nhwc", "i1")):
        graph, names = CASES["bn_relu_maxpool"](layout)
        src = render_group(group_from_nodes(graph, names), FAKE_GPU).source
        assert "__syncthreads" not in src and "__shared__" not in src
        decomp = re.findall(r"const int (i\d) = \(int\)\((.*?)\);", src)
        assert decomp[-1][0] == inner and decomp[-1][1] == "(r) % " + str(
            graph.values[graph.output_values()[0]].shape[int(inner[1])]
        )


def test_launch_config_comes_from_the_hardware():
    cfg = launch_config(10_000_000, FAKE_GPU)
    assert cfg.block == FAKE_GPU.warp_size * 8
    assert cfg.grid == FAKE_GPU.cores * 32
    small = launch_config(100, FAKE_GPU)
    assert small.grid == 1 and small.total == 100


def test_unsupported_group_is_refused():
    from middleware.errors import UnsupportedError
    from middleware.graph import Graph, Node, TensorType
    from middleware.ops import infer_types

    g = Graph()
    x = g.add_input("x", TensorType((2, 3)))
    w = g.add_param("w", __import__("numpy").ones((4, 3), dtype="float32"))
    n = Node("fc", "linear", (x, w), ("y",), {})
    g.add_node(n, infer_types(g.values, n))
    g.set_outputs("y")
    with pytest.raises(UnsupportedError, match="linear"):
        render_group(group_from_nodes(g, ["fc"]), FAKE_GPU)


def test_render_cuda_takes_the_shared_schedule():
    """The backend-neutral schedule of the fusion pass renders to the same kernel as the
    group of its layers (skipped until passes/schedule.py is in the tree)."""
    schedule_mod = pytest.importorskip("middleware.passes.schedule")
    graph, names = CASES["bn_relu_maxpool"]("nhwc")
    schedule = schedule_mod.schedule_group(graph, names, FAKE_GPU)
    src = render_cuda(schedule, FAKE_GPU, graph)
    assert src == render_group(group_from_nodes(graph, names, schedule.name), FAKE_GPU).source


def test_every_op_the_x86_backend_fuses_has_a_cuda_element_function():
    """The CUDA backend renders whatever the shared loop semantics let x86 fuse."""
    from middleware.backends.cuda.elements import supported_ops
    from middleware.ops import CATALOGUE, has_loops

    assert {n for n in CATALOGUE if has_loops(n)} <= set(supported_ops())


def test_stacked_windows_are_refused_past_the_recompute_limit():
    from cuda_cases import Builder, pool_attrs
    from middleware.backends.cuda.elements import recompute_factor, why_unsupported

    b = Builder("nchw")
    x = b.input("x", (1, 2, 9, 9))
    for _ in range(3):  # 3x3/1 pooling thrice: the first is recomputed 9 * 9 * 9 times
        x = b.node("max_pool2d", (x,), **pool_attrs(3, 1, 1))
    graph, names = b.done(x)
    group = group_from_nodes(graph, names)
    assert recompute_factor(group) == 729
    assert "recompute" in why_unsupported(group)
    graph, names = CASES["bn_relu_maxpool"]("nchw")
    assert why_unsupported(group_from_nodes(graph, names)) == ""


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_epilogues_and_four_wide_kernels_compile_with_nvcc(arch, cache_dir):
    """The convolution epilogues (float4 and scalar, both layouts, every activation) and a
    kernel computing 4 elements per thread (float4 stores) compile for the device."""
    from middleware.backends.cuda.epilogue import Epilogue, render_epilogue
    from middleware.backends.cuda.render import vector_width

    parts, names = [], []
    acts = [None, "relu", "hardtanh", "hardswish", "silu", "sigmoid", "gelu", "leaky_relu"]
    for i, act in enumerate(acts):
        for layout, shape in (("nhwc", (2, 8, 5, 5)), ("nchw", (2, 3, 5, 5))):
            ep = Epilogue(shape, layout, True, i % 2 == 0, act)
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
    wide = render_group(group_from_nodes(g, ns, name="wide"), FAKE_GPU, emulate=False)
    assert vector_width(group_from_nodes(g, ns)) == 4 and "float4" in wide.source
    cubin = build(cubin_request(f"wide_{arch}", wide.source, arch, compiler="nvcc"), cache_dir)
    assert wide.name.encode() in cubin.read_bytes()
