"""Whole networks with non-degenerate values for equivalence tests.

torchvision's random initialisation with running statistics left at (0, 1) can shrink a
deep network's output to ~1e-9, where an absolute tolerance passes any answer, an all-zero
one included. ``nondegenerate`` re-initialises every convolution and linear layer so that
activations keep their variance (He initialisation, fan-in, for ReLU-like networks) and
gives every batch-norm random statistics and affine parameters close to the identity, so
the outputs have a scale of order one and a tolerance relative to it means something.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn


def nondegenerate(model: nn.Module, seed: int = 0) -> nn.Module:
    """``model`` (in place, and returned in eval mode) with variance-keeping weights and
    randomised batch-norm statistics."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                fan_in = m.weight[0].numel()
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * math.sqrt(2.0 / fan_in))
                if m.bias is not None:
                    m.bias.copy_(torch.randn(m.bias.shape, generator=gen) * 0.1)
            elif isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.running_mean.copy_(torch.randn(c, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(c, generator=gen) * 0.5 + 0.75)
                if m.affine:
                    m.weight.copy_(1.0 + 0.1 * torch.randn(c, generator=gen))
                    m.bias.copy_(0.1 * torch.randn(c, generator=gen))
    return model.eval()


def assert_matches(got: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4) -> None:
    """``got`` equals ``expected`` within ``rel`` of the output's scale, and the output is
    not degenerate (its scale is not vanishingly small, its values not all equal)."""
    scale = float(expected.abs().max())
    assert scale > 1e-2, f"degenerate reference output (max |y| = {scale:.3g})"
    assert float(expected.std()) > 1e-3 * scale, "reference output is nearly constant"
    torch.testing.assert_close(got, expected, rtol=rel, atol=rel * scale)


def variance_keeping(model: nn.Module, seed: int = 0) -> nn.Module:
    """Like :func:`nondegenerate` for any architecture (transformers included; the same rule
    as ``bench/coverage.py``): convolutions He (2/fan-in), linear layers and attention
    projections 1/fan-in, norms' affine parameters near (1, 0), layer scales near 1, every
    other parameter (class tokens, position embeddings, relative-position tables)
    N(0, 0.1^2), batch-norm statistics random near the identity. In place; eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            for name, p in mod.named_parameters(recurse=False):
                fan_in = p[0].numel() if p.dim() >= 2 else 1
                noise = torch.randn(p.shape, generator=gen)
                if isinstance(mod, nn.modules.conv._ConvNd) and name == "weight":
                    p.copy_(noise * math.sqrt(2.0 / fan_in))
                elif (isinstance(mod, nn.Linear) and name == "weight") or name.endswith(
                    "proj_weight"
                ):
                    p.copy_(noise * math.sqrt(1.0 / fan_in))
                elif "scale" in name or (name == "weight" and p.dim() == 1):
                    p.copy_(1.0 + 0.1 * noise)
                else:
                    p.copy_(0.1 * noise)
            if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.running_mean is not None:
                c = mod.num_features
                mod.running_mean.copy_(0.1 * torch.randn(c, generator=gen))
                mod.running_var.copy_(torch.rand(c, generator=gen) * 0.5 + 0.75)
    return model.eval()
