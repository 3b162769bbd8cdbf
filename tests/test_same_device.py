"""A plan built for ``torch.device("cuda")`` reads the model's own tensors on ``cuda:0``.

``torch.device("cuda") == torch.device("cuda", 0)`` is False, and the CUDA plans compared
devices that way: on a GPU every weight was copied (an H200 run measured the plan holding
a second copy of all of vgg16's 528 MiB). No GPU is needed: CUDA devices can be named
without one, and a stand-in tensor answers what ``users_tensor`` asks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from middleware.backends.interface import same_device, users_tensor


@pytest.fixture
def current_is(monkeypatch):
    def set_current(index: int) -> None:
        monkeypatch.setattr(torch.cuda, "current_device", lambda: index)

    return set_current


@pytest.mark.parametrize(
    ("a", "b", "current", "same"),
    [
        ("cuda", "cuda:0", 0, True),
        ("cuda:0", "cuda", 0, True),
        ("cuda", "cuda:1", 0, False),
        ("cuda", "cuda:1", 1, True),
        ("cuda:0", "cuda:1", 0, False),
        ("cuda", "cuda", 3, True),
        ("cpu", "cpu", 0, True),
        ("cpu", "cuda", 0, False),
        ("cuda:0", "cpu", 0, False),
        ("meta", "meta", 0, True),
    ],
)
def test_same_device(a, b, current, same, current_is):
    current_is(current)
    assert same_device(torch.device(a), torch.device(b)) is same


class StandIn:
    """What users_tensor reads of a tensor, on a device this machine may not have."""

    def __init__(self, device: str, shape: tuple[int, ...]) -> None:
        self.device = torch.device(device)
        self.dtype = torch.float32
        self.shape = torch.Size(shape)

    def dim(self) -> int:
        return len(self.shape)

    def is_contiguous(self, memory_format=torch.contiguous_format) -> bool:
        return memory_format is torch.contiguous_format


def test_users_tensor_on_the_current_cuda_device(current_is):
    current_is(0)
    arr = np.zeros((4, 3), np.float32)
    own = StandIn("cuda:0", (4, 3))
    assert users_tensor(arr, (arr, own), torch.device("cuda")) is own
    assert users_tensor(arr, (arr, StandIn("cuda:1", (4, 3))), torch.device("cuda")) is None
    current_is(1)
    assert users_tensor(arr, (arr, own), torch.device("cuda")) is None
