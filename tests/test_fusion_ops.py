"""Every generated kernel against PyTorch running the same group (Graph.evaluate) on
seeded random inputs, over odd shapes and both layouts. Tolerance: 1e-5 abs/rel (float32
single ops; 1e-4 for transcendental chains)."""

from __future__ import annotations

import pytest
from fusion_helpers import avgpool, bn, build_chain, check_group, maxpool

LAYOUTS = ["nchw", "nhwc"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


# (input shape, steps): C not a multiple of the SIMD width, 1x1 and 2x2 spatial, ...
CHAINS = {
    "bn_relu_maxpool_3x3s2p1": ((2, 5, 9, 7), [bn(), ("relu", {}), maxpool(3, 2, 1)]),
    "bn_relu_maxpool_C17": ((1, 17, 12, 12), [bn(), ("relu", {}), maxpool(3, 2, 1)]),
    "maxpool_1x1_spatial": ((2, 3, 1, 1), [maxpool(1, 1)]),
    "maxpool_2x2_spatial_pad": ((2, 3, 2, 2), [maxpool(3, 1, 1)]),
    "maxpool_window_larger_than_input": ((1, 4, 2, 3), [maxpool(5, 2, 2)]),
    "maxpool_ceil_mode": ((2, 6, 10, 11), [maxpool(3, 2, 0, ceil=True)]),
    "maxpool_ceil_pad": ((1, 3, 7, 8), [maxpool(3, 2, 1, ceil=True)]),
    "maxpool_stride_gt_kernel": ((1, 5, 11, 13), [maxpool(2, 3, 1)]),
    "maxpool_dilation": ((1, 3, 13, 12), [maxpool(3, 1, 1, d=2)]),
    "maxpool_then_relu": ((2, 7, 8, 9), [maxpool(2, 2), ("relu", {})]),
    "avgpool_include_pad": ((2, 5, 9, 10), [avgpool(3, 2, 1)]),
    "avgpool_exclude_pad": ((2, 5, 9, 10), [avgpool(3, 2, 1, cip=False)]),
    "avgpool_ceil_include_pad": ((1, 4, 7, 7), [avgpool(3, 2, 1, ceil=True)]),
    "avgpool_ceil_exclude_pad": ((1, 4, 8, 7), [avgpool(2, 2, 1, ceil=True, cip=False)]),
    "avgpool_divisor_override": ((1, 3, 6, 6), [avgpool(2, 2, div=3)]),
    "avgpool_window_larger": ((1, 3, 2, 2), [avgpool(3, 1, 1, cip=False)]),
    "maxpool_relu_merged": (
        (2, 5, 9, 7),
        [("maxpool_relu", dict(maxpool(3, 2, 1)[1], activation="relu", activation_attrs=()))],
    ),
    "activations": (
        (2, 3, 5, 6),
        [
            ("hardtanh", dict(min_val=-0.5, max_val=0.7)),
            ("leaky_relu", dict(negative_slope=0.1)),
            ("silu", {}),
            ("hardswish", {}),
        ],
    ),
    "sigmoid_tanh_gelu": (
        (1, 9, 4, 3),
        [("sigmoid", {}), ("tanh", {}), ("gelu", dict(approximate="none")), ("hardsigmoid", {})],
    ),
    "gelu_tanh": ((1, 4, 3, 3), [("gelu", dict(approximate="tanh"))]),
    "mish_then_avgpool": (
        (2, 6, 7, 8),
        [bn(), ("mish", {}), avgpool(3, 2, 1), ("mish", {})],
    ),
    "hardshrink_around_pool": (
        (2, 5, 9, 6),
        [bn(), ("hardshrink", dict(lambd=0.4)), maxpool(3, 2, 1), ("hardshrink", dict(lambd=0.1))],
    ),
    "elu_then_pool": (
        (2, 5, 8, 7),
        [bn(), ("elu", dict(alpha=0.7)), maxpool(3, 2, 1), ("elu", dict(alpha=1.0))],
    ),
    "scalar_arith": (
        (2, 3, 4, 5),
        [
            ("add", dict(scalar=1.5)),
            ("mul", dict(scalar=0.5)),
            ("sub", dict(scalar=2.0, reverse=True)),
            ("div", dict(scalar=3.0)),
        ],
    ),
    "residual_add": ((2, 6, 5, 5), [bn(), ("add", {}, [("input", (2, 6, 5, 5))]), ("relu", {})]),
    "add_alpha": ((1, 3, 4, 4), [("sub", dict(alpha=2.0), [("input", (1, 3, 4, 4))])]),
    "se_channel_scale": ((2, 7, 6, 5), [("mul", {}, [("input", (2, 7, 1, 1))])]),
    "param_broadcast": ((2, 4, 3, 3), [("add", {}, [("param", (4, 1, 1))]), ("relu", {})]),
    "adaptive_avg_1": ((2, 6, 7, 5), [("adaptive_avg_pool2d", dict(output_size=(1, 1)))]),
    "adaptive_avg_uneven": ((1, 3, 10, 7), [("adaptive_avg_pool2d", dict(output_size=(3, 4)))]),
    "adaptive_max_uneven": ((1, 5, 9, 11), [("adaptive_max_pool2d", dict(output_size=(4, 3)))]),
    "global_mean_keepdim": ((2, 5, 4, 6), [("mean", dict(dims=(2, 3), keepdim=True))]),
    "global_mean_flatten": (
        (2, 9, 3, 3),
        [("relu", {}), ("mean", dict(dims=(-1, -2), keepdim=False))],
    ),
    "gap_flatten": (
        (2, 6, 5, 5),
        [
            ("adaptive_avg_pool2d", dict(output_size=(1, 1))),
            ("flatten", dict(start_dim=1, end_dim=-1)),
        ],
    ),
    "two_pools": ((1, 4, 17, 15), [bn(), ("relu", {}), maxpool(3, 2, 1), avgpool(2, 2)]),
    # index remaps (op_shapes.py): slices with offsets and steps on any dim, an int index
    # dropping a dim, broadcasts, tiles, rolls (mod the size), also before a window
    "slice_channels_step": (
        (2, 9, 6, 7),
        [bn(), ("slice", dict(index=(("slice", 0, 2, 1), ("slice", 1, 8, 3)))), ("relu", {})],
    ),
    "slice_spatial_then_pool": (
        (2, 5, 11, 10),
        [
            ("slice", dict(index=(("slice", 1, 2, 1), ("slice", 0, 5, 1), ("slice", 2, 11, 2)))),
            ("relu", {}),
            maxpool(3, 2, 1),
        ],
    ),
    "slice_int_index": (
        (3, 4, 5, 6),
        [bn(), ("slice", dict(index=(("slice", 0, 3, 2), ("int", 2)))), ("sigmoid", {})],
    ),
    "expand_broadcast": (
        (2, 1, 6, 1),
        [("expand", dict(shape=(2, 5, 6, 4))), ("relu", {})],
    ),
    "repeat_tiles": ((1, 3, 4, 5), [("repeat", dict(repeats=(2, 2, 1, 3))), ("tanh", {})]),
    "roll_two_dims": (
        (2, 5, 6, 7),
        [bn(), ("roll", dict(shifts=(2, -3), dims=(2, 3))), ("relu", {})],
    ),
    "roll_channels_then_pool": (
        (2, 6, 9, 8),
        [("roll", dict(shifts=(4, 1), dims=(1, -1))), ("relu", {}), maxpool(3, 2, 1)],
    ),
    # ShuffleNet's shuffle as the layout pass writes it for channels_last: one gather over
    # channels, fused with the concat before it
    "cat_channel_shuffle": (
        (2, 5, 6, 7),
        [
            ("cat", dict(dim=1), [("input", (2, 5, 6, 7))]),
            ("channel_shuffle", dict(groups=2)),
            ("relu", {}),
        ],
    ),
    "channel_shuffle_3_groups": ((1, 12, 4, 5), [bn(), ("channel_shuffle", dict(groups=3))]),
    # the averaging divisor of a materialised pool holds over its own rows, not the output's
    "avgpool_exclude_pad_then_pool": (
        (1, 3, 12, 11),
        [avgpool(3, 1, 1, cip=False), maxpool(3, 2, 1)],
    ),
}

# index remaps across ranks (row-major values: the layout is nchw below rank 4)
REMAPS = {
    "slice_new_axis": (
        (3, 5, 7),
        [("slice", dict(index=(("slice", 0, 3, 1), ("new",), ("slice", 1, 5, 2)))), ("relu", {})],
    ),
    "slice_int_on_batch": ((3, 4, 5, 6), [("slice", dict(index=(("int", 1),))), ("relu", {})]),
    "expand_rank1_to_4": ((6,), [("expand", dict(shape=(2, 3, 4, 6))), ("sigmoid", {})]),
    "expand_rank3_to_4": ((3, 1, 5), [("expand", dict(shape=(2, 3, 4, 5))), ("sigmoid", {})]),
    "repeat_more_dims": ((4, 5), [("repeat", dict(repeats=(2, 3, 1, 2))), ("tanh", {})]),
    "roll_rank2": ((5, 7), [("roll", dict(shifts=(-2, 9), dims=(0, 1))), ("relu", {})]),
    "roll_rank3_same_dim_twice": (
        (4, 6, 5),
        [("roll", dict(shifts=(2, 3, -1), dims=(1, 1, -1))), ("relu", {})],
    ),
}


@pytest.mark.parametrize("case", sorted(REMAPS))
def test_index_remaps_across_ranks(case, cache):
    shape, steps = REMAPS[case]
    check_group(build_chain(shape, "nchw", steps), cache)


TOL = {
    "sigmoid_tanh_gelu": 1e-4,
    "elu_then_pool": 1e-5,
    "mish_then_avgpool": 1e-4,
    "activations": 1e-5,
    "gelu_tanh": 1e-4,
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(CHAINS))
def test_chain_matches_pytorch(case, layout, cache):
    shape, steps = CHAINS[case]
    g = build_chain(shape, layout, steps, seed=hash(case) % 1000)
    tol = TOL.get(case, 1e-5)
    check_group(g, cache, seed=1, atol=tol, rtol=tol)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k,s,p", [(3, 1, 1), (3, 2, 1), (5, 1, 2)])
def test_depthwise_conv(layout, k, s, p, cache):
    c = 6
    steps = [
        bn(),
        ("relu", {}),
        (
            "conv2d",
            dict(stride=(s, s), padding=(p, p), dilation=(1, 1), groups=c),
            [("param", (c, 1, k, k)), ("param", (c,))],
        ),
        ("hardtanh", dict(min_val=0.0, max_val=6.0)),
    ]
    g = build_chain((2, c, 9, 8), layout, steps, seed=k * 10 + s)
    check_group(g, cache, seed=2, atol=1e-4, rtol=1e-4)


def test_depthwise_conv_in_an_io_group_runs_through_onednn(cache):
    """On x86 oneDNN's depthwise convolution (with its fused post-op) is faster than the
    generated one (backends/cpu/units.py, VENDOR_FASTER): it splits its group, the nodes
    around it are still generated, and the plan equals the reference."""
    import torch
    from fusion_helpers import hardware

    from middleware.backends.cpu import CpuBackend
    from middleware.backends.cpu.units import fusion_units
    from middleware.options import Options
    from middleware.runtime.plan import build_plan

    c = 6
    steps = [
        bn(),
        ("relu", {}),
        (
            "conv2d",
            dict(stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=c),
            [("param", (c, 1, 3, 3)), ("param", (c,))],
        ),
        ("hardtanh", dict(min_val=0.0, max_val=6.0)),
        ("sigmoid", {}),
    ]
    g = build_chain((2, c, 9, 8), "nchw", steps, seed=5)
    opts = Options(cache_dir=cache)
    fused, failed = fusion_units(CpuBackend(), g, opts, hardware())
    covered = {n for u in fused.values() for n in u.nodes}
    conv = [n.name for n in g.nodes() if n.op == "conv2d"]
    assert conv and not set(conv) & covered and not failed
    assert len(covered) == len(g) - 1  # everything else is generated
    units = CpuBackend().units(g, opts, hardware(), torch.device("cpu"))
    assert [u.runs_as for u in units if u.nodes == tuple(conv)] == ["vendor"]
    x = torch.randn(g.values[g.inputs[0]].shape, generator=torch.Generator().manual_seed(3))
    plan = build_plan(g, torch.device("cpu"), units, plan_memory=True)
    with torch.no_grad():
        torch.testing.assert_close(plan.run([x]), g.evaluate(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("shape", "src", "dst"),
    [
        ((2, 3, 9, 13), "nchw", "nhwc"),  # an image's 3 channels, HW past one block
        ((1, 70, 5, 3), "nhwc", "nchw"),  # more channels than a block's positions
        ((3, 5, 11, 12), "nchw", "nhwc"),
        ((2, 1, 4, 70), "nhwc", "nchw"),
    ],
)
def test_layout_conversion_alone_is_a_blocked_transposition(shape, src, dst, cache):
    """A to_layout alone in its group renders as backends/x86/transpose.py's blocked
    transposition (not the schedule's element loop) and equals PyTorch's conversion."""
    from middleware.backends.x86.transpose import layout_copy

    g = build_chain(shape, src, [("to_layout", dict(layout=dst))])
    kernel = check_group(g, cache)
    assert layout_copy(kernel.schedule) == (src, dst)
    assert "blocked transposition" in kernel.source_path.read_text()
