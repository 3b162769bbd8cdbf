"""Whole torchvision networks through TorchDynamo (issue 15, part 0): the ``torch.compile``
backend, and ``optimize()`` capturing a network wrapped in code ``torch.fx`` cannot trace.
The eleven networks at small inputs and vit_b_16 (slow tests: the default run leaves them out).

Weights re-initialised so that activations keep their variance (``nondegenerate``; the
zero-initialised heads get random values too), eval mode, batch 1, outputs within 1e-4 of
the output's scale.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from net_helpers import assert_matches, nondegenerate

import middleware
from middleware.enums import RunsAs

torchvision = pytest.importorskip("torchvision")

pytestmark = pytest.mark.slow


def _vit() -> nn.Module:
    model = torchvision.models.vit_b_16()
    with torch.no_grad():  # the head is zero-initialised: give it values
        nn.init.normal_(model.heads.head.weight, std=(1.0 / 768) ** 0.5)
    return model


def _tv(name: str, **kw: object):
    return lambda: getattr(torchvision.models, name)(**kw)


# (constructor, whether no node may fall back, input side): the eleven networks at a small
# side (the capture, not the speed, is under test), vit_b_16 at its own
NETWORKS = {
    "resnet18": (_tv("resnet18"), True, 224),
    "vit_b_16": (_vit, False, 224),  # attention and layer norm still run as fallback nodes
    "alexnet": (_tv("alexnet"), True, 96),
    "vgg16": (_tv("vgg16"), True, 64),
    "resnet50": (_tv("resnet50"), True, 96),
    "densenet121": (_tv("densenet121"), True, 96),
    "squeezenet1_1": (_tv("squeezenet1_1"), True, 96),
    "mobilenet_v2": (_tv("mobilenet_v2"), True, 96),
    "mobilenet_v3_small": (_tv("mobilenet_v3_small"), True, 96),
    "googlenet": (_tv("googlenet", aux_logits=False, init_weights=True), True, 96),
    "inception_v3": (_tv("inception_v3", aux_logits=False, init_weights=True), True, 139),
    "shufflenet_v2_x1_0": (_tv("shufflenet_v2_x1_0"), True, 96),
}


@pytest.mark.parametrize("name", list(NETWORKS))
def test_torch_compile_backend_on_network(name: str) -> None:
    make, no_fallbacks, side = NETWORKS[name]
    torch.manual_seed(0)
    model = nondegenerate(make())
    backend = middleware.Backend(device="cpu")
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(1, 3, side, side)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no subgraph falls back as a whole
        assert_matches(compiled(x), model(x))
    report = backend.report()
    (sub,) = report.subgraphs  # these networks capture in one graph
    assert sub.optimized and not report.breaks
    rows = sub.report.rows
    assert any(r.op in ("conv2d", "linear") and r.runs_as != RunsAs.FALLBACK for r in rows)
    if no_fallbacks:
        assert not sub.report.fallbacks, str(sub.report)


class GuardedClassifier(nn.Module):
    """A torchvision backbone behind code as written outside torchvision: a runtime shape
    assert, a ``torch.jit.is_scripting()`` branch and a data-dependent normalisation."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = torchvision.models.resnet18()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._assert(x.dim() == 4 and x.shape[1] == 3, "expects NCHW RGB images")
        if not torch.jit.is_scripting():
            x = x.contiguous()
        if x.abs().amax() > 3.0:  # data-dependent: fx gives up here
            x = x.clamp(-3.0, 3.0)
        return F.log_softmax(self.backbone(x), dim=1)


def test_optimize_captures_untraceable_network() -> None:
    torch.manual_seed(0)
    model = nondegenerate(GuardedClassifier())
    optimized = middleware.optimize(model)
    x = torch.randn(1, 3, 224, 224) * 1.5
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_matches(optimized(x), model(x))
    report = optimized.report()
    assert report.breaks and all(s.optimized for s in report.subgraphs), str(report)
    convs = [r for r in report.rows if r.op == "conv2d"]
    assert len(convs) == 20 and all(r.runs_as != RunsAs.FALLBACK for r in convs)
