"""The generated CUDA kernels, run on the CPU through the emulation header, against PyTorch.

Every case of ``cuda_cases`` in both layouts: the kernel's outputs equal ``Graph.evaluate``
(PyTorch's reference ops on the same inputs) within rtol 1e-5 / atol 1e-5.
"""

from __future__ import annotations

import shutil
import zlib

import pytest
import torch
from cuda_cases import CASES, FAKE_GPU, LAYOUTS, inputs_for, kernel_args
from middleware.backends.cuda.build import build, emulation_request
from middleware.backends.cuda.emulate import EmulatedLauncher
from middleware.backends.cuda.group import group_from_nodes
from middleware.backends.cuda.kernel import GeneratedKernel, emulate_group
from middleware.backends.cuda.render import render_group

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulation")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cuda-emulation-cache")


@pytest.fixture(scope="module")
def all_cases_library(cache_dir):
    """Every case's kernel (emulation entry included) in one library: one g++ run instead
    of one per case. Each kernel sits in its own namespace; the entry points are extern "C"
    with unique names."""
    parts = []
    for i, (case, layout) in enumerate((c, lay) for c in sorted(CASES) for lay in LAYOUTS):
        graph, names = CASES[case](layout)
        group = group_from_nodes(graph, names, name=f"{case}_{layout}")
        source = render_group(group, FAKE_GPU, emulate=True).source
        parts.append(f"namespace case{i} {{\n{source}}}\n")
    return build(emulation_request("all_cases", "\n".join(parts)), cache_dir)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_emulated_kernel_matches_pytorch(case, layout, all_cases_library):
    graph, names = CASES[case](layout)
    _check_emulated(graph, names, f"{case}_{layout}", all_cases_library, f"{case}/{layout}")


def _check_emulated(graph, names, group_name: str, library, seed_key: str) -> None:  # noqa: ANN001
    """The group's kernel from ``library`` on seeded inputs against ``Graph.evaluate``:
    outputs of the right shape and layout, within 1e-5."""
    group = group_from_nodes(graph, names, name=group_name)
    rendered = render_group(group, FAKE_GPU, emulate=True)
    kernel = GeneratedKernel(rendered, EmulatedLauncher(library, rendered.name))
    inputs = inputs_for(graph, seed=zlib.crc32(seed_key.encode()) % 1000)
    expected = graph.evaluate(*inputs)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = kernel(*kernel_args(graph, group.inputs, inputs))
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(expected) == len(group.outputs)
    for g, e, v in zip(got, expected, group.outputs, strict=True):
        assert g.shape == e.shape, v
        t = graph.values[v]
        if t.rank == 4 and t.layout == "nhwc":
            assert g.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=f"{seed_key}: {v}")


def _widened(case: str, layout: str):
    """The case rebuilt with every input's innermost memory dimension rounded up to a
    multiple of 4 (so that its kernel computes 4 elements per thread), or None where the
    case's own parameter shapes then no longer fit."""
    import cuda_cases

    original = cuda_cases.Builder.input

    def wide_input(self, name, shape):  # noqa: ANN001, ANN202
        shape = list(shape)
        k = 1 if len(shape) == 4 and self.layout == "nhwc" else len(shape) - 1
        if shape:
            shape[k] = -(-shape[k] // 4) * 4
        return original(self, name, tuple(shape))

    cuda_cases.Builder.input = wide_input
    try:
        return CASES[case](layout)
    except Exception:  # noqa: BLE001 - a fixed parameter shape no longer broadcasts
        return None
    finally:
        cuda_cases.Builder.input = original


WIDE = [(c, lay) for c in sorted(CASES) for lay in LAYOUTS if _widened(c, lay) is not None]


@pytest.fixture(scope="module")
def wide_library(cache_dir):
    parts = []
    for i, (case, layout) in enumerate(WIDE):
        graph, names = _widened(case, layout)
        group = group_from_nodes(graph, names, name=f"wide_{case}_{layout}")
        source = render_group(group, FAKE_GPU, emulate=True).source
        parts.append(f"namespace wide{i} {{\n{source}}}\n")
    return build(emulation_request("wide_cases", "\n".join(parts)), cache_dir)


def test_most_widened_cases_compute_four_elements_per_thread():
    from middleware.backends.cuda.render import vector_width

    from middleware.ops import get_op

    widths = {}
    for c, lay in WIDE:
        group = group_from_nodes(*_widened(c, lay), name="w")
        widths[c, lay] = vector_width(group)
        if not all(get_op(n.op).elementwise for n in group.nodes):
            assert widths[c, lay] == 1, (c, lay)  # windows keep a warp's loads adjacent
    assert len(WIDE) > 60 and list(widths.values()).count(4) > 30


@pytest.mark.parametrize("case,layout", WIDE)
def test_four_elements_per_thread_match_pytorch(case, layout, wide_library):
    graph, names = _widened(case, layout)
    _check_emulated(graph, names, f"wide_{case}_{layout}", wide_library, f"wide/{case}/{layout}")


def test_unaligned_outputs_are_written_element_by_element(cache_dir):
    """A 4-wide kernel writing into an output that is not 16-byte aligned (a slice of a
    larger buffer) takes the scalar stores and still writes the right values."""
    graph, names = _widened("relu", "nchw") or CASES["relu"]("nchw")
    group = group_from_nodes(graph, names, name="unaligned_relu")
    kernel = emulate_group(group, FAKE_GPU, cache_dir)
    (x,) = inputs_for(graph, seed=3)
    out_t = graph.values[group.outputs[0]]
    buf = torch.zeros(out_t.numel + 1)
    out = buf[1:].view(out_t.shape)
    assert out.data_ptr() % 16 != 0
    kernel.out(x, out)
    torch.testing.assert_close(out, torch.relu(x))
    assert buf[0] == 0


def test_emulated_kernel_writes_into_given_outputs(cache_dir):
    """The destination-passing form writes every element of preallocated outputs."""
    graph, names = CASES["two_outputs"]("nhwc")
    group = group_from_nodes(graph, names)
    kernel = emulate_group(group, FAKE_GPU, cache_dir)
    inputs = inputs_for(graph, seed=3)
    expected = graph.evaluate(*inputs)
    outs = [
        torch.full(e.shape, float("nan")).contiguous(memory_format=torch.channels_last)
        for e in expected
    ]
    kernel.out(*kernel_args(graph, group.inputs, inputs), *outs)
    for o, e in zip(outs, expected, strict=True):
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5)


def test_emulation_reads_inputs_in_any_layout(cache_dir):
    """An input that arrives in the other memory format is laid out as the kernel expects."""
    graph, names = CASES["bn_relu_maxpool"]("nhwc")
    group = group_from_nodes(graph, names)
    kernel = emulate_group(group, FAKE_GPU, cache_dir)
    (x,) = inputs_for(graph, seed=5)
    expected = graph.evaluate(x)
    got = kernel(*kernel_args(graph, group.inputs, [x.contiguous()]))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_emulation_refuses_synchronisation(tmp_path):
    """The emulation runs threads one after another, so a barrier must not compile."""
    import subprocess

    from middleware.backends.cuda.build import EMULATE_H

    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void k(float* x) { __syncthreads(); x[0] = 1; }\n')
    proc = subprocess.run(
        ["g++", "-x", "c++", "-std=c++17", "-fsyntax-only", "-include", str(EMULATE_H), str(src)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode != 0
    assert "must not synchronise" in proc.stderr
