"""Training through ``optimize()``: a model in train mode gets training plans whose outputs
carry autograd history over the model's own parameters (runtime/training.py).

Every check compares against an eager copy of the model run from the same random state:
the output, the gradients of every parameter and of the input (within 1e-4 of their
scale), batch-norm running statistics, and whole optimizer runs (loss curves).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from net_helpers import nondegenerate
from test_fuzz_graphs import FuzzNet, programs

import middleware
from middleware.enums import RunsAs
from middleware.runtime.training import TrainingPlan

REL = 1e-4


class ConvNet(nn.Module):
    """conv-BN-ReLU, a residual block, max and average pooling, a concat, dropout, a head."""

    def __init__(self, p: float = 0.0, c: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(c, momentum=None)  # cumulative average
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.pool = nn.MaxPool2d(2)
        self.side = nn.Conv2d(c, 4, 1)
        self.drop = nn.Dropout(p)
        self.fc = nn.Linear(2 * c + 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.stem(x)))
        z = F.relu(self.bn2(self.conv2(y)) + y)  # residual
        z = self.pool(F.hardswish(self.dw(z)) * torch.sigmoid(z))
        z = torch.cat([z, F.avg_pool2d(z, 3, 1, 1), F.relu6(self.side(z))], dim=1)
        return self.fc(self.drop(z.mean((2, 3))))


def _scale(t: torch.Tensor) -> float:
    return max(float(t.detach().abs().max()), 1e-3) if t.numel() else 1e-3


def assert_close_rel(
    got: torch.Tensor, expected: torch.Tensor, what: str, floor: float = 0.0
) -> None:
    """Within ``REL`` of ``expected``'s scale (at least ``floor``: a gradient that is zero
    in exact arithmetic, a convolution's bias before a training-mode batch-norm, is
    rounding noise, judged against the scale of the model's gradients)."""
    atol = REL * max(_scale(expected), floor)
    torch.testing.assert_close(got, expected, rtol=REL, atol=atol, msg=lambda m: f"{what}: {m}")


def run_step(model: nn.Module, x: torch.Tensor, seed: int) -> tuple[tuple, torch.Tensor]:
    """One forward and backward from random state ``seed``: (outputs, input gradient). The
    loss weighs each output element by a fixed random number (non-degenerate gradients)."""
    torch.manual_seed(seed)
    x = x.detach().clone().requires_grad_()
    out = model(x)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(seed + 1)
    loss = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    loss.backward()
    return tuple(o.detach() for o in outs), x.grad


def check_training_matches(model: nn.Module, x: torch.Tensor, seed: int = 0, **options) -> object:
    """Outputs, every parameter's gradient, the input's gradient and the buffers of the
    optimized model against an eager copy, after one step; returns the optimized module."""
    eager = copy.deepcopy(model)
    optimized = middleware.optimize(model, **options)
    got, gx = run_step(optimized, x, seed)
    expected, ex = run_step(eager, x, seed)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert_close_rel(g, e, f"output {i}")
    assert_close_rel(gx, ex, "input gradient")
    floor = max((_scale(q.grad) for q in eager.parameters() if q.grad is not None), default=0.0)
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None, f"{name}: no gradient reached the model's own parameter"
        assert_close_rel(p.grad, q.grad, f"{name}.grad", floor)
    for (name, b), (_, c) in zip(model.named_buffers(), eager.named_buffers(), strict=True):
        assert_close_rel(b.float(), c.float(), name)
    return optimized


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("p", [0.0, 0.3], ids=["p0", "p0.3"])
def test_convnet_gradients_match_pytorch(batch: int, layout: str, p: float) -> None:
    model = nondegenerate(ConvNet(p)).train()
    x = torch.randn(batch, 3, 10, 10)
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    optimized = check_training_matches(model, x, layout=layout)
    plan = optimized.plan
    assert isinstance(plan, TrainingPlan)
    kinds = {st.runs_as for st in plan.steps}
    assert RunsAs.GENERATED in kinds, "no fused group ran in the training plan"
    assert RunsAs.FALLBACK not in kinds, optimized.report().verbose()
    rows = {r.node: r for r in optimized.report().rows}
    assert "batch statistics" in rows["bn1"].reason


class Chain(nn.Module):
    """An elementwise chain between two convolutions: one fused group."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return self.b(F.hardswish(torch.sigmoid(y) * y + 0.5))


def _autograd_nodes(out: torch.Tensor) -> list[Any]:
    """Every node of the backward graph reachable from ``out``, each once."""
    found, todo, seen = [], [out.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        found.append(fn)
        todo += [f for f, _ in fn.next_functions]
    return found


def test_generated_group_is_one_autograd_function_saving_its_inputs() -> None:
    """The backward graph holds one node per fused group (not one per op inside it)."""
    model = nondegenerate(Chain()).train()
    optimized = check_training_matches(model, torch.randn(2, 3, 10, 10), layout="nchw")
    out = optimized(torch.randn(2, 3, 10, 10, requires_grad=True))
    names = [type(fn).__name__ for fn in _autograd_nodes(out)]
    assert any("GroupFunction" in n for n in names), names
    assert not any(n.startswith(("HardswishBackward", "SigmoidBackward")) for n in names), names


class ResidualSum(nn.Module):
    """ReLU of a sum after convolutions: ``relu(a(x) + b(x) + x)`` (three operands, one a
    graph input), then ``relu(a(x) - b(x))`` (a sub: not a ReLU of a sum) and
    ``relu(b(x) + b(x))`` (one operand twice), each read by a convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 1)
        self.c = nn.Conv2d(12, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.relu(self.a(x) + self.b(x) + x)
        d = torch.relu(self.a(x) - self.b(x))
        t = self.b(x)
        return self.c(torch.cat([s, d, torch.relu(t + t)], 1))


def _group_saves(out: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """The tensors each fused group reachable from ``out`` saved for backward."""
    return [
        tuple(fn.saved_tensors)
        for fn in _autograd_nodes(out)
        if "GroupFunction" in type(fn).__name__
    ]


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_relu_of_a_sum_saves_its_output_and_matches(layout: str) -> None:
    """A ReLU of a sum of the group's inputs (a ResNet block's ``add > relu``) saves its
    output, which the next convolution keeps anyway, instead of its inputs (here a(x),
    b(x) and the input x itself), and computes every input's gradient from it as ReLU's
    backward; a sub, or an operand added to itself, keeps the generated backward.
    Gradients, outputs and the report against eager."""
    model = nondegenerate(ResidualSum()).train()
    x = torch.randn(3, 4, 9, 11)
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    optimized = check_training_matches(model, x, layout=layout)
    rows = optimized.report().rows
    ops = sorted(r.op for r in rows if "ReLU's from the saved output" in (r.reason or ""))
    assert ops == ["add", "add", "relu"], optimized.report()
    xg = x.clone().requires_grad_(True)
    saves = _group_saves(optimized(xg))
    singles = [t for t in saves if len(t) == 1 and t[0].shape == x.shape]
    assert any(bool((t[0] >= 0).all()) for t in singles), [len(t) for t in saves]
    assert not any(t.data_ptr() == xg.data_ptr() for ts in saves for t in ts)


def test_weight_updates_are_picked_up_and_loss_curve_matches() -> None:
    """Twenty SGD-with-momentum steps (dropout p > 0, seeded): the same losses as eager at
    every step (relative difference < 1e-3), running statistics included."""
    model = nondegenerate(ConvNet(0.2)).train()
    eager = copy.deepcopy(model)
    optimized = middleware.optimize(model)
    runs = []
    for net, params in ((optimized, optimized.parameters()), (eager, eager.parameters())):
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)
        gen = torch.Generator().manual_seed(5)
        losses = []
        for step in range(20):
            x = torch.randn(4, 3, 10, 10, generator=gen)
            target = torch.randint(0, 5, (4,), generator=gen)
            torch.manual_seed(100 + step)
            opt.zero_grad()
            loss = F.cross_entropy(net(x), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs.append(losses)
    got, expected = runs
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert abs(g - e) <= 1e-3 * abs(e), f"step {step}: {g} vs eager {e}"
    assert expected[-1] < expected[0], "the loss did not move: the check would be vacuous"
    for (name, b), (_, c) in zip(model.named_buffers(), eager.named_buffers(), strict=True):
        assert_close_rel(b.float(), c.float(), name)
    assert optimized.report().rows and len(optimized.signatures) == 0  # eval plans: none


def test_train_eval_switching() -> None:
    model = nondegenerate(ConvNet(0.5)).train()
    eager = copy.deepcopy(model)
    optimized = middleware.optimize(model)
    x = torch.randn(2, 3, 10, 10)
    check = torch.randn(2, 3, 10, 10)
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(3):
        for net, opt in ((optimized, opt_a), (eager, opt_b)):
            net.train()
            torch.manual_seed(step)
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
            net.eval()
            assert not model.training if net is optimized else True
            with torch.no_grad():
                out = net(check)
            if net is optimized:
                got = out
        assert_close_rel(got, out, f"eval output after step {step}")
    assert optimized.signatures, "eval mode ran no inference plan"
    optimized.train()
    assert model.training and all(m.training for m in model.modules())
    optimized.eval()
    assert not model.training and not optimized.training


def test_parameters_are_the_models_own_and_state_dict_keeps_its_structure() -> None:
    model = nondegenerate(ConvNet()).train()
    before = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    optimized = middleware.optimize(model)
    assert [id(p) for p in optimized.parameters()] == [id(p) for p in model.parameters()]
    assert dict(optimized.named_buffers()).keys() == dict(model.named_buffers()).keys()
    opt = torch.optim.Adam(optimized.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        optimized(torch.randn(2, 3, 10, 10)).sum().backward()
        opt.step()
    after = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    assert after == before
    assert int(model.bn1.num_batches_tracked) == 2, "one count per training step"


class Unlowered(nn.Module):
    """A training model with a call the frontend has no rule for (torch.cumsum)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cumsum(F.relu(self.bn(self.conv(x))), 3) * 0.3
        return torch.sigmoid(y) * y


def test_unlowered_call_trains_through_the_original_callable() -> None:
    optimized = check_training_matches(nondegenerate(Unlowered()).train(), torch.randn(2, 3, 7, 7))
    fallbacks = optimized.report().fallbacks
    assert fallbacks and all(r.reason for r in fallbacks)


def test_training_on_another_device_than_cpu_trains_as_the_original() -> None:
    """The fallback path: a plan that cannot be built trains as the original model."""
    from middleware.runtime import training

    model = nondegenerate(ConvNet()).train()
    original = training.compile_training

    def refuse(*args, **kwargs):
        raise middleware.errors.UnsupportedError("refused for the test")

    training_module = __import__("middleware.runtime.module", fromlist=["compile_training"])
    training_module.compile_training = refuse
    try:
        optimized = check_training_matches(model, torch.randn(2, 3, 10, 10))
    finally:
        training_module.compile_training = original
    assert optimized.plan is None
    assert "refused for the test" in str(optimized.report().rows[0].reason)


def test_frozen_batch_norm_in_eval_inside_a_training_model() -> None:
    """Mixed modes: a batch-norm kept in eval mode (frozen statistics) fuses into a group,
    and its affine parameters still get their gradients."""
    model = nondegenerate(ConvNet()).train()
    model.bn1.eval()
    check_training_matches(model, torch.randn(2, 3, 10, 10))


@settings(
    max_examples=30,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(programs())
def test_random_graph_gradients_match_pytorch(tmp_path_factory, case) -> None:
    shape, program, modules, outputs, layout, seed = case
    torch.manual_seed(seed)
    model = FuzzNet(program, modules, outputs).train()
    x = torch.randn(shape)
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    try:  # batch-norm statistics need more than one value per channel
        with torch.no_grad():
            copy.deepcopy(model)(x)
    except ValueError:
        assume(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a plan failing at run time would warn
        check_training_matches(model, x, seed=seed, layout=layout)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_torchvision_network_gradients_match_pytorch(name: str) -> None:
    torchvision = pytest.importorskip("torchvision")
    model = nondegenerate(getattr(torchvision.models, name)(num_classes=10)).train()
    check_training_matches(model, torch.randn(2, 3, 64, 64))


def test_training_profile_leaves_the_models_weights_alone() -> None:
    model = nondegenerate(ConvNet()).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = middleware.profile(model, torch.randn(2, 3, 10, 10), repeats=2, train=True)
    assert "training step" in result.method
    for m in (result.original, result.optimized):
        assert m.latency_ms > 0 and m.peak_io_bytes > 0 and m.param_bytes > 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"profiling trained the caller's {k}"
    assert not result.notes, result.notes  # the optimized copy ran its training plan


def test_profile_command_line_train(tmp_path, capsys) -> None:  # noqa: ANN001
    from middleware.__main__ import main

    src = tmp_path / "mynet.py"
    src.write_text(
        "import torch.nn as nn\n"
        "def small():\n"
        "    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), (3, 12, 12)\n"
    )
    rc = main(["profile", f"{src}:small", "--batch", "2", "--repeats", "1", "--train"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "one training step" in out and "peak I/O memory" in out


def test_second_derivative_through_a_fused_group_raises() -> None:
    """The recomputing backward is not itself differentiable: create_graph=True through a
    fused group must fail loudly, never return a silently wrong second derivative."""
    model = nondegenerate(Chain()).train()
    optimized = middleware.optimize(model, layout="nchw")
    x = torch.randn(2, 3, 10, 10, requires_grad=True)
    (g,) = torch.autograd.grad(optimized(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiate twice"):
        g.sum().backward()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "densenet121"])
def test_torchvision_loss_curve_matches_eager(name: str) -> None:
    """Twenty SGD-with-momentum steps from the same seed (dropout on, seeded per step):
    the loss of every step within 1e-3 of eager's, batch-norm running statistics too."""
    torchvision = pytest.importorskip("torchvision")
    model = nondegenerate(getattr(torchvision.models, name)(num_classes=10)).train()
    eager = copy.deepcopy(model)
    optimized = middleware.optimize(model)
    curves = []
    for net in (optimized, eager):
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        gen = torch.Generator().manual_seed(7)
        losses = []
        for step in range(20):
            x = torch.randn(4, 3, 32, 32, generator=gen)
            target = torch.randint(0, 10, (4,), generator=gen)
            torch.manual_seed(step)
            opt.zero_grad()
            loss = F.cross_entropy(net(x), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(losses)
    for step, (g, e) in enumerate(zip(*curves, strict=True)):
        assert abs(g - e) <= 1e-3 * abs(e), f"{name} step {step}: {g} vs eager {e}"
    assert isinstance(optimized.plan, TrainingPlan)
    for (n, b), (_, c) in zip(model.named_buffers(), eager.named_buffers(), strict=True):
        torch.testing.assert_close(b.float(), c.float(), rtol=1e-3, atol=1e-3 * _scale(c), msg=n)
