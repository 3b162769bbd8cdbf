"""A submodule switched to training mode on its own (``model.eval(); model.bn.train()``)
after ``optimize()`` makes the call a training one, as in eager PyTorch: batch statistics
and running-statistics updates (review finding, session 7: the eval plan, batch-norm
folded, kept running)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import middleware


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))))


def test_a_submodule_in_training_mode_after_the_first_compile(tmp_path):
    torch.manual_seed(0)
    ref = _Net().eval()
    with torch.no_grad():
        ref.bn.running_mean.uniform_(-1, 1)
        ref.bn.running_var.uniform_(0.5, 2)
    mod = copy.deepcopy(ref)
    x = torch.randn(4, 3, 6, 5) * 2 + 1
    opt = middleware.optimize(mod, example_inputs=[x], cache_dir=tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), ref(x), rtol=1e-4, atol=1e-4)
    ref.bn.train()
    mod.bn.train()
    with torch.no_grad():
        y, y_ref = opt(x), ref(x)
    scale = max(1.0, float(y_ref.abs().max()))
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4 * scale)
    torch.testing.assert_close(mod.bn.running_mean, ref.bn.running_mean)
    torch.testing.assert_close(mod.bn.running_var, ref.bn.running_var)
    assert int(mod.bn.num_batches_tracked) == int(ref.bn.num_batches_tracked) == 1
    ref.bn.eval()
    mod.bn.eval()
    with torch.no_grad():
        torch.testing.assert_close(opt(x), ref(x), rtol=1e-4, atol=1e-4 * scale)


def test_the_training_flags_read_per_call_are_each_copys_own(tmp_path):
    """The call reads every module's ``training`` flag from the modules' attribute
    dictionaries: a deep copy of the optimized module reads its own modules' flags, not
    the ones it was copied from."""
    x = torch.randn(2, 3, 6, 5)
    opt = middleware.optimize(_Net().eval(), example_inputs=[x], cache_dir=tmp_path)
    twin = copy.deepcopy(opt)
    assert not opt._training_call() and not twin._training_call()
    twin.original.bn.train()
    assert twin._training_call() and not opt._training_call()
    opt.original.head.train()
    assert opt._training_call()
