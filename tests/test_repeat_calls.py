"""Repeated calls take a guarded path (``module._Repeat``: the previous call's signature
behind TorchDynamo's C++ tensor guards) that skips the Python signature. Over random call
sequences whose inputs change layout, strides, shape, requires_grad and
inference-mode-ness between calls, every output equals eager PyTorch's, and a call whose
dense inputs repeat the previous call's takes the guarded path."""

from __future__ import annotations

from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import middleware
from middleware.runtime import module as module_mod
from tests.fusion_helpers import close_to_scale


class Block(nn.Module):
    """A generated group with a channel-wise parameter: a plan that reads its input in a
    declared layout, so an input in another layout on the wrong plan gives wrong values."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(4)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.weight.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(F.relu(self.bn(x)), 3, 1, 1) + y


VARIANTS = ["plain", "channels_last", "transposed", "sliced", "grad", "inference"]


def make(kind: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=gen)
    if kind == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if kind == "transposed":  # same shape, strides of neither layout
        return x.transpose(2, 3).contiguous().transpose(2, 3)
    if kind == "sliced":
        big = torch.randn(*shape[:-1], shape[-1] * 2, generator=gen)
        return big[..., ::2]
    if kind == "grad":
        return x.requires_grad_()
    if kind == "inference":
        with torch.inference_mode():
            return x.clone()
    return x


_SHARED: list = []


def shared() -> tuple[nn.Module, nn.Module]:
    """One model and its optimized module for every example: plans (four signatures) are
    built once, and each example's call sequence starts from the previous one's guard."""
    if not _SHARED:
        torch.manual_seed(0)
        model = Block().eval()
        _SHARED.extend([model, middleware.optimize(model, device="cpu")])
    return _SHARED[0], _SHARED[1]


@settings(max_examples=25, deadline=None)
@given(
    calls=st.lists(
        st.tuples(st.sampled_from(VARIANTS), st.sampled_from([6, 7]), st.booleans()),
        min_size=3,
        max_size=7,
    ),
    seed=st.integers(0, 2**16),
)
def test_repeated_calls_equal_eager(calls, seed) -> None:
    model, opt = shared()
    gen = torch.Generator().manual_seed(seed)
    previous = None
    signatures: list[int] = []
    real = module_mod.dense_signature

    def counting(inputs):
        signatures.append(1)
        return real(inputs)

    for kind, hw, grad_mode in calls:
        shape = (2, 4, hw, hw)
        x, y = make(kind, shape, gen), make("plain", shape, gen)
        before = len(signatures)
        with (
            torch.set_grad_enabled(grad_mode),
            mock.patch.object(module_mod, "dense_signature", counting),
        ):
            got = opt(x, y)
        if (kind, hw) == previous and kind in ("plain", "channels_last", "grad"):
            assert len(signatures) == before, (kind, hw)  # a repeat: the guarded path
        previous = (kind, hw)
        with torch.no_grad():  # eager refuses inference tensors where autograd records
            want = model(x, y)
        assert got.dtype == want.dtype and got.shape == want.shape
        close_to_scale(got.detach(), want.detach())
        assert not got.requires_grad  # inference plans: outputs carry no history


def test_a_repeat_skips_the_python_signature(monkeypatch, any_call_path: str) -> None:
    calls: list[int] = []
    real = module_mod.dense_signature

    def counting(inputs):
        calls.append(1)
        return real(inputs)

    monkeypatch.setattr(module_mod, "dense_signature", counting)
    model = Block().eval()
    opt = middleware.optimize(model, device="cpu")
    x, y = torch.randn(2, 4, 6, 6), torch.randn(2, 4, 6, 6)
    opt(x, y)
    first = len(calls)
    for _ in range(3):  # same types, sizes and strides: the guarded path
        got = opt(x, y)
        with torch.no_grad():
            close_to_scale(got, model(x, y))
    assert len(calls) == first
    xc = x.contiguous(memory_format=torch.channels_last)  # other strides: the Python path
    with torch.no_grad():
        close_to_scale(opt(xc, y), model(xc, y))
    assert len(calls) == first + 1
    with torch.no_grad():  # a changed weight is still noticed on the guarded path
        model.bn.weight.mul_(2)
        close_to_scale(opt(xc, y), model(xc, y))
        close_to_scale(opt(xc, y), model(xc, y))
    model.train()  # so is training mode (its own plans)
    out = opt(xc, y)
    assert out.requires_grad == any(p.requires_grad for p in model.parameters())


def test_copies_guard_their_own_calls(any_call_path: str) -> None:
    import copy

    model = Block().eval()
    opt = middleware.optimize(model, device="cpu")
    x, y = torch.randn(2, 4, 6, 6), torch.randn(2, 4, 6, 6)
    opt(x, y)
    assert opt._repeat is not None
    clone = copy.deepcopy(opt)
    assert clone._repeat is None
    with torch.no_grad():
        close_to_scale(clone(x, y), model(x, y))
    assert clone._repeat is not None and clone._repeat is not opt._repeat


class _Racing(dict):
    """The plans table whose first lookup lets ``hook`` run in between, as another thread
    could between a call's lookup and its guard being published."""

    def __init__(self, plans: dict, hook) -> None:  # noqa: ANN001
        super().__init__(plans)
        self.hook = hook

    def get(self, key, default=None):  # noqa: ANN001, ANN201
        found = super().get(key, default)
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return found


def test_a_guard_is_never_published_for_a_forgotten_plan(any_call_path: str) -> None:
    """Between a call's plan lookup and its guard being published, another thread writes
    a weight, refreshes and rebuilds: the late guard must not serve the old plan (built
    from the old weight) to the calls after."""
    model = Block().eval()
    opt = middleware.optimize(model, device="cpu")
    x, y = torch.randn(2, 4, 6, 6), torch.randn(2, 4, 6, 6)
    xc = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        opt(x, y)  # the plan of the contiguous signature
        opt(xc, y)  # the guard holds the channels_last call: the next one takes the lookup

        def other_thread() -> None:
            model.bn.weight.data.mul_(3)  # a .data write: noticed only through refresh()
            opt.refresh()
            close_to_scale(opt(x, y), model(x, y))  # rebuilds with the new weight

        opt.__dict__["_plans"] = _Racing(opt._plans, other_thread)
        opt(x, y)  # looks up the old plan, then publishes its guard
        for _ in range(2):
            close_to_scale(opt(x, y), model(x, y))
