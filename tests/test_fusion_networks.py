"""Whole torchvision networks through optimize() with io groups generated: outputs match
PyTorch (fp32, 1e-4) and the report shows generated kernels. Marked slow."""

from __future__ import annotations

import pytest
import torch

import middleware

torchvision = pytest.importorskip("torchvision")

NETS = ["resnet18", "shufflenet_v2_x1_0", "mobilenet_v2", "googlenet", "squeezenet1_1"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NETS)
def test_network_matches_with_generated_io_groups(name, tmp_path):
    torch.manual_seed(0)
    kw = dict(aux_logits=False, init_weights=False) if name == "googlenet" else {}
    model = getattr(torchvision.models, name)(weights=None, **kw).eval()
    x = torch.randn(2, 3, 64, 64)
    opt = middleware.optimize(model, device="cpu", example_inputs=[x], cache_dir=tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), atol=1e-4, rtol=1e-4)
    counts = opt.report().counts()
    assert counts.get("generated", 0) > 0, counts
    assert counts.get("fallback", 0) == 0, opt.report().fallbacks
