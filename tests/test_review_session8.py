"""Regression tests from the fresh-eyes review of session 8 (Recycled outputs, flat pooling,
generated backward, weights held once): each case failed before its fix."""

from __future__ import annotations

import warnings

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
