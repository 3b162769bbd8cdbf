"""The group index: a warm start loads an x86 fused kernel without scheduling or rendering.

The kernel cache (``backends/cache.py``) is keyed by the generated source, so finding a
binary there costs the islpy schedule and the render of its group. The index sits in front
of it: ``<cache_dir>/index/<group key>.json`` maps a key computed cheaply from the group
itself (:func:`group_key`) to what loading the kernel needs (:class:`IndexRecord`): the
kernel cache request's name and key, the C function name, the argument values with their memory
layouts, and the output's shape and layout. A group the scheduler rejected is recorded too
(``kind == "not_fusable"``), so that a warm start does not schedule it again to find out.

The group key hashes everything the schedule and the source depend on: the group's nodes
(name, op, inputs, outputs, attrs, bound, group, source; a node with a payload is not
indexed), the ``TensorType`` of every value they touch, which produced values escape the group (read
outside it or graph outputs), a sha256 of the bytes of every parameter they read (batch-norm
constants are baked into the source), ``Options.codegen_key()``, ``Hardware.key()``, the
package version, :data:`CODEGEN_VERSION`, a hash of every source file and template of the
installed packages (:func:`codegen_digest`, found through ``importlib.resources``, so that
editing the scheduler, the op catalogue or a template never hands out a stale kernel, even
when nobody bumps the constant, in an editable or a regular install alike; a missing or
unreadable file raises :class:`CodegenDigestError`), the C compiler's ``--version`` output,
its flags and the host's CPU.

Entries are written atomically (``write_atomic``). A hit is used only when the record reads
back whole, names its own key, and the kernel cache verifies the binary (size and sha256
against its ``meta.json``, whose key must match); anything else is a miss and the caller
takes the full schedule -> render -> compile path, which rewrites the entry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.resources
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ... import version
from ...graph import Graph
from ...hardware import Hardware
from ...options import Options
from ..cache import CachedKernel, compiler_version_text, kernel_cache, write_atomic
from .build import C_FLAGS, c_compiler, host_id

if TYPE_CHECKING:
    from importlib.abc import Traversable

# Bump whenever the schedule or the C code generated from it changes meaning.
CODEGEN_VERSION = 2
INDEX_FORMAT = 1
INDEX_DIR = "index"

# Every package this distribution installs (pyproject's [tool.setuptools] packages; a test
# checks the two lists agree). Any of their files can change a kernel (the schedule IR, the
# op catalogue, the graph, the loops, the templates), so all of them are hashed into every
# group key: an edit anywhere costs one cold build, never a stale binary.
PACKAGES = (
    "middleware",
    "middleware.frontends",
    "middleware.passes",
    "middleware.backends",
    "middleware.backends.x86",
    "middleware.backends.cpu",
    "middleware.backends.vendor",
    "middleware.backends.cuda",
    "middleware.backends.reference",
    "middleware.runtime",
)
# What a package's folder holds that is code: its modules, kernel headers and, in its
# ``templates`` folder, the jinja2 templates (package data in a non-editable install).
_SOURCE_SUFFIXES = (".py", ".h")
_TEMPLATE_DIR = "templates"
_TEMPLATE_SUFFIX = ".j2"
# Files the generated C depends on for certain: their absence means a broken install,
# and a digest without them would hand out stale kernels.
REQUIRED_FILES = frozenset(
    {
        "middleware/graph.py",
        "middleware/ops.py",
        "middleware/loops.py",
        "middleware/isl_helpers.py",
        "middleware.passes/schedule.py",
        "middleware.passes/schedule_ir.py",
        "middleware.backends.x86/backend.py",
        "middleware.backends.x86/build.py",
        "middleware.backends.x86/cfuncs.py",
        "middleware.backends.x86/cstage.py",
        "middleware.backends.x86/render.py",
        "middleware.backends.x86/templates/group.c.j2",
        "middleware.backends.x86/templates/group.ispc.j2",
        "middleware.backends.x86/templates/group_glue.c.j2",
    }
)


class CodegenDigestError(RuntimeError):
    """A package file the codegen digest must cover is missing or unreadable."""


@dataclasses.dataclass(frozen=True)
class IndexRecord:
    """What loading an indexed kernel needs. ``inputs`` are (value, layout, rank) in argument
    order; ``output`` is (value, layout, torch shape)."""

    kind: str  # "kernel" or "not_fusable"
    why: str = ""
    function: str = ""
    request_name: str = ""
    cache_key: str = ""
    binary_name: str = ""
    suffix: str = ""
    inputs: tuple[tuple[str, str, int], ...] = ()
    output: tuple[str, str, tuple[int, ...]] = ("", "", ())


_codegen_digest: str | None = None
_records: dict[tuple[str, str], IndexRecord] = {}  # (index folder, key) -> record read
_lock = threading.Lock()


def codegen_files() -> dict[str, Traversable]:
    """Every source file and template of the installed packages, by a name relative to the
    install (``"<package>/<file>"``), found through ``importlib.resources`` so that an
    editable and a regular install list the same files."""
    files: dict[str, Traversable] = {}
    for pkg in PACKAGES:
        try:
            root = importlib.resources.files(pkg)
            entries = list(root.iterdir())
        except (ImportError, OSError) as e:
            raise CodegenDigestError(f"cannot list package {pkg!r}: {e}") from e
        for entry in entries:
            if entry.is_file() and entry.name.endswith(_SOURCE_SUFFIXES):
                files[f"{pkg}/{entry.name}"] = entry
            elif entry.name == _TEMPLATE_DIR and entry.is_dir():
                for t in entry.iterdir():
                    if t.is_file() and t.name.endswith(_TEMPLATE_SUFFIX):
                        files[f"{pkg}/{_TEMPLATE_DIR}/{t.name}"] = t
    missing = sorted(REQUIRED_FILES - files.keys())
    if missing:
        raise CodegenDigestError(
            f"the installed middleware lacks {', '.join(missing)}; reinstall the package "
            "(a digest without them could hand out stale kernels)"
        )
    return files


def codegen_digest() -> str:
    """sha256 of :data:`CODEGEN_VERSION` and every file of :func:`codegen_files`, in name
    order (memoised). Raises :class:`CodegenDigestError` when a file cannot be read."""
    global _codegen_digest
    if _codegen_digest is None:
        h = hashlib.sha256(f"codegen={CODEGEN_VERSION}".encode())
        for name, f in sorted(codegen_files().items()):
            try:
                data = f.read_bytes()
            except OSError as e:
                raise CodegenDigestError(f"cannot read {name}: {e}") from e
            # length-prefixed, so that no two file lists hash alike
            h.update(f"{name}\0{len(data)}\0".encode())
            h.update(data)
        _codegen_digest = h.hexdigest()
    return _codegen_digest


def _array_digest(a: Any) -> str:
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().contiguous().numpy()
    a = np.ascontiguousarray(a)
    h = hashlib.sha256(f"{a.dtype}|{a.shape}|".encode())
    h.update(a.tobytes())
    return h.hexdigest()


def _canon(x: Any) -> Any:
    """A JSON-able, exact rendering of attribute values (arrays by content hash)."""
    if isinstance(x, np.ndarray | torch.Tensor):
        return {"array": _array_digest(x)}
    if isinstance(x, dict):
        return {str(k): _canon(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, list | tuple):
        return [type(x).__name__, [_canon(v) for v in x]]
    if isinstance(x, float):
        return ["float", x.hex()]
    if x is None or isinstance(x, bool | int | str):
        return x
    if isinstance(x, np.generic):
        return _canon(x.item())
    return ["repr", type(x).__name__, repr(x)]


def group_key(
    graph: Graph, names: Sequence[str], options: Options, hardware: Hardware
) -> str | None:
    """The group's index key (sha256 hex), or None when the group cannot be keyed (a node
    carries a payload, whose effect on codegen is not known here)."""
    inside = set(names)
    outs_graph = set(graph.output_values())
    nodes, values, params = [], {}, {}
    for n in names:
        node = graph.node(n)
        if node.payload is not None:
            return None
        nodes.append(
            [
                node.name,
                node.op,
                list(node.inputs),
                list(node.outputs),
                _canon(dict(node.attrs)),
                str(node.bound),
                node.group,
                node.source,
            ]
        )
        for v in (*node.inputs, *node.outputs):
            if v not in values:
                t = graph.values[v]
                values[v] = [list(t.shape), t.dtype, t.layout]
            if v in graph.params and v not in params:
                params[v] = _array_digest(graph.params[v])
    escapes = sorted(
        v
        for n in names
        for v in graph.node(n).outputs
        if v in outs_graph or any(c.name not in inside for c in graph.consumers(v))
    )
    cc = c_compiler()
    fields = {
        "format": INDEX_FORMAT,
        "nodes": nodes,
        "values": values,
        "params": params,
        "escapes": escapes,
        "codegen_key": options.codegen_key(),
        "hardware": hardware.key(),
        "package": version.__version__,
        "codegen": codegen_digest(),
        "cc": [cc, compiler_version_text(cc), list(C_FLAGS), host_id()],
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _path(cache_dir: Path, key: str) -> Path:
    return Path(cache_dir) / INDEX_DIR / f"{key}.json"


def get(cache_dir: Path, key: str) -> IndexRecord | None:
    """The record stored under ``key``, or None (missing, unreadable, or not for this key)."""
    memo_key = (str(Path(cache_dir) / INDEX_DIR), key)
    with _lock:
        if memo_key in _records:
            return _records[memo_key]
    try:
        data = json.loads(_path(cache_dir, key).read_text())
        if data.get("format") != INDEX_FORMAT or data.get("key") != key:
            return None
        kind = data["kind"]
        if kind == "not_fusable":
            rec = IndexRecord(kind, why=str(data["why"]))
        elif kind == "kernel":
            out_value, out_layout, out_shape = data["output"]
            rec = IndexRecord(
                kind,
                function=str(data["function"]),
                request_name=str(data["request_name"]),
                cache_key=str(data["cache_key"]),
                binary_name=str(data["binary_name"]),
                suffix=str(data["suffix"]),
                inputs=tuple((str(v), str(lay), int(r)) for v, lay, r in data["inputs"]),
                output=(str(out_value), str(out_layout), tuple(int(s) for s in out_shape)),
            )
            if not rec.function.isidentifier():
                return None
        else:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    with _lock:
        _records[memo_key] = rec
    return rec


def put(cache_dir: Path, key: str, record: IndexRecord) -> None:
    """Store ``record`` under ``key`` (atomically; a failure to write is ignored: the index
    is only a shortcut)."""
    data = dataclasses.asdict(record)
    data.update(format=INDEX_FORMAT, key=key)
    folder = Path(cache_dir) / INDEX_DIR
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(_path(cache_dir, key), json.dumps(data, indent=1) + "\n")
        with _lock:
            _records[(str(folder), key)] = record


def forget(cache_dir: Path, key: str) -> None:
    """Drop the in-process memo of ``key`` (after its record proved unusable)."""
    with _lock:
        _records.pop((str(Path(cache_dir) / INDEX_DIR), key), None)


def verified_kernel(cache_dir: Path, record: IndexRecord) -> CachedKernel | None:
    """The kernel cache's verified binary for ``record`` (size and sha256 against its
    ``meta.json``, whose key must be the record's), or None."""
    return kernel_cache(Path(cache_dir)).lookup_key(
        record.request_name, record.cache_key, record.binary_name, record.suffix
    )
