"""The shared-memory tiled form of window kernels (``backends/cuda/tiles.py``), run on the
CPU through the emulation header (its barriers as phase loops over a block's threads)
against PyTorch.

Seeded random windows (max and average pooling: kernel, stride, padding, dilation,
ceil_mode, count_include_pad; with no prologue, a batch-norm + activation before the pool,
the lowered batch-norm's multiply-add by per-channel constant inputs, or a stride-1 pool
whose prologue the schedule keeps in a buffer of its own) on random
shapes, in both layouts, with the default shared-memory budget (one tile covers these small
outputs) and with a tiny one (many tiles, partial tiles at the borders, a grid smaller than
the tile count): every case takes the tiled form and equals ``Graph.evaluate`` on plain
inputs and on inputs holding NaN and infinities.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import zlib

import pytest
import torch
from cuda_cases import (
    FAKE_GPU,
    Builder,
    avg_attrs,
    gpu_skip_reason,
    inputs_for,
    kernel_args,
    pool_attrs,
    schedule_of,
    special_inputs,
)

from middleware.backends.cuda import render, tiles
from middleware.backends.cuda.build import build, cubin_request, emulation_request, find_nvcc
from middleware.backends.cuda.emulate import EmulatedLauncher
from middleware.backends.cuda.kernel import GeneratedKernel
from middleware.loops import window_out_size

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulation")


@pytest.fixture(autouse=True, scope="module")
def _tiled_on():
    """The tiled form is off by default (measured slower on an H200): on for these tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(render, "TILED", True)
        yield


# one SM: the grid (32 blocks per SM at most) is smaller than the tile count of the tiny budget
ONE_SM = dataclasses.replace(FAKE_GPU, cores=1)
BUDGETS = {"default": tiles.SMEM_BUDGET, "tiny": 64 * 4}
N_CASES = 20


def _random_case(seed: int, layout: str):
    rnd = random.Random(seed)
    while True:
        op = rnd.choice(["max_pool2d", "avg_pool2d"])
        k = rnd.randint(1, 4)
        s = rnd.randint(1, 3)
        p = rnd.randint(0, k // 2)
        d = rnd.choice([1, 1, 2]) if op == "max_pool2d" else 1
        ceil = rnd.random() < 0.4
        shape = (rnd.randint(1, 2), rnd.randint(1, 9), rnd.randint(1, 13), rnd.randint(1, 13))
        sizes = [window_out_size(shape[i], k, s, p, d, ceil) for i in (2, 3)]
        if min(sizes) >= 1 and (k - 1) * d + 1 <= shape[2] + 2 * p:
            break
    b = Builder(layout, seed=seed)
    x = b.input("x", shape)
    prologue = rnd.choice(["none", "bn_relu", "bn_hardswish", "affine_relu"])
    if prologue == "affine_relu":  # the CUDA backend's lowered batch-norm (cuda/lower.py)
        c = shape[1]
        scaled = b.node("mul", (x, b.param("scale", (1, c, 1, 1))))
        x = b.node("relu", (b.node("add", (scaled, b.param("shift", (1, c, 1, 1)))),))
    elif prologue != "none":
        x = b.node("relu" if prologue == "bn_relu" else "hardswish", (b.bn(x),))
    if op == "max_pool2d":
        attrs = pool_attrs(k, s, p, d=d, ceil=ceil)
    else:
        cip = rnd.random() < 0.5
        attrs = avg_attrs(k, s, p, ceil=ceil, cip=cip, div=rnd.choice([None, None, 5]))
    graph, names = b.done(b.node(op, (x,), **attrs))
    return graph, names, f"{op} k{k} s{s} p{p} d{d} ceil={ceil} {shape} {prologue} {layout}"


def _cases():
    out = []
    for i in range(N_CASES):
        for layout in ("nchw", "nhwc"):
            for budget in BUDGETS:
                out.append((i, layout, budget))
    return out


@pytest.fixture(scope="module")
def tiled_library(tmp_path_factory):
    """Every case's tiled kernel in one library (one g++ run), with its rendered kernel."""
    cache = tmp_path_factory.mktemp("cuda-tiles")
    parts, rendered = [], {}
    with pytest.MonkeyPatch.context() as mp:
        for case in _cases():
            i, layout, budget = case
            mp.setattr(tiles, "SMEM_BUDGET", BUDGETS[budget])
            graph, names, what = _random_case(1000 + i, layout)
            s = schedule_of(graph, names, ONE_SM)
            plan = tiles.tile_plan(s, ONE_SM)
            assert plan is not None, f"{what}: no tiled form"
            name = f"tile{i}_{layout}_{budget}"
            r = render.render_schedule(s, ONE_SM, name=name)
            assert "MW_SHARED float s_tile" in r.source, what
            ns = f"ns_{name}"
            parts.append(f"namespace {ns} {{\n{r.source}}}\n")
            rendered[case] = (graph, r, what, plan)
    lib = build(emulation_request("tiles", "\n".join(parts)), cache)
    return lib, rendered


@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
@pytest.mark.parametrize("inputs", ["plain", "nan_inf"])
def test_tiled_window_matches_pytorch(case, inputs, tiled_library):
    lib, rendered = tiled_library
    graph, r, what, plan = rendered[case]
    kernel = GeneratedKernel(r, EmulatedLauncher(lib, r.name))
    make = inputs_for if inputs == "plain" else special_inputs
    xs = make(graph, seed=zlib.crc32(r.name.encode()) % 1000)
    expected = graph.evaluate(*xs)
    got = kernel(*kernel_args(graph, r.inputs, xs))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, equal_nan=True, msg=what)


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc (CUDA toolkit) is not installed")
def test_tiled_kernels_compile_with_nvcc(tiled_library, tmp_path):
    """Every random case's tiled kernel (shared memory, barriers, unrolled phases) as nvcc
    compiles it for sm_90, in one translation unit."""
    _, rendered = tiled_library
    parts, names = [], []
    for k, (_, r, _, _) in enumerate(rendered.values()):
        src = render.render_schedule(r.schedule, ONE_SM, emulate=False, name=f"{r.name}_gpu")
        parts.append(f"namespace gpu{k} {{\n{src.source}}}\n")
        names.append(src.name)
    data = build(cubin_request("tiles_gpu", "\n".join(parts), "sm_90"), tmp_path).read_bytes()
    assert data[:4] == b"\x7fELF" and all(n.encode() in data for n in names)


def test_cases_cover_partial_tiles_and_a_grid_stride(tiled_library):
    """The random cases include outputs whose tiles do not divide them (the guards on the
    output's and the box's borders matter) and grids smaller than the tile count."""
    _, rendered = tiled_library
    partial = strided = 0
    for graph, r, _, plan in rendered.values():
        shape = graph.values[r.outputs[0]].shape
        counts = [-(-shape[d] // plan.tile[d]) for d in range(4)]
        partial += any(shape[d] % plan.tile[d] for d in range(4))
        strided += r.launch.grid < counts[0] * counts[1] * counts[2] * counts[3]
    assert partial >= 3 and strided >= 1


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_epilogue_reading_the_prologue(layout, tmp_path):
    """``max_pool2d(y, 3, 1, 1) + y`` for ``y = relu(bn(x))``: the schedule keeps ``y`` in
    a buffer of its own, read by the window and by the add after it; the tiled kernel
    recomputes ``y`` at the output point for the add (it holds no such buffer)."""
    b = Builder(layout, seed=3)
    y = b.node("relu", (b.bn(b.input("x", (2, 5, 9, 11))),))
    graph, names = b.done(b.node("add", (b.node("max_pool2d", (y,), **pool_attrs(3, 1, 1)), y)))
    s = schedule_of(graph, names, ONE_SM)
    assert len(s.stages) == 2 and tiles.tile_plan(s, ONE_SM) is not None
    r = render.render_schedule(s, ONE_SM, name=f"epilogue_{layout}")
    kernel = GeneratedKernel(
        r, EmulatedLauncher(build(emulation_request(r.name, r.source), tmp_path), r.name)
    )
    for make in (inputs_for, special_inputs):
        xs = make(graph, seed=5)
        got = kernel(*kernel_args(graph, r.inputs, xs))
        torch.testing.assert_close(got, graph.evaluate(*xs), rtol=1e-5, atol=1e-5, equal_nan=True)


def test_windows_over_a_reduction_or_a_concat_keep_the_flat_form():
    """An adaptive window (taps move with the point) and a concat before a pool are not
    boxes over one input: the flat form renders them."""
    b = Builder("nchw")
    x = b.input("x", (2, 5, 7, 5))
    graph, names = b.done(b.node("adaptive_avg_pool2d", (x,), output_size=(3, 2)))
    s = schedule_of(graph, names, ONE_SM)
    assert tiles.tile_plan(s, ONE_SM) is None
    assert "s_tile" not in render.render_schedule(s, ONE_SM).source


@pytest.mark.gpu
@pytest.mark.skipif(bool(gpu_skip_reason()), reason=gpu_skip_reason())
@pytest.mark.parametrize("budget", sorted(BUDGETS))
def test_tiled_windows_on_the_gpu(budget, tmp_path):
    """The same random cases on a real GPU (real barriers and shared memory, the device's
    own SM count), plain and NaN/inf inputs."""
    from middleware.backends.cuda.kernel import compile_schedule
    from middleware.hardware import detect_cuda

    hw = detect_cuda(None, measure=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiles, "SMEM_BUDGET", BUDGETS[budget])
        for i in range(N_CASES):
            for layout in ("nchw", "nhwc"):
                graph, names, what = _random_case(1000 + i, layout)
                s = schedule_of(graph, names, hw)
                assert tiles.tile_plan(s, hw) is not None, what
                kernel = compile_schedule(s, hw, tmp_path, torch.cuda.current_device())
                for make in (inputs_for, special_inputs):
                    xs = make(graph, seed=i)
                    expected = graph.evaluate(*xs)
                    on_gpu = [x.to("cuda") for x in xs]  # layouts kept
                    args = kernel_args(graph, kernel.rendered.inputs, on_gpu, device="cuda")
                    got = kernel(*args)
                    torch.testing.assert_close(
                        got.cpu(), expected, rtol=1e-5, atol=1e-5, equal_nan=True, msg=what
                    )
