"""The generated CUDA kernels, run on the CPU through the emulation header, against PyTorch.

Every case of ``cuda_cases`` in both layouts: the kernel rendered from the case's schedule
(``passes/schedule.py``) gives what ``Graph.evaluate`` (PyTorch's reference ops on the same
inputs) gives within rtol 1e-5 / atol 1e-5, on plain inputs and on inputs holding NaN and
infinities (same NaNs, same infinities). Every function of the loop vocabulary is checked
against PyTorch on its own; the cases holding an op without loop semantics run that op
through the framework, with the reason.
"""

from __future__ import annotations

import shutil
import zlib

import pytest
import torch
from cuda_cases import (
    ALL_CASES,
    CASES,
    FAKE_GPU,
    FRAMEWORK_OPS,
    LAYOUTS,
    SPLIT_CASES,
    inputs_for,
    kernel_args,
    schedule_of,
    special_inputs,
)

from middleware.backends.cuda.build import build, emulation_request
from middleware.backends.cuda.emulate import EmulatedLauncher
from middleware.backends.cuda.kernel import GeneratedKernel, emulate_schedule
from middleware.backends.cuda.render import render_schedule

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
        source = render_schedule(
            schedule_of(graph, names), FAKE_GPU, name=f"{case}/{layout}"
        ).source
        parts.append(f"namespace case{i} {{\n{source}}}\n")
    return build(emulation_request("all_cases", "\n".join(parts)), cache_dir)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_emulated_kernel_matches_pytorch(case, layout, all_cases_library):
    graph, names = CASES[case](layout)
    _check_emulated(graph, names, all_cases_library, f"{case}/{layout}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_nan_and_infinity_match_pytorch(case, layout, all_cases_library):
    """The same kernels on inputs holding NaN, +inf and -inf: PyTorch's NaN semantics
    (relu, clamp, max-pooling and maximum propagate a NaN; sums of infinities)."""
    graph, names = CASES[case](layout)
    _check_emulated(graph, names, all_cases_library, f"{case}/{layout}", special_inputs, "nan")


def _check_emulated(graph, names, library, name: str, make_inputs=inputs_for, salt="") -> None:  # noqa: ANN001
    """The group's kernel ``name`` from ``library`` on seeded inputs against
    ``Graph.evaluate``: an output of the right shape and layout, within 1e-5, NaN where
    PyTorch gives NaN."""
    rendered = render_schedule(schedule_of(graph, names), FAKE_GPU, name=name)
    kernel = GeneratedKernel(rendered, EmulatedLauncher(library, rendered.name))
    seed_key = salt + name
    inputs = make_inputs(graph, seed=zlib.crc32(seed_key.encode()) % 1000)
    expected = graph.evaluate(*inputs)
    got = kernel(*kernel_args(graph, rendered.inputs, inputs))
    (v,) = rendered.outputs
    assert got.shape == expected.shape, v
    t = graph.values[v]
    if t.rank == 4 and t.layout == "nhwc":
        assert got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, equal_nan=True, msg=seed_key)


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
        return ALL_CASES[case](layout)
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
        source = render_schedule(
            schedule_of(graph, names), FAKE_GPU, name=f"wide/{case}/{layout}"
        ).source
        parts.append(f"namespace wide{i} {{\n{source}}}\n")
    return build(emulation_request("wide_cases", "\n".join(parts)), cache_dir)


def test_most_widened_cases_compute_four_elements_per_thread():
    from middleware.backends.cuda.render import vector_width
    from middleware.ops import get_op

    widths = {}
    for c, lay in WIDE:
        graph, names = _widened(c, lay)
        widths[c, lay] = vector_width(schedule_of(graph, names))
        if not all(get_op(graph.node(n).op).elementwise for n in names):
            assert widths[c, lay] == 1, (c, lay)  # windows keep a warp's loads adjacent
    assert len(WIDE) > 50 and list(widths.values()).count(4) > 30
    # a (N, C) output: 4 along C, its innermost memory dim
    assert vector_width(schedule_of(*CASES["rank2_add_relu"]("nchw"))) == 4


@pytest.mark.parametrize("case,layout", WIDE)
def test_four_elements_per_thread_match_pytorch(case, layout, wide_library):
    graph, names = _widened(case, layout)
    _check_emulated(graph, names, wide_library, f"wide/{case}/{layout}")


def test_unaligned_outputs_are_written_element_by_element(cache_dir):
    """A 4-wide kernel writing into an output that is not 16-byte aligned (a slice of a
    larger buffer) takes the scalar stores and still writes the right values."""
    graph, names = _widened("relu", "nchw") or CASES["relu"]("nchw")
    kernel = emulate_schedule(schedule_of(graph, names), FAKE_GPU, cache_dir)
    assert kernel.rendered.launch.total * 4 == graph.values[names[-1] + "_out"].numel
    (x,) = inputs_for(graph, seed=3)
    out_t = graph.values[kernel.rendered.outputs[0]]
    buf = torch.zeros(out_t.numel + 1)
    out = buf[1:].view(out_t.shape)
    assert out.data_ptr() % 16 != 0
    kernel.out(x, out)
    torch.testing.assert_close(out, torch.relu(x))
    assert buf[0] == 0


def test_emulated_kernel_writes_into_given_outputs(cache_dir):
    """The destination-passing form writes every element of a preallocated output."""
    graph, names = CASES["cat_pool"]("nhwc")
    kernel = emulate_schedule(schedule_of(graph, names), FAKE_GPU, cache_dir)
    inputs = inputs_for(graph, seed=3)
    expected = graph.evaluate(*inputs)
    out = torch.full(expected.shape, float("nan")).contiguous(memory_format=torch.channels_last)
    kernel.out(*kernel_args(graph, kernel.rendered.inputs, inputs), out)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_emulation_reads_inputs_in_any_layout(cache_dir):
    """An input that arrives in the other memory format is laid out as the kernel expects."""
    graph, names = CASES["bn_relu_maxpool"]("nhwc")
    kernel = emulate_schedule(schedule_of(graph, names), FAKE_GPU, cache_dir)
    (x,) = inputs_for(graph, seed=5)
    expected = graph.evaluate(x)
    got = kernel(*kernel_args(graph, kernel.rendered.inputs, [x.contiguous()]))
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


# ------------------------------------------------------------------- function table
def _reference(fn: str, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """PyTorch's value of vocabulary function ``fn`` (conditions as 0/1)."""
    ref = {
        "add": lambda: x + y,
        "sub": lambda: x - y,
        "mul": lambda: x * y,
        "div": lambda: x / y,
        "max": lambda: torch.maximum(x, y),
        "min": lambda: torch.minimum(x, y),
        "neg": lambda: -x,
        "exp": lambda: torch.exp(x),
        "expm1": lambda: torch.expm1(x),
        "log": lambda: torch.log(x),
        "log1p": lambda: torch.log1p(x),
        "abs": lambda: torch.abs(x),
        "tanh": lambda: torch.tanh(x),
        "erf": lambda: torch.erf(x),
        "sigmoid": lambda: torch.sigmoid(x),
        "sqrt": lambda: torch.sqrt(x),
        "gt": lambda: (x > y).float(),
        "ge": lambda: (x >= y).float(),
        "le": lambda: (x <= y).float(),
        "and": lambda: ((x != 0) & (y != 0)).float(),
        "select": lambda: torch.where(x != 0, y, z),
    }
    return ref[fn]()


def test_every_function_of_the_vocabulary_has_a_cuda_spelling():
    from middleware.backends.cuda.funcs import CUDA_FUNCS, missing_functions
    from middleware.loops import FUNCTIONS

    assert missing_functions() == []
    assert set(CUDA_FUNCS) <= set(FUNCTIONS) | {"expm1", "log", "log1p", "abs", "ge", "le", "and"}


def test_every_cuda_spelling_matches_pytorch(cache_dir):
    """Each spelling of ``funcs.CUDA_FUNCS`` (compiled with the emulation header, as the
    kernels are) on ordinary values, zeros, negatives, NaN and infinities, against PyTorch
    (max/min propagate a NaN; select and and read a condition as nonzero)."""
    import ctypes

    from middleware.backends.cuda.funcs import CUDA_FUNCS, HELPERS

    parts = [HELPERS]
    for fn, spelling in sorted(CUDA_FUNCS.items()):
        body = spelling.format("x[i]", "y[i]", "z[i]")
        parts.append(
            f'extern "C" void f_{fn}(const float* x, const float* y, const float* z, float* o, '
            f"int n) {{ for (int i = 0; i < n; ++i) o[i] = (float)({body}); }}"
        )
    lib = ctypes.CDLL(str(build(emulation_request("functions", "\n".join(parts)), cache_dir)))
    special = [0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 30.0, -30.0, 1e-7]
    special += [float("nan"), float("inf"), float("-inf")]
    grid = torch.tensor(special)
    x = grid.repeat_interleave(len(special) * 3)
    y = grid.repeat_interleave(3).repeat(len(special))
    z = torch.tensor([0.0, 7.0, float("nan")]).repeat(len(special) ** 2)
    x = torch.cat([x, torch.linspace(-6, 6, 101)])
    y = torch.cat([y, torch.linspace(3, -3, 101)])
    z = torch.cat([z, torch.linspace(-1, 1, 101)])
    ptr = ctypes.c_void_p
    for fn in sorted(CUDA_FUNCS):
        out = torch.empty_like(x)
        getattr(lib, f"f_{fn}")(
            ptr(x.data_ptr()), ptr(y.data_ptr()), ptr(z.data_ptr()), ptr(out.data_ptr()), x.numel()
        )
        expected = _reference(fn, x, y, z)
        torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-7, equal_nan=True, msg=fn)


# --------------------------------------------------- groups left to the framework or split
def _units(case: str, layout: str, tmp_path):  # noqa: ANN202
    from middleware.backends.cuda.units import cuda_units
    from middleware.options import Options
    from middleware.runtime.plan import build_plan

    graph, _ = ALL_CASES[case](layout)
    options = Options(device="cuda", cache_dir=tmp_path, measure_hardware=False)
    units = cuda_units(graph, options, FAKE_GPU, torch.device("cpu"), emulate=True)
    inputs = inputs_for(graph, seed=7)
    expected = graph.evaluate(*inputs)
    got = build_plan(graph, torch.device("cpu"), units).run(inputs)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = got if isinstance(got, (tuple, list)) else (got,)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=case)
    return graph, units


@pytest.mark.parametrize("case", sorted(FRAMEWORK_OPS))
def test_ops_without_loop_semantics_run_through_the_framework(case, tmp_path):
    """The op runs as its own framework (cuDNN/ATen) call with the reason; the plan
    matches PyTorch; the case's other io nodes that have loop semantics still run in
    generated kernels."""
    graph, units = _units(case, "nhwc", tmp_path)
    op, why = FRAMEWORK_OPS[case]
    mine = [u for u in units if any(graph.node(n).op == op for n in u.nodes)]
    assert mine and all(u.runs_as == "vendor" and len(u.nodes) == 1 for u in mine)
    assert all(why in u.reason for u in mine), [u.reason for u in mine]
    generated = {graph.node(n).op for u in units if u.runs_as == "generated" for n in u.nodes}
    if case in ("channel_shuffle", "grouped_conv_relu"):
        assert "relu" in generated
    if case == "channel_shuffle":  # the shuffle's views are read through by its reshape
        assert {"cat", "reshape", "permute"} <= generated


@pytest.mark.parametrize("case", SPLIT_CASES)
def test_group_with_two_outputs_runs_as_one_kernel_per_output(case, tmp_path):
    graph, units = _units(case, "nchw", tmp_path)
    generated = [u for u in units if u.runs_as == "generated"]
    assert len(generated) == 2 and all(len(u.outputs) == 1 for u in generated)


@pytest.mark.parametrize("ilp", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_grid_stride_iterations_and_the_clamped_tail(layout, ilp, cache_dir, monkeypatch):
    """More outputs than ILP times the grid's threads: each thread takes ILP elements a
    grid stride apart over several iterations, the last iteration's elements past the end
    clamped, not stored. One SM's grid (8192 threads) over 19600 outputs."""
    import dataclasses

    import torch.nn as nn

    import middleware
    from middleware.backends.cuda import render
    from middleware.graph import TensorType
    from middleware.passes.schedule import schedule_group

    model = nn.Sequential(nn.ReLU(), nn.MaxPool2d(3, 2, 1)).eval()
    x = torch.randn(2, 8, 70, 70)
    graph = middleware.trace(model, x)
    if layout == "nhwc":
        for v, t in list(graph.values.items()):
            if t.rank == 4:
                graph.values[v] = TensorType(t.shape, t.dtype, "nhwc")
        x = x.contiguous(memory_format=torch.channels_last)
    hw = dataclasses.replace(FAKE_GPU, cores=1)
    names = [n.name for n in graph.nodes()]
    monkeypatch.setattr(render, "ILP", ilp)
    kernel = emulate_schedule(schedule_group(graph, names, hw), hw, cache_dir)
    launch = kernel.rendered.launch
    threads = launch.grid * launch.block
    assert ilp * threads < 19600 and 19600 % (ilp * threads)  # iterations, a clamped tail
    torch.testing.assert_close(kernel(x), model(x), rtol=1e-6, atol=1e-6)
