"""Shared-memory tiled CUDA kernels (``backends/cuda/tiled.py``) for groups around one
overlapping window: which groups are tiled, and every such case of ``cuda_cases`` in both
layouts against PyTorch through the CPU emulation (which runs the two phases with the
barrier between), with the default tiles and with tiles shrunk so that a plane splits into
many tiles, halos and partial channel tiles included. The CUDA source compiles with nvcc."""

from __future__ import annotations

import dataclasses
import shutil
import zlib

import pytest
import torch
from cuda_cases import CASES, FAKE_GPU, LAYOUTS, Builder, inputs_for, kernel_args, pool_attrs
from middleware.backends.cuda import tiled
from middleware.backends.cuda.build import build, cubin_request, emulation_request, find_nvcc
from middleware.backends.cuda.emulate import EmulatedLauncher
from middleware.backends.cuda.group import group_from_nodes
from middleware.backends.cuda.kernel import GeneratedKernel

# (shared-memory floats per block, warp width): the default, and tiles shrunk so that a
# plane splits into many tiles and channels into tiles of 2 (the last one partial)
CONFIGS = {"default": (tiled.SMEM_FLOATS, 32), "tiny": (40, 2), "small": (100, 2)}


def _hardware(config: str):  # noqa: ANN202
    return dataclasses.replace(FAKE_GPU, warp_size=CONFIGS[config][1])


def _tiled_cases() -> list[tuple[str, str]]:
    out = []
    for case in sorted(CASES):
        for layout in LAYOUTS:
            graph, names = CASES[case](layout)
            if tiled.tile_plan(group_from_nodes(graph, names), FAKE_GPU) is not None:
                out.append((case, layout))
    return out


TILED = _tiled_cases()


def _plannable(case: str, layout: str, config: str) -> bool:
    mp = pytest.MonkeyPatch()
    mp.setattr(tiled, "SMEM_FLOATS", CONFIGS[config][0])
    try:
        graph, names = CASES[case](layout)
        return tiled.tile_plan(group_from_nodes(graph, names), _hardware(config)) is not None
    finally:
        mp.undo()


RUNS = [(c, lay, cf) for cf in CONFIGS for c, lay in TILED if _plannable(c, lay, cf)]


def test_window_groups_are_tiled_and_others_are_not():
    cases = {c for c, _ in TILED}
    assert {"bn_relu_maxpool", "maxpool_relu", "avgpool_pad_include"} <= cases
    assert len(TILED) >= 20
    b = Builder("nchw")  # 2x2/2: windows do not overlap, each input is read once anyway
    x = b.input("x", (2, 4, 8, 8))
    g, names = b.done(b.node("max_pool2d", (b.node("relu", (x,)),), **pool_attrs(2, 2)))
    assert tiled.tile_plan(group_from_nodes(g, names), FAKE_GPU) is None
    b = Builder("nchw")  # two outputs: the pre-window value is written too
    x = b.input("x", (2, 4, 8, 8))
    r = b.node("relu", (x,))
    g, names = b.done(r, b.node("max_pool2d", (r,), **pool_attrs(3, 2, 1)))
    assert tiled.tile_plan(group_from_nodes(g, names), FAKE_GPU) is None


def _render(case: str, layout: str, config: str, monkeypatch, emulate: bool = True):  # noqa: ANN001, ANN202
    monkeypatch.setattr(tiled, "SMEM_FLOATS", CONFIGS[config][0])
    graph, names = CASES[case](layout)
    group = group_from_nodes(graph, names, name=f"tiled_{case}_{layout}_{config}")
    hw = _hardware(config)
    plan = tiled.tile_plan(group, hw)
    assert plan is not None
    return graph, group, tiled.render_tiled(group, plan, hw, emulate=emulate)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """Every tiled case in every config as one emulation library (one g++ run)."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ for the emulation")
    mp = pytest.MonkeyPatch()
    parts = []
    try:
        for i, (case, layout, config) in enumerate(RUNS):
            _, _, r = _render(case, layout, config, mp)
            parts.append(f"namespace t{i} {{\n{r.source}}}\n")
    finally:
        mp.undo()
    cache = tmp_path_factory.mktemp("cuda-tiled")
    return build(emulation_request("tiled_cases", "\n".join(parts)), cache)


def test_most_cases_are_tiled_in_every_config(monkeypatch):
    for config in CONFIGS:
        assert sum(cf == config for _, _, cf in RUNS) >= len(TILED) - 2, config
    for layout in LAYOUTS:  # shrunk tiles: a plane splits into rows (and columns) of tiles
        graph, group, _ = _render("bn_relu_maxpool", layout, "tiny", monkeypatch)
        plan = tiled.tile_plan(group, _hardware("tiny"))
        _, c, oh, ow = graph.values[group.outputs[0]].shape
        assert plan.toh < oh and plan.tc < c and (layout == "nchw" or plan.tow < ow)


@pytest.mark.parametrize("case,layout,config", RUNS)
def test_tiled_kernel_matches_pytorch(case, layout, config, library, monkeypatch):
    graph, group, rendered = _render(case, layout, config, monkeypatch)
    assert "__syncthreads" in rendered.source and "__shared__" in rendered.source
    kernel = GeneratedKernel(rendered, EmulatedLauncher(library, rendered.name))
    inputs = inputs_for(graph, seed=zlib.crc32(f"tiled/{case}/{layout}".encode()) % 1000)
    expected = graph.evaluate(*inputs)
    got = kernel(*kernel_args(graph, group.inputs, inputs))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc (CUDA toolkit) is not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_tiled_kernels_compile_with_nvcc(arch, tmp_path, monkeypatch):
    parts, names = [], []
    for i, (case, layout, config) in enumerate(RUNS):
        _, _, r = _render(case, layout, config, monkeypatch, emulate=False)
        parts.append(f"namespace t{i} {{\n{r.source}}}\n")
        names.append(r.name)
    cubin = build(cubin_request(f"tiled_{arch}", "\n".join(parts), arch, compiler="nvcc"), tmp_path)
    blob = cubin.read_bytes()
    assert all(n.encode() in blob for n in names)
