"""Whole torchvision networks through optimize() with io groups generated: outputs match
PyTorch within 1e-4 of the output's scale (weights initialised so that activations keep
their variance, batch-norm statistics randomised: see net_helpers) and the report shows
generated kernels and no fallback. Two networks in the default run, the rest slow."""

from __future__ import annotations

import pytest
import torch
from net_helpers import assert_matches, nondegenerate

import middleware

torchvision = pytest.importorskip("torchvision")

NETS = ["resnet18", "shufflenet_v2_x1_0", "mobilenet_v2", "googlenet", "squeezenet1_1"]


# resnet18 (residual blocks) and shufflenet_v2_x1_0 (channel shuffle, split, concat as
# generated groups) in the default run; the others are marked slow (`-m slow`).
DEFAULT_RUN = ("resnet18", "shufflenet_v2_x1_0")


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in DEFAULT_RUN else pytest.mark.slow) for n in NETS]
)
def test_network_matches_with_generated_io_groups(name, tmp_path):
    torch.manual_seed(0)
    kw = dict(aux_logits=False, init_weights=False) if name == "googlenet" else {}
    model = nondegenerate(getattr(torchvision.models, name)(weights=None, **kw))
    x = torch.randn(2, 3, 64, 64)
    opt = middleware.optimize(model, device="cpu", example_inputs=[x], cache_dir=tmp_path)
    with torch.no_grad():
        assert_matches(opt(x), model(x))
    counts = opt.report().counts()
    assert counts.get("generated", 0) > 0, counts
    assert counts.get("fallback", 0) == 0, opt.report().fallbacks
