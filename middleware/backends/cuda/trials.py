"""cuDNN's algorithm search for a plan's convolutions, before the plan holds any memory.

With ``torch.backends.cudnn.benchmark`` on, the first call of each convolution problem
(shapes, memory formats, geometry, dtype) times cuDNN's candidate algorithms, each with
its own workspace: a transient that sets the whole process's peak GPU memory on most
networks (H200, batch 16: resnet50 2.3 GiB above what the plan holds, vgg16 3.2 GiB).
A plan searched on its first run does so while its weight copies, its buffers and the
CUDA graph's captured inputs are allocated, so its peak sat 9-96 MiB above
``torch.compile(mode="reduce-overhead")``'s (bench/results/gpu_s24.md). Here each
problem is searched once while the plan is being built, on scratch tensors of the
problem's shapes and formats that are freed right after: the search's peak is the
model, one convolution's input and output and the search's workspace. cuDNN keeps the
chosen algorithm per problem (per thread, keyed by sizes, memory format and pointer
alignment), so the plan's own first run, in the thread that built it, finds them there.
Not covered: string padding ("same"), and batch-sliced plans whose slices start at offsets
of another alignment. (The expected effect, from that run's figures: every measured peak
under reduce-overhead's. Not yet measured on a GPU: ``bench/gpu_memory.py``'s
``mw_graph_late`` mode is the A/B.)

Nothing happens with ``benchmark`` off (cuDNN's heuristics choose without timing) or off
a CUDA device.
"""

from __future__ import annotations

import dataclasses

import torch

from ...graph import Graph
from ...op_registry import torch_dtype
from .epilogue import conv_geometry

# Search the plan's convolution algorithms while it is built (off: on its first run).
PRETRIAL = True


@dataclasses.dataclass(frozen=True)
class ConvProblem:
    """What cuDNN's algorithm cache tells one convolution from another by."""

    x_shape: tuple[int, ...]
    x_layout: str  # "nchw" or "nhwc"
    w_shape: tuple[int, ...]
    w_layout: str
    dtype: str
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int


def conv_problems(graph: Graph, weight_layouts: dict[str, str]) -> list[ConvProblem]:
    """The distinct problems of the conv2d nodes named in ``weight_layouts`` (those that
    run through cuDNN, with the layout of the weight their step passes), in graph order;
    a node with string padding ("same") is left to its first run."""
    out: dict[ConvProblem, None] = {}
    for n in graph.nodes():
        if n.name not in weight_layouts or isinstance(n.attrs.get("padding", 0), str):
            continue
        x, w = graph.values[n.inputs[0]], graph.values[n.inputs[1]]
        if x.rank != 4 or w.rank != 4:
            continue
        stride, padding, dilation, groups = conv_geometry(n)
        problem = ConvProblem(
            tuple(x.shape),
            x.layout,
            tuple(w.shape),
            weight_layouts[n.name],
            x.dtype,
            stride,
            padding,
            dilation,
            groups,
        )
        out[problem] = None
    return list(out)


def scratch_operands(p: ConvProblem, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised input and weight of problem ``p``, with the strides the plan's own
    tensors have: an activation allocated in its layout (as the plan's buffers and the
    kernels' outputs are), a weight made contiguous in its layout (as ``to_tensor`` makes
    a constant: on a weight of one input channel, or 1x1, ``.contiguous(memory_format=
    channels_last)`` keeps the default strides, and cuDNN keys a problem by the memory
    format the operands' strides suggest)."""
    dtype = torch_dtype(p.dtype)
    x = torch.empty(p.x_shape, dtype=dtype, device=device, memory_format=_format(p.x_layout))
    w = torch.empty(p.w_shape, dtype=dtype, device=device)
    return x, w.contiguous(memory_format=_format(p.w_layout))


def search_conv_algorithms(problems: list[ConvProblem], device: torch.device) -> int:
    """Run each problem once on scratch tensors (cuDNN searches and caches its algorithm),
    freeing them before the next; returns how many ran (0: ``PRETRIAL`` off, not a CUDA
    device, cuDNN missing, off or not in benchmark mode). A problem that fails here (out
    of memory for its scratch tensors, say) is left to the plan's first run, as before;
    autocast is off (the plan runs its convolutions in their own dtype)."""
    cudnn = torch.backends.cudnn
    if (
        not PRETRIAL
        or device.type != "cuda"
        or not cudnn.is_available()
        or not cudnn.enabled
        or not cudnn.benchmark
    ):
        return 0
    ran = 0
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        for p in problems:
            try:
                x, w = scratch_operands(p, device)
                torch.conv2d(x, w, None, p.stride, p.padding, p.dilation, p.groups)
                ran += 1
            except Exception:  # noqa: BLE001 - only a head start: the first run searches
                pass
            finally:
                x = w = None  # noqa: F841 - freed before the next problem's
    return ran


def _format(layout: str) -> torch.memory_format:
    return torch.channels_last if layout == "nhwc" else torch.contiguous_format
