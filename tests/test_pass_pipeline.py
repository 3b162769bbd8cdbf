"""The pipeline end to end: names, disable_passes, debug_dir, no mutation, report groups."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import middleware
from middleware import trace
from middleware.options import Options
from middleware.passes import PIPELINE, make_pipeline, pass_names, run_passes
from middleware.passes.verify import check_equivalent

EXPECTED = [
    "canonicalize",
    "decompose_layer_norm",
    "decompose_softmax",
    "fold_batchnorm",
    "merge_concat",
    "pool_before_concat",
    "merge_pool_relu",
    "fuse_vendor_epilogue",
    "layout",
    "fuse_depthwise",
    "fuse_stem",
    "classify",
    "group",
]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.b1 = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1)
        self.fc = nn.Linear(16, 4)
        self.drop = nn.Dropout()

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        z = torch.cat([y, torch.relu(self.dw(y))], 1)
        z = nn.functional.max_pool2d(z, 2)
        z = torch.relu(self.c2(z))
        return self.fc(self.drop(torch.flatten(nn.functional.adaptive_avg_pool2d(z, 1), 1)))


def net() -> nn.Module:
    torch.manual_seed(0)
    m = Net().eval()
    m.b1.running_mean.uniform_(-1, 1)
    m.b1.running_var.uniform_(0.5, 2)
    return m


def test_pipeline_is_a_named_list():
    assert pass_names() == EXPECTED
    assert [n for n, _ in make_pipeline(middleware.passes.DEFAULT_HARDWARE)] == EXPECTED
    assert all(callable(p) for _, p in PIPELINE)


def test_passes_do_not_mutate_their_input():
    g = trace(net(), (torch.randn(1, 3, 16, 16),))
    text, params = g.text(), {k: v.copy() for k, v in g.params.items()}
    current = g
    for name, fn in PIPELINE:
        before_text = current.text()
        new = fn(current)
        assert new is not current, name
        assert current.text() == before_text, f"{name} modified its input"
        check_equivalent(current, new, tol=1e-5)
        current = new
    assert g.text() == text
    for k, v in params.items():
        np.testing.assert_array_equal(g.params[k], v)


def test_disable_passes_and_debug_dir(tmp_path):
    m = net()
    x = torch.randn(2, 3, 16, 16)
    debug = tmp_path / "dbg"
    om = middleware.optimize(
        m,
        measure_hardware=False,
        cache_dir=tmp_path / "cache",
        disable_passes=["fold_batchnorm", "merge_pool_relu"],
        debug_dir=debug,
        strict=True,
    )
    with torch.no_grad():
        torch.testing.assert_close(om(x), m(x), rtol=1e-4, atol=1e-4)
    files = sorted(p.name for p in debug.iterdir())
    assert files == [
        "000_input.txt",
        "001_canonicalize.txt",
        "002_decompose_layer_norm.txt",
        "003_decompose_softmax.txt",
        "005_merge_concat.txt",
        "006_pool_before_concat.txt",
        "008_fuse_vendor_epilogue.txt",
        "009_layout.txt",
        "010_fuse_depthwise.txt",
        "011_fuse_stem.txt",
        "012_classify.txt",
        "013_group.txt",
    ]
    ops = [n.op for n in om.graph.nodes()]
    assert "batch_norm" in ops and "maxpool_relu" not in ops
    assert "[io g" in (debug / "013_group.txt").read_text()
    assert set(om.graph.meta["pass_times"]) == set(EXPECTED) - {"fold_batchnorm", "merge_pool_relu"}


def test_unknown_pass_name_lists_the_passes():
    g = trace(net(), (torch.randn(1, 3, 8, 8),))
    with pytest.raises(
        ValueError, match="canonicalize, decompose_layer_norm, decompose_softmax, fold_batchnorm"
    ):
        run_passes(g, Options(disable_passes=("fold_bn",)))


def test_report_groups(tmp_path):
    m = net()
    x = torch.randn(1, 3, 16, 16)
    om = middleware.optimize(m, measure_hardware=False, cache_dir=tmp_path, strict=True)
    om(x)
    g, report = om.graph, om.report()
    assert {r.group for r in report.rows} == {gr.group for gr in report.groups}
    assert [r.node for r in report.rows] == [n.name for n in g.nodes()]
    for gr in report.groups:
        nodes = [g.node(n) for n in gr.nodes]
        assert all(n.group == gr.group for n in nodes)
        inside = {v for n in nodes for v in n.outputs}
        read = {v for n in nodes for v in n.inputs} - inside
        later = {v for n in g.nodes() if n.group != gr.group for v in n.inputs}
        written = {v for v in inside if v in later or v in g.output_values()}
        assert gr.bytes == sum(g.values[v].nbytes for v in read | written)
        assert gr.flops_per_byte == pytest.approx(gr.flops / gr.bytes)
    # the io group around the concat: its intermediates are not counted
    cat_group = next(gr for gr in report.groups if any(o.startswith("cat") for o in gr.ops))
    node_bytes = sum(r.bytes for r in report.rows if r.group == cat_group.group)
    assert len(cat_group.nodes) > 1 and cat_group.bytes < node_bytes
    text = str(report)
    assert len(text.splitlines()) == len(report.notes) + 2 + len(report.groups) + 1 + len(
        {gr.bound for gr in report.groups}
    )
    assert "maxpool" in text and "conv2d+relu" in text
    verbose = report.verbose()
    assert len(verbose.splitlines()) == len(report.notes) + 1 + len(report.rows)


def test_without_classify_groups_use_the_catalogue_class(tmp_path):
    m = net()
    x = torch.randn(1, 3, 16, 16)
    om = middleware.optimize(
        m, measure_hardware=False, cache_dir=tmp_path, disable_passes=["classify"], strict=True
    )
    with torch.no_grad():
        torch.testing.assert_close(om(x), m(x), rtol=1e-4, atol=1e-4)
    bounds = {n.op: n.bound for n in om.graph.nodes()}
    assert bounds["conv2d"] == "compute" and bounds["linear"] == "param"
    assert all(n.group is not None for n in om.graph.nodes())


def test_all_passes_off_leaves_the_graph_alone():
    g = trace(net(), (torch.randn(1, 3, 8, 8),))
    out = run_passes(g, Options(disable_passes=tuple(EXPECTED)))
    assert out is not g and out.text() == g.text() and "pass_times" not in g.meta
