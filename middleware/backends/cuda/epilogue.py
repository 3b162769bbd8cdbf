"""Convolutions on CUDA: cuDNN for the convolution itself, then the fused epilogue (bias add,
residual add, activation) as ONE generated in-place kernel.

Why: PyTorch runs a cuDNN convolution's bias as a separate broadcast add (a non-vectorised
elementwise kernel in channels_last) and the activation as a third pass; on an H200 at
batch 16 those two passes took 1.07 of vgg16's 3.44 ms of kernel time (``bench/gpu_diag.py``,
eager channels_last). One vectorised pass reads and writes the output once instead of twice.
The activation is the registry's scalar semantics of the op (``ops.activation_expr``,
the same expression the C backend and the fused groups use) printed with the backend's
one function table (``funcs.CUDA_FUNCS``), so every activation with loop semantics can be
fused.

Each distinct (shape, layout, epilogue) is one small kernel compiled through the kernel
cache like a group's kernel; only device pointers are passed, sizes are constants.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ...graph import Graph, Node
from ...hardware import Hardware
from ...loops import DIMS, Load, NotFusable
from ...ops import activation_expr
from .funcs import HELPERS, cuda_expr
from .render import BLOCKS_PER_SM, WARPS_PER_BLOCK, environment


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """What follows a convolution: its output's shape and layout, and the fused steps."""

    shape: tuple[int, int, int, int]
    layout: str  # "nchw" | "nhwc"
    has_bias: bool
    has_residual: bool
    activation: str | None
    activation_attrs: tuple[tuple[str, Any], ...] = ()

    @property
    def total(self) -> int:
        n, c, h, w = self.shape
        return n * c * h * w

    @property
    def vec(self) -> int:
        """Floats per access: 4 where every float4 stays inside one channel run (nchw: the
        plane is a multiple of 4) or covers 4 channels (nhwc: C is a multiple of 4)."""
        _, c, h, w = self.shape
        inner = c if self.layout == "nhwc" else h * w
        return 4 if inner % 4 == 0 and self.total % 4 == 0 else 1

    def name(self) -> str:
        n, c, h, w = self.shape
        parts = [f"mw_epi_{self.layout}_{n}x{c}x{h}x{w}"]
        parts += ["b"] if self.has_bias else []
        parts += ["r"] if self.has_residual else []
        parts += [self.activation] if self.activation else []
        return "_".join(parts)


def conv_epilogue(graph: Graph, node: Node) -> Epilogue | None:
    """The epilogue of a conv2d node (bias, ``residual``, ``activation`` attrs), or None
    when there is nothing to fuse or the output is not a float32 4-d tensor."""
    if node.op != "conv2d" or isinstance(node.attrs.get("padding", 0), str):
        return None
    out = graph.values[node.outputs[0]]
    if out.rank != 4 or out.dtype not in ("float32", torch.float32):
        return None
    residual = bool(node.attrs.get("residual", False))
    has_bias = len(node.inputs) - int(residual) == 3
    act = node.attrs.get("activation")
    if not (has_bias or residual or act):
        return None
    if act:
        try:
            activation(act, dict(node.attrs.get("activation_attrs", ())), "v")
        except NotFusable:
            return None  # no scalar semantics: PyTorch applies it after the convolution
    return Epilogue(
        tuple(out.shape),
        out.layout if out.layout == "nhwc" else "nchw",
        has_bias,
        residual,
        act,
        tuple(node.attrs.get("activation_attrs", ())),
    )


def activation(name: str, attrs: dict[str, Any], x: str) -> str:
    """CUDA C of activation ``name`` (its registry semantics) applied to the C variable
    ``x``; raises ``NotFusable`` for an op without scalar semantics."""
    placeholder = Load(x, DIMS)
    expr = activation_expr(name, attrs, placeholder)
    return cuda_expr(expr, lambda ld: ld.value, lambda p: "", acc=x)


def launch_shape(ep: Epilogue, hardware: Hardware) -> tuple[int, int]:
    block = max(1, hardware.warp_size or 32) * WARPS_PER_BLOCK
    items = ep.total // ep.vec
    grid = max(1, min(-(-items // block), max(1, hardware.cores) * BLOCKS_PER_SM))
    return grid, block


def render_epilogue(ep: Epilogue, hardware: Hardware) -> str:
    """The CUDA C source of ``ep``'s in-place kernel (with the CPU emulation entry)."""
    grid, block = launch_shape(ep, hardware)
    _, c, h, w = ep.shape
    act = activation(ep.activation, dict(ep.activation_attrs), "v") if ep.activation else "v"
    formula = " + ".join(
        ["conv(x)"]
        + (["bias[c]"] if ep.has_bias else [])
        + (["residual"] if ep.has_residual else [])
    )
    if ep.activation:
        formula = f"{ep.activation}({formula})"
    return (
        environment()
        .get_template("epilogue.cu.j2")
        .render(
            kernel=ep.name(),
            formula=formula,
            shape="x".join(map(str, ep.shape)),
            layout=ep.layout,
            vec=ep.vec,
            total=ep.total,
            channels=c,
            plane=h * w,
            has_bias=ep.has_bias,
            has_residual=ep.has_residual,
            act=act,
            helpers=HELPERS,
            grid=grid,
            block=block,
        )
    )


class ConvWithEpilogue:
    """``fn(x, w, [b], [residual])``: the convolution through PyTorch (cuDNN) without its
    bias, then the epilogue kernel in place on the result. ``weight``: the constant weight
    already in the output's memory format (else the passed one is used)."""

    def __init__(
        self,
        node: Node,
        ep: Epilogue,
        launcher: Any,
        grid: int,
        block: int,
        conv_args: tuple,
        weight: torch.Tensor | None = None,
    ) -> None:
        self.name = node.name
        self.ep = ep
        self.launcher = launcher
        self.grid, self.block = grid, block
        self.stride, self.padding, self.dilation, self.groups = conv_args
        self.weight = weight
        self.memory_format = torch.channels_last if ep.layout == "nhwc" else torch.contiguous_format

    def __call__(self, x: torch.Tensor, w: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        w = w if self.weight is None else self.weight
        y = torch.conv2d(x, w, None, self.stride, self.padding, self.dilation, self.groups)
        if not y.is_contiguous(memory_format=self.memory_format):
            y = y.contiguous(memory_format=self.memory_format)
        b = rest[0] if self.ep.has_bias else y
        r = rest[-1] if self.ep.has_residual else y
        if self.ep.has_residual and not r.is_contiguous(memory_format=self.memory_format):
            r = r.contiguous(memory_format=self.memory_format)
        b = b.contiguous()
        self.launcher.launch(self.grid, self.block, [y.data_ptr(), b.data_ptr(), r.data_ptr()])
        return y


def conv_geometry(node: Node) -> tuple:
    def pair(v: Any) -> tuple[int, int]:
        return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))

    return (
        pair(node.attrs.get("stride", 1)),
        pair(node.attrs.get("padding", 0)),
        pair(node.attrs.get("dilation", 1)),
        int(node.attrs.get("groups", 1)),
    )


def make_conv(
    node: Node, ep: Epilogue, launcher: Any, hardware: Hardware, weight: torch.Tensor | None
) -> Callable[..., torch.Tensor]:
    grid, block = launch_shape(ep, hardware)
    return ConvWithEpilogue(node, ep, launcher, grid, block, conv_geometry(node), weight)
