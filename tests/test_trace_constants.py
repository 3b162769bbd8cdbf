"""Tensors computed at trace time (folded factory methods and calls on parameters only)
must never swallow a write or a gradient (review findings, session 7):

- a factory method's result (``x.new_zeros``) written in place by a traced value
  (``add_``, ``mul_``, ``out=``) used to be returned unchanged: the graph recorded the
  write as a node whose result nobody read;
- in training mode, ``sigmoid(self.s)`` folded to a constant (tracer or canonicalize)
  cut ``s``'s gradient path while ``s`` was still read elsewhere, so its gradient was
  silently partial.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import middleware


class _AddInto(nn.Module):
    def forward(self, x):
        m = x.new_zeros(x.shape)
        m.add_(x)
        return m * 3


class _MulInto(nn.Module):
    def forward(self, x):
        m = x.new_ones(x.shape)
        m.mul_(x)
        return m * 2 + 1


class _OutInto(nn.Module):
    def forward(self, x):
        m = x.new_full(x.shape, 0.5)
        torch.add(m, x, out=m)
        return m.relu()


@pytest.mark.parametrize("cls", [_AddInto, _MulInto, _OutInto])
@pytest.mark.parametrize("shape", [(3, 5, 4), (2, 3, 6, 5)])
def test_writes_into_trace_time_tensors_are_kept(cls, shape, tmp_path, tree_close):
    torch.manual_seed(0)
    x = torch.randn(shape)
    model = cls().eval()
    opt = middleware.optimize(model, example_inputs=[x], cache_dir=tmp_path)
    with torch.no_grad():
        tree_close(opt(x), model(x), rtol=1e-5, atol=1e-6)


class _SharedScale(nn.Module):
    """``s`` read directly and through a call on parameters only."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn
        self.c = nn.Conv2d(4, 4, 3, padding=1)
        self.s = nn.Parameter(torch.rand(1, 4, 1, 1) + 0.5)

    def forward(self, x):
        return F.relu(self.c(x) * self.s) * self.fn(self.s)


@pytest.mark.parametrize("fn", [torch.sigmoid, torch.exp, lambda s: s * 2 + 1])
def test_gradients_through_calls_on_parameters(fn, tmp_path):
    torch.manual_seed(0)
    ref = _SharedScale(fn).train()
    mod = copy.deepcopy(ref)
    x = torch.randn(2, 4, 5, 5)
    opt = middleware.optimize(mod, example_inputs=[x], cache_dir=tmp_path)
    ref(x).square().sum().backward()
    opt(x).square().sum().backward()
    for (name, p), q in zip(ref.named_parameters(), mod.parameters(), strict=True):
        scale = max(1.0, float(p.grad.abs().max()))
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-4 * scale, msg=name)
