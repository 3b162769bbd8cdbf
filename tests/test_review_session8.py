"""Regression tests from the fresh-eyes review of session 8 (Recycled outputs, flat pooling,
generated backward, weights held once): each case failed before its fix."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import middleware


def test_recycled_output_of_a_max_pool_with_index_scratch() -> None:
    # A max-pool run through ATen's out= form (its index tensor is a scratch output) whose
    # result is a graph output above Recycled.MIN_BYTES: the Recycled step called the form
    # without its scratch (TypeError), and the whole model ran as the original.
    model = nn.Sequential(nn.MaxPool2d(3, 1, 1)).eval()
    x = torch.randn(2, 32, 48, 48)
    opt = middleware.optimize(model, example_inputs=[x], fuse=False, layout="nchw")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for scale in (1.0, 2.0, 3.0):
            assert torch.equal(opt(x * scale), model(x * scale))
    assert all(r.runs_as != "fallback" for r in opt.report().rows), opt.report()


class _Stem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU(),
        )
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x).mean((2, 3)))


class _DataDependent(_Stem):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        if y.mean() > 0.5:  # fx cannot trace this: TorchDynamo captures the model
            y = y * 0.5
        return self.fc(y.mean((2, 3)))


@pytest.mark.slow  # two profiles, one through TorchDynamo: about 20 s
def test_profile_of_batch_sliced_and_captured_plans() -> None:
    # profile() asked every plan for held_tensors(), which only Plan had: a batch-sliced
    # plan (ChunkedPlan) and a TorchDynamo capture (DynamoPlan) raised AttributeError
    x = torch.randn(4, 8, 16, 16)
    sliced = middleware.profile(_Stem().eval(), x, repeats=1, batch_chunk=2)
    assert sliced.optimized.param_bytes > 0
    captured = middleware.profile(_DataDependent().eval(), x, repeats=1)
    assert captured.optimized.peak_io_bytes > 0
