"""The pass pipeline on the eleven torchvision networks: same outputs, and the rewrites the
issue asks for happened (batch-norms folded, relus merged into max-pools, poolings in
front of concats)."""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch
import torch.nn as nn

tvm = pytest.importorskip("torchvision.models")

import middleware  # noqa: E402
from middleware import trace  # noqa: E402
from middleware.graph import Graph  # noqa: E402
from middleware.models import NETWORKS  # noqa: E402
from middleware.options import Options  # noqa: E402
from middleware.passes import DEFAULT_HARDWARE, run_passes  # noqa: E402
from middleware.passes.verify import relative_error  # noqa: E402

# In the default run: alexnet (linear layers, relus merged into max-pools), resnet18
# (batch-norms folded into convolutions, residual adds) and squeezenet1_1 (poolings moved in
# front of concats); googlenet's concat rewrite runs in the default run through
# test_googlenet_shared_concats_move_in_the_pipeline (passes only). The other networks'
# cases are marked slow (`-m slow` runs them).
DEFAULT_RUN = ("alexnet", "resnet18", "squeezenet1_1")


def nets(*cases):
    """The cases as params, those of networks outside ``DEFAULT_RUN`` marked slow."""
    out = []
    for case in cases:
        name = case[0] if isinstance(case, tuple) else case
        values = case if isinstance(case, tuple) else (case,)
        marks = () if name in DEFAULT_RUN else (pytest.mark.slow,)
        out.append(pytest.param(*values, marks=marks))
    return out


# Small inputs keep the test fast; inception_v3 needs at least 75x75.
SIZE = {"inception_v3": 80}
TOL = 1e-4  # relative to the largest output magnitude


@functools.cache
def model(name: str) -> nn.Module:
    """The network with seeded random weights and batch-norm statistics far from the
    identity (so that folding them is exercised)."""
    torch.manual_seed(0)
    kw = (
        {"aux_logits": False, "init_weights": False}
        if name in ("googlenet", "inception_v3")
        else {}
    )
    m = getattr(tvm, name)(weights=None, **kw).eval()
    gen = torch.Generator().manual_seed(1)
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            c = mod.num_features
            mod.running_mean.copy_(torch.randn(c, generator=gen) * 0.1)
            mod.running_var.copy_(torch.rand(c, generator=gen) + 0.5)
            mod.weight.data.copy_(torch.rand(c, generator=gen) + 0.5)
            mod.bias.data.copy_(torch.randn(c, generator=gen) * 0.1)
    return m


def example(name: str) -> torch.Tensor:
    s = SIZE.get(name, 64)
    return torch.randn(1, 3, s, s, generator=torch.Generator().manual_seed(2))


@functools.cache
def traced(name: str) -> Graph:
    return trace(model(name), (example(name),))


def readers(g: Graph, value: str) -> list:
    return [n for n in g.nodes() if value in n.inputs]


_CACHE = tempfile.TemporaryDirectory(prefix="mw-test-cache-")


@functools.cache
def optimized(name: str) -> tuple[middleware.runtime.module.OptimizedModule, float]:
    """``optimize(model)`` after one call, and its error against the model (cached: the
    structural tests below read the same passed graph)."""
    m, x = model(name), example(name)
    om = middleware.optimize(m, measure_hardware=False, cache_dir=_CACHE.name, strict=True)
    with torch.no_grad():
        ref = m(x)
        out = om(x)
    return om, relative_error(ref, out)


@pytest.mark.parametrize("name", nets(*NETWORKS))
def test_optimized_network_matches_pytorch(name):
    om, err = optimized(name)
    assert err <= TOL
    g = om.graph
    assert all(n.bound in ("io", "param", "compute") and n.group is not None for n in g.nodes())
    # no batch-norm is left that a layer feeds alone
    for n in g.nodes():
        if n.op == "batch_norm":
            p = g.producer(n.inputs[0])
            assert (
                p is None or p.op not in ("conv2d", "linear") or len(readers(g, p.outputs[0])) > 1
            )
            assert n.bound == "io"
    # no monotone activation next to a max-pool is left unmerged
    for n in g.nodes():
        if n.op == "max_pool2d":
            p = g.producer(n.inputs[0])
            assert (
                p is None or p.op not in ("relu", "hardtanh") or len(readers(g, p.outputs[0])) > 1
            )
            rs = readers(g, n.outputs[0])
            assert not (len(rs) == 1 and rs[0].op in ("relu", "hardtanh"))
    report = om.report()
    assert len(report.groups) == len({n.group for n in g.nodes()})
    assert len(str(report).splitlines()) < len(g) + 20


@pytest.mark.parametrize("name", nets("resnet18", "resnet50", "mobilenet_v2", "densenet121"))
def test_batch_norms_folded(name):
    g = optimized(name)[0].graph
    bns = [n for n in g.nodes() if n.op == "batch_norm"]
    if name == "densenet121":
        # the pre-activation batch-norms (after a concat) stay, io
        assert len(bns) == 58 + 3 + 1
        first = ("cat", "maxpool_relu", "avg_pool2d")  # a block's first layer: no concat
        assert all(g.producer(n.inputs[0]).op in first and n.bound == "io" for n in bns)
    else:
        assert bns == []


@pytest.mark.parametrize("name", nets("alexnet", "vgg16"))
def test_relus_merged_into_max_pools(name):
    before = traced(name)
    g = optimized(name)[0].graph
    pools = sum(n.op == "max_pool2d" for n in before.nodes())
    ops = [n.op for n in g.nodes()]
    assert "max_pool2d" not in ops and "relu" not in ops
    assert ops.count("maxpool_relu") == pools


POOLS = ("max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "adaptive_max_pool2d", "maxpool_relu")


def pools_after_cat(g: Graph, only_pool_readers: bool) -> list[str]:
    out = []
    for n in g.nodes():
        p = g.producer(n.inputs[0]) if n.op in POOLS else None
        if p is not None and p.op == "cat":
            if not only_pool_readers or all(r.op in POOLS for r in readers(g, p.outputs[0])):
                out.append(n.name)
    return out


@pytest.mark.parametrize("name, moved", nets(("googlenet", 3), ("squeezenet1_1", 2)))
def test_poolings_in_front_of_concats(name, moved):
    before = traced(name)
    assert len(pools_after_cat(before, True)) == moved
    g = optimized(name)[0].graph
    # every pooling that followed a concat is in front of it, also where other ops read
    # the concat (the pipeline runs pool_before_concat with shared=True)
    assert pools_after_cat(g, False) == []


def test_googlenet_shared_concats_move_in_the_pipeline():
    before = traced("googlenet")
    assert len(pools_after_cat(before, False)) == 9
    g = run_passes(before, Options(), DEFAULT_HARDWARE)
    assert pools_after_cat(g, False) == []
    x = example("googlenet")
    with torch.no_grad():
        assert relative_error(model("googlenet")(x), g.evaluate(x)) <= TOL
