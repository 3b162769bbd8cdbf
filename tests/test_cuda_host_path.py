"""The host path of a generated CUDA step, without a GPU (a recording launcher): the plan's
own constants are checked once when the plan names them, every other input at every call,
with the same errors as before."""

from __future__ import annotations

import pytest
import torch
from cuda_cases import CASES, FAKE_GPU, schedule_of

from middleware.backends.cuda.kernel import GeneratedKernel
from middleware.backends.cuda.render import render_schedule
from middleware.backends.interface import Unit
from middleware.enums import RunsAs
from middleware.runtime.plan import tell_constants


class Recorder:
    def __init__(self) -> None:
        self.launches: list[list[int]] = []

    def launch(self, grid: int, block: int, ptrs) -> None:
        self.launches.append(list(ptrs))


def _kernel():
    graph, names = CASES["mul_channel"]("nchw")
    rendered = render_schedule(schedule_of(graph, names), FAKE_GPU, emulate=False)
    rec = Recorder()
    kernel = GeneratedKernel(rendered, rec)
    torch.manual_seed(0)
    ins = [torch.randn(t.shape) for t in rendered.in_types]
    assert len(ins) == 2  # the input and a per-channel factor (a constant in a plan)
    return kernel, rec, ins


def test_constants_skip_their_checks_and_user_inputs_are_still_checked():
    kernel, rec, ins = _kernel()
    x, consts = ins[0], ins[1:]
    kernel.constant_inputs({i + 1: c for i, c in enumerate(consts)})
    assert [c for _, _, c in kernel._checks] == [None, *consts]
    y = kernel(*ins)
    assert rec.launches[-1] == [t.data_ptr() for t in (*ins, y)]
    kernel.out(*ins, y)
    assert rec.launches[-1] == [t.data_ptr() for t in (*ins, y)]
    n = len(rec.launches)
    # the user's input: every check as before, with the same errors
    with pytest.raises(TypeError, match="float32"):
        kernel(x.double(), *consts)
    with pytest.raises(ValueError, match="shape"):
        kernel(x[:1], *consts)
    # another tensor where a constant was: checked (equal values, own memory: launched)
    kernel(x, *[c.clone() for c in consts])
    with pytest.raises(ValueError, match="shape"):
        kernel(x, torch.randn(3))
    assert len(rec.launches) == n + 1
    # a non-contiguous input is laid out (a copy) before the launch
    xt = x.transpose(2, 3).contiguous().transpose(2, 3)
    assert not xt.is_contiguous()
    kernel(xt, *consts)
    assert rec.launches[-1][0] != xt.data_ptr()


def test_a_constant_the_kernel_cannot_read_as_it_is_stays_checked_per_call():
    kernel, rec, ins = _kernel()
    x, consts = ins[0], ins[1:]
    wrong = consts[0].double()
    kernel.constant_inputs({1: wrong})
    assert kernel._checks[1][2] is None
    with pytest.raises(TypeError, match="float32"):
        kernel(x, wrong, *consts[1:])


def test_the_plan_names_only_its_own_constants():
    """``tell_constants``: the plan's own constants by input position; the user's tensors
    serving as constants (their storage can be swapped under the plan) are not named."""
    told = []

    class Fn:
        def __call__(self, *args):
            return args[0]

        def constant_inputs(self, mapping):
            told.append(mapping)

    own, users = torch.ones(2), torch.zeros(2)
    slot_of = {"x": 0, "w_own": 1, "w_user": 2, "y": 3}
    units = [
        Unit("k", RunsAs.GENERATED, Fn(), ("x", "w_user", "w_own"), ("y",), ("k",), ""),
        Unit("plain", RunsAs.VENDOR, lambda *a: a[0], ("y", "w_own"), ("z",), ("p",), ""),
    ]
    tell_constants(units, slot_of, {1: own, 2: users}, {1})
    assert len(told) == 1 and told[0].keys() == {2} and told[0][2] is own
