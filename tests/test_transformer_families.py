"""Issue 15's families through ``optimize()`` with no fallback node, equal to PyTorch:
a tiny ViT (class token, position embedding, nn.MultiheadAttention traced through to SDPA),
tiny Swin V1 and V2 (shifted windows, odd sizes that pad, relative-position-bias gathers
folded at trace time, cosine attention), a tiny segmentation model (a dilated backbone,
DeepLabV3's ASPP head and an FCN aux head, bilinear upsampling, an OrderedDict output).
The whole torchvision networks (vit_b_16, swin_t, deeplabv3_mobilenet_v3_large) are slow.
Weights keep activations' variance (``net_helpers.variance_keeping``)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.fx._symbolic_trace as fx_trace
import torch.nn as nn
import torchvision
from net_helpers import variance_keeping
from torchvision.models import swin_transformer as swin
from torchvision.models.segmentation.deeplabv3 import DeepLabHead, DeepLabV3
from torchvision.models.segmentation.fcn import FCNHead

import middleware
from middleware.enums import RunsAs


def check(
    model: nn.Module, x: torch.Tensor, ops: tuple[str, ...] = ()
) -> middleware.OptimizedModule:
    """No fallback node, the ``ops`` present, every output equal to eager within 1e-4 of its
    scale on fresh values (the output not degenerate)."""
    model = variance_keeping(model)
    opt = middleware.optimize(model, example_inputs=(x,))
    rows = opt.report().rows
    assert not [r for r in rows if r.runs_as == RunsAs.FALLBACK], str(opt.report())
    # constants folded at trace time are not left on the user's model
    assert not [k for k in vars(model) if k.startswith("_tensor_constant")]
    for op in ops:
        assert any(r.op == op for r in rows), f"no {op} node: {opt.report()}"
    fresh = torch.randn_like(x)
    with torch.no_grad():
        want, got = model(fresh), opt(fresh)
    pairs = [(got[k], want[k]) for k in want] if isinstance(want, dict) else [(got, want)]
    assert type(got) is type(want)
    for g, w in pairs:
        scale = float(w.abs().max())
        assert scale > 1e-2 and float(w.std()) > 1e-3 * scale, "degenerate reference output"
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * scale)
    return opt


@pytest.mark.parametrize("batch", [1, 3])
def test_tiny_vit(batch: int) -> None:
    model = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
        num_classes=10,
    )  # fmt: skip
    check(model, torch.randn(batch, 3, 32, 32), ("scaled_dot_product_attention", "slice"))


@pytest.mark.parametrize(
    "v2,size", [(False, 32), (False, 36), (True, 32)], ids=["v1", "v1-padded", "v2"]
)
def test_tiny_swin(v2: bool, size: int) -> None:
    """36x36 at patch 4 gives 9x9 tokens: windows of 4 pad to 12, the merging pads to 10."""
    kw = (
        {"block": swin.SwinTransformerBlockV2, "downsample_layer": swin.PatchMergingV2}
        if v2
        else {}
    )
    model = swin.SwinTransformer(
        patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4],
        num_classes=10, **kw,
    )  # fmt: skip
    before = dict(fx_trace._wrapped_fns_to_patch)
    ops = ("roll", "amax", "exp", "matmul") + (("normalize",) if v2 else ())  # softmax decomposed
    check(model, torch.randn(2, 3, size, size), ops)
    # tracing into fx.wrap'ed functions leaves fx's global patch table as it was
    assert dict(fx_trace._wrapped_fns_to_patch) == before


class TinyBackbone(nn.Module):
    """Stride 4 then dilated 3x3 convolutions (DeepLab's output stride), returning the
    features an IntermediateLayerGetter would: {"out", "aux"}."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 12, 3, 2, 1)
        )
        self.dilated = nn.Sequential(
            nn.BatchNorm2d(12), nn.ReLU(), nn.Conv2d(12, 16, 3, padding=2, dilation=2), nn.ReLU()
        )

    def forward(self, x):  # noqa: ANN001, ANN201
        aux = self.stem(x)
        return OrderedDict([("out", self.dilated(aux)), ("aux", aux)])


@pytest.mark.parametrize("size", [(33, 41), (32, 32)])
def test_tiny_segmentation(size: tuple[int, int]) -> None:
    """DeepLabV3's ASPP (dilations 2, 3, 5 on a small map, a pooled branch upsampled back)
    and an FCN aux head; both outputs upsampled bilinearly to the input size."""
    model = DeepLabV3(TinyBackbone(), DeepLabHead(16, 5, (2, 3, 5)), FCNHead(12, 5))
    opt = check(model, torch.randn(1, 3, *size), ("interpolate", "conv2d"))
    assert any(r.op == "conv2d" for r in opt.report().rows)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vit_b_16", "swin_t"])
def test_torchvision_transformer(name: str) -> None:
    check(torchvision.models.get_model(name, weights=None), torch.randn(1, 3, 224, 224))


@pytest.mark.slow
def test_torchvision_segmentation() -> None:
    model = torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, aux_loss=True
    )
    check(model, torch.randn(1, 3, 224, 224), ("interpolate",))
