"""Models whose inputs are not all tensors (a detection model's list of images, an optional
number) run through TorchDynamo: the tensor subgraphs are optimized, the Python around them
runs as written, and the outputs equal PyTorch's. Training plans still take tensors only."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import middleware
from middleware.errors import InputTypeError


class ListNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, images, scale=None):
        out = [torch.relu(self.bn(self.conv(x))).amax(dim=(2, 3)) for x in images]
        return out if scale is None else [o * scale for o in out]


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = ListNet()
    with torch.no_grad():
        m.bn.running_mean.normal_()
        m.bn.running_var.uniform_(0.5, 2.0)
    return m.eval()


def _close(ys, refs) -> None:
    assert len(ys) == len(refs)
    for y, r in zip(ys, refs, strict=True):
        torch.testing.assert_close(y, r, rtol=1e-5, atol=1e-5 * float(r.abs().max()))


def test_list_inputs_run_through_dynamo_and_equal_pytorch(tmp_path):
    model = _model()
    opt = middleware.optimize(model, cache_dir=tmp_path)
    calls = [
        ([torch.randn(1, 3, 8, 8), torch.randn(2, 3, 10, 12)],),
        ([torch.randn(1, 3, 8, 8), torch.randn(2, 3, 10, 12)], 2.5),
        ([torch.randn(3, 3, 9, 9)],),
    ]
    with torch.no_grad():
        for args in calls:
            _close(opt(*args), model(*args))
    notes = " ".join(opt.report().notes)
    assert "captured through TorchDynamo" in notes
    assert "subgraph" in notes


def test_list_example_inputs_compile_at_optimize(tmp_path):
    model = _model()
    images = [torch.randn(2, 3, 7, 7)]
    opt = middleware.optimize(model, example_inputs=(images,), cache_dir=tmp_path)
    assert "captured through TorchDynamo" in " ".join(opt.report().notes)
    with torch.no_grad():
        _close(opt(images), model(images))


def test_training_with_list_inputs_is_refused_clearly(tmp_path):
    model = _model().train()
    opt = middleware.optimize(model, cache_dir=tmp_path)
    with pytest.raises(InputTypeError, match="input 0 is a list; the optimized model takes"):
        opt([torch.randn(2, 3, 8, 8)])


@pytest.mark.slow
def test_detection_and_video_models_still_run(tmp_path):
    """fasterrcnn_mobilenet_v3_large_fpn (a list of images in, a list of dicts out, data-
    dependent shapes: graph breaks) and r3d_18 (3-d convolutions; in-place writes through
    views that torch.fx refuses) run, their outputs equal to PyTorch's."""
    import torchvision

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from coverage import variance_keeping

    torch._logging.set_logs(dynamo=logging.ERROR)
    torch.manual_seed(0)
    det = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, box_score_thresh=0.0
    )
    det = variance_keeping(det)
    images = [torch.rand(3, 160, 160)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = det(images)
        got = middleware.optimize(det, cache_dir=tmp_path)(images)
    assert len(got) == len(ref) and ref[0]["boxes"].shape[0] > 0
    for g, r in zip(got, ref, strict=True):
        assert set(g) == set(r)
        for k in r:
            # scores are probabilities (scale 1): with these weights the kept boxes' scores
            # are 1e-40-1e-34, where a logit's float noise (1e-6 of its ~80) is 1e-4 of them
            scale = 1.0 if k == "scores" else float(r[k].abs().max())
            torch.testing.assert_close(g[k], r[k], rtol=1e-4, atol=1e-4 * scale)
    video = torchvision.models.video.r3d_18().eval()
    clip = torch.randn(1, 3, 8, 56, 56)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = middleware.optimize(video, cache_dir=tmp_path)
        torch.testing.assert_close(opt(clip), video(clip), rtol=1e-4, atol=1e-4)


def test_inference_dropout_in_place_is_the_identity(tmp_path):
    """``F.dropout(x, training=False, inplace=True)`` (as TorchDynamo records
    mobilenet_v3's classifier) writes nothing: the graph keeps its views (a subgraph used to
    run as the original for an in-place write through a view)."""
    import torch.nn.functional as F

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(12, 16), nn.Linear(16, 5)

        def forward(self, x):
            y = F.hardswish(self.fc1(x.flatten(1)))
            z = F.dropout(y, 0.2, False, True)
            return torch.cat([self.fc2(z), y], dim=1)

    torch.manual_seed(0)
    model = Head().eval()
    x = torch.randn(3, 3, 2, 2)
    backend = middleware.Backend(device="cpu", cache_dir=tmp_path)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no subgraph may run as the original
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    (sub,) = backend.report().subgraphs
    assert sub.optimized and not sub.report.fallbacks, str(sub.report)
