"""Every bad input and bad setting raises a specific error whose message says what to do."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import middleware
from middleware.errors import (
    DeviceError,
    InputMismatchError,
    InputTypeError,
    MiddlewareError,
    TrainingModeError,
)

SIGNATURE = r"float32\[N, 3, d2, d3\] on cpu"


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):  # noqa: ANN001, ANN201
        return torch.relu(self.bn(self.conv(x)))


@pytest.fixture
def compiled() -> nn.Module:
    """Optimized for one float32 input of 3 channels on the CPU."""
    return middleware.optimize(Small().eval(), example_inputs=torch.randn(2, 3, 5, 5))


# -------------------------------------------------------------------- call time
def test_wrong_number_of_inputs(compiled) -> None:
    x = torch.randn(2, 3, 5, 5)
    with pytest.raises(InputMismatchError, match=rf"expected 1 inputs \({SIGNATURE}\), got 2"):
        compiled(x, x)
    with pytest.raises(ValueError, match=r"expected 1 inputs .* got 0: \(\)"):
        compiled()


def test_wrong_rank(compiled) -> None:
    with pytest.raises(
        ValueError, match=r"input 0: expected rank 4 .* got rank 3 \(float32\[3, 5, 5\]"
    ):
        compiled(torch.randn(3, 5, 5))


def test_wrong_channel_count(compiled) -> None:
    with pytest.raises(
        InputMismatchError,
        match=rf"input 0: expected 3 channels \({SIGNATURE}\), got 4 \(float32\[2, 4, 5, 5\] on cpu\)",
    ):
        compiled(torch.randn(2, 4, 5, 5))


def test_wrong_dtype(compiled) -> None:
    with pytest.raises(TypeError, match=r"expected dtype torch.float32 .* got torch.float64") as e:
        compiled(torch.randn(2, 3, 5, 5, dtype=torch.float64))
    assert isinstance(e.value, InputTypeError)
    assert "given (float64[2, 3, 5, 5] on cpu)" in str(e.value)


def test_wrong_device(compiled) -> None:
    with pytest.raises(
        InputTypeError, match=r"expected device cpu .* got meta; move the input with \.to\('cpu'\)"
    ):
        compiled(torch.randn(2, 3, 5, 5, device="meta"))


def test_wrong_device_on_first_call() -> None:
    optimized = middleware.optimize(Small().eval())  # lazy: nothing compiled yet
    with pytest.raises(
        TypeError, match=r"input 0 is on meta but the model was optimized for device='cpu'"
    ):
        optimized(torch.randn(2, 3, 5, 5, device="meta"))


@pytest.mark.parametrize("bad", [[1.0, 2.0], 3.0, None, "x"])
def test_non_tensor_input(compiled, bad) -> None:
    """A non-tensor input goes to the original model (through TorchDynamo, which takes any
    structure); one the model itself rejects is the user's error, named as such."""
    want = rf"input 0 is a {type(bad).__name__}, which Small rejects in eager PyTorch too"
    with pytest.raises(InputTypeError, match=want):
        compiled(bad)
    model = Small().eval()
    lazy = middleware.optimize(model)
    with pytest.raises(TypeError, match=want):
        lazy(bad)
    x = torch.randn(2, 3, 5, 5)
    with torch.no_grad():  # the module is as it was: tensors still run a plan
        torch.testing.assert_close(lazy(x), model(x), rtol=1e-5, atol=1e-5)
    assert lazy.report().rows[0].runs_as != "fallback"


def test_keyword_inputs(compiled) -> None:
    with pytest.raises(
        InputTypeError, match=r"keyword inputs \(x\) are not supported; pass tensors positionally"
    ):
        compiled(x=torch.randn(2, 3, 5, 5))


def test_errors_leave_the_module_usable(compiled) -> None:
    x = torch.randn(2, 3, 5, 5)
    with pytest.raises(InputMismatchError):
        compiled(torch.randn(2, 4, 5, 5))
    torch.testing.assert_close(compiled(x), compiled.original(x), rtol=1e-4, atol=1e-4)


# -------------------------------------------------------------------- optimize()
@pytest.mark.parametrize("device", ["tpu", "gpu", "meta", "cpux", ""])
def test_unknown_device_lists_backends(device) -> None:
    with pytest.raises(
        DeviceError,
        match=rf"unknown device '{device}'; choose one of cpu, cuda, auto\. Backends available here: cpu \(",
    ) as e:
        middleware.optimize(Small().eval(), device=device)
    assert isinstance(e.value, ValueError)
    for line in middleware.available_backends():
        assert line in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_lists_backends(device) -> None:
    with pytest.raises(
        DeviceError, match=rf"device='{device}' but no CUDA device exists on this machine"
    ) as e:
        middleware.optimize(Small().eval(), device=device)
    assert "Backends available here: cpu (OpenMP C" in str(e.value)


def test_auto_device_picks_what_exists() -> None:
    from middleware.api import resolve_device

    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        assert middleware.optimize(Small().eval(), device="auto").options.device == "cpu"


def test_training_mode_is_accepted() -> None:
    model = Small()  # nn.Module starts in training mode
    middleware.optimize(model)
    assert model.training, "optimize() must not switch the user's model to eval"


def test_unknown_option_names() -> None:
    with pytest.raises(
        TypeError,
        match=r"unknown option\(s\) \['fusion', 'speed'\]; options are: .*disable_passes.*strict",
    ):
        middleware.optimize(Small().eval(), fusion=True, speed=2)


def test_unknown_pass_name() -> None:
    with pytest.raises(
        ValueError, match=r"unknown pass\(es\) \['no_such_pass'\] in disable_passes"
    ):
        middleware.optimize(
            Small().eval(), example_inputs=torch.randn(1, 3, 4, 4), disable_passes=["no_such_pass"]
        )


def test_not_a_module() -> None:
    with pytest.raises(
        TypeError, match=r"optimize\(\) takes a torch.nn.Module, got builtin_function_or_method"
    ):
        middleware.optimize(torch.relu)


def test_error_classes() -> None:
    """One base class; each error is also the builtin a caller would catch."""
    assert issubclass(InputMismatchError, MiddlewareError) and issubclass(
        InputMismatchError, ValueError
    )
    assert issubclass(InputTypeError, MiddlewareError) and issubclass(InputTypeError, TypeError)
    assert issubclass(DeviceError, ValueError) and issubclass(TrainingModeError, ValueError)
