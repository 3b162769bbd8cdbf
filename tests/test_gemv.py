"""The generated streaming GEMV (linear's ``gemv`` algorithm, backends/vendor/gemv.py) and,
above 4 rows, its blocked product, against ``F.linear`` plus the activation: random row
counts (1..16, leading dims of rank 2 and 3; partial blocks of weight and input rows), feature counts on and off the kernel's 64-float step, bias or none, activations,
NaN/inf; and through ``optimize()`` on a small classifier. Exact up to float rounding
(2e-5 of the output's scale)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from fusion_helpers import hardware
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import middleware
from middleware.backends.vendor import algorithms as alg
from middleware.graph import Graph, Node, TensorType
from middleware.ops import get_op, infer_types
from middleware.options import Options

CPU = torch.device("cpu")


def _case(lead, in_f, out_f, activation=None, bias=True, seed=0):
    rng = np.random.default_rng(seed)
    g = Graph()
    g.add_input("x", TensorType((*lead, in_f)))
    w = (rng.standard_normal((out_f, in_f)) / math.sqrt(in_f)).astype(np.float32)
    g.add_param("w", w)
    ins = ["x", "w"]
    if bias:
        g.add_param("b", rng.standard_normal(out_f).astype(np.float32))
        ins.append("b")
    attrs = {} if activation is None else dict(activation=activation, activation_attrs=())
    node = Node("l", "linear", tuple(ins), ("y",), attrs)
    g.add_node(node, infer_types(g.values, node))
    g.set_outputs("y")
    return g, node


def _run(g, node, x, tmp_path, vendor=None):
    opts = Options(cache_dir=tmp_path)
    assert alg.GEMV.applies(g, node, CPU, opts) is None
    hw = hardware() if vendor is None else dataclasses.replace(hardware(), vendor=vendor)
    fn = alg.GEMV.build(g, node, CPU, opts, hw)
    args = [x, torch.from_numpy(g.params["w"])]
    if "b" in g.params:
        args.append(torch.from_numpy(g.params["b"]))
    before = x.clone()
    y = fn(*args)
    assert torch.equal(x.nan_to_num(), before.nan_to_num()), "gemv wrote its input"
    return y, get_op("linear").bind(node)(*args)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lead=st.sampled_from([(1,), (2,), (4,), (5,), (8,), (2, 3), (1, 7), (13,), (16,), (3, 5)]),
    in_f=st.sampled_from([1, 15, 64, 65, 200, 1029]),
    out_f=st.integers(1, 70),
    activation=st.sampled_from([None, "relu", "sigmoid", "hardswish"]),
    bias=st.booleans(),
    # the two forms of the streaming GEMV (gemv.stream_form): Intel's, several rows of W
    # side by side (any output count: 4, 2 or 1 at a time), and AMD's
    vendor=st.sampled_from(["GenuineIntel", "AuthenticAMD"]),
)
def test_gemv_matches_pytorch(lead, in_f, out_f, activation, bias, vendor, tmp_path_factory):
    g, node = _case(lead, in_f, out_f, activation, bias)
    x = torch.randn(*lead, in_f)
    y, ref = _run(g, node, x, tmp_path_factory.getbasetemp() / "gemv", vendor)
    scale = max(1e-12, float(ref.abs().max()))
    torch.testing.assert_close(y, ref, rtol=2e-5, atol=2e-5 * scale)


@pytest.mark.parametrize("rows", [3, 11])
def test_nan_and_infinity_spread_as_in_pytorch(rows, tmp_path):
    g, node = _case((rows,), 130, 9, "relu")
    x = torch.randn(rows, 130)
    x[0, 5], x[2, 129] = math.nan, math.inf
    y, ref = _run(g, node, x, tmp_path)
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
    fin = ref.isfinite()
    torch.testing.assert_close(y[fin], ref[fin], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
def test_each_output_sums_in_one_order_whatever_the_rows(vendor, tmp_path):
    """An output's sum does not depend on how many rows of W a pass reads side by side
    (gemv.stream_form: on Intel 4 at one row of x, 1 at three rows) or on the rows of x:
    row 0 of a three-row call equals the one-row call's bit for bit."""
    in_f, out_f = 1029, 12
    x = torch.randn(3, in_f)
    g1, n1 = _case((1,), in_f, out_f)  # no activation: every output a sum, none clamped
    g3, n3 = _case((3,), in_f, out_f)
    y1, _ = _run(g1, n1, x[:1].clone(), tmp_path, vendor)
    y3, _ = _run(g3, n3, x, tmp_path, vendor)
    assert torch.equal(y1[0], y3[0])


def test_gemv_declines_many_rows_and_other_devices():
    g, node = _case((17,), 16, 4)
    assert "17 rows" in alg.GEMV.applies(g, node, CPU, Options())
    g1, node1 = _case((1,), 16, 4)
    assert "x86 only" in alg.GEMV.applies(g1, node1, torch.device("cuda"), Options())
    assert alg.GEMV.exact and "gemv" in alg.algorithm_names("linear")


@pytest.mark.parametrize("batch", [1, 3])
def test_gemv_through_optimize(batch, tmp_path, tree_close):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(300, 129), nn.ReLU(), nn.Dropout(), nn.Linear(129, 10)
    ).eval()
    x = torch.randn(batch, 3, 10, 10)
    opt = middleware.optimize(
        model, example_inputs=[x], cache_dir=tmp_path, algorithms={"linear": "gemv"}
    )
    with torch.no_grad():
        tree_close(opt(x), model(x), rtol=1e-4, atol=1e-4)
    rows = [r for r in opt.report().rows if r.op == "linear"]
    assert [r.algorithm for r in rows] == ["gemv", "gemv"], rows


@pytest.mark.parametrize("batch", [1, 4, 12, 17])
def test_the_default_runs_one_row_as_the_gemv(batch, tmp_path, tree_close):
    """With no selection, a linear layer on one row is the generated GEMV and on 5 to 16
    rows its blocked product (each measured faster than F.linear and oneDNN there), with
    the reason in report(); at 2-4 rows and above 16 the vendor call is;
    algorithms={'linear': 'vendor'} keeps the vendor call on one row."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Flatten(), nn.Linear(300, 129), nn.ReLU(), nn.Linear(129, 10))
    model = model.eval()
    x = torch.randn(batch, 3, 10, 10)
    opt = middleware.optimize(model, example_inputs=[x], cache_dir=tmp_path)
    with torch.no_grad():
        tree_close(opt(x), model(x), rtol=1e-4, atol=1e-4)
    rows = [r for r in opt.report().rows if r.op == "linear"]
    want = "gemv" if batch in (1, 12) else "vendor"
    assert [r.algorithm for r in rows] == [want, want], rows
    if batch == 12:
        assert all("5 to 16 rows" in r.reason for r in rows), rows
    if batch == 1:
        assert all("one row" in r.reason for r in rows), rows
        named = middleware.optimize(
            model, example_inputs=[x], cache_dir=tmp_path, algorithms={"linear": "vendor"}
        )
        assert {r.algorithm for r in named.report().rows if r.op == "linear"} == {"vendor"}
