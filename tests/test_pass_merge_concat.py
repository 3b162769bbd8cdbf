"""merge_concat: a concat of a concat along the same dim becomes one concat."""

from __future__ import annotations

import torch
import torch.nn as nn

from middleware import trace
from middleware.passes.merge_concat import merge_concat
from middleware.passes.verify import check_equivalent


def cats(g):
    return [n for n in g.nodes() if n.op == "cat"]


class Nested(nn.Module):
    def forward(self, a, b, c, d):
        inner = torch.cat([a, torch.cat([b, c], 1)], 1)
        return torch.relu(torch.cat([torch.cat([inner, d], 1), a], 1))


def inputs(n=4, c=(2, 3, 1, 2)):
    return tuple(torch.randn(1, k, 3, 3) for k in c[:n])


def test_chain_of_any_depth_becomes_one_cat():
    g = trace(Nested(), inputs())
    assert len(cats(g)) == 4
    g2 = merge_concat(g)
    (cat,) = cats(g2)
    assert cat.inputs == ("a", "b", "c", "d", "a")
    check_equivalent(g, g2, tol=0.0)


class Kept(nn.Module):
    def forward(self, a, b, c):
        inner = torch.cat([a, b], 1)
        other = torch.cat([a, b], 2)
        return (
            torch.cat([inner, c], 1),  # inner is read twice: stays
            torch.sigmoid(inner),
            torch.cat([other, torch.cat([a, a], 2)], 1),  # dims differ: stay
        )


def test_shared_or_other_dim_stays():
    g = trace(Kept(), (torch.randn(1, 2, 3, 3), torch.randn(1, 2, 3, 3), torch.randn(1, 4, 3, 3)))
    g2 = merge_concat(g)
    assert len(cats(g2)) == len(cats(g)) == 5
    check_equivalent(g, g2, tol=0.0)


class Twice(nn.Module):
    def forward(self, a, b):
        inner = torch.cat([a, b], 1)
        return torch.cat([inner, inner], 1)


def test_inner_read_twice_by_the_same_outer_is_inlined_twice():
    g = trace(Twice(), (torch.randn(2, 1, 4), torch.randn(2, 3, 4)))
    g2 = merge_concat(g)
    (cat,) = cats(g2)
    assert cat.inputs == ("a", "b", "a", "b")
    check_equivalent(g, g2, tol=0.0)
