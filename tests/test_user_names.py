"""User names (modules, values) never collide with the identifiers a generated kernel
declares (issue 11): a submodule named ``c`` gave ``c_nchw[...] = c[...]`` with ``c`` also
the channel loop variable, and the group fell back. Every user-derived name now lives in
its own namespace in the C and ISPC sources (``v_``/``p_``/``o<dim>_`` prefixes)."""

from __future__ import annotations

import re
import shutil
import subprocess
import warnings

import numpy as np
import pytest
import torch
from conftest import OPT_ATOL, OPT_RTOL, assert_tree_close
from fusion_helpers import check_group, hardware
from torch import nn

import middleware
from middleware.backends.x86 import IspcBackend, X86Backend
from middleware.graph import Graph, Node, TensorType
from middleware.ops import infer_types

# loop variables, tile origins, accumulator names, helpers and libc/math functions of the
# generated sources, all valid module names
CLASHING = ["c", "w", "n", "h", "i", "t", "x", "acc", "acc0", "acc_v", "t_h", "k_w", "expf"]


class Named(nn.Module):
    """batch-norm -> ReLU -> max-pool with the batch-norm registered under ``name``; its
    output is also returned, so it is a buffer of the generated kernel."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        bn = nn.BatchNorm2d(4)
        with torch.no_grad():
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
        self.add_module(name, bn)
        self.pool = nn.MaxPool2d(3, 2, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = getattr(self, self.name)(x)
        return self.pool(torch.relu(y)), y


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("name", CLASHING)
def test_module_named_like_a_kernel_identifier_runs_generated(name: str, layout: str) -> None:
    model = Named(name).eval()
    x = torch.randn(2, 4, 9, 9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a kernel that fails to compile only warns
        opt = middleware.optimize(model, device="cpu", example_inputs=[x], layout=layout)
        with torch.no_grad():
            got = opt(x)
    rows = opt.report().rows
    assert not [r for r in rows if r.runs_as == "fallback"], str(opt.report())
    # (channels_last: the two-output group splits and some pieces run in the framework as
    # "vendor"; the conversion of ``name``'s output, ``<name>_nchw = <name>``, is generated)
    assert any(r.runs_as == "generated" for r in rows), str(opt.report())
    with torch.no_grad():
        assert_tree_close(got, model(x), OPT_RTOL, OPT_ATOL)


def _clashing_graph() -> Graph:
    """input ``c`` -> batch-norm ``w`` (value ``h``) -> ReLU ``acc`` (value ``n``) -> 3x3/1
    max-pool ``x`` (value ``t_h``): the ReLU's output is materialised in per-tile scratch
    (read through a window), so buffers, scratch origins and constants all carry user
    names."""
    rng = np.random.default_rng(0)
    g = Graph()
    g.add_input("c", TensorType((2, 5, 9, 7), "float32", "nhwc"))
    stats = [
        g.add_param(f"w.{k}", rng.uniform(0.5, 2, 5).astype(np.float32))
        for k in ("mean", "var", "weight", "bias")
    ]
    pool = dict(kernel_size=(3, 3), stride=(1, 1), padding=(0, 0), dilation=(1, 1))
    io = dict(bound="io", group=0)
    nodes = [
        Node("w", "batch_norm", ("c", *stats), ("h",), {"eps": 1e-5}, **io),
        Node("acc", "relu", ("h",), ("n",), {}, **io),
        Node("x", "max_pool2d", ("n",), ("t_h",), {**pool, "ceil_mode": False}, **io),
    ]
    for node in nodes:
        g.add_node(node, infer_types(g.values, node))
    g.set_outputs("t_h")
    return g


def test_c_kernel_with_clashing_value_names_compiles_and_matches(tmp_path) -> None:
    check_group(_clashing_graph(), tmp_path)


def _declared(src: str) -> set[str]:
    """Names declared as arrays, pointers or scalar constants in C/ISPC source."""
    pats = [
        r"float\s*\*\s*(?:restrict\s+)?(\w+)",
        r"float\s+(\w+)\s*\[",
        r"const\s+(?:uniform\s+)?int\s+(\w+)\s*=",
    ]
    return {m for p in pats for m in re.findall(p, src)}


@pytest.mark.parametrize("backend", [X86Backend, IspcBackend])
def test_sources_prefix_every_user_name(backend: type) -> None:
    """Checked on the text (the ISPC one needs no ispc binary): no user value or layer name
    is declared or read bare."""
    g = _clashing_graph()
    be = backend()
    s = be.schedule(g, [n.name for n in g.nodes()], hardware())
    src = be.render(s)
    text = "\n".join(src) if isinstance(src, tuple) else src
    declared = _declared(text)
    user = {"c", "h", "n", "t_h", "w", "acc", "x"}
    assert {"v_c", "v_t_h", "v_n", "oh_v_n"} <= declared, declared
    assert any(d.startswith("p_w_") for d in declared), declared
    for d in declared:
        # a user's name is only ever declared prefixed; the kernel's own names (acc, the
        # AVX-512 stages' s_, e_, any_nan, ...) are never the graph's bare user names
        prefixed = d[:2] in ("v_", "p_") or re.match(r"o[nchw]_v_", d)
        assert prefixed or d not in user - {"acc"}, d
    code = re.sub(r"/\*.*?\*/", "", text, flags=re.S)  # comments may name the layers
    for name in user - {"acc"}:
        assert not re.search(rf"(?<![\w.]){re.escape(name)}\s*\[", code), name


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
def test_ispc_glue_with_clashing_names_compiles(tmp_path) -> None:
    """The ISPC kernel's C glue (declarations and the per-tile call with the namespaced
    scratch names) is valid C, checked with gcc without an ispc binary."""
    g = _clashing_graph()
    be = IspcBackend()
    _, glue = be.render(be.schedule(g, [n.name for n in g.nodes()], hardware()))
    src = tmp_path / "glue.c"
    src.write_text(glue)
    proc = subprocess.run(
        ["gcc", "-fsyntax-only", "-fopenmp", "-Wall", "-Werror", str(src)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
