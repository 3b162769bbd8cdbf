"""The persistent kernel cache shared by the x86 (gcc, ISPC) and CUDA (nvcc) backends.

Layout: one folder per kernel, ``<root>/kernels/<name>-<key[:16]>/``, holding

- ``kernel<suffix>``: the generated source (plus any ``extra_files`` of the request),
- the binary (``binary_name``, e.g. ``kernel.so``),
- ``meta.json``: name, key, the compile commands (as templates and with the real paths), the
  compiler and its version, the package version, compile seconds, sha256 and size of the
  binary, and the request's own metadata (group, layers, shapes).

The key is the sha256 of everything that changes the binary: the source (and extra files),
the full compile command(s), the compiler's whole ``--version`` output, the package version
and the request's ``key_extra``. The name is not in the key; it only names the folder.

Concurrency: every file is written under a temporary name in its final folder and moved into
place with ``os.replace``; the folder is created tolerantly (``exist_ok``). Compiles of one
folder are serialised by an ``flock`` on ``<folder>/.lock`` (and a thread lock inside a
process), so when two processes ask for the same kernel at once, one compiles and the other
finds the finished binary; both succeed.

Integrity: a hit is returned only when the binary's size and sha256 match ``meta.json``. A
binary that does not match (corrupt, truncated, missing, or with ``meta.json`` missing or
unreadable) is rebuilt, ``CachedKernel.rebuilt_reason`` says why and a warning is issued.
Inside a process, a kernel verified once is not re-hashed while its binary's size,
modification time and inode are unchanged.

Failures: a compile that fails raises :class:`~middleware.errors.CompileError` with the
compiler's output, the failing command (with the real source and binary paths) and the
source path. The kernel folder is kept with its source and a ``compile_error.txt`` (stderr
and command) but no binary and no ``meta.json``, so the user can read the source; failures
are not cached: the next build of the same request compiles again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import subprocess
import threading
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import version
from ..errors import CompileError

META_FILE = "meta.json"
ERROR_FILE = "compile_error.txt"
LOCK_FILE = ".lock"
_PROGRESS_THRESHOLD = 3  # show a progress bar when more kernels than this compile
COMPILE_TIMEOUT_S = 900.0  # one compile command taking longer than this is a failure


@dataclasses.dataclass(frozen=True)
class BuildRequest:
    """Everything needed to compile one kernel; everything in it that changes the binary is
    hashed into the key (``meta`` is not: it only describes the kernel in ``meta.json``).

    ``command`` and ``steps`` are argument lists whose items may hold the placeholders
    ``{src}`` (the source path), ``{out}`` (where the binary must be written) and ``{dir}``
    (the kernel folder, for intermediate files); ``command`` runs first, then each step.
    ``extra_files`` are further (file name, text) pairs written into the kernel folder before
    compiling (e.g. the C glue of an ISPC kernel); they are part of the key.
    """

    name: str
    source: str
    suffix: str
    command: tuple[str, ...]
    binary_name: str
    compiler: str
    key_extra: tuple[str, ...] = ()
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    steps: tuple[tuple[str, ...], ...] = ()
    extra_files: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        # Lists are accepted and stored as tuples, so that requests hash and compare by value.
        coerce = object.__setattr__
        coerce(self, "command", tuple(self.command))
        coerce(self, "steps", tuple(tuple(step) for step in self.steps))
        coerce(self, "key_extra", tuple(self.key_extra))
        coerce(self, "extra_files", tuple((str(n), str(t)) for n, t in self.extra_files))
        if not self.command or not all(isinstance(a, str) for a in self.command):
            raise ValueError(f"BuildRequest {self.name!r}: command must be a non-empty str tuple")
        if not self.suffix.startswith("."):
            raise ValueError(f"BuildRequest {self.name!r}: suffix {self.suffix!r} lacks its dot")
        reserved = {META_FILE, ERROR_FILE, LOCK_FILE, "kernel" + self.suffix}
        for file_name in (self.binary_name, *(n for n, _ in self.extra_files)):
            if Path(file_name).name != file_name or file_name in reserved or file_name[:1] == ".":
                raise ValueError(
                    f"BuildRequest {self.name!r}: {file_name!r} must be a plain file name, "
                    f"not one of {sorted(reserved)}"
                )


@dataclasses.dataclass(frozen=True)
class CachedKernel:
    """A verified binary in the cache (``compiled`` says whether this call produced it)."""

    key: str
    folder: Path
    binary: Path
    source_path: Path
    compiled: bool
    rebuilt_reason: str
    compile_seconds: float


_versions: dict[str, str] = {}  # executable -> the whole ``--version`` output
_versions_lock = threading.Lock()


def compiler_version_text(executable: str) -> str:
    """The whole output of ``<executable> --version`` (stdout, else stderr), memoised per
    process. This is what goes into the key: nvcc's first line ("nvcc: NVIDIA (R) Cuda
    compiler driver") is the same for every release, its version is on a later line.

    Raises :class:`CompileError` when the executable cannot be run.
    """
    with _versions_lock:
        if executable in _versions:
            return _versions[executable]
    command = [executable, "--version"]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise CompileError(
            f"cannot run the compiler {executable!r}: {exc}", command=command
        ) from exc
    text = proc.stdout.strip() or proc.stderr.strip()
    if proc.returncode != 0 or not text:
        raise CompileError(
            f"the compiler {executable!r} did not report a version",
            stderr=proc.stderr,
            command=command,
        )
    with _versions_lock:
        _versions[executable] = text
    return text


def compiler_version(executable: str) -> str:
    """The first line of ``<executable> --version``, memoised per process (the key hashes the
    whole output, see :func:`compiler_version_text`). Raises :class:`CompileError` when the
    executable cannot be run."""
    return compiler_version_text(executable).splitlines()[0].strip()


def _package_version() -> str:
    return version.__version__  # read at call time: tests pin it


def _folder_name(name: str, key: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "kernel"
    return f"{safe[:80]}-{key[:16]}"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` under a temporary name in the same folder, then rename it
    into place, so that a reader sees either the old file or the whole new one. The file gets
    the usual permissions (0666 less the umask): users read the generated kernels."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    """What must not change for a verified binary to stay verified without re-hashing."""
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def _substitute(args: Sequence[str], paths: Mapping[str, str]) -> list[str]:
    out = []
    for arg in args:
        for placeholder, value in paths.items():
            arg = arg.replace(placeholder, value)
        out.append(arg)
    return out


class KernelCache:
    """The kernel cache under ``root`` (normally ``Options.cache_dir``); see the module doc.

    Thread-safe. Use :func:`kernel_cache` to share one instance per root in a process.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.kernels_dir = self.root / "kernels"
        # kernel folder -> (kernel, (size, mtime_ns, inode) of the binary when verified). The
        # folder (name + key) rather than the key: requests differing only in name get their
        # own folders, as a user browsing the cache expects.
        self._verified: dict[Path, tuple[CachedKernel, tuple[int, int, int]]] = {}
        self._keys: dict[BuildRequest, str] = {}
        self._lock = threading.Lock()
        self._folder_locks: dict[Path, threading.Lock] = {}

    # ---- keys and paths -------------------------------------------------------------------

    def key(self, req: BuildRequest) -> str:
        """sha256 (hex) of the source, extra files, the compile command(s), the compiler's
        version (its whole ``--version`` output), the package version and ``key_extra``."""
        with contextlib.suppress(TypeError):  # an unhashable request is simply not memoised
            with self._lock:
                if req in self._keys:
                    return self._keys[req]
        fields = {
            "source": req.source,
            "suffix": req.suffix,
            "extra_files": [list(item) for item in req.extra_files],
            "command": list(req.command),
            "steps": [list(step) for step in req.steps],
            "binary_name": req.binary_name,
            "compiler": req.compiler,
            "compiler_version": compiler_version_text(req.compiler),
            "package_version": _package_version(),
            "key_extra": list(req.key_extra),
        }
        key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
        with contextlib.suppress(TypeError):
            with self._lock:
                self._keys[req] = key
        return key

    def folder(self, req: BuildRequest, key: str | None = None) -> Path:
        """The kernel's folder (it may not exist yet)."""
        return self.kernels_dir / _folder_name(req.name, key or self.key(req))

    def _kernel(self, req: BuildRequest, key: str, **fields: Any) -> CachedKernel:
        folder = self.folder(req, key)
        return CachedKernel(
            key=key,
            folder=folder,
            binary=folder / req.binary_name,
            source_path=folder / ("kernel" + req.suffix),
            **fields,
        )

    # ---- lookups --------------------------------------------------------------------------

    def lookup(self, req: BuildRequest) -> CachedKernel | None:
        """The cached kernel if its binary is present and matches ``meta.json``, else None."""
        key = self.key(req)
        hit, _reason = self._check(req, key)
        return hit

    def lookup_key(self, name: str, key: str, binary_name: str, suffix: str) -> CachedKernel | None:
        """The verified kernel of a request named ``name`` whose key was ``key`` (as
        :meth:`lookup`, for a caller that recorded the key instead of keeping the request):
        the binary must be present and match ``meta.json``, which must name ``key``."""
        try:
            req = BuildRequest(name, "", suffix, ("true",), binary_name, "")
        except ValueError:
            return None
        hit, _reason = self._check(req, key)
        return hit

    def _check(self, req: BuildRequest, key: str) -> tuple[CachedKernel | None, str]:
        """(verified hit, "") or (None, why the folder's content is unusable; "" on a miss)."""
        folder = self.folder(req, key)
        with self._lock:
            memo = self._verified.get(folder)
        if memo is not None:
            kernel, stamp = memo
            with contextlib.suppress(OSError):
                st = kernel.binary.stat()
                if _stamp(st) == stamp:
                    return dataclasses.replace(kernel, compiled=False, rebuilt_reason=""), ""
            with self._lock:
                self._verified.pop(folder, None)

        binary = folder / req.binary_name
        meta_path = folder / META_FILE
        if not meta_path.exists():
            if binary.exists():
                return None, f"{META_FILE} missing beside {binary}"
            return None, ""
        try:
            meta = json.loads(meta_path.read_text())
            expected_sha, expected_size = str(meta["sha256"]), int(meta["size"])
            if meta.get("key") != key:
                return None, f"{meta_path} belongs to key {meta.get('key')!r}, not {key}"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return None, f"{meta_path} unreadable ({type(exc).__name__}: {exc})"
        try:
            st = binary.stat()
        except OSError:
            return None, f"binary {binary} missing"
        if st.st_size != expected_size:
            return None, (
                f"binary {binary} truncated or corrupt: {st.st_size} bytes, "
                f"{META_FILE} says {expected_size}"
            )
        sha = _sha256_file(binary)
        if sha != expected_sha:
            return (
                None,
                f"binary {binary} corrupt: sha256 {sha[:16]}..., {META_FILE} says {expected_sha[:16]}...",
            )
        kernel = self._kernel(
            req,
            key,
            compiled=False,
            rebuilt_reason="",
            compile_seconds=float(meta.get("compile_seconds", 0.0)),
        )
        with self._lock:
            self._verified[kernel.folder] = (kernel, _stamp(st))
        return kernel, ""

    # ---- builds ---------------------------------------------------------------------------

    def build(self, req: BuildRequest) -> CachedKernel:
        """A verified hit, or compile the request into the cache.

        Raises :class:`CompileError` (stderr, the failing command, the source path) when the
        compiler fails. A cached binary that fails verification is rebuilt; the result's
        ``rebuilt_reason`` says why and a warning is issued.
        """
        key = self.key(req)
        hit, _ = self._check(req, key)
        if hit is not None:
            return hit
        folder = self.folder(req, key)
        with self._thread_lock(folder), self._file_lock(folder):
            hit, reason = self._check(req, key)  # another thread or process may have built it
            if hit is not None:
                return hit
            if reason:
                warnings.warn(f"kernel cache: {reason}; rebuilding", RuntimeWarning, stacklevel=2)
            return self._compile(req, key, reason)

    def build_many(
        self, reqs: Sequence[BuildRequest], progress: bool = True
    ) -> list[CachedKernel | CompileError]:
        """Build every request; misses compile in parallel threads (at most ``os.cpu_count()``)
        with a tqdm progress bar when more than three compile. Results come back in the order
        of ``reqs``, a :class:`CompileError` in place of each kernel that failed to compile."""
        results: list[CachedKernel | CompileError | None] = [None] * len(reqs)
        misses: dict[Path, list[int]] = {}  # kernel folder -> positions asking for it
        first: dict[Path, BuildRequest] = {}
        for i, req in enumerate(reqs):
            try:
                key = self.key(req)
            except CompileError as exc:
                results[i] = exc
                continue
            hit, _ = self._check(req, key)
            if hit is not None:
                results[i] = hit
            else:
                folder = self.folder(req, key)
                misses.setdefault(folder, []).append(i)
                first.setdefault(folder, req)

        if misses:
            workers = max(1, min(os.cpu_count() or 1, len(misses)))
            bar = None
            if progress and len(misses) > _PROGRESS_THRESHOLD:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(misses), desc="compiling kernels", unit="kernel", leave=False)
            try:
                with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
                    futures = {pool.submit(self._build_or_error, first[k]): k for k in misses}
                    for future in concurrent.futures.as_completed(futures):
                        outcome = future.result()
                        for n, i in enumerate(misses[futures[future]]):
                            if n and isinstance(outcome, CachedKernel):
                                outcome = dataclasses.replace(outcome, compiled=False)
                            results[i] = outcome
                        if bar is not None:
                            bar.update(1)
            finally:
                if bar is not None:
                    bar.close()
        return results  # type: ignore[return-value]

    def _build_or_error(self, req: BuildRequest) -> CachedKernel | CompileError:
        try:
            return self.build(req)
        except CompileError as exc:
            return exc

    # ---- internals ------------------------------------------------------------------------

    def _thread_lock(self, folder: Path) -> threading.Lock:
        """The lock serialising this instance's threads on one kernel folder."""
        with self._lock:
            return self._folder_locks.setdefault(folder, threading.Lock())

    @contextlib.contextmanager
    def _file_lock(self, folder: Path) -> Iterator[None]:
        """An exclusive ``flock`` on ``<folder>/.lock``: serialises processes (and separate
        instances) compiling one kernel. Released by the OS if the process dies."""
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / LOCK_FILE, "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _compile(self, req: BuildRequest, key: str, rebuilt_reason: str) -> CachedKernel:
        """Compile holding the folder's locks: sources, commands, then binary and meta.json."""
        folder = self.folder(req, key)
        source_path = folder / ("kernel" + req.suffix)
        binary = folder / req.binary_name
        write_atomic(source_path, req.source)
        for file_name, text in req.extra_files:
            write_atomic(folder / file_name, text)
        # Holding the folder's lock, nobody else writes here: whatever is left is stale (a
        # metadata/binary pair that disagrees, temporaries of a process that died).
        stale = [folder / META_FILE, binary, *folder.glob(".*.partial"), *folder.glob(".*.tmp")]
        for path in stale:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

        # The compiler writes under a temporary name that moves into place once complete. The
        # commands recorded (meta.json, errors) name the final paths: that is what a user
        # runs to reproduce a build.
        partial = folder / f".{req.binary_name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.partial"
        src, out, dir_ = "{src}", "{out}", "{dir}"
        run_paths = {src: str(source_path), out: str(partial), dir_: str(folder)}
        shown_paths = {src: str(source_path), out: str(binary), dir_: str(folder)}
        templates = (req.command, *req.steps)
        commands = [_substitute(cmd, shown_paths) for cmd in templates]
        start = time.perf_counter()
        try:
            for template, shown in zip(templates, commands, strict=True):
                self._run(_substitute(template, run_paths), shown, source_path, folder)
            if not partial.is_file():
                error = CompileError(
                    f"compiling {req.name!r} produced no binary (expected at {binary})",
                    command=commands[-1],
                    source_path=str(source_path),
                )
                self._record_failure(folder, error)
                raise error
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
            raise
        seconds = time.perf_counter() - start

        size = partial.stat().st_size
        sha = _sha256_file(partial)
        os.replace(partial, binary)
        meta = {
            "name": req.name,
            "key": key,
            "command": list(req.command),
            "steps": [list(s) for s in req.steps],
            "commands": commands,
            "compiler": req.compiler,
            "compiler_version": compiler_version(req.compiler),
            "compiler_version_text": compiler_version_text(req.compiler),
            "package_version": _package_version(),
            "key_extra": list(req.key_extra),
            "compile_seconds": round(seconds, 6),
            "binary": req.binary_name,
            "sha256": sha,
            "size": size,
            "source": source_path.name,
            "extra_files": [name for name, _ in req.extra_files],
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "rebuilt_reason": rebuilt_reason,
            "meta": dict(req.meta),
        }
        write_atomic(folder / META_FILE, json.dumps(meta, indent=2, default=str) + "\n")
        with contextlib.suppress(FileNotFoundError):
            (folder / ERROR_FILE).unlink()
        kernel = self._kernel(
            req, key, compiled=True, rebuilt_reason=rebuilt_reason, compile_seconds=seconds
        )
        st = binary.stat()
        with self._lock:
            self._verified[kernel.folder] = (kernel, _stamp(st))
        return kernel

    def _run(self, cmd: list[str], shown: list[str], source_path: Path, folder: Path) -> None:
        """Run one compile command in the kernel folder; raise CompileError (naming the
        command as ``shown``) on failure."""
        try:
            proc = subprocess.run(
                cmd,
                cwd=folder,
                capture_output=True,
                text=True,
                check=False,
                timeout=COMPILE_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as exc:
            error = CompileError(
                f"{cmd[0]} did not finish within {COMPILE_TIMEOUT_S:.0f} s",
                stderr=str(exc.stderr or ""),
                command=shown,
                source_path=str(source_path),
            )
            self._record_failure(folder, error)
            raise error from exc
        except OSError as exc:
            error = CompileError(
                f"cannot run {cmd[0]!r}: {exc}", command=shown, source_path=str(source_path)
            )
            self._record_failure(folder, error)
            raise error from exc
        if proc.returncode != 0:
            stderr = (proc.stderr or "") + (proc.stdout or "")
            error = CompileError(
                f"{cmd[0]} exited with status {proc.returncode}",
                stderr=stderr,
                command=shown,
                source_path=str(source_path),
            )
            self._record_failure(folder, error)
            raise error

    @staticmethod
    def _record_failure(folder: Path, error: CompileError) -> None:
        with contextlib.suppress(OSError):
            write_atomic(folder / ERROR_FILE, f"{error}\n")


_caches: dict[str, KernelCache] = {}
_caches_lock = threading.Lock()


def kernel_cache(root: Path) -> KernelCache:
    """The process's one :class:`KernelCache` for ``root`` (keyed by the resolved path)."""
    resolved = str(Path(root).expanduser().resolve())
    with _caches_lock:
        cache = _caches.get(resolved)
        if cache is None:
            cache = _caches[resolved] = KernelCache(Path(resolved))
        return cache
