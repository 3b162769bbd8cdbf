"""The PyTorch frontend: fallback nodes, whole-model fallback, the graph it produces.

Numerical checks compare against eager PyTorch on seeded random inputs: fallback nodes run
the original callable, so they must match exactly up to float rounding (rtol 1e-5,
atol 1e-6 times the output's scale); optimized modules within rtol 1e-4, atol 1e-4 times
the output's scale.
"""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import middleware
from middleware.errors import TraceError

EVAL_RTOL, EVAL_ATOL = 1e-5, 1e-6
OPT_RTOL, OPT_ATOL = 1e-4, 1e-4


def _fallback_rows(optimized: nn.Module) -> dict[str, str]:
    return {r.node: r.reason for r in optimized.report().rows if r.runs_as == "fallback"}


# ---------------------------------------------------------------- fallback nodes
class UnknownModule(nn.Module):
    """A torch.nn leaf module that the catalogue does not know, between known ops."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)
        self.act = nn.CELU(alpha=0.7)
        self.norm = nn.InstanceNorm2d(5, affine=True)  # has parameters of its own
        self.shuffle = nn.PixelShuffle(2)

    def forward(self, x):  # noqa: ANN001, ANN201
        return self.shuffle(self.norm(self.act(self.conv(x))).repeat(1, 4, 1, 1)).relu()


class UnknownFunction(nn.Module):
    def forward(self, x):  # noqa: ANN001, ANN201
        y = torch.cumsum(torch.relu(x), 3)
        return torch.expm1(torch.clamp(y, min=-1.0, max=0.5)) + 1


class UnknownMethod(nn.Module):
    def forward(self, x):  # noqa: ANN001, ANN201
        y = x.relu().pow(2).cumsum(1)
        values, _ = y.max(dim=1, keepdim=True)  # a multi-output fallback
        return y.sum(dim=(2, 3)), values - torch.max(x, 1).values.unsqueeze(1)


@pytest.mark.parametrize(
    ("model_cls", "shape", "fallback_reasons"),
    [
        (
            UnknownModule,
            (2, 3, 5, 7),
            {"act": "module 'act'", "norm": "module 'norm'", "shuffle": "module 'shuffle'"},
        ),
        (
            UnknownFunction,
            (2, 3, 5, 7),
            {"cumsum": "cumsum", "clamp": "clamp", "expm1": "expm1"},
        ),
        (
            UnknownMethod,
            (2, 3, 5, 7),
            {"pow_1": "Tensor.pow", "cumsum": "Tensor.cumsum", "max_1": "Tensor.max"},
        ),
    ],
)
def test_unknown_call_becomes_fallback_node(model_cls, shape, fallback_reasons, tree_close):
    model = model_cls().eval()
    x = torch.randn(shape)
    graph = middleware.trace(model, x)
    ops = {n.name: n.op for n in graph.nodes()}
    for name in fallback_reasons:
        assert ops.get(name) == "fallback", graph.text()
    assert any(op != "fallback" for op in ops.values()), "known ops must still be lowered"
    tree_close(graph.evaluate(x), model(x), EVAL_RTOL, EVAL_ATOL)

    optimized = middleware.optimize(model)
    fresh = torch.randn(shape)
    with torch.no_grad():
        expected = model(fresh)
    tree_close(optimized(fresh), expected, OPT_RTOL, OPT_ATOL)
    rows = _fallback_rows(optimized)
    for name, words in fallback_reasons.items():
        assert name in rows, str(optimized.report())
        assert words in rows[name] and "not in the op catalogue" in rows[name], rows[name]
    assert "fallbacks:" in str(optimized.report())
    for r in optimized.report().rows:
        assert r.runs_as in ("vendor", "generated", "fallback")
        assert r.bound in ("io", "param", "compute")


def test_fallback_runs_the_original_callable() -> None:
    """A fallback node calls the user's own module object (not a copy): a hook counts it."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.CELU()

        def forward(self, x):  # noqa: ANN001, ANN201
            return self.act(x) * 2

    model = Model().eval()
    calls = []
    model.act.register_forward_hook(lambda mod, args, out: calls.append(mod))
    graph = middleware.trace(model, torch.randn(2, 3))
    assert [n.op for n in graph.nodes()] == ["fallback", "mul"], graph.text()
    optimized = middleware.optimize(model, example_inputs=torch.randn(4, 3))
    calls.clear()  # tracing ran the model once on the example inputs
    x = torch.randn(4, 3)
    out = optimized(x)
    assert calls == [model.act]
    torch.testing.assert_close(out, F.celu(x) * 2, rtol=EVAL_RTOL, atol=EVAL_ATOL)


def test_fallback_with_kwargs_and_nested_arguments(tree_close) -> None:
    class Model(nn.Module):
        def forward(self, x, y):  # noqa: ANN001, ANN201
            s = torch.stack([x, y.relu()], dim=1)  # a list argument holding two values
            return torch.where(x > 0, x, y), s.prod(dim=1, keepdim=False)

    model = Model().eval()
    x, y = torch.randn(3, 5), torch.randn(3, 5)
    optimized = middleware.optimize(model)
    tree_close(optimized(x, y), model(x, y), OPT_RTOL, OPT_ATOL)
    assert {"stack", "where", "gt", "prod"} <= set(_fallback_rows(optimized))


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        (
            lambda x: F.max_pool2d(x, 2, return_indices=True)[0],
            "max_pool2d_with_indices is not in the op catalogue",
        ),
        (lambda x: F.dropout(x, 0.5), "dropout with training=True"),
        (lambda x: torch.div(x, 3, rounding_mode="floor"), "div with a rounding_mode"),
        (lambda x: F.softmax(x, 1, dtype=torch.float64).float(), "softmax with a dtype"),
        (lambda x: torch.add(x, True), "add of _V and bool"),
    ],
    ids=["maxpool-indices", "dropout-training", "div-rounding", "softmax-dtype", "add-bool"],
)
def test_variants_outside_the_catalogue_fall_back(fn, reason, tree_close) -> None:
    """A known call with arguments the catalogue op cannot express runs as a fallback node."""

    class Model(nn.Module):
        def forward(self, x):  # noqa: ANN001, ANN201
            return fn(x)

    model = Model().eval()
    x = torch.randn(2, 3, 6, 6)
    graph = middleware.trace(model, x)
    fallbacks = [n for n in graph.nodes() if n.op == "fallback"]
    assert fallbacks and reason in fallbacks[0].attrs["reason"], graph.text()
    optimized = middleware.optimize(model)
    if "dropout" in reason:  # random: compare the kept mask's scale, not values
        out = optimized(x)
        assert out.shape == x.shape and set(
            torch.unique(out[out != 0] / x[out != 0]).round().tolist()
        ) <= {2.0}
    else:
        tree_close(optimized(x), model(x), OPT_RTOL, OPT_ATOL)
    assert reason in optimized.report().fallbacks[0].reason


def test_conv_padding_mode_falls_back(tree_close) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")).eval()
    x = torch.randn(1, 3, 5, 5)
    optimized = middleware.optimize(model)
    tree_close(optimized(x), model(x), OPT_RTOL, OPT_ATOL)
    assert "conv padding_mode='reflect'" in optimized.report().fallbacks[0].reason


# --------------------------------------------------------- whole-model fallback
class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x):  # noqa: ANN001, ANN201
        y = self.conv(x)
        if y.sum() > 0:  # control flow on a tensor value: fx cannot trace it
            return y * 2
        return y - 1


def test_untraceable_model_is_captured_through_dynamo(tree_close) -> None:
    """fx gives up on data-dependent control flow; optimize() captures the model through
    TorchDynamo instead (tests/test_dynamo_capture.py has the details)."""
    model = DataDependent().eval()
    with pytest.raises(TraceError, match="control flow"):
        middleware.trace(model, torch.randn(1, 3, 4, 4))

    optimized = middleware.optimize(model)
    for sign in (1.0, -1.0):  # both branches, decided per call like the original
        x = torch.full((1, 3, 4, 4), sign)
        with torch.no_grad():
            tree_close(optimized(x), model(x), OPT_RTOL, OPT_ATOL)

    report = optimized.report()
    assert report.subgraphs and report.breaks
    assert "torch.fx could not trace DataDependent" in str(report)
    assert "control flow" in report.breaks[0].reason


def test_untraceable_model_strict_raises() -> None:
    optimized = middleware.optimize(DataDependent().eval(), strict=True)
    with pytest.raises(TraceError, match="control flow"):
        optimized(torch.randn(1, 3, 4, 4))


def test_untraceable_model_with_example_inputs_captures_at_optimize() -> None:
    optimized = middleware.optimize(DataDependent().eval(), example_inputs=torch.randn(1, 3, 2, 2))
    assert optimized.report().subgraphs


def test_shape_dependent_control_flow_is_specialised(tree_close) -> None:
    """Shapes are concrete while tracing: branching on them traces, once per signature."""

    class Model(nn.Module):
        def forward(self, x):  # noqa: ANN001, ANN201
            if x.shape[0] > 2:
                return x.relu()
            return x.sigmoid().view(x.size(0), -1)

    model = Model().eval()
    optimized = middleware.optimize(model)
    for n in (1, 4):
        x = torch.randn(n, 3, 5, 5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no whole-model fallback
            tree_close(optimized(x), model(x), OPT_RTOL, OPT_ATOL)
        assert not optimized.report().fallbacks


# ----------------------------------------------------------- the graph itself
class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.fc = nn.Linear(6, 4)

    def forward(self, x, bias):  # noqa: ANN001, ANN201
        y = F.relu(self.bn(self.conv(x)), inplace=True)
        a, b = y.chunk(2, dim=1)
        pooled = torch.flatten(F.adaptive_avg_pool2d(a + b, 1), 1)
        return {"logits": self.fc(torch.cat([pooled, pooled], 1)) + bias, "features": [a, b]}


def test_graph_text_and_structure() -> None:
    model = TwoHeads().eval()
    graph = middleware.trace(model, (torch.randn(2, 3, 5, 7), torch.randn(4)))
    assert graph.inputs == ["x", "bias"]
    assert graph.values["x"].shape == (2, 3, 5, 7)
    assert [n.op for n in graph.nodes()] == [
        "conv2d", "batch_norm", "relu", "split", "add", "adaptive_avg_pool2d", "flatten",
        "cat", "linear", "add",
    ]  # fmt: skip
    text = graph.text()
    lines = text.splitlines()
    assert lines[0] == "input  x: float32[2x3x5x7]"
    assert lines[1] == "input  bias: float32[4]"
    assert any(line.startswith("params ") for line in lines)
    assert len([ln for ln in lines if " = " in ln]) == len(graph)  # one line per node
    assert "conv: float32[2x6x5x7] = conv2d(x, conv.weight, conv.bias; stride=(1,1)" in text
    assert lines[-1].startswith("return {logits: ")
    assert set(graph.params) >= {"conv.weight", "conv.bias", "fc.weight", "bn.running_var"}
    assert graph.params["conv.weight"].shape == (6, 3, 3, 3)
    # framework-neutral: parameters are numpy arrays, no torch object in the records
    assert all(type(a).__module__ == "numpy" for a in graph.params.values())
    for n in graph.nodes():
        assert n.payload is None


def test_inplace_on_intermediate_is_seen_by_later_readers(tree_close) -> None:
    class Model(nn.Module):
        def forward(self, x):  # noqa: ANN001, ANN201
            y = x * 2
            z = y + 1  # reads y before the in-place op
            y.relu_()
            y += z  # reads y after it
            return y, z

    model = Model().eval()
    x = torch.randn(3, 5, 7, 9)
    graph = middleware.trace(model, x)
    assert "fallback" not in [n.op for n in graph.nodes()]
    tree_close(graph.evaluate(x), model(x), EVAL_RTOL, EVAL_ATOL)
    tree_close(middleware.optimize(model)(x), model(x), OPT_RTOL, OPT_ATOL)


Pair = collections.namedtuple("Pair", "main aux")


def test_output_structures_are_kept(tree_close) -> None:
    class Model(nn.Module):
        def forward(self, x):  # noqa: ANN001, ANN201
            r = x.relu()
            return {"pair": Pair(r, (x.sigmoid(), [r - 1, None])), "n": 3, "x": x}

    model = Model().eval()
    x = torch.randn(2, 3, 4, 4)
    graph = middleware.trace(model, x)
    assert "fallback" not in [n.op for n in graph.nodes()], graph.text()
    out = middleware.optimize(model)(x)
    tree_close(out, model(x), OPT_RTOL, OPT_ATOL)
    assert isinstance(out["pair"], Pair)


def test_namedtuple_fields_of_results() -> None:
    class Model(nn.Module):
        def forward(self, x):  # noqa: ANN001, ANN201
            return torch.max(x, dim=1).values + x.min(1).indices.float()

    model = Model().eval()
    x = torch.randn(3, 5, 7)
    torch.testing.assert_close(middleware.optimize(model)(x), model(x), rtol=0, atol=0)


def test_parameters_shared_between_calls_are_one_graph_constant() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):  # noqa: ANN001, ANN201
            return self.conv(self.conv(x))

    graph = middleware.trace(Model().eval(), torch.randn(1, 4, 5, 5))
    convs = [n for n in graph.nodes() if n.op == "conv2d"]
    assert len(convs) == 2 and convs[0].inputs[1:] == convs[1].inputs[1:]
    assert len(graph.params) == 2


def test_trace_with_too_many_example_inputs() -> None:
    with pytest.raises(TraceError, match="takes 1 inputs but 2 example inputs"):
        middleware.trace(nn.ReLU(), (torch.randn(2), torch.randn(2)))
