"""A float32 model gives float32 answers whatever ``torch.get_default_dtype()`` is: every
kernel that allocates its output or workspace says float32 (review finding, session 7:
``gemv`` returned float64 garbage after ``torch.set_default_dtype(torch.float64)``; a
generated group's output was a float64 tensor holding float32 bits, and Winograd's
workspaces were float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import middleware


@pytest.fixture
def float64_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 64, 3, padding=1)
        self.b = nn.Conv2d(64, 64, 3, padding=1)
        self.dw = nn.Conv2d(64, 64, 3, padding=1, groups=64)
        self.p = nn.Conv2d(64, 16, 1)
        self.fc = nn.Linear(16 * 8 * 8, 10)

    def forward(self, x):
        y = torch.relu(self.b(torch.relu(self.a(x))))
        y = self.p(torch.relu(self.dw(y)))
        return self.fc(y.flatten(1))


@pytest.mark.filterwarnings("error::UserWarning")  # a plan that fails and falls back fails
@pytest.mark.parametrize(
    "algorithms",
    [
        {"conv2d": "direct", "linear": "gemv"},
        {"conv2d": ["vendor", "winograd_f4x4", "vendor", "vendor"]},
        {"conv2d": ["vendor", "winograd_f2x2", "vendor", "vendor"]},
        {"conv2d": "im2col_gemm"},
        None,
    ],
)
def test_float32_model_under_a_float64_default(algorithms, tmp_path, float64_default):
    torch.manual_seed(0)
    model = _Net().float().eval()
    x = torch.randn(1, 3, 8, 8, dtype=torch.float32)
    with torch.no_grad():
        ref = model(x)
        opt = middleware.optimize(
            model, example_inputs=[x], cache_dir=tmp_path, algorithms=algorithms
        )
        y = opt(x)
    assert y.dtype == torch.float32
    scale = max(1.0, float(ref.abs().max()))
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * scale)
