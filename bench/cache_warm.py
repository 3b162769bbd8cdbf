"""Kernel cache: a cold and a warm build of N small distinct OpenMP C kernels.

    python bench/cache_warm.py [--count 20] [--cache-dir DIR]

Measures, against a fresh cache folder (a temporary one unless --cache-dir is given):
- cold: ``build_many`` compiling every kernel (parallel threads, at most os.cpu_count());
- warm, same process: ``build_many`` again (in-memory hits, no re-hashing);
- warm, new process: a fresh interpreter runs ``build_many`` on the same requests (hits
  verified against meta.json by sha256); its time is measured inside the child, and the
  wall time of the whole child (interpreter start and imports included) is reported beside it.
The warm runs must compile nothing; the script fails if they do.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from middleware.backends.cache import BuildRequest, KernelCache, kernel_cache
from middleware.backends.x86.build import c_build_request

_OPS = ("x[i] * {a}f + {b}f", "fmaxf(x[i] * {a}f, {b}f)", "x[i] > {b}f ? x[i] : {a}f * x[i]")


def kernel_source(i: int) -> str:
    """A small elementwise OpenMP kernel; each ``i`` gives distinct source text."""
    expr = _OPS[i % len(_OPS)].format(a=1.0 + i / 8, b=i / 16 - 0.5)
    return (
        f"/* bench kernel {i} */\n#include <math.h>\n"
        f"void k{i}(const float *restrict x, float *restrict y, long n) {{\n"
        "    #pragma omp parallel for simd\n"
        f"    for (long i = 0; i < n; ++i) y[i] = {expr};\n"
        "}\n"
    )


def requests(count: int) -> list[BuildRequest]:
    return [
        c_build_request(f"bench_k{i}", kernel_source(i), meta={"bench": "cache_warm"})
        for i in range(count)
    ]


def timed_build(cache: KernelCache, reqs: list[BuildRequest]) -> tuple[float, int]:
    """(seconds, number of kernels compiled) of one ``build_many``; fails on any error."""
    start = time.perf_counter()
    results = cache.build_many(reqs, progress=False)
    seconds = time.perf_counter() - start
    errors = [r for r in results if isinstance(r, Exception)]
    if errors:
        raise errors[0]
    return seconds, sum(r.compiled for r in results)


def warm_child(root: Path, count: int) -> None:
    """Runs in the new process: print the warm build's time and compile count as JSON."""
    seconds, compiled = timed_build(kernel_cache(root), requests(count))
    print(json.dumps({"seconds": seconds, "compiled": compiled}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--warm-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warm_child:
        warm_child(args.cache_dir, args.count)
        return

    with tempfile.TemporaryDirectory(prefix="mw-cache-bench-") as tmp:
        root = args.cache_dir or Path(tmp)
        if (root / "kernels").exists() and any((root / "kernels").iterdir()):
            sys.exit(f"{root}/kernels is not empty: the cold build needs a fresh cache folder")
        reqs = requests(args.count)
        cache = kernel_cache(root)
        cold_s, cold_n = timed_build(cache, reqs)
        warm_s, warm_n = timed_build(cache, reqs)
        start = time.perf_counter()
        child = subprocess.run(
            [sys.executable, __file__, "--warm-child", "--count", str(args.count)]
            + ["--cache-dir", str(root)],
            capture_output=True,
            text=True,
            check=True,
        )
        child_wall = time.perf_counter() - start
        result = json.loads(child.stdout.strip().splitlines()[-1])

    print(f"kernels: {args.count} small OpenMP C kernels, gcc -O3 -march=native -fopenmp")
    print(f"cold build             : {cold_s:8.3f} s  compiled {cold_n}")
    print(f"warm, same process     : {warm_s * 1e3:8.3f} ms compiled {warm_n}")
    print(
        f"warm, new process      : {result['seconds'] * 1e3:8.3f} ms compiled "
        f"{result['compiled']} (child wall {child_wall:.2f} s with interpreter start and imports)"
    )
    if cold_n != args.count or warm_n or result["compiled"]:
        sys.exit("FAILED: the cold build must compile every kernel and the warm ones none")


if __name__ == "__main__":
    main()
