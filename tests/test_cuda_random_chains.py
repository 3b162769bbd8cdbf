"""Random I/O-bound chains (hypothesis): the emulated CUDA kernel equals PyTorch.

Shapes, layouts and op parameters are drawn at random (seeded by hypothesis's database-free
derandomised mode so CI is reproducible); each chain's schedule (``passes/schedule.py``) is
rendered, compiled for the CPU emulation and compared with ``Graph.evaluate`` at rtol/atol
1e-5.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from cuda_cases import (
    FAKE_GPU,
    REGISTRY_ACTIVATIONS,
    Builder,
    avg_attrs,
    inputs_for,
    kernel_args,
    pool_attrs,
    schedule_of,
)
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from middleware.backends.cuda.kernel import emulate_schedule
from middleware.ops import CATALOGUE

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulation")

# every activation of the registry, with its default attrs
ACTIVATIONS = REGISTRY_ACTIVATIONS


@st.composite
def chains(draw):
    layout = draw(st.sampled_from(["nchw", "nhwc"]))
    shape = (
        draw(st.integers(1, 3)),
        draw(st.integers(1, 9)),
        draw(st.integers(1, 12)),
        draw(st.integers(1, 12)),
    )
    steps = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["act", "bn", "max", "avg", "scalar", "channel_mul"]))
        if kind in ("max", "avg"):
            k = draw(st.integers(1, 3))
            s = draw(st.integers(1, 2))
            p = draw(st.integers(0, k // 2))
            steps.append((kind, (k, s, p, draw(st.booleans()), draw(st.booleans()))))
        elif kind == "act":
            steps.append((kind, draw(st.sampled_from(ACTIVATIONS))))
        elif kind == "scalar":
            steps.append(
                (kind, (draw(st.sampled_from(["add", "sub", "mul", "div"])), draw(st.booleans())))
            )
        else:
            steps.append((kind, None))
    return layout, shape, steps


def _build(layout, shape, steps):
    b = Builder(layout, seed=1)
    x = b.input("x", shape)
    for kind, arg in steps:
        if kind == "act":
            x = b.node(arg, (x,), **dict(CATALOGUE[arg].defaults))
        elif kind == "bn":
            x = b.bn(x)
        elif kind == "scalar":
            op, reverse = arg
            x = b.node(op, (x,), scalar=1.25, reverse=reverse)
        elif kind == "channel_mul":
            s = b.param(f"s{len(b.names)}", (1, b.g.values[x].shape[1], 1, 1))
            x = b.node("mul", (x, s))
        else:
            k, s, p, ceil, flag = arg
            try:
                if kind == "max":
                    x = b.node("max_pool2d", (x,), **pool_attrs(k, s, p, ceil=ceil))
                else:
                    x = b.node("avg_pool2d", (x,), **avg_attrs(k, s, p, ceil=ceil, cip=flag))
            except RuntimeError:  # PyTorch refuses the window for this input size
                return None
    return b.done(x)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cuda-random-cache")


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(chain=chains())
def test_random_chain_matches_pytorch(chain, cache_dir):
    built = _build(*chain)
    assume(built is not None)
    graph, names = built
    assume(all(s > 0 for v in graph.values.values() for s in v.shape))
    kernel = emulate_schedule(schedule_of(graph, names), FAKE_GPU, cache_dir)
    inputs = inputs_for(graph, seed=2)
    expected = graph.evaluate(*inputs)
    got = kernel(*kernel_args(graph, kernel.rendered.inputs, inputs))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=str(chain))
