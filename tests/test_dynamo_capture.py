"""Capture through TorchDynamo (issue 15, part 0): where ``torch.fx`` cannot trace a model,
``optimize()`` captures it through dynamo, optimizes each subgraph with the middleware's
pipeline and keeps the Python between them; ``report()`` lists subgraphs and breaks.

Every numerical check compares against eager PyTorch on seeded inputs, within 1e-4 of the
output's scale, on weights re-initialised so that activations keep their variance.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from conftest import OPT_ATOL, OPT_RTOL
from net_helpers import assert_matches, nondegenerate

import middleware
from middleware.capture import GRAD_REASON, Capture, CaptureReport
from middleware.enums import RunsAs
from middleware.frontends.dynamo import CONSTANT, TENSOR, freeze, placeholders, refusal


class Untraceable(nn.Module):
    """A block written as models outside torchvision are: a runtime shape assert, a
    ``torch.jit.is_scripting()`` branch, data-dependent control flow and ``.item()``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._assert(x.shape[1] == 3, "expects RGB input")
        y = F.relu(self.bn1(self.conv1(x)))
        if not torch.jit.is_scripting():
            y = y + 0.5
        if y.mean() > 1.0:  # data-dependent: fx cannot trace this, dynamo breaks here
            y = y * 0.5
        else:
            y = y - 0.25
        scale = float(y.abs().amax().item())  # a value read back to Python
        y = F.relu(self.bn2(self.conv2(y / max(scale, 1e-3))))
        return self.fc(F.adaptive_avg_pool2d(y, 1).flatten(1))


def _untraceable() -> nn.Module:
    return nondegenerate(Untraceable())


def _optimized_rows(report: CaptureReport) -> list:
    return [r for r in report.rows if r.runs_as != RunsAs.FALLBACK]


def test_untraceable_model_is_captured_and_matches() -> None:
    model = _untraceable()
    x = torch.randn(2, 3, 16, 16)
    with pytest.raises(middleware.TraceError):
        middleware.trace(model, x)  # fx alone gives up on this model
    opt = middleware.optimize(model)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no "running as the original" warning
        for inp in (x, x + 1.0):  # both sides of the data-dependent branch
            assert_matches(opt(inp), model(inp))
    report = opt.report()
    assert isinstance(report, CaptureReport)
    assert len(report.subgraphs) >= 3, str(report)
    assert all(s.optimized for s in report.subgraphs), str(report)
    assert len(report.breaks) >= 2, str(report)
    reasons = " | ".join(b.reason for b in report.breaks)
    assert "data-dependent" in reasons and "item()" in reasons, reasons
    # the convolutions and the linear layer run through the middleware's plans
    ops = {r.op for r in _optimized_rows(report)}
    assert {"conv2d", "linear"} <= ops, ops
    breaks = [r for r in report.rows if r.op == "graph_break"]
    assert len(breaks) == len(report.breaks) and all(r.reason for r in breaks)
    text = str(report)
    assert "torch.fx could not trace" in text and "subgraph g0" in text and "break0" in text


def test_capture_follows_weight_changes() -> None:
    model = _untraceable()
    opt = middleware.optimize(model)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert_matches(opt(x), model(x))
        model.conv2.weight.mul_(-1.5)  # in place: the version counter moves
        assert_matches(opt(x), model(x))
        model.fc.weight = nn.Parameter(torch.randn_like(model.fc.weight))  # a new object
        assert_matches(opt(x), model(x))


class SmallNet(nn.Module):
    """A small CNN without breaks: conv-bn-relu, a residual, pooling, a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)) + y)
        y = self.pool(y)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


def test_torch_compile_backend_by_name_matches() -> None:
    model = nondegenerate(SmallNet())
    x = torch.randn(2, 3, 16, 16)
    options = {"device": "cpu", "layout": "nchw"}
    compiled = torch.compile(model, backend="middleware", options=options)
    with torch.no_grad():
        assert_matches(compiled(x), model(x))
    report = middleware.compile_report(options)
    mine = [s for s in report.subgraphs if s.inputs == ("float32[2, 3, 16, 16]",)]
    assert mine and mine[-1].optimized and mine[-1].report is not None, str(report)
    assert not mine[-1].report.fallbacks, str(mine[-1].report)
    assert report.subgraphs == middleware.compile_report({"layout": "nchw"}).subgraphs


def test_torch_compile_backend_object_and_options() -> None:
    model = _untraceable()
    backend = middleware.Backend(device="cpu", layout="nhwc")
    assert backend.options.layout == "nhwc"
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert_matches(compiled(x), model(x))
    report = backend.report()
    assert len(report.subgraphs) >= 3 and len(report.breaks) >= 2, str(report)
    assert all(s.optimized for s in report.subgraphs), str(report)
    with pytest.raises(TypeError, match="unknown option"):
        middleware.Backend(device="cpu", no_such_option=1)
    with pytest.raises(middleware.OptionsError):
        middleware.Backend(device="cpu", layout="sideways")
    with pytest.raises(Exception, match="unknown option"):  # dynamo wraps backend errors
        torch.compile(SmallNet().eval(), backend="middleware", options={"lay_out": "nhwc"})(x)


def test_grad_required_runs_as_captured() -> None:
    """With grad mode on and parameters requiring grad the subgraph runs as dynamo gave it:
    same values, and autograd still works."""
    model = nondegenerate(SmallNet())
    backend = middleware.Backend(device="cpu")
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 3, 16, 16)
    out = compiled(x)
    assert_matches(out.detach(), model(x).detach())
    out.sum().backward()
    assert model.conv1.weight.grad is not None
    report = backend.report()
    assert report.subgraphs and not report.subgraphs[0].optimized
    assert report.subgraphs[0].reason == GRAD_REASON


def test_training_mode_runs_as_captured() -> None:
    model = nondegenerate(SmallNet()).train()
    twin = nondegenerate(SmallNet()).train()
    backend = middleware.Backend(device="cpu")
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        got, expected = compiled(x), twin(x)
    assert_matches(got, expected)
    # the batch statistics were updated as eager PyTorch updates them
    torch.testing.assert_close(model.bn1.running_mean, twin.bn1.running_mean)
    sub = backend.report().subgraphs[0]
    assert not sub.optimized and "training mode" in sub.reason, sub.reason


class WritesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)  # the caller sees its tensor doubled
        return self.conv(x)


def test_in_place_write_to_an_input_runs_as_captured() -> None:
    model = nondegenerate(WritesInput())
    backend = middleware.Backend(device="cpu")
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(1, 4, 8, 8)
    a, b = x.clone(), x.clone()
    with torch.no_grad():
        assert_matches(compiled(a), model(b))
    torch.testing.assert_close(a, b)  # the write happened, as in eager
    sub = backend.report().subgraphs[0]
    assert not sub.optimized and "in place" in sub.reason, sub.reason


def test_fake_example_inputs_compile_on_first_real_call() -> None:
    """Dynamo may hand a backend fake example inputs: the subgraph compiles lazily, on the
    first real call, and treats parameters as constants."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 3, padding=1)
    with torch.no_grad():
        conv.weight.mul_(math.sqrt(3.0))

    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
        return (F.relu(F.conv2d(x, w, b, padding=1)),)

    gm = fx.symbolic_trace(f)
    x = torch.randn(2, 3, 8, 8)
    mode = FakeTensorMode()
    fakes = [mode.from_tensor(t) for t in (x, conv.weight, conv.bias)]
    # fx's own placeholders carry no dynamo source: nn.Parameter marks the constants
    kinds = [p.kind for p in placeholders(gm, [x, conv.weight, conv.bias])]
    assert kinds == [TENSOR, CONSTANT, CONSTANT]
    capture = Capture(middleware.api.make_options("cpu"))
    with torch.no_grad():
        sub = capture(gm, fakes)
        (got,) = sub(x, conv.weight, conv.bias)
        (expected,) = f(x, conv.weight, conv.bias)
    torch.testing.assert_close(
        got, expected, rtol=OPT_RTOL, atol=OPT_ATOL * float(expected.abs().max())
    )
    rows = capture.report().subgraphs[0].report.rows
    assert any(r.op == "conv2d" and r.runs_as != RunsAs.FALLBACK for r in rows)


def test_freeze_and_refusal_on_a_traced_graph() -> None:
    def f(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
        return (x @ w).view(n, -1)

    gm = fx.symbolic_trace(f, concrete_args=None)
    x, w = torch.randn(4, 3), nn.Parameter(torch.randn(3, 5))
    inputs = placeholders(gm, [x, w, 2])
    assert [p.kind for p in inputs] == ["tensor", "constant", "scalar"]
    frozen, positions = freeze(gm, inputs, [x, w, 2])
    assert positions == (0,)
    assert next(iter(frozen.parameters())) is w  # shared, never copied
    torch.testing.assert_close(frozen(x), f(x, w, 2))
    assert refusal(gm, inputs) is None

    def g(x: torch.Tensor) -> torch.Tensor:
        x.view(-1).add_(1.0)
        return x

    assert "in place" in refusal(fx.symbolic_trace(g), placeholders(fx.symbolic_trace(g), [x]))


def test_dynamic_shapes_specialise_per_size() -> None:
    model = nondegenerate(SmallNet())
    backend = middleware.Backend(device="cpu")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no subgraph runs as the original
        for n in (2, 3):
            x = torch.randn(n, 3, 16, 16)
            assert_matches(compiled(x), model(x))
    (sub,) = backend.report().subgraphs  # one graph for both sizes: sizes are inputs
    assert sub.optimized and not sub.report.fallbacks, str(sub.report)


def test_model_dynamo_cannot_capture_runs_as_the_original(monkeypatch) -> None:
    def no_dynamo(model: nn.Module, **kwargs: object):  # noqa: ANN202
        def run(*args: object) -> None:
            raise RuntimeError("dynamo says no")

        return run

    model = _untraceable()
    opt = middleware.optimize(model)
    monkeypatch.setattr(torch, "compile", no_dynamo)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        with pytest.warns(UserWarning, match="TorchDynamo could not capture it either"):
            out = opt(x)
        assert_matches(out, model(x))
    (row,) = opt.report().rows
    assert row.op == "model" and row.runs_as == RunsAs.FALLBACK
    assert "torch.fx could not trace" in row.reason and "dynamo says no" in row.reason


class Attention(nn.Module):
    """nn.MultiheadAttention: dynamo inlines it into F.multi_head_attention_forward, which
    returns (out, None); the subgraph must still compile (that call as one fallback node)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.norm = nn.LayerNorm(32)
        self.fc = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.attn(x, x, x, need_weights=False)
        return self.fc(F.gelu(self.norm(x + y)))


def test_attention_through_torch_compile() -> None:
    model = Attention().eval()
    backend = middleware.Backend(device="cpu")
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 11, 32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_matches(compiled(x), model(x))
    (sub,) = backend.report().subgraphs
    assert sub.optimized and sub.report is not None
    rows = sub.report.rows
    assert not any(r.op == "model" for r in rows), str(sub.report)  # not a whole fallback
    assert any(r.op == "linear" and r.runs_as != RunsAs.FALLBACK for r in rows)


def test_capture_does_not_keep_the_model_alive() -> None:
    import gc
    import weakref

    model = _untraceable()
    alive = weakref.ref(model)
    opt = middleware.optimize(model)
    with torch.no_grad():
        opt(torch.randn(2, 3, 16, 16))
    del opt, model
    gc.collect()
    assert alive() is None
