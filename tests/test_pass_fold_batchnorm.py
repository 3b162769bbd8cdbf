"""fold_batchnorm: inference batch-norms after a conv/linear become its weight and bias."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from middleware import trace
from middleware.graph import Graph
from middleware.passes.fold_batchnorm import fold_batchnorm
from middleware.passes.verify import check_equivalent, random_inputs

TOL = 1e-5  # float64 folding, cast back to float32: rounding only


def randomize_bn(m: nn.Module, seed: int = 0) -> nn.Module:
    """Batch-norm statistics far from the identity, so that folding is exercised."""
    gen = torch.Generator().manual_seed(seed)
    for mod in m.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            c = mod.num_features
            mod.running_mean.copy_(torch.randn(c, generator=gen))
            mod.running_var.copy_(torch.rand(c, generator=gen) * 2 + 0.1)
            if mod.affine:
                mod.weight.data.copy_(torch.randn(c, generator=gen))
                mod.bias.data.copy_(torch.randn(c, generator=gen))
    return m.eval()


def ops(g: Graph) -> list[str]:
    return [n.op for n in g.nodes()]


class Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.b1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)  # depthwise, no bias
        self.b2 = nn.BatchNorm2d(8, eps=1e-3)
        self.c3 = nn.Conv2d(8, 4, 1, bias=False)
        self.b3 = nn.BatchNorm2d(4, affine=False)
        self.fc = nn.Linear(4, 6)
        self.b4 = nn.BatchNorm1d(6)

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        y = self.b3(self.c3(self.b2(self.c2(y))))
        return self.b4(self.fc(y.mean((2, 3))))


def test_conv_and_linear_batch_norms_fold():
    m = randomize_bn(Layers())
    g = trace(m, (torch.randn(2, 3, 8, 8),))
    params_before = {k: v.copy() for k, v in g.params.items()}
    g2 = fold_batchnorm(g)
    assert "batch_norm" not in ops(g2), g2.text()
    assert ops(g2).count("conv2d") == 3 and ops(g2).count("linear") == 1
    for k, v in g.params.items():
        np.testing.assert_array_equal(v, params_before[k])  # never written
    check_equivalent(g, g2, tol=TOL)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        ref = m(x)
    torch.testing.assert_close(g2.evaluate(x), ref, rtol=1e-4, atol=1e-4)


class Shared(nn.Module):
    """One conv applied twice, each time followed by its own batch-norm."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(4, 4, 3, padding=1)
        self.b1, self.b2 = nn.BatchNorm2d(4), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.b1(self.c(x)) + self.b2(self.c(x * 2))


def test_shared_weights_fold_into_separate_params():
    g = trace(randomize_bn(Shared()), (torch.randn(1, 4, 6, 6),))
    g2 = fold_batchnorm(g)
    convs = [n for n in g2.nodes() if n.op == "conv2d"]
    assert "batch_norm" not in ops(g2) and len(convs) == 2
    assert convs[0].inputs[1] != convs[1].inputs[1]
    check_equivalent(g, g2, tol=TOL)


class NotFoldable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(4, 4, 3, padding=1)
        self.b = nn.BatchNorm2d(4)
        self.c2 = nn.Conv2d(4, 4, 1)
        self.b2 = nn.BatchNorm2d(4)
        self.b3 = nn.BatchNorm2d(8)

    def forward(self, x):
        y = self.c(x)
        z = self.b(y) + y  # the conv output has another reader
        w = self.c2(z)
        cat = self.b3(torch.cat([z, self.b2(w)], 1))  # pre-activation bn after a concat
        return cat, w  # w is a graph output: b2 may not fold into c2


def test_batch_norms_that_must_stay():
    g = trace(randomize_bn(NotFoldable()), (torch.randn(1, 4, 6, 6),))
    g2 = fold_batchnorm(g)
    assert ops(g2).count("batch_norm") == 3
    check_equivalent(g, g2, tol=0.0)


def test_rounding_is_float64():
    """Folded weights equal the float64 computation rounded once."""
    m = randomize_bn(nn.Sequential(nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5)))
    g = trace(m, (torch.randn(1, 3, 5, 5),))
    g2 = fold_batchnorm(g)
    conv = next(iter(g2.nodes()))
    bn = m[1]
    s = bn.weight.double() / torch.sqrt(bn.running_var.double() + bn.eps)
    w = (m[0].weight.double() * s[:, None, None, None]).float()
    np.testing.assert_array_equal(g2.params[conv.inputs[1]], w.detach().numpy())
    check_equivalent(g, g2, random_inputs(g, seed=3), tol=TOL)
