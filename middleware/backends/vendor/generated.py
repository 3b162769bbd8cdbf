"""What the vendor module's generated algorithms (``direct.py``, ``gemv.py``) share: the
node's fused activation as C (or why it has none), and compiling a rendered kernel through
the kernel cache into a ctypes function, or None with a warning where it does not compile
(``options.strict`` raises)."""

from __future__ import annotations

import warnings
from typing import Any

from ...errors import CompileError
from ...graph import Node
from ...hardware import Hardware
from ...loops import Acc, NotFusable
from ...ops import activation_expr
from ...options import Options
from ..x86.build import load_shared
from ..x86.cfuncs import c_expr
from ..x86.compile import build_c
from .calls import activation_attrs


def activation_why_not(node: Node, key: str = "activation") -> str | None:
    """None where ``node``'s fused activation (if any; ``key``: which, as in
    ``calls.activation_attrs``) has loop semantics, else why not."""
    name, attrs = activation_attrs(node, key)
    if name:
        try:
            activation_expr(name, attrs, Acc())
        except NotFusable:
            return f"activation {name} has no loop semantics"
    return None


def activation_c(node: Node, key: str = "activation") -> str:
    """``node``'s fused activation (``key``: which, as in ``calls.activation_attrs``) as a C
    expression of ``acc_v`` (``acc_v`` itself where there is none)."""
    name, attrs = activation_attrs(node, key)
    if not name:
        return "acc_v"
    return c_expr(activation_expr(name, attrs, Acc()), lambda x: "")


def load_kernel(
    node: Node,
    kname: str,
    src: str,
    argtypes: list[Any],
    options: Options,
    hardware: Hardware,
    what: str,
) -> Any | None:
    """``kname`` of ``src`` compiled through the kernel cache, as a ctypes function with
    ``argtypes`` and no result; None (warned: ``node`` runs as ``what``) where it does not
    compile, unless ``options.strict``."""
    try:
        built = build_c(
            kname, src, options.cache_dir, key_extra=(options.codegen_key(), hardware.key())
        )
    except CompileError as e:
        if options.strict:
            raise
        warnings.warn(
            f"{node.name} runs as {what}: its generated kernel failed to compile; source: "
            f"{e.source_path}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    fn = getattr(load_shared(built.binary), kname)
    fn.restype = None
    fn.argtypes = argtypes
    return fn
