"""The native runner (``runtime/native.py``): a CPU plan recorded once, then run as one C call.

Its outputs equal the Python steps' bit for bit and PyTorch's within tolerance, on random
small networks; it never writes into an output the caller holds; another thread count,
another thread, a step it cannot run and a failing step all keep the answers right.
"""

from __future__ import annotations

import ctypes
import random
import threading
import warnings

import pytest
import torch
import torch.nn as nn
from fusion_helpers import reinit

import middleware
from middleware.backends.interface import NativeCall
from middleware.runtime.native import NativeProgram


class Block(nn.Module):
    """conv-bn-relu, optionally depthwise, optionally with a residual add."""

    def __init__(self, c: int, depthwise: bool, residual: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, groups=c if depthwise else 1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x)))
        return y + x if self.residual else y


class Net(nn.Module):
    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        c = rng.choice([8, 16, 24])
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, stride=2, padding=1), nn.BatchNorm2d(c))
        self.pool = rng.choice([nn.MaxPool2d(3, 2, 1), nn.AvgPool2d(2), nn.Identity()])
        self.blocks = nn.Sequential(
            *[Block(c, rng.random() < 0.4, rng.random() < 0.5) for _ in range(rng.randint(1, 4))]
        )
        self.head = nn.Linear(c, rng.choice([10, 37]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.blocks(self.pool(torch.relu(self.stem(x))))
        return self.head(y.mean((2, 3)))


def _native_note(om: middleware.OptimizedModule) -> str:
    return " ".join(n for n in om.plan.notes if n.startswith("native runner"))


def _native_equals_python(m: nn.Module, x: torch.Tensor) -> middleware.OptimizedModule:
    """``m`` on ``x`` runs natively, bit for bit as its Python steps, and as PyTorch."""
    on = middleware.optimize(m, example_inputs=(x,), measure_hardware=False)
    off = middleware.optimize(m, example_inputs=(x,), measure_hardware=False, native_runner=False)
    with torch.no_grad():
        on(x)
        got = on(x)
        assert on.plan.native is not None, _native_note(on)
        assert torch.equal(got, off(x))
        ref = m(x)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
    return on


@pytest.mark.parametrize("seed", range(6))
def test_random_networks_equal_the_python_steps_and_pytorch(seed: int) -> None:
    rng = random.Random(seed)
    m = reinit(Net(rng), seed)
    batch = 1 if seed % 3 else 2  # the linear head of two rows is a framework call
    x = torch.randn(batch, 3, rng.choice([16, 24, 33]), 20)
    on = middleware.optimize(m, example_inputs=(x,), measure_hardware=False)
    off = middleware.optimize(m, example_inputs=(x,), measure_hardware=False, native_runner=False)
    with torch.no_grad():
        ref = m(x)
        first = on(x)  # recorded here
        if batch == 1:
            assert on.plan.native is not None, _native_note(on)
            assert "steps run as one C call" in _native_note(on)
        else:
            assert "native runner: off (step head is not one C call)" in _native_note(on)
        for _ in range(2):
            got = on(x)
            assert torch.equal(got, off(x))  # the same kernels on the same data
            assert torch.equal(got, first)
        scale = ref.abs().max()
        assert float((got - ref).abs().max() / scale) < 1e-4
    assert off.plan.native is None and not _native_note(off)


def _mobile() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return reinit(Net(random.Random(3)), 3), torch.randn(1, 3, 32, 32)


def test_held_outputs_are_not_overwritten(call_path: str) -> None:
    m, x = _mobile()
    om = middleware.optimize(m, example_inputs=(x,), measure_hardware=False)
    with torch.no_grad():
        held = [om(x) for _ in range(2)]
        kept = [h.clone() for h in held]
        x2 = torch.randn_like(x)
        other = om(x2)
        assert om.plan.native is not None
        for h, k in zip(held, kept, strict=True):
            assert torch.equal(h, k)
        assert torch.allclose(other, m(x2), rtol=1e-4, atol=1e-4 * float(other.abs().max()))


def test_another_thread_count_runs_the_python_steps(call_path: str) -> None:
    m, x = _mobile()
    om = middleware.optimize(m, example_inputs=(x,), measure_hardware=False)
    threads = torch.get_num_threads()
    with torch.no_grad():
        ref = om(x)
        assert om.plan.native is not None
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            got = om(x)
        finally:
            torch.set_num_threads(threads)
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        assert torch.equal(om(x), ref)


def _calls_from_two_threads(
    om: nn.Module, xs: list[torch.Tensor], refs: list[torch.Tensor], calls: int
) -> list[str]:
    """Two threads, started together, each make ``calls`` calls over ``xs`` in turn; the
    calls whose output is not the reference's."""
    barrier = threading.Barrier(2)
    errors: list[str] = []

    def worker(k: int) -> None:
        barrier.wait()
        with torch.no_grad():
            for r in range(calls):
                i = (k + r) % len(xs)
                y = om(xs[i])
                scale = float(refs[i].abs().max())
                if not torch.allclose(y, refs[i], rtol=1e-4, atol=1e-4 * scale):
                    errors.append(f"thread {k} call {r}")

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return errors


def test_calls_from_two_threads(call_path: str) -> None:
    m, x = _mobile()
    om = middleware.optimize(m, example_inputs=(x,), measure_hardware=False)
    xs = [torch.randn_like(x) for _ in range(4)]
    with torch.no_grad():
        om(x)
        refs = [m(v) for v in xs]
    errors = _calls_from_two_threads(om, xs, refs, 20)
    assert om.plan.native is not None
    assert not errors, errors


class WithFallback(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flip(torch.relu(self.conv(x)), dims=(3,)) * 2.0


def test_a_step_that_is_not_one_c_call_keeps_the_python_steps() -> None:
    m = reinit(WithFallback(), 1)
    x = torch.randn(1, 3, 12, 12)
    om = middleware.optimize(m, example_inputs=(x,), measure_hardware=False)
    with torch.no_grad():
        for _ in range(2):
            got = om(x)
        ref = m(x)
    assert om.plan.native is None
    assert "native runner: off" in _native_note(om)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


def test_a_failing_step_is_an_error_not_a_wrong_answer(call_path: str) -> None:
    """A native step that reports failure raises; the module answers with the original."""
    m, x = _mobile()
    om = middleware.optimize(m, example_inputs=(x,), measure_hardware=False)
    with torch.no_grad():
        for _ in range(3):  # the third call is one C++ function where call_path says so
            om(x)
        assert (om._fast is not None) == (call_path == "c++")
        prog = om.plan.native
        assert isinstance(prog, NativeProgram)
        libc = ctypes.CDLL(None)
        st = prog.steps[0]
        # abs(7) = 7: a status function that reports failure
        st.fn = NativeCall(ctypes.cast(libc.abs, ctypes.c_void_p).value, (7,), True).fn
        st.status, st.nargs, st.slot[0], st.off[0] = 1, 1, -1, 7
        with pytest.raises(RuntimeError, match="native runner"):
            prog([x])
        with pytest.warns(UserWarning, match="the plan failed while running"):
            got = om(x)
        ref = m(x)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


class Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.adaptive_avg_pool2d(torch.relu(self.conv(x)), 4)
        return self.fc(torch.flatten(y, 1))


def test_views_run_as_nothing() -> None:
    """A flatten between the layers is a view of the arena: no call, the same answer."""
    on = _native_equals_python(reinit(Flat(), 2), torch.randn(1, 3, 16, 16))
    assert len(set(on.plan.native.names)) < len(on.plan.steps)  # the view made no call


class ManyInputs(nn.Module):
    """A generated step that reads eleven values (densenet's concatenations read up to
    thirty-two): more arguments than the six x86-64 passes in registers."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(3, 4, 1) for _ in range(11))
        self.bn = nn.BatchNorm2d(44)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(torch.cat([c(x) for c in self.convs], 1)))


def test_a_step_with_many_arguments() -> None:
    m = reinit(ManyInputs(), 4)
    x = torch.randn(1, 3, 10, 12)
    _native_equals_python(m, x)


class TwoEscapes(nn.Module):
    """Pools of slices whose results are read both by a concat and by the next block
    (googlenet's pool-before-concat): an io group with several values read outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 1)
        self.b = nn.Conv2d(3, 8, 1)
        self.head = nn.Conv2d(16, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([self.a(x), self.b(x)], 1)
        p = nn.functional.max_pool2d(torch.relu(y), 3, 2, ceil_mode=True)
        q = nn.functional.max_pool2d(p, 3, 1, 1)
        return self.head(p) + self.head(q)


def test_a_group_with_several_outputs_runs_as_one_output_pieces() -> None:
    """Each piece of the group with one value read outside it is its own generated kernel
    (before: the whole group ran through the framework, and so the plan from Python)."""
    m = reinit(TwoEscapes(), 5)
    x = torch.randn(1, 3, 17, 17)
    om = middleware.optimize(m, example_inputs=(x,), measure_hardware=False)
    with torch.no_grad():
        om(x)
        got = om(x)
        ref = m(x)
    pools = [r for r in om.report().rows if "pool" in r.op]
    assert pools and all(r.runs_as.value == "generated" for r in pools), [
        (r.node, r.runs_as, r.reason) for r in pools
    ]
    assert om.plan.native is not None, _native_note(om)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


def test_strided_copy_matches_torch(tmp_path) -> None:  # noqa: ANN001
    """The runner's copy of a strided view into dense memory (a reshape that copies, a
    channel slice a kernel reads dense) gives ``contiguous()``'s elements."""
    from middleware.backends.x86.runner import function_address

    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(
        function_address(tmp_path, "mw_strided_copy")
    )
    rng = random.Random(0)
    for _ in range(200):
        nd = rng.randint(1, 6)
        shape = [rng.randint(1, 5) for _ in range(nd)]
        base = torch.randn(*[s + rng.randint(0, 2) for s in shape])
        v = base[
            tuple(
                slice(rng.randint(0, b - s), None) for s, b in zip(shape, base.shape, strict=True)
            )
        ]
        v = v[tuple(slice(0, s) for s in shape)]
        v = v.permute(*rng.sample(range(nd), nd))
        if rng.random() < 0.3 and v.dim() > 1:
            v = v.transpose(0, -1)
        desc = torch.tensor([v.dim(), *v.shape, *v.stride()], dtype=torch.int64)
        out = torch.full((v.numel(),), float("nan"))
        fn(v.data_ptr(), out.data_ptr(), desc.data_ptr())
        assert torch.equal(out, v.contiguous().reshape(-1)), (v.shape, v.stride())


class Shuffle(nn.Module):
    """shufflenet's unit: split the channels, convolve one half, concatenate, shuffle."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.branch = nn.Sequential(
            nn.Conv2d(c // 2, c // 2, 1), nn.BatchNorm2d(c // 2), nn.ReLU(),
            nn.Conv2d(c // 2, c // 2, 3, padding=1, groups=c // 2), nn.BatchNorm2d(c // 2),
        )  # fmt: skip
        self.stem = nn.Conv2d(3, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        for _ in range(2):
            a, b = y.chunk(2, dim=1)
            y = torch.cat((a, self.branch(b)), dim=1)
            n, c, h, w = y.shape
            y = y.view(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)
        return y.mean((2, 3))


def test_channel_shuffles_run_natively() -> None:
    m = reinit(Shuffle(16), 6)
    x = torch.randn(1, 3, 14, 18)
    _native_equals_python(m, x)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x) + self.conv(y))


def test_inputs_sharing_memory_at_the_recording_refuse_it() -> None:
    """A first call with one tensor as both inputs cannot say which input an address
    follows later: refused, and a later call with two tensors is right."""
    m = reinit(TwoInputs(), 7)
    x = torch.randn(1, 3, 10, 10)
    om = middleware.optimize(m, example_inputs=(x, x), measure_hardware=False)
    with torch.no_grad():
        om(x, x)
        a, b = torch.randn_like(x), torch.randn_like(x)
        got, ref = om(a, b), m(a, b)
    assert om.plan.native is None
    assert "share memory" in _native_note(om)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


class Concat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(3, 8, 1)
        self.c = nn.Conv2d(16, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], 1))


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_convolutions_written_into_concat_slices(layout: str) -> None:
    """At batch 1 in NCHW a channel slice of a concat is dense (its batch stride moves
    nothing): the oneDNN convolution writes straight into it, with no plan failure."""
    m = reinit(Concat(), 8)
    x = torch.randn(1, 3, 9, 11)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        om = middleware.optimize(
            m, example_inputs=(x,), measure_hardware=False, layout=layout, fuse=False
        )  # (the concat through the framework: its inputs written into its slices)
        with torch.no_grad():
            for _ in range(3):
                got = om(x)
            ref = m(x)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


def test_first_calls_from_two_threads() -> None:
    """Two threads make the first calls of a fresh module together: the recording holds
    the plan, the other waits."""
    m, x = _mobile()
    om = middleware.optimize(m, example_inputs=(x,), measure_hardware=False)
    xs = [torch.randn_like(x) for _ in range(2)]
    with torch.no_grad():
        refs = [m(v) for v in xs]
    errors = _calls_from_two_threads(om, xs, refs, 10)
    assert not errors, errors


def test_a_skipped_computation_fails_the_check() -> None:
    """A step the program would wrongly skip: the check runs with every intermediate set
    to NaN first, so it cannot pass on what the recorded run left in the arena (here the
    convolution's output, which no later step overwrites)."""
    from middleware.runtime.planned_steps import NATIVE_NOTHING

    m = reinit(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)), 9)
    x = torch.randn(1, 3, 12, 12)
    om = middleware.optimize(m, example_inputs=(x,), measure_hardware=False)
    with torch.no_grad():
        om(torch.randn_like(x))  # compiles; the plan records on its first run
    plan = om.plan
    assert plan.native is not None, _native_note(om)
    plan._native = om.options.cache_dir  # record again, the convolution's step lying
    step = plan._program[0][0]
    honest = step.native_step
    step.native_step = lambda ins, r: NATIVE_NOTHING
    try:
        with torch.no_grad():
            got = om(x)
            ref = m(x)
    finally:
        step.native_step = honest
    assert plan.native is None
    assert "differed" in _native_note(om)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


def test_the_call_shortcut_keeps_hooks_modes_and_weights(any_call_path: str) -> None:
    """``OptimizedModule.__call__``'s shortcut to the native program (a repeated inference
    call), or to a plan whose steps run from Python, steps aside for everything
    ``nn.Module``'s call or ``forward`` would honour: hooks on the module and global ones,
    training mode, changed weights, other inputs."""
    call_path = any_call_path
    native = call_path != "python-steps"
    m, x = _mobile()
    om = middleware.optimize(m, example_inputs=(x,), measure_hardware=False)
    forwards = []
    real_forward = om.forward
    om.forward = lambda *a, **k: (forwards.append(1), real_forward(*a, **k))[1]
    with torch.no_grad():
        om(x)
        assert (om.plan.native is not None) == native
        assert (om._repeat.native is not None) == native
        ref = m(x)
        scale = float(ref.abs().max())

        def close(a: torch.Tensor, b: torch.Tensor) -> bool:
            return torch.allclose(a, b, rtol=1e-5, atol=1e-5 * scale)

        forwards.clear()
        assert close(om(x), ref) and close(om(x), ref) and close(om(x), ref)
        assert forwards == []  # the shortcut ran: forward was not called
        assert (om._fast is not None) == (call_path == "c++")
        pre = om.register_forward_pre_hook(lambda mod, args: (args[0] * 2.0,))
        post = om.register_forward_hook(lambda mod, args, out: out + 1.0)
        assert close(om(x), m(x * 2.0) + 1.0)
        assert forwards == [1]  # hooks: nn.Module's call, through forward
        pre.remove()
        post.remove()
        seen: list[int] = []
        glob = nn.modules.module.register_module_forward_hook(
            lambda mod, args, out: seen.append(1) if mod is om else None
        )
        try:
            om(x)
        finally:
            glob.remove()
        assert seen == [1]
        assert close(om(x), ref)
        m.head.bias.add_(1.0)  # an in-place weight update: new plans
        assert close(om(x), m(x))
        x2 = torch.randn(2, 3, 32, 32)  # another input kind
        assert torch.allclose(om(x2), m(x2), rtol=1e-5, atol=1e-5 * float(m(x2).abs().max()))
    om.train()
    y = om(x)  # training mode: batch statistics, autograd
    assert y.requires_grad
    torch.testing.assert_close(y, m(x), rtol=1e-4, atol=1e-4 * float(m(x).abs().max()))
