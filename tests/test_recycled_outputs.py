"""Graph outputs written into memory the user let go of (``planned_steps.Recycled``).

A later call must never write into an output, or a view, storage, NumPy array or DLPack
capsule of one, that the user still holds; memory nobody holds is reused (no new pages).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn as nn

import middleware
from middleware.runtime.planned_steps import Recycled

# every test with the module's call as one C++ function (its own output pool) and in Python
pytestmark = pytest.mark.usefixtures("call_path")


class Residual(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + y) * 2.0


def _model_and_inputs(layout: str) -> tuple[nn.Module, list[torch.Tensor]]:
    shape = (2, 32, 48, 48)  # 576 KiB of output: above Recycled.MIN_BYTES
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(shape, generator=g).contiguous(memory_format=fmt) for _ in range(2)]
    return Residual().eval(), xs


def _holders(y: torch.Tensor, how: str) -> tuple[object, Callable[[object], torch.Tensor]]:
    """What the user keeps of output ``y`` (dropping ``y`` itself), and how to read it at
    the end (nothing else may hold the storage meanwhile)."""
    shape, stride, off = tuple(y.shape), y.stride(), y.storage_offset()
    if how == "tensor":
        return y, lambda t: t
    if how == "view":
        return y[1:], lambda v: v
    if how == "storage":
        return y.untyped_storage(), lambda st: torch.empty(0).set_(st, off, shape, stride)
    if how == "numpy":
        return y.numpy(), torch.from_numpy
    if how == "dlpack":
        return torch.utils.dlpack.to_dlpack(y), torch.from_dlpack
    raise AssertionError(how)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_held_outputs_are_never_overwritten(layout: str) -> None:
    model, xs = _model_and_inputs(layout)
    opt = middleware.optimize(model, example_inputs=xs)
    rng = random.Random(1)
    held: list[tuple[str, object, Callable[[object], torch.Tensor], torch.Tensor]] = []
    ptrs: set[int] = set()
    reused = 0
    for call in range(40):
        scale = 1.0 + call
        ins = [x * scale for x in xs]
        y = opt(*ins)
        ref = model(*ins)
        assert torch.equal(y, ref)
        reused += y.data_ptr() in ptrs
        ptrs.add(y.data_ptr())
        how = rng.choice(["drop"] * 4 + ["tensor", "view", "storage", "numpy", "dlpack"])
        if how != "drop":
            obj, read = _holders(y, how)
            want = ref[1:] if how == "view" else ref
            held.append((how, obj, read, want.clone()))
        del y
        if held and rng.random() < 0.5:  # the user lets go of something held before
            held.pop(rng.randrange(len(held)))
    assert held
    for how, obj, read, want in held:
        assert torch.equal(read(obj).reshape(want.shape), want), how
    assert reused >= 10  # memory was reused while other outputs were held
    fast = "native_call=True" in repr(opt.options)
    assert (opt._fast is not None) == fast  # the C++ call served where it was asked for


def test_dropped_output_memory_is_reused() -> None:
    model, xs = _model_and_inputs("nchw")
    opt = middleware.optimize(model, example_inputs=xs)
    first = opt(*xs).data_ptr()  # dropped at once
    y = opt(*xs)
    assert y.data_ptr() == first
    z = opt(*xs)  # y is held: another buffer
    assert z.data_ptr() != y.data_ptr()
    assert torch.equal(y, z) and torch.equal(z, model(*xs))


def test_shared_memory_output_is_not_reused() -> None:
    model, xs = _model_and_inputs("nchw")
    opt = middleware.optimize(model, example_inputs=xs)
    y = opt(*xs)
    y.share_memory_()  # moved to a shared-memory file another process could map
    st = y.untyped_storage()
    ptr = st.data_ptr()
    want = y.clone()
    del y
    for _ in range(3):
        opt(*[x * 3 for x in xs])
    assert torch.equal(torch.empty(0).set_(st, 0, want.shape, want.stride()), want)
    assert st.data_ptr() == ptr


@pytest.mark.parametrize("move", ["share_memory_", "resize_"])
def test_moved_output_memory_is_never_handed_out_again(move: str) -> None:
    """An output whose storage moved (to a shared-memory file another process may map, or
    resized) and then dropped by the user: its buffer's address tells, not its references."""
    model, xs = _model_and_inputs("nchw")
    opt = middleware.optimize(model, example_inputs=xs)
    for _ in range(3):  # the C++ call where call_path says so
        opt(*xs)
    y = opt(*xs)
    if move == "share_memory_":
        y.share_memory_()
    else:
        y.resize_(y.numel() * 2)
    moved = y.data_ptr()
    del y
    for _ in range(4):
        z = opt(*xs)
        assert z.data_ptr() != moved
        assert torch.equal(z, model(*xs))
        del z


def test_small_outputs_and_other_devices_are_left_to_the_allocator() -> None:
    from middleware.graph import TensorType

    assert not Recycled.applies(TensorType((4, 1000)), torch.device("cpu"))
    assert Recycled.applies(TensorType((16, 64, 56, 56)), torch.device("cpu"))
    assert not Recycled.applies(TensorType((16, 64, 56, 56)), torch.device("cuda"))
    np.testing.assert_equal(Recycled.KEEP >= 2, True)


def test_profiler_counts_kept_outputs_as_io_not_parameters() -> None:
    model, xs = _model_and_inputs("nchw")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the profiler warns when its peak misses the plan's
        result = middleware.profile(model, xs, repeats=1)
    out_bytes = model(*xs).numel() * 4
    assert result.optimized.param_bytes == 0, result  # the model has no parameters
    assert result.optimized.peak_io_bytes >= out_bytes + sum(x.numel() * 4 for x in xs)
    assert result.optimized.peak_io_bytes == result.planned_peak_io_bytes, result


@pytest.mark.parametrize("first", ["inference", "plain"])
def test_outputs_take_the_calls_inference_mode(first: str) -> None:
    """A recycled buffer made under ``torch.inference_mode()`` is handed to a later call
    outside it as a normal tensor (autograd can use it), and a buffer made outside it is
    an inference tensor under it: each output is an inference tensor exactly when eager's
    is, whichever call made the buffer."""
    model, xs = _model_and_inputs("nchw")
    opt = middleware.optimize(model, example_inputs=xs)
    w = torch.ones(1, requires_grad=True)
    modes = ["inference", "plain"] if first == "inference" else ["plain", "inference"]
    for _ in range(3):  # buffers made in both modes, then reused in both
        for mode in modes:
            if mode == "inference":
                with torch.inference_mode():
                    y = opt(*xs)
                    want = model(*xs)
            else:
                with torch.no_grad():
                    want = model(*xs)
                y = opt(*xs)
            assert y.is_inference() == want.is_inference() == (mode == "inference")
            torch.testing.assert_close(y, want)
            if mode == "plain":
                (y * w).sum().backward()  # an inference tensor refuses this
            del y


def test_one_buffer_serves_calls_in_inference_mode_after_one_outside() -> None:
    """The usual order (example inputs or a first call outside ``torch.inference_mode()``,
    then calls inside it): the buffer of the other mode is replaced, not joined, and the
    later calls reuse one buffer, handed out as inference tensors."""
    model, xs = _model_and_inputs("nhwc")
    opt = middleware.optimize(model, example_inputs=xs)
    opt(*xs)
    ptrs = set()
    with torch.inference_mode():
        want = model(*xs)
        for _ in range(4):
            y = opt(*xs)
            assert y.is_inference()
            torch.testing.assert_close(y, want)
            ptrs.add(y.data_ptr())
            del y
    (rec,) = opt.plan.recycled
    assert len(rec.buffers()) == 1 and len(ptrs) == 1
    assert rec.buffers()[0].is_inference()  # replaced by one of the calls' mode
