"""The eleven torchvision networks of issue 2, end to end, against eager PyTorch.

Random weights that keep the activations' variance and randomised batch-norm statistics
(``net_helpers.nondegenerate``: outputs of order one, not ~1e-9), eval mode, batch 1 and 3
(3x224x224 inputs, 3x299x299 for inception_v3), and batch 16, where depth-first slicing
over the batch and Winograd convolutions switch on. ``optimize(m)(x)`` must equal ``m(x)``
within 1e-4 of the output's scale (its largest magnitude), and ``report()`` must show no
fallback row. Each network is built and optimized once per module; the batch-3 call then
builds and caches the second plan of the same ``OptimizedModule``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from net_helpers import assert_matches, nondegenerate

import middleware

torchvision = pytest.importorskip("torchvision")

RTOL = 1e-4

NETWORKS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "alexnet": (lambda: torchvision.models.alexnet(), 224),
    "vgg16": (lambda: torchvision.models.vgg16(), 224),
    "resnet18": (lambda: torchvision.models.resnet18(), 224),
    "resnet50": (lambda: torchvision.models.resnet50(), 224),
    "densenet121": (lambda: torchvision.models.densenet121(), 224),
    "squeezenet1_1": (lambda: torchvision.models.squeezenet1_1(), 224),
    "mobilenet_v2": (lambda: torchvision.models.mobilenet_v2(), 224),
    "mobilenet_v3_small": (lambda: torchvision.models.mobilenet_v3_small(), 224),
    "googlenet": (
        lambda: torchvision.models.googlenet(aux_logits=False, init_weights=True),
        224,
    ),
    "inception_v3": (
        lambda: torchvision.models.inception_v3(aux_logits=False, init_weights=True),
        299,
    ),
    "shufflenet_v2_x1_0": (lambda: torchvision.models.shufflenet_v2_x1_0(), 224),
}


class _Built:
    def __init__(self, name: str) -> None:
        make, size = NETWORKS[name]
        torch.manual_seed(0)
        self.model = nondegenerate(make())
        self.optimized = middleware.optimize(self.model)
        self.inputs = torch.randn(3, 3, size, size)


@pytest.fixture(scope="module")
def built() -> Callable[[str], _Built]:
    """Each network built and optimized once for the whole module."""
    cache: dict[str, _Built] = {}

    def get(name: str) -> _Built:
        if name not in cache:
            cache.clear()  # keep one network alive at a time
            cache[name] = _Built(name)
        return cache[name]

    return get


# In the default run (the others are marked slow, `-m slow` runs them): one network per
# family of distinct ops and passes: plain residual convs (resnet18), depthwise + relu6
# (mobilenet_v2), hardswish/hardsigmoid and squeeze-excitation multiplies
# (mobilenet_v3_small), channel shuffle and chunk (shufflenet_v2_x1_0), fire-module concats
# and ceil-mode pools (squeezenet1_1), inception concats with pools in front (googlenet).
# Five of the eleven also run end to end at batch 1 with the buffer planner in the default
# run (tests/test_memory_planner.py::test_networks_match_pytorch_with_planning; the larger
# six there are slow).
DEFAULT_RUN = (
    "resnet18",
    "mobilenet_v2",
    "mobilenet_v3_small",
    "shufflenet_v2_x1_0",
    "squeezenet1_1",
    "googlenet",
)


def _param(name: str, *values, id: str) -> pytest.param:
    # googlenet at batch 3 is the default run's slowest case (18 s): its batch-1 case and
    # the planner's googlenet test stay in the default run
    slow = name not in DEFAULT_RUN or id == "googlenet-b3"
    return pytest.param(*values, id=id, marks=(pytest.mark.slow,) if slow else ())


@pytest.mark.parametrize(
    ("name", "batch"), [_param(n, n, b, id=f"{n}-b{b}") for n in NETWORKS for b in (1, 3)]
)
def test_network_matches_pytorch(name: str, batch: int, built) -> None:
    net = built(name)
    x = net.inputs[:batch].clone()
    with torch.no_grad():
        expected = net.model(x)
    got = net.optimized(x)
    assert isinstance(got, torch.Tensor) and got.shape == expected.shape == (batch, 1000)
    assert_matches(got, expected, RTOL)
    report = net.optimized.report()
    assert report.fallbacks == [], str(report)
    assert report.rows and all(r.runs_as in ("vendor", "generated") for r in report.rows)
    assert net.optimized.graph.values[net.optimized.graph.inputs[0]].shape[0] == batch


# where the batch-16 plan must show both features (measured choices: README, bench/zoo.py)
SLICED_AND_WINOGRAD = ("vgg16", "resnet18")


# At batch 16 only resnet18 in the default run: it shows batch slicing and Winograd (the
# two features this test is about) at a fifth of vgg16's cost; the rest are slow.
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n == "resnet18" else pytest.mark.slow) for n in NETWORKS]
)
@pytest.mark.usefixtures("winograd_generic_rule")  # Winograd in the network on any host
def test_network_at_batch_16_matches_pytorch(name: str) -> None:
    """The benchmarked batch: batch slicing ("auto") and Winograd (on) as optimize() picks
    them by the tests' generic rule (conftest.winograd_generic_rule: 64 channels, so
    resnet18's layer1 too), the plan's outputs against PyTorch."""
    make, size = NETWORKS[name]
    torch.manual_seed(0)
    model = nondegenerate(make())
    x = torch.randn(16, 3, size, size)
    optimized = middleware.optimize(model, example_inputs=(x,))
    with torch.no_grad():
        expected = model(x)
        got = optimized(x)
    assert_matches(got, expected, RTOL)
    report = optimized.report()
    assert report.fallbacks == [], str(report)
    if name in SLICED_AND_WINOGRAD:
        notes = " ".join(report.notes)
        assert "depth-first over the batch" in notes and "Winograd" in notes, notes
