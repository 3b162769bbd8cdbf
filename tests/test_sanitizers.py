"""Memory safety of the generated C: the fused-op test chains (and the NaN tests) run with
every generated kernel compiled with ``-fsanitize=address,undefined`` and the sanitizer
runtime preloaded into a Python subprocess; any report fails the run. A canary
kernel with a planted out-of-bounds write checks that the sanitizer really is active.
The fused-op chains run by default; the NaN tests' rerun is marked slow (it recompiles every
kernel of those tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SANITIZE = ("-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all")
# The fused-op chains run by default; the NaN tests' kernels under the sanitizers are
# marked slow (`-m slow`), so that the two runs together cover both files once.
TESTS = {
    # the fused-op chains in channels_last (every op kind); the whole file is the slow run
    "fusion_chains": ("tests/test_fusion_ops.py", "-k", "test_chain_matches_pytorch and nhwc"),
    "fusion_ops": ("tests/test_fusion_ops.py",),
    "nan_semantics": ("tests/test_nan_semantics.py",),
}

PRELUDE = f"""
import sys
from pathlib import Path
import middleware.backends.x86.build as build
build.C_FLAGS = build.C_FLAGS + {SANITIZE!r}
"""

CANARY = """
import ctypes, tempfile
from pathlib import Path
import torch
from middleware.backends.x86.compile import build_c
src = "void canary(float* p) { p[100] = 1.0f; }\\n"
lib = ctypes.CDLL(str(build_c("canary", src, Path(tempfile.mkdtemp())).binary))
x = torch.zeros(4)
lib.canary(ctypes.c_void_p(x.data_ptr()))
print("no report")
"""


def _libasan() -> str | None:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    out = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True)
    path = out.stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


LIBASAN = _libasan()
pytestmark = pytest.mark.skipif(LIBASAN is None, reason="no libasan for the C compiler")


def _run(code: str, timeout: int) -> subprocess.CompletedProcess:
    # libstdc++ preloaded too: a C++ exception thrown in an extension imported later (triton's
    # pybind11 module) otherwise trips ASan's __cxa_throw interceptor
    stdcxx = subprocess.run(
        ["g++", "-print-file-name=libstdc++.so"], capture_output=True, text=True
    )
    env = dict(
        os.environ,
        LD_PRELOAD=" ".join(p for p in (LIBASAN or "", stdcxx.stdout.strip()) if p),
        ASAN_OPTIONS="detect_leaks=0:halt_on_error=1",
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_sanitizer_catches_a_planted_out_of_bounds_write():
    run = _run(CANARY, 300)
    assert run.returncode != 0 and "no report" not in run.stdout
    assert "AddressSanitizer" in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize(
    "which",
    [
        "fusion_chains",
        pytest.param("fusion_ops", marks=pytest.mark.slow),
        pytest.param("nan_semantics", marks=pytest.mark.slow),
    ],
)
def test_generated_kernels_run_clean_under_the_sanitizers(which, tmp_path):
    base = tmp_path / "pt"
    code = (
        "import pytest\n"
        # in this process (-n 0): the sanitizer flags are set here, not in xdist workers
        f"rc = pytest.main(['-q', '-x', '-n', '0', '-p', 'no:cacheprovider', '-m', 'not slow', "
        f"'--basetemp', {str(base)!r}, *{TESTS[which]!r}])\n"
        # the kernels really were built with the sanitizers: they link its runtime
        f"n = sum(b'libasan' in p.read_bytes() for p in Path({str(base)!r}).rglob('*.so'))\n"
        "print('SANITIZED', n)\n"
        "sys.exit(rc)\n"
    )
    run = _run(code, 1500)
    text = run.stdout[-3000:] + run.stderr[-3000:]
    assert "AddressSanitizer" not in run.stderr and "runtime error:" not in run.stderr, text
    assert run.returncode == 0, text
    assert " passed" in run.stdout, text
    sanitized = int(run.stdout.rsplit("SANITIZED", 1)[1].split()[0])
    assert sanitized >= 20, text
