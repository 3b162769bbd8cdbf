"""LayerNorm (module and functional, over one or two trailing dims, with and without its
affine parameters, ConvNeXt's channels-last and channels-first uses) and torchvision's
stochastic depth in eval mode are graph nodes, not fallbacks; outputs equal PyTorch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import middleware


def _close(opt, model, x):
    with torch.no_grad():
        want = model(x)
        got = opt(x)
    scale = want.abs().max().item()
    assert scale > 1e-3  # a non-degenerate output
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


def _randomise(model: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 1.0)
    return model.eval()


class LastDims(nn.Module):
    """x (N, L, C) -> LayerNorm over ``dims`` trailing dims -> GELU -> a residual."""

    def __init__(self, shape, affine: bool, bias: bool) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(shape, elementwise_affine=affine, bias=bias)

    def forward(self, x):
        return F.gelu(self.ln(x)) + x


class ChannelsFirst(nn.Module):
    """ConvNeXt's LayerNorm2d between convolutions: permute, layer_norm, permute back."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.w, self.b = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c))

    def forward(self, x):
        y = self.conv(x).permute(0, 2, 3, 1)
        y = F.layer_norm(y, (y.shape[-1],), self.w, self.b, 1e-6)
        return torch.relu(y.permute(0, 3, 1, 2)) + x


@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("shape", [(6,), (5, 6)])
def test_layer_norm_over_trailing_dims(shape, affine, bias):
    model = _randomise(LastDims(shape, affine, bias), seed=len(shape))
    x = torch.randn(3, 5, 6) * 3 + 1
    opt = middleware.optimize(model, example_inputs=(x,))
    # a token sequence's LayerNorm is decomposed into generated ops (decompose_layer_norm)
    rows = [r for r in opt.report().rows if r.source == "ln"]
    assert {r.op for r in rows} >= {"mean", "sub", "rsqrt"}
    assert all(r.runs_as == "generated" for r in rows)
    _close(opt, model, x)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("n,c,h,w", [(1, 8, 5, 7), (4, 3, 6, 6)])
def test_layer_norm_channels_first_between_convolutions(n, c, h, w, layout):
    model = _randomise(ChannelsFirst(c), seed=c)
    x = torch.randn(n, c, h, w)
    opt = middleware.optimize(model, example_inputs=(x,), layout=layout)
    assert not [r for r in opt.report().rows if r.runs_as == "fallback"]
    _close(opt, model, x)


def test_stochastic_depth_is_the_identity_in_eval_and_refused_in_training():
    torchvision = pytest.importorskip("torchvision")

    class Block(nn.Module):
        """torchvision's StochasticDepth (its function is torch.fx-wrapped: a leaf call)."""

        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.sd = torchvision.ops.StochasticDepth(0.2, "row")

        def forward(self, x):
            return self.sd(torch.relu(self.conv(x))) + x

    x = torch.randn(2, 4, 6, 5)
    model = _randomise(Block(), seed=3)
    assert "stochastic_depth" in {n.op for n in middleware.trace(model, x).nodes()}
    opt = middleware.optimize(model, example_inputs=(x,))  # (the passes drop the identity)
    assert "fallback" not in {r.runs_as for r in opt.report().rows}
    _close(opt, model, x)
    training = _randomise(Block(), seed=3)
    training.sd.train()  # the model in eval mode, its stochastic depth not
    opt = middleware.optimize(training, example_inputs=(x,))
    reasons = [r.reason for r in opt.report().rows if r.runs_as == "fallback"]
    assert any("stochastic_depth with training=True" in r for r in reasons), reasons


@pytest.mark.slow
def test_convnext_tiny_without_fallbacks():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.convnext_tiny().eval()
    x = torch.randn(1, 3, 96, 96)
    opt = middleware.optimize(model, example_inputs=(x,))
    assert not [r for r in opt.report().rows if r.runs_as == "fallback"]
    _close(opt, model, x)
