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
package version, :data:`CODEGEN_VERSION`, a hash of the codegen's own source files (so that
editing the scheduler or the templates never hands out a stale kernel, even when nobody bumps
the constant), the C compiler's ``--version`` output, its flags and the host's CPU.

Entries are written atomically (``write_atomic``). A hit is used only when the record reads
back whole, names its own key, and the kernel cache verifies the binary (size and sha256
against its ``meta.json``, whose key must match); anything else is a miss and the caller
takes the full schedule -> render -> compile path, which rewrites the entry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...graph import Graph
from ...hardware import Hardware
from ...options import Options
from ..cache import CachedKernel, compiler_version_text, kernel_cache, write_atomic
from .build import C_FLAGS, c_compiler, host_id

# Bump whenever the schedule or the C code generated from it changes meaning.
CODEGEN_VERSION = 1
INDEX_FORMAT = 1
INDEX_DIR = "index"

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent.parent
# The files whose content decides the generated kernel (hashed into every group key).
_CODEGEN_FILES = (
    _ROOT / "passes" / "schedule.py",
    _ROOT / "middleware" / "loops.py",
    _ROOT / "middleware" / "isl_helpers.py",
    _HERE / "render.py",
    _HERE / "cfuncs.py",
    _HERE / "build.py",
    _HERE / "backend.py",
    _HERE / "templates" / "group.c.j2",
)


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


def codegen_digest() -> str:
    """sha256 of the codegen's source files and :data:`CODEGEN_VERSION` (memoised)."""
    global _codegen_digest
    if _codegen_digest is None:
        h = hashlib.sha256(f"codegen={CODEGEN_VERSION}".encode())
        for path in _CODEGEN_FILES:
            h.update(path.name.encode())
            with contextlib.suppress(OSError):
                h.update(path.read_bytes())
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
    from ... import __version__

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
        "package": __version__,
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
