"""The optimized module's inference call as one C++ function (``runtime/shortcut.cpp``).

From a plan's third call (the first compiles, the second takes the Python shortcut and
makes the C++ one), the call is ``Shortcut(inputs)``: it must step aside (return None, so
the Python path decides) for everything that path would treat differently, and give the
same outputs as eager PyTorch whenever it does not.
"""

from __future__ import annotations

import copy
import gc
import random
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
from fusion_helpers import reinit

import middleware
from middleware.errors import MiddlewareError
from middleware.runtime import shortcut

pytestmark = pytest.mark.usefixtures("call_path")


def _net() -> nn.Module:
    return reinit(
        nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 4, 1),
        ),
        1,
    ).eval()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = max(1.0, float(want.detach().abs().max()))
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-4, atol=1e-4 * scale)


def _ready(call_path: str) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """A model, its optimized module after three calls, and the input they were called on."""
    m, x = _net(), torch.randn(2, 3, 16, 16)
    om = middleware.optimize(m, example_inputs=(x,), measure_hardware=False)
    with torch.no_grad():
        for _ in range(3):
            _close(om(x), m(x))
    assert om.plan.native is not None
    assert (om._fast is not None) == (call_path == "c++")
    return m, om, x


def test_the_call_is_one_cpp_function(call_path: str) -> None:
    m, om, x = _ready(call_path)
    forwards: list[int] = []
    real = om.forward
    om.forward = lambda *a: (forwards.append(1), real(*a))[1]
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn_like(x)
            _close(om(x), m(x))
    assert forwards == []
    note = [n for n in om.report().notes if n.startswith("call:")]
    if call_path == "c++":
        assert note == ["call: one C++ function (checks, output buffer and native program)"]
    else:
        assert note == ["call: the Python shortcut; the C++ call: off (Options.native_call)"]


# Each case changes one thing the Python path would treat differently and returns the
# inputs of the next call (a function of the test's model, optimized module and input).
def _other_batch(m, om, x):
    return (torch.randn(3, 3, 16, 16),)


def _other_dtype(m, om, x):
    return (x.double(),)


def _channels_last(m, om, x):
    return (x.contiguous(memory_format=torch.channels_last),)


def _strided(m, om, x):
    return (torch.randn(2, 3, 16, 32)[..., ::2],)


def _requires_grad(m, om, x):
    return (x.clone().requires_grad_(),)


class _Sub(torch.Tensor):
    pass


def _subclass(m, om, x):
    return (x.clone().as_subclass(_Sub),)


def _submodule_trains(m, om, x):
    m[1].train()  # one batch norm on its own: batch statistics, as in eager
    return (x,)


def _weight_written(m, om, x):
    with torch.no_grad():
        m[0].weight.mul_(1.5)
    return (x,)


def _parameter_replaced(m, om, x):
    m[4].bias = nn.Parameter(torch.randn(4))
    return (x,)


def _module_hook(m, om, x):
    om.register_forward_hook(lambda mod, args, out: out * 2.0)
    return (x,)


def _global_hook(m, om, x):
    handle = nn.modules.module.register_module_forward_pre_hook(lambda mod, args: None)
    om._test_handle = handle  # removed by the test
    return (x,)


def _thread_count(m, om, x):
    torch.set_num_threads(1 if torch.get_num_threads() > 1 else 2)
    return (x,)


def _two_inputs(m, om, x):
    return (x, x)


CASES = [
    _other_batch,
    _other_dtype,
    _channels_last,
    _strided,
    _requires_grad,
    _subclass,
    _submodule_trains,
    _weight_written,
    _parameter_replaced,
    _module_hook,
    _global_hook,
    _thread_count,
    _two_inputs,
]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__[1:] for c in CASES])
def test_every_check_steps_aside(case, call_path: str) -> None:
    """The C++ call returns None after the change (the Python path decides: a test for each
    of its checks), and the module's output is eager's."""
    m, om, x = _ready(call_path)
    fast = om._fast
    threads = torch.get_num_threads()
    try:
        inputs = case(m, om, x)
        if fast is not None:
            with torch.no_grad():
                assert fast(inputs) is None
        if case in (_other_dtype, _two_inputs):  # refused with an error naming the fix
            with pytest.raises(MiddlewareError, match="expected"):
                om(*inputs)
            return
        with torch.no_grad():
            got = om(*inputs)
            want = m(*inputs)
            if case is _module_hook:
                want = want * 2.0
        _close(got, want)
    finally:
        torch.set_num_threads(threads)
        handle = om.__dict__.pop("_test_handle", None)
        if handle is not None:
            handle.remove()


def test_inference_mode(call_path: str) -> None:
    """Inference mode (other dispatch keys in the thread's state) takes the Python path;
    outputs are inference tensors exactly where eager's are."""
    m, om, x = _ready(call_path)
    fast = om._fast
    with torch.inference_mode():
        if fast is not None:
            assert fast((x,)) is None
        y = om(x)
        assert y.is_inference()
        _close(y, m(x))
    with torch.no_grad():
        y = om(x)
        assert not y.is_inference()
        _close(y, m(x))


def test_compiled_module_steps_aside(call_path: str) -> None:
    m, om, x = _ready(call_path)
    fast = om._fast
    om.__dict__["_compiled_call_impl"] = lambda *a: m(*a) * 3.0  # what nn.Module.compile sets
    with torch.no_grad():
        if fast is not None:
            assert fast((x,)) is None
        _close(om(x), m(x) * 3.0)


def test_a_module_with_its_cpp_call_is_collected(call_path: str) -> None:
    """The call holds the module's attribute dictionary, which holds the call: a cycle the
    garbage collector must break (the plan's memory goes with it)."""
    _, om, _ = _ready(call_path)
    ref = weakref.ref(om)
    plan = weakref.ref(om.plan)
    del om
    gc.collect()
    assert ref() is None and plan() is None


def test_copies_make_their_own_call(call_path: str) -> None:
    m, om, x = _ready(call_path)
    clone = copy.deepcopy(om)
    assert clone._fast is None
    with torch.no_grad():
        for _ in range(3):
            _close(clone(x), clone._original(x))
    assert (clone._fast is not None) == (call_path == "c++")
    assert clone._fast is None or clone._fast is not om._fast


class _Residual(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.relu(a + b) * 0.5


@pytest.mark.parametrize("seed", range(4))
def test_random_shapes_and_layouts_equal_eager(seed: int, call_path: str) -> None:
    """Random sizes and layouts, outputs held or dropped at random: every call equals
    eager, and a held output is never written by a later call (seeds 0 and 2 draw
    outputs above 256 KiB: the recycled pool)."""
    rng = random.Random(seed)
    # outputs of 4 KB to 3 MB: allocated per call below Recycled.MIN_BYTES, pooled above
    n, c, h, w = rng.randint(1, 3), rng.randint(1, 64), rng.randint(8, 64), rng.randint(8, 64)
    fmt = rng.choice([torch.contiguous_format, torch.channels_last])
    model = _Residual().eval()
    om = middleware.optimize(model, device="cpu")
    held: list[tuple[torch.Tensor, torch.Tensor]] = []
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(8):
            a, b = (
                torch.randn(n, c, h, w, generator=g).contiguous(memory_format=fmt) for _ in "ab"
            )
            y = om(a, b)
            _close(y, model(a, b))
            if rng.random() < 0.5:
                held.append((y, y.clone()))
        for y, copy_ in held:
            assert torch.equal(y, copy_)


def test_the_extension_reports_why_it_is_missing(tmp_path, monkeypatch) -> None:
    """Where the C++ call cannot be built, the Python shortcut serves and report() says why."""
    monkeypatch.setenv("MIDDLEWARE_EXTENSION_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert shortcut.extension(wait=True) is None
    assert "could not be built" in shortcut.why_not()


def test_a_trace_steps_aside(call_path: str) -> None:
    """Inside a TorchScript trace the C++ call returns None (the Python path decides).
    Two of its checks see a trace: the tracing state and the thread's dispatch keys (the
    tracer's); this test fails only where both are gone."""
    m, om, x = _ready(call_path)
    fast = om._fast
    seen: list = []

    def probe(t: torch.Tensor) -> torch.Tensor:
        if fast is not None:
            seen.append(fast((t,)))
        return t * 2.0

    torch.jit.trace(probe, (x,), check_trace=False)
    assert seen == ([None] if fast is not None else [])


def test_the_latest_plan_is_the_one_that_ran(call_path: str) -> None:
    """A training call then an inference call: report() and .plan describe the inference
    plan again (the C++ call sets it as the Python path does)."""
    m = reinit(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)), 1)
    x = torch.randn(2, 3, 16, 16)
    om = middleware.optimize(m.eval(), example_inputs=(x,), measure_hardware=False)
    with torch.no_grad():
        for _ in range(3):
            om(x)
    inference = om._latest
    for round_ in range(2):
        om.train()  # no batch norm: training leaves the weights as they were
        om(x).sum().backward()  # (the first builds the training plan, a new weight snapshot)
        assert om._latest is not inference
        om.eval()
        fast = om._fast
        with torch.no_grad():
            _close(om(x), m(x))
            assert om._latest is inference
            if round_ == 1 and call_path == "c++":  # that call was the C++ one
                assert fast is om._fast and fast((x,)) is not None
            for _ in range(2):  # the C++ call made again for the new snapshot
                om(x)
        if call_path == "c++":
            assert any(n.startswith("call: one C++") for n in om.report().notes)


def test_an_input_refusing_its_address_is_no_crash(call_path: str) -> None:
    """An input whose data pointer PyTorch refuses (the C++ call must not let the C++
    exception out): the Python path answers, with the original model."""
    m, om, x = _ready(call_path)
    x2 = x.clone()
    torch._C._set_throw_on_mutable_data_ptr(x2)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _close(om(x2), m(x))


def test_a_failing_output_allocation_raises_its_own_error(call_path: str) -> None:
    """An allocation error inside the C++ call reaches the caller as itself (not as an
    error about the lock's release), and the plan's lock is free afterwards."""
    from middleware.graph import TensorType
    from middleware.runtime.planned_steps import Recycled

    _, om, x = _ready(call_path)
    ext = shortcut.extension()
    if ext is None or call_path != "c++":
        return

    def fail(t: TensorType) -> torch.Tensor:
        raise MemoryError("no memory for the test")

    pool = Recycled(TensorType((2, 4, 8, 8)), torch.device("cpu"), fail)
    fast = om._shortcut_of(
        ext, om._repeat, (x,), pool, om.plan.native, om._weights, om._training_dicts
    )
    with torch.no_grad(), pytest.raises(MemoryError, match="no memory for the test"):
        fast((x,))
    assert om.plan._busy.acquire(False)
    om.plan._busy.release()
