"""The runtime: plans per input signature, the untouched original, output structures.

Optimized outputs are compared with eager PyTorch on seeded random inputs within
rtol 1e-4, atol 1e-4 times the output's scale.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import middleware
from middleware.runtime.module import OptimizedModule

OPT_RTOL, OPT_ATOL = 1e-4, 1e-4

Heads = collections.namedtuple("Heads", "logits extra")


class Net(nn.Module):
    """Convolutions, batch-norm with non-trivial statistics, pooling and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 10, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(10)
        self.conv2 = nn.Conv2d(10, 10, 3, padding=1, groups=10)
        self.fc = nn.Linear(10, 7)
        self.bn1.running_mean.uniform_(-1, 1)
        self.bn1.running_var.uniform_(0.5, 2)

    def forward(self, x):  # noqa: ANN001, ANN201
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.max_pool2d(y + self.conv2(y), 2, ceil_mode=True)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


def _snapshot(model: nn.Module) -> dict[str, object]:
    return {
        "state": {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()},
        "ptrs": {k: v.data_ptr() for k, v in model.state_dict(keep_vars=True).items()},
        "requires_grad": {k: p.requires_grad for k, p in model.named_parameters()},
        "training": [m.training for m in model.modules()],
        "dict_keys": [sorted(vars(m)) for m in model.modules()],
        "hooks": [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()],
        "types": [type(m) for m in model.modules()],
        "devices": {k: v.device for k, v in model.state_dict().items()},
    }


def _assert_unchanged(model: nn.Module, before: dict[str, object]) -> None:
    after = _snapshot(model)
    for k, v in before["state"].items():
        assert torch.equal(after["state"][k], v), f"{k} changed"
        assert after["state"][k].dtype == v.dtype
    for key in ("ptrs", "requires_grad", "training", "dict_keys", "hooks", "types", "devices"):
        assert after[key] == before[key], key


def test_new_batch_size_builds_and_caches_another_plan(tree_close) -> None:
    model = Net().eval()
    optimized = middleware.optimize(model)
    assert optimized.graph is None and optimized.signatures == []
    assert "not compiled yet" in str(optimized.report())

    def check(n: int, h: int = 9, w: int = 11) -> None:
        x = torch.randn(n, 3, h, w)
        with torch.no_grad():
            expected = model(x)
        tree_close(optimized(x), expected, OPT_RTOL, OPT_ATOL)

    check(2)
    first_plan, first_graph = optimized.plan, optimized.graph
    assert first_graph.values[first_graph.inputs[0]].shape == (2, 3, 9, 11)
    check(2)
    assert optimized.plan is first_plan and len(optimized.signatures) == 1  # cached, not rebuilt
    check(5)
    assert len(optimized.signatures) == 2 and optimized.plan is not first_plan
    assert optimized.graph.values[optimized.graph.inputs[0]].shape == (5, 3, 9, 11)
    check(2)
    assert optimized.plan is first_plan and len(optimized.signatures) == 2
    check(1, 4, 5)  # a new spatial size is a new signature too
    assert len(optimized.signatures) == 3
    assert [s[0][0] for s in optimized.signatures] == [(2, 3, 9, 11), (5, 3, 9, 11), (1, 3, 4, 5)]


def test_example_inputs_compile_eagerly(tree_close) -> None:
    model = Net().eval()
    x = torch.randn(3, 3, 8, 8)
    optimized = middleware.optimize(model, example_inputs=[x])
    assert optimized.graph is not None and len(optimized.signatures) == 1
    plan = optimized.plan
    tree_close(optimized(x), model(x), OPT_RTOL, OPT_ATOL)
    assert optimized.plan is plan


def test_original_model_is_never_modified() -> None:
    model = Net().eval()
    for p in model.parameters():
        p.requires_grad_(True)
    before = _snapshot(model)
    call, getattr_ = nn.Module.__call__, nn.Module.__getattr__
    optimized = middleware.optimize(model, example_inputs=torch.randn(2, 3, 9, 9))
    for n in (2, 4):
        optimized(torch.randn(n, 3, 9, 9))
    optimized.to(torch.float64)  # must not reach the original
    optimized.train()
    optimized.eval()
    _assert_unchanged(model, before)
    assert nn.Module.__call__ is call and nn.Module.__getattr__ is getattr_, "fx patches leaked"
    assert optimized.original is model
    # not a registered submodule (.to() above did not reach it); modules() lists its
    # modules so that parameters() are the user's own (optimizers, DDP)
    assert model not in list(optimized.children()), "the original is not a registered submodule"


def test_optimized_module_is_an_inference_module() -> None:
    optimized = middleware.optimize(Net().eval())
    assert isinstance(optimized, nn.Module) and isinstance(optimized, OptimizedModule)
    assert not optimized.training
    assert "original=Net" in repr(optimized)


def test_report_rows_and_table() -> None:
    optimized = middleware.optimize(Net().eval(), example_inputs=torch.randn(1, 3, 6, 6))
    report = optimized.report()
    assert [r.node for r in report.rows] == [n.name for n in optimized.graph.nodes()]
    assert {r.op for r in report.rows} >= {"conv2d", "linear"}
    # classes come from the roofline rule (passes/classify.py): a 3->? conv on a 6x6 image
    # moves more bytes than it computes on this machine, so any class is legitimate here;
    # each node's class must be what the graph says
    for r in report.rows:
        assert r.bound in ("io", "param", "compute")
        assert r.bound == optimized.graph.node(r.node).bound
    for r in report.rows:
        assert r.runs_as in ("vendor", "generated")
        assert r.bound in ("io", "param", "compute")
        # a row runs as intended (no reason), or it is an io node the fusion left to the
        # framework, or the default's rule picked an algorithm other than the vendor call
        # (the linear layer on one row: the GEMV), and it says why
        left_out = r.bound == "io" and r.runs_as == "vendor"
        picked = r.algorithm not in ("", "vendor")
        assert bool(r.reason) == (left_out or picked), r
        assert r.op != "linear" or r.algorithm == "gemv", r
    text = str(report)
    assert f"{len(report.rows)} nodes" in text
    assert "conv2d" in report.verbose() and "vendor" in report.verbose()
    assert report.fallbacks == []


class Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x, y):  # noqa: ANN001, ANN201
        a = self.conv(x)
        b = a.relu()
        return (
            a,
            [b, {"pooled": F.avg_pool2d(b, 2), "y": y * 2}],
            {"heads": Heads(b.mean((2, 3)), (y.sigmoid(), [x]))},
        )


def test_outputs_keep_the_original_structure(tree_close) -> None:
    model = Structured().eval()
    x, y = torch.randn(2, 3, 4, 6), torch.randn(5)
    optimized = middleware.optimize(model)
    out = optimized(x, y)
    tree_close(out, model(x, y), OPT_RTOL, OPT_ATOL)
    assert isinstance(out[2]["heads"], Heads)
    # a returned input comes back with the input's values (a copy: the layout pass converts
    # 4-d inputs once and outputs back to the user's layout)
    assert torch.equal(out[2]["heads"].extra[1][0], x)


def test_plain_list_and_single_tensor_outputs(tree_close) -> None:
    class ListOut(nn.Module):
        def forward(self, x):  # noqa: ANN001, ANN201
            return [x.relu(), x.tanh()]

    x = torch.randn(3, 5)
    tree_close(middleware.optimize(ListOut().eval())(x), ListOut()(x), OPT_RTOL, OPT_ATOL)
    out = middleware.optimize(nn.Sequential(nn.ReLU()).eval())(x)
    assert isinstance(out, torch.Tensor)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda x: x.contiguous(memory_format=torch.channels_last), id="channels_last"),
        pytest.param(lambda x: x.transpose(2, 3).contiguous().transpose(2, 3), id="strided"),
        pytest.param(lambda x: torch.cat([x, x], 1)[:, ::2], id="sliced"),
    ],
)
def test_inputs_in_other_memory_layouts(make, tree_close) -> None:
    """Same shape, dtype and device but other strides: the plan still computes the same."""
    model = Net().eval()
    optimized = middleware.optimize(model, example_inputs=torch.randn(2, 3, 7, 7))
    x = make(torch.randn(2, 3, 7, 7))
    assert x.shape == (2, 3, 7, 7)
    with torch.no_grad():
        expected = model(x.contiguous())
    tree_close(optimized(x), expected, OPT_RTOL, OPT_ATOL)


def test_optimized_module_deepcopies_and_keeps_working(tree_close) -> None:
    model = Net().eval()
    optimized = middleware.optimize(model, example_inputs=torch.randn(1, 3, 5, 5))
    clone = copy.deepcopy(optimized)
    x = torch.randn(1, 3, 5, 5)
    with torch.no_grad():
        expected = model(x)
    tree_close(clone(x), expected, OPT_RTOL, OPT_ATOL)
    tree_close(optimized(x), expected, OPT_RTOL, OPT_ATOL)


def test_runs_under_grad_mode_and_inference_mode(tree_close) -> None:
    model = Net().eval()
    optimized = middleware.optimize(model)
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        expected = model(x)
    tree_close(optimized(x), expected, OPT_RTOL, OPT_ATOL)  # grad mode on
    with torch.inference_mode():
        tree_close(optimized(x), expected, OPT_RTOL, OPT_ATOL)


# ---------------------------------------------------------------- memory tracking
def test_live_storage_tracker_counts_live_storages() -> None:
    from middleware.runtime.memtrack import LiveStorageTracker

    with LiveStorageTracker() as t:
        a = torch.empty(1000)  # 4000 bytes
        b = torch.empty(2000)  # 8000 bytes: 12000 live
        view = b[10:20].view(2, 5)  # a view allocates nothing
        del a  # 8000 live
        c = torch.empty(500)  # 10000 live
        assert t.live_bytes == 10000
    assert t.peak_bytes == 12000 and t.allocated_bytes == 14000
    del b, view, c
    assert t.live_bytes == 0


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_live_storage_tracker_counts_opaque_tensors() -> None:
    from middleware.runtime.memtrack import LiveStorageTracker

    dense = torch.randn(10, 20)
    with LiveStorageTracker() as t:
        packed = dense.to_mkldnn()  # an opaque oneDNN tensor: no storage, 800 bytes
        assert t.live_bytes == 800
        del packed
        assert t.live_bytes == 0
    assert t.peak_bytes == 800


def test_measure_peak_on_cpu() -> None:
    from middleware.runtime.memtrack import measure_peak

    def work() -> torch.Tensor:
        a = torch.ones(2**18)  # 1 MiB
        b = torch.ones(2**19)  # 2 MiB: 3 MiB live
        del a
        return b + 1  # 4 MiB live

    peak = measure_peak(work)
    assert 4 * 2**20 <= peak < 4 * 2**20 + 2**16, peak
