"""Transparent huge pages for the plan's long-lived CPU buffers (``runtime/pages.py``).

The advice covers whole 2 MiB blocks inside a buffer only (never memory beyond it), reaches
the arena, recycled outputs and spilled classes through ``Options(huge_pages=...)`` and its
environment default, and changes no value.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn

import middleware
from middleware.runtime import pages, planned_steps
from middleware.runtime.pages import HUGE_PAGE, advise_huge_pages, huge_range, thp_mode


def test_huge_range_is_the_whole_blocks_inside() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        start = rng.randrange(0, 1 << 34, rng.choice([1, 4, 64, 4096]))
        nbytes = rng.choice([0, 1, HUGE_PAGE - 1, HUGE_PAGE, 2 * HUGE_PAGE + 5]) + rng.randrange(
            0, 8 * HUGE_PAGE
        )
        lo, n = huge_range(start, nbytes)
        end = start + nbytes
        assert n >= 0 and n % HUGE_PAGE == 0
        if n:
            assert lo % HUGE_PAGE == 0
            assert start <= lo and lo + n <= end  # never beyond the buffer
        else:
            lo = -(-start // HUGE_PAGE) * HUGE_PAGE
        # the block before and the block after the range are not wholly inside the buffer
        assert lo - HUGE_PAGE < start
        assert lo + n + HUGE_PAGE > end


@pytest.mark.parametrize(
    "text, mode",
    [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]\n", "never"),
        ("garbage\n", ""),
    ],
)
def test_thp_mode_reads_the_bracketed_word(text: str, mode: str, tmp_path) -> None:  # noqa: ANN001
    p = tmp_path / "enabled"
    p.write_text(text)
    assert thp_mode(p) == mode
    assert thp_mode(tmp_path / "missing") == ""


def test_advice_only_where_it_can_apply() -> None:
    small = torch.empty(1000)
    assert not advise_huge_pages(small)  # no whole 2 MiB block inside
    big = torch.empty(3 * HUGE_PAGE // 4)
    assert advise_huge_pages(big) == (pages._madvise() is not None)
    if torch.cuda.is_available():  # pragma: no cover - GPU hosts
        assert not advise_huge_pages(torch.empty(3 * HUGE_PAGE // 4, device="cuda"))


def _anon_huge_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


@pytest.mark.skipif(thp_mode() != "madvise", reason="the kernel's THP mode is not madvise")
@pytest.mark.parametrize("advise", [True, False])
def test_advised_memory_is_backed_by_huge_pages(advise: bool) -> None:
    """Advice before the first write: the kernel backs the buffer's whole 2 MiB blocks
    with 2 MiB pages (most of them: it may lack free ones for a few); without it (the mode
    is madvise) it backs none. 64 MiB: above glibc's largest mmap threshold (32 MiB), so
    the buffer is fresh memory, not heap pages touched before."""
    before = _anon_huge_kb()
    t = torch.empty(32 * HUGE_PAGE // 4)
    blocks = huge_range(t.data_ptr(), t.numel() * 4)[1] // HUGE_PAGE  # 31 or 32
    if advise:
        assert advise_huge_pages(t)
    t.fill_(1.0)
    grew = _anon_huge_kb() - before
    del t
    if advise:
        assert grew >= blocks // 2 * HUGE_PAGE // 1024, (grew, blocks)
    else:
        assert grew < HUGE_PAGE // 1024, grew


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(32)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(x))
        return torch.nn.functional.max_pool2d(y, 3, 2, 1) + 1.0


def _advised(monkeypatch: pytest.MonkeyPatch, **options: object) -> tuple[list[int], float]:
    """The byte sizes of the buffers the plan advised, and the output's error against
    PyTorch relative to its scale."""
    calls: list[int] = []
    real = planned_steps.advise_huge_pages

    def record(t: torch.Tensor) -> bool:
        calls.append(t.untyped_storage().nbytes())
        return real(t)

    monkeypatch.setattr(planned_steps, "advise_huge_pages", record)
    torch.manual_seed(0)
    m = Chain().eval()
    x = torch.randn(8, 32, 64, 64)  # 1 MiB of output: recycled
    om = middleware.optimize(m, example_inputs=(x,), measure_hardware=False, **options)
    with torch.no_grad():
        for _ in range(3):
            got = om(x)
        ref = m(x)
    return calls, float((got - ref).abs().max() / ref.abs().max())


def test_options_huge_pages_reach_the_planner(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MIDDLEWARE_HUGE_PAGES", raising=False)
    calls, err = _advised(monkeypatch)
    assert calls and max(calls) >= 8 * 32 * 32 * 32 * 4  # the recycled output, once
    assert len(calls) <= 3  # allocated once and reused, not per call
    assert err < 1e-5
    calls, err = _advised(monkeypatch, huge_pages=False)
    assert calls == [] and err < 1e-5


def test_environment_switches_huge_pages_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIDDLEWARE_HUGE_PAGES", "0")
    assert middleware.Options().huge_pages is False
    calls, err = _advised(monkeypatch)
    assert calls == [] and err < 1e-5
