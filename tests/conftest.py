"""Shared test set-up: seeded randomness, a private kernel/hardware cache, tree comparison.

Tolerances used across the suite (fp32 on CPU):
- the reference interpreter (``Graph.evaluate``) against eager PyTorch: rtol 1e-5, atol 1e-6
  times the output's scale (it calls the same framework functions);
- an optimized module against eager PyTorch: rtol 1e-4, atol 1e-4 times the output's scale
  (passes may fold batch-norm into convolutions and kernels may reorder sums).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

EVAL_RTOL, EVAL_ATOL = 1e-5, 1e-6
OPT_RTOL, OPT_ATOL = 1e-4, 1e-4


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same random state."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Kernels and the measured hardware description go to a per-session folder, never
    into the user's ``~/.cache/middleware``."""
    old = os.environ.get("MIDDLEWARE_CACHE_DIR")
    os.environ["MIDDLEWARE_CACHE_DIR"] = str(tmp_path_factory.mktemp("middleware-cache"))
    yield
    if old is None:
        os.environ.pop("MIDDLEWARE_CACHE_DIR", None)
    else:
        os.environ["MIDDLEWARE_CACHE_DIR"] = old


@pytest.fixture(autouse=True, scope="session")
def _native_call(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The C++ call (runtime/shortcut.cpp) built once, before any test, in a folder the
    xdist workers share (one compile, under the kernel cache's file lock), so that every
    test sees the same call path: the C++ one unless a test switches it off."""
    from middleware.runtime import shortcut

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' common folder
    old = os.environ.get("MIDDLEWARE_EXTENSION_DIR")
    os.environ["MIDDLEWARE_EXTENSION_DIR"] = str(root / "middleware-extension")
    shortcut.extension(wait=True)
    yield
    if old is None:
        os.environ.pop("MIDDLEWARE_EXTENSION_DIR", None)
    else:
        os.environ["MIDDLEWARE_EXTENSION_DIR"] = old


@pytest.fixture(params=["c++", "python"])
def call_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with the optimized module's call as one C++ function, and again with
    the Python shortcut (``Options.native_call``'s default, read when optimize() runs)."""
    return _set_call_path(request.param, monkeypatch)


@pytest.fixture(params=["c++", "python", "python-steps"])
def any_call_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """:func:`call_path`'s two, and a plan whose steps run from Python
    (``Options.native_runner`` off: the shortcut of ``__call__`` that a CUDA plan takes)."""
    return _set_call_path(request.param, monkeypatch)


def _set_call_path(path: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("MIDDLEWARE_NATIVE_CALL", "1" if path == "c++" else "0")
    if path == "python-steps":
        monkeypatch.setenv("MIDDLEWARE_NATIVE_RUNNER", "0")
    return path


def _scale(t: torch.Tensor) -> float:
    return max(1.0, float(t.detach().abs().max())) if t.numel() else 1.0


def assert_tree_close(got: Any, expected: Any, rtol: float, atol: float, path: str = "out") -> None:
    """``got`` has the same nested structure (types included) as ``expected`` and every
    tensor matches within ``rtol`` and ``atol`` times the expected tensor's scale
    (its largest magnitude, at least 1)."""
    assert type(got) is type(expected), f"{path}: {type(got).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert got.shape == expected.shape, f"{path}: shape {got.shape} != {expected.shape}"
        assert got.dtype == expected.dtype, f"{path}: dtype {got.dtype} != {expected.dtype}"
        torch.testing.assert_close(
            got, expected, rtol=rtol, atol=atol * _scale(expected), msg=lambda m: f"{path}: {m}"
        )
    elif isinstance(expected, (tuple, list)):
        assert len(got) == len(expected), f"{path}: {len(got)} items != {len(expected)}"
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert_tree_close(g, e, rtol, atol, f"{path}[{i}]")
    elif isinstance(expected, dict):
        assert list(got) == list(expected), f"{path}: keys {list(got)} != {list(expected)}"
        for k in expected:
            assert_tree_close(got[k], expected[k], rtol, atol, f"{path}[{k!r}]")
    else:
        assert got == expected, f"{path}: {got!r} != {expected!r}"


@pytest.fixture
def tree_close():
    """``tree_close(got, expected, rtol=..., atol=...)``: see :func:`assert_tree_close`."""
    return assert_tree_close


@pytest.fixture
def winograd_generic_rule(monkeypatch):
    """A test rule: the default's Winograd rule of every CPU but AMD's on whatever host
    runs the tests (the AMD rule has tests of its own, test_winograd.py), with 64 channels
    instead of the shipped 128 so that the tests' small networks, whose layers have 64
    channels, reach Winograd (tests lower ``MIN_PIXELS`` themselves)."""
    from middleware.backends.vendor import winograd

    monkeypatch.setattr(winograd, "AMD_RULE", ())
    monkeypatch.setattr(winograd, "MIN_CHANNELS", 64)
