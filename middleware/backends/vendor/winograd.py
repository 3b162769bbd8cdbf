"""Winograd F(4x4, 3x3) convolutions on x86: generated transforms around oneDNN's batched
matmul (``torch.bmm`` where PyTorch's oneDNN cannot be called directly).

A 3x3 stride-1 convolution computes each 4x4 output tile from a 6x6 input patch with 36
multiplications per (input, output) channel pair instead of 144 (Lavin & Gray, "Fast
Algorithms for Convolutional Neural Networks", 2016):

    Y = A^T [ (G g G^T) (.) (B^T d B) ] A

- the weight transform ``U = G g G^T`` runs once, at optimize time: ``U[36][C][K]``;
- ``<name>_in`` (generated OpenMP C, SIMD over channels) writes ``V[36][T][C]``, the input
  transform of a chunk of T tiles (zero padding handled at the borders);
- a oneDNN matmul primitive (PyTorch's oneDNN through its C API, ``onednn.BatchedMatmul``:
  U packed once; ``torch.bmm`` where the primitive cannot be built) computes
  ``M[36][T][K] = V @ U``;
- ``<name>_out`` (generated) computes ``A^T M A`` with the convolution's fused epilogue
  (bias, residual add, activation) and writes the NHWC output, clipped at the borders.

The tiles run in chunks whose ``V`` and ``M`` fit ``WORKSPACE_BYTES`` (depth-first over
tiles: the transformed data of a chunk stays in cache between the three calls). Tile
geometry and channel counts are runtime arguments, so one compiled pair of transforms
serves every layer with the same epilogue (the kernel cache keys it by its source).

The float32 result differs from the direct convolution by rounding (about 1e-5 of the
output's scale per layer, measured in tests/test_winograd.py); ``Options.winograd=False``
keeps every convolution in oneDNN's direct algorithm.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import threading
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import CompileError
from ...graph import PARAM_SOURCES, Graph, Node
from ...hardware import Hardware
from ...loops import Acc, NotFusable
from ...ops import activation_expr
from ...options import Options
from ..cache import kernel_cache
from ..interface import SCRATCH, NativeCall, native_address
from ..x86.build import c_build_request, load_shared
from ..x86.cfuncs import c_expr
from ..x86.compile import build_c
from ..x86.render import environment
from . import onednn
from .calls import _conv_geometry, activation_attrs, holds_constants

# When a convolution runs as Winograd (else oneDNN's direct call), on every CPU but AMD's.
# Measured on the Intel Xeon host (2 cores, AVX-512; session 23, the product on oneDNN's
# matmul primitives since session 20), each conv2d layer alone with its bias and ReLU,
# Winograd F(4x4) over oneDNN's direct primitive (`python bench/algorithms.py
# --net-layers --nets resnet18,vgg16 --batch 1`, and `--batch 16` over resnet18, vgg16,
# mobilenet_v2 and squeezenet1_1; bench/results/algorithms_layers_s23_intel_b*.md):
# batch 1: 128->128 @28 1.19x, @112 1.31x, 128->256 @56 1.69x, 256->256 @56 1.87x,
# 256->512 @28 2.08x, 512->512 @28 2.44x, 512->512 @14 1.09x, 64->128 @112 1.12x; slower:
# 64->64 @56 0.74x and @224 0.88x, 256->256 @14 0.91x (196 pixels), 512->512 @7 0.85x;
# batch 16: 128->128 @28 1.26-1.50x, 256->256 @14 1.33-1.45x, 512->512 @7 1.83-2.00x, @14
# 1.52x, @28 2.08x, 256->512 @28 1.53x, 256->256 @56 1.37x, 128->128 @112 1.13x, 64->128
# @112 1.05x; slower: 64->64 @56 0.73-0.92x and @224 0.73x, squeezenet's 16->64, 32->128,
# 48->192 and 64->256 0.64-0.85x. So: at least 128 input and output channels over at least
# 784 output pixels (N * OH * OW). Whole networks against the rule before (64 channels over
# 2048 pixels, measured with torch.bmm's product), one process, interleaved, caches evicted
# between calls: batch 1 vgg16 0.82x, resnet18 0.97x, the others within 1%; batch 16
# resnet18 0.92x, resnet50 0.95x, inception_v3 0.97x, googlenet 0.97x, vgg16 0.96x.
# U holds 4x the weight (36 against 9 values per channel pair): 108 * C * K extra bytes.
MIN_CHANNELS = 128  # input and output channels
CHANNEL_MULTIPLE = 16  # the transforms' SIMD block (one AVX-512 register)
MIN_PIXELS = 784  # output pixels per call (N * OH * OW)
# The rule on AMD: (min channels, min output pixels) pairs, any of which admits a layer.
# Measured on the AMD EPYC (Zen 5) host against oneDNN's primitives, two threads, ReLU
# epilogue, single layers through optimize() (session 20, after the product moved from
# torch.bmm to oneDNN matmul primitives, MKL's sgemm taking its AVX2 path on AMD at 210
# GFLOP/s against oneDNN's 475, and the chunk loop into one C call): batch 16: 64->64 @224
# 1.37x, @56 1.37x, 128->128 @112 1.41x, @28 1.86x, 256->256 @56 1.92x, @14 1.76x,
# 512->512 @28 2.53x, @14 1.89x, @7 1.73x, 96->128 @28 1.92x, 160->320 @7 1.58x, 32->128
# @27 1.43x, 48->192 @13 1.50x, 32->32 @56 1.31x, 128->32 @56 1.38x, @14 1.07x, @7 1.12x,
# but 16->64 @55 0.84x (16 input channels: the transforms outweigh the product); batch 1:
# 64->64 @56 2.25x, 128->128 @28 2.42x, 256->256 @14 1.74x, 512->512 @14 1.49x, 128->32
# @56 1.81x, @28 1.76x, 32->128 @27 1.84x, 64->256 @13 1.38x, but 512->512 @7 0.80x (4
# tiles: U, 36 MiB, read for little work) and 128->32 @7 0.91x. Whole networks, one process, interleaved
# against the rule before ((64, 196), (32, 8192)): densenet121 batch 16 1.10x, batch 1
# 1.02x, googlenet 0.99x at batch 1, the others unchanged; admitting the 7x7 layers at
# batch 1 too (160->320 @7 1.32x alone) made googlenet 3-4% slower. (With torch.bmm,
# session 13, it lost on every 3x3 layer of resnet18 and won only on vgg16's widest.)
# Empty: the rule below everywhere (the tests of the Winograd arithmetic through the
# default's rule).
AMD_RULE: tuple[tuple[int, int], ...] = ((32, 196),)
# Bytes of V + M per chunk of tiles, and the least tiles per chunk (smaller GEMMs lose
# more to the re-read of U than the cache saves).
WORKSPACE_BYTES = 8 << 20
MIN_CHUNK_TILES = 64
TILE = 4  # output tile (F(4x4, 3x3)); input patch TILE + 2

# Lavin & Gray's G for F(4, 3) (points 0, 1, -1, 2, -2, infinity)
_G = np.array(
    [
        [1 / 4, 0, 0],
        [-1 / 6, -1 / 6, -1 / 6],
        [-1 / 6, 1 / 6, -1 / 6],
        [1 / 24, 1 / 12, 1 / 6],
        [1 / 24, -1 / 12, 1 / 6],
        [0, 0, 1],
    ],
    dtype=np.float64,
)


def transform_weight(weight: np.ndarray | torch.Tensor) -> torch.Tensor:
    """``U[36][C][K]`` (float32, contiguous) of a ``[K][C][3][3]`` weight: position
    ``i*6 + j`` holds ``(G g G^T)[i][j]`` for every (c, k). One GEMM writes the final layout:
    ``U = (G kron G) @ w[3][3][C][K]`` viewed as ``[36][9] @ [9][C*K]`` (7x faster than an
    einsum and a transposing copy on 512x512 weights: 15 against 108 ms)."""
    w = torch.as_tensor(np.asarray(weight, dtype=np.float32))
    k, c = w.shape[0], w.shape[1]
    g = torch.from_numpy(_G)
    t = torch.kron(g, g).to(torch.float32)  # [36][9]: (i*6 + j, a*3 + b) -> G[i][a] G[j][b]
    return (t @ w.permute(2, 3, 1, 0).reshape(9, c * k)).reshape(36, c, k)


class DirectWeight:
    """The untransformed ``[K][C][3][3]`` weight that tiles holding a NaN or an infinity are
    computed from (the direct convolution, so that they reach what PyTorch's do).

    The user's own weight is held as it is (no copy). A derived one (batch-norm folded) is
    not held beside ``u``: it is recovered from ``u`` through the transform's left inverse
    (``pinv(G) kron pinv(G)``: the weight within float32 rounding) the first time a call
    meets such a tile, and kept from then on. Saves the folded weight of every Winograd
    layer (resnet50 at batch 16: 11 MiB) on inputs that hold no NaN or infinity."""

    def __init__(
        self, weight: np.ndarray, users: bool, u: Callable[[], torch.Tensor], g: np.ndarray
    ) -> None:
        self._t = torch.from_numpy(np.ascontiguousarray(weight, np.float32)) if users else None
        self._u, self._g = u, g  # u: gives U (the packed product's weight, unpacked)
        self._shape = tuple(weight.shape)
        self._lock = threading.Lock()

    def ptr(self) -> int:
        """The address of the weight (recovered on the first call that needs it)."""
        if self._t is None:
            with self._lock:
                if self._t is None:
                    self._t = recover_weight(self._u(), self._g, self._shape)
        return self._t.data_ptr()


def recover_weight(u: torch.Tensor, g: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """The ``[K][C][3][3]`` weight whose transform (``G w G^T`` per channel pair, laid out as
    ``transform_weight`` writes it: ``[alpha^2][C][K]``) is ``u``."""
    k, c = shape[0], shape[1]
    p = np.linalg.pinv(g)  # [3][alpha]: p @ g = I
    inv = torch.from_numpy(np.kron(p, p)).to(torch.float32)  # [9][alpha^2]
    w9 = inv @ u.reshape(u.shape[0], c * k)  # [(a, b)][(c, k)]
    return w9.reshape(3, 3, c, k).permute(3, 2, 0, 1).contiguous()


def user_weight(graph: Graph, value: str) -> bool:
    """The graph's array for ``value`` is the user's own tensor's memory (not derived)."""
    source = graph.meta.get(PARAM_SOURCES, {}).get(value)
    return source is not None and source[0] is graph.params.get(value)


def tiles_of(n: int, oh: int, ow: int) -> int:
    return n * -(-oh // TILE) * -(-ow // TILE)


def last_chunk(tiles: int, chunk: int) -> int:
    """Tiles in the last chunk of ``tiles`` cut in chunks of ``chunk`` (the product's
    second row count)."""
    return tiles - (tiles - 1) // chunk * chunk


def chunk_tiles(c: int, k: int, tiles: int) -> int:
    """Tiles per chunk: V + M within ``WORKSPACE_BYTES``, at least ``MIN_CHUNK_TILES``."""
    per_tile = 36 * 4 * (c + k)
    return max(1, min(tiles, max(MIN_CHUNK_TILES, WORKSPACE_BYTES // per_tile)))


def why_not_applicable(graph: Graph, node: Node) -> str | None:
    """None when the transforms can compute ``node`` at all (whether or not the measured
    rule would pick it), else why not: a 3x3, stride-1, undilated, ungrouped float32
    convolution in channels_last with channels a multiple of the SIMD block, padding at
    most 2 and constant weights."""
    if node.op != "conv2d":
        return "not a convolution"
    a = node.attrs
    if isinstance(a["padding"], str):
        return "string padding"
    x_t, out_t = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    w_t = graph.values[node.inputs[1]]
    if x_t.rank != 4 or x_t.dtype != "float32":
        return "not a float32 4-d input"
    if x_t.layout != "nhwc" or out_t.layout != "nhwc":
        return "not channels_last"
    if tuple(w_t.shape[2:]) != (3, 3):
        return f"kernel {tuple(w_t.shape[2:])}, not 3x3"
    (ph, pw), stride, dilation, groups = _conv_geometry(node)
    if stride != [1, 1] or dilation != [1, 1] or groups != 1:
        return "strided, dilated or grouped"
    if not (0 <= ph <= 2 and 0 <= pw <= 2):
        return f"padding {(ph, pw)} beyond 2"
    c, k = x_t.shape[1], out_t.shape[1]
    if c % CHANNEL_MULTIPLE or k % CHANNEL_MULTIPLE:
        return f"{c}->{k} channels (the transforms want multiples of {CHANNEL_MULTIPLE})"
    if not graph.is_param(node.inputs[1]):
        return "weight is computed"
    residual = bool(a.get("residual", False))
    if len(node.inputs) - int(residual) == 3 and not graph.is_param(node.inputs[2]):
        return "bias is computed"
    return None


def why_not(graph: Graph, node: Node, hardware: Hardware | None = None) -> str | None:
    """None when ``node`` runs faster as Winograd by the measured rule of ``hardware``'s
    kind (:data:`AMD_RULE` on AMD, :data:`MIN_CHANNELS` and :data:`MIN_PIXELS` elsewhere),
    else why not (the default's choice; :func:`why_not_applicable` says whether it can run
    at all)."""
    reason = why_not_applicable(graph, node)
    if reason is not None:
        return reason
    x_t, out_t = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    c, k = x_t.shape[1], out_t.shape[1]
    if hardware is not None and hardware.amd and AMD_RULE:
        pixels = out_t.shape[0] * out_t.shape[2] * out_t.shape[3]
        if any(min(c, k) >= mc and pixels >= mp for mc, mp in AMD_RULE):
            return None
        wants = " or ".join(f">= {mc} channels over >= {mp}" for mc, mp in AMD_RULE)
        return (
            f"{c}->{k} channels over {pixels} output pixels: on AMD the rule wants {wants} "
            "(oneDNN's direct kernels are faster below)"
        )
    if min(c, k) < MIN_CHANNELS:
        return f"{c}->{k} channels (the rule wants >= {MIN_CHANNELS}, multiples of 16)"
    if out_t.shape[0] * out_t.shape[2] * out_t.shape[3] < MIN_PIXELS:
        return f"fewer than {MIN_PIXELS} output pixels (weights 4x for little time)"
    return None


def extra_bytes(graph: Graph, node: Node) -> int:
    """Bytes held beyond the direct call's: ``U`` (36 values per channel pair, 4x the
    weight) plus the workspace of one call (V + M of a chunk of tiles)."""
    x_t, out_t = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    c, k = x_t.shape[1], out_t.shape[1]
    n, oh, ow = out_t.shape[0], out_t.shape[2], out_t.shape[3]
    return 36 * 4 * c * k + 36 * 4 * (c + k) * chunk_tiles(c, k, tiles_of(n, oh, ow))


@dataclasses.dataclass(frozen=True)
class _Epilogue:
    bias: bool
    residual: bool
    activation: str | None
    attrs: tuple[tuple[str, Any], ...]

    def tag(self) -> str:
        parts = ["bias"] if self.bias else []
        parts += ["residual"] if self.residual else []
        if self.activation:
            parts.append(self.activation)
        if self.attrs:
            parts.append(hashlib.sha256(repr(self.attrs).encode()).hexdigest()[:6])
        return "_".join(parts) or "plain"

    def text(self) -> str:
        t = "conv(x)" + (" + bias" if self.bias else "") + (" + residual" if self.residual else "")
        return f"{self.activation}({t})" if self.activation else t


def render(ep: _Epilogue, threads: int) -> tuple[str, str]:
    """(kernel name, C source) of the transforms with epilogue ``ep``."""
    name = f"winograd_f43_{ep.tag()}"
    act = "acc_v"
    if ep.activation:
        expr = activation_expr(ep.activation, dict(ep.attrs), Acc())
        act = c_expr(expr, lambda x: "")
    src = (
        environment()
        .get_template("winograd.c.j2")
        .render(
            name=name,
            epilogue_text=ep.text(),
            VL=CHANNEL_MULTIPLE,
            threads=threads,
            bias="bias" if ep.bias else "",
            residual=ep.residual,
            activation=act,
        )
    )
    return name, src


def _epilogue(node: Node) -> _Epilogue:
    residual = bool(node.attrs.get("residual", False))
    name, attrs = activation_attrs(node)
    return _Epilogue(
        len(node.inputs) - int(residual) == 3, residual, name, tuple(sorted(attrs.items()))
    )


def prebuild(graph: Graph, options: Options, hardware: Hardware) -> threading.Thread:
    """Start compiling, in the background, the transforms every eligible convolution of
    ``graph`` will ask for (``winograd_kernel`` then finds them in the kernel cache); join
    the returned thread before building the plan. Failures are left to ``winograd_kernel``,
    which reports them."""
    reqs = {}
    for node in graph.nodes():
        if why_not(graph, node, hardware) is None:
            try:
                kname, src = render(_epilogue(node), max(1, hardware.cores))
            except NotFusable:
                continue
            reqs[kname] = c_build_request(
                kname, src, key_extra=(options.codegen_key(), hardware.key())
            )

    def work() -> None:
        if reqs:
            kernel_cache(Path(options.cache_dir)).build_many(list(reqs.values()), progress=False)

    t = threading.Thread(target=work, name="winograd-prebuild", daemon=True)
    t.start()
    return t


def _native_form(
    options: Options,
    transforms: tuple[Any, Any],
    mm: onednn.BatchedMatmul,
    direct: DirectWeight,
    bias: torch.Tensor | None,
    geometry: tuple[int, ...],
    pos: int,
    tiling: tuple[Callable[[int, int, int], int], Callable[[int, int, int], int]],
    residual: bool,
) -> Callable[..., Any]:
    """The destination form's ``native``: the whole chunk loop as one C call
    (``x86/templates/winograd_driver.c.j2``), for the native runner. Offering it materializes
    the direct weight (``direct.ptr()``: the C loop cannot recover it when a tile holds a
    NaN or an infinity)."""
    h, w, c, k, oh, ow, ph, pw = geometry
    tiles_of_, chunk_tiles_ = tiling

    def native(x: torch.Tensor, _w: Any, *rest: torch.Tensor) -> NativeCall | None:
        y = rest[-1]
        res = rest[-2] if residual else None
        cl = torch.channels_last
        if not (x.is_contiguous(memory_format=cl) and y.is_contiguous(memory_format=cl)):
            return None
        if res is not None and not res.is_contiguous(memory_format=cl):
            return None
        try:
            src = environment().get_template("winograd_driver.c.j2").render()
            built = build_c("winograd_driver", src, options.cache_dir)
        except CompileError:
            return None
        driver = load_shared(built.binary).mw_winograd
        tiles = tiles_of_(x.shape[0], oh, ow)
        chunk = chunk_tiles_(c, k, tiles)
        f_in, f_out = transforms
        h_full, h_last = mm.rows(chunk), mm.rows(last_chunk(tiles, chunk))
        onednn_bytes = -(-mm.scratch_bytes // 64) * 64  # oneDNN's scratchpad, then V, M
        params = (ctypes.c_long * 19)(
            native_address(f_in), native_address(f_out), native_address(mm.lib.run),
            h_full, h_last, bias.data_ptr() if bias is not None else 0,
            direct.ptr(), h, w, c, k, oh, ow, ph, pw, pos, tiles, chunk, onednn_bytes,
        )  # fmt: skip
        scratch = onednn_bytes + 4 * pos * chunk * (c + k) + chunk
        args = (ctypes.addressof(params), x, res if res is not None else 0, y, SCRATCH)
        # the runtime's one scratchpad (sized to the largest step's) holds the chunk's V
        # and M: no buffer of its own per Winograd layer
        return NativeCall(
            native_address(driver), args, True, scratch,
            keep=(params, driver, mm, direct, bias),
        )  # fmt: skip

    return native


def winograd_kernel(
    graph: Graph, node: Node, options: Options, hardware: Hardware, rule: bool = True
) -> Any | None:
    """The Winograd call for ``node`` (same arguments and result as the vendor conv:
    ``fn(x, w[, b][, residual])`` -> a new channels_last tensor, with ``into_residual``),
    or None where it does not apply, where ``rule`` is on and the measured rule says
    oneDNN's direct call is faster, or where the transforms failed to compile (warned;
    ``options.strict`` raises). ``rule=False``: a layer chosen by name (``algorithms=``)."""
    why = why_not(graph, node, hardware) if rule else why_not_applicable(graph, node)
    if why is not None:  # (the rule of hardware's kind: the default's own check)
        return None
    ep = _epilogue(node)
    try:
        kname, src = render(ep, max(1, hardware.cores))
    except NotFusable:
        return None  # an activation without loop semantics: oneDNN fuses it
    try:
        built = build_c(
            kname, src, options.cache_dir, key_extra=(options.codegen_key(), hardware.key())
        )
    except CompileError as e:
        if options.strict:
            raise
        warnings.warn(
            f"{node.name} runs as oneDNN's direct convolution: its Winograd transforms "
            f"failed to compile; source: {e.source_path}",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    lib = load_shared(built.binary)
    f_in = getattr(lib, f"{kname}_in")
    f_in.restype = None
    f_in.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 5 + [ctypes.c_long, ctypes.c_int]
    f_in.argtypes += [ctypes.c_void_p]  # per tile: a NaN or infinity in its input patch
    f_out = getattr(lib, f"{kname}_out")
    f_out.restype = None
    f_out.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_long, ctypes.c_int]
    f_out.argtypes += [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5  # flags, x, w, H, W, C, PH, PW

    weight = graph.params[node.inputs[1]]
    return transform_call(
        graph, node, options, (f_in, f_out), weight, transform_weight(weight), _G, ep,
        "winograd F(4x4,3x3)", (tiles_of, chunk_tiles),
    )  # fmt: skip


def transform_call(
    graph: Graph,
    node: Node,
    options: Options,
    transforms: tuple[Any, Any],
    weight: np.ndarray,
    u: torch.Tensor,
    g: np.ndarray,
    ep: _Epilogue,
    algorithm: str,
    tiling: tuple[Callable[[int, int, int], int], Callable[[int, int, int], int]],
) -> Any:
    """The convolution call of a Winograd algorithm (F(4x4) here, F(2x2) in winograd_f2):
    per chunk of tiles, the generated input transform (``transforms[0]``) into V, the
    product ``M = V @ U`` (U: ``u``, positions x C x K, ``weight``'s transform by ``g``),
    the generated output transform with the epilogue ``ep`` (``transforms[1]``). The
    product runs as oneDNN matmul primitives where they can be built (U packed into them
    and let go), else as ``torch.bmm``. ``tiling``: (tiles_of, chunk_tiles) of the
    algorithm. Offers the destination form and, with a residual, ``into_residual``."""
    f_in, f_out = transforms
    tiles_of_, chunk_tiles_ = tiling
    pos = int(u.shape[0])
    residual, has_bias = ep.residual, ep.bias
    x_t, out_t = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    c, h, w = x_t.shape[1], x_t.shape[2], x_t.shape[3]
    k, oh, ow = out_t.shape[1], out_t.shape[2], out_t.shape[3]
    (ph, pw), _, _, _ = _conv_geometry(node)
    tiles_full = tiles_of_(out_t.shape[0], oh, ow)
    chunk_full = chunk_tiles_(c, k, tiles_full)
    # the product as oneDNN matmul primitives (the full chunk's rows and the last chunk's),
    # U packed into them; else torch.bmm on U as it is
    mm = onednn.batched_matmul(u, [chunk_full, last_chunk(tiles_full, chunk_full)], options)
    if mm is not None:
        u = None
        u_source = mm.plain
    else:
        u_source = (lambda u: lambda: u)(u)
    # the direct weights too, for tiles whose input holds a NaN or an infinity
    direct = DirectWeight(weight, user_weight(graph, node.inputs[1]), u_source, g)
    del weight
    bias = (
        torch.from_numpy(np.ascontiguousarray(graph.params[node.inputs[2]], dtype=np.float32))
        if has_bias
        else None
    )
    bias_ptr = bias.data_ptr() if bias is not None else None
    cl = torch.channels_last

    def workspace(n: int) -> int:
        """Bytes of V + M for a call at batch ``n`` (the plan counts them as temporaries)."""
        return pos * 4 * (c + k) * chunk_tiles_(c, k, tiles_of_(n, oh, ow))

    def run(x: torch.Tensor, res: torch.Tensor | None, y: torch.Tensor) -> None:
        tiles = tiles_of_(x.shape[0], oh, ow)
        chunk = chunk_tiles_(c, k, tiles)
        # framework allocations, as the plan counts them (workspace_bytes: temporaries of
        # the call); the native form's workspace is the native program's, kept
        v_buf = torch.empty(pos * chunk * c, dtype=torch.float32)
        m_buf = torch.empty(pos * chunk * k, dtype=torch.float32)
        flags = torch.empty(chunk, dtype=torch.uint8)
        res_ptr = res.data_ptr() if res is not None else None
        xp, fp = x.data_ptr(), flags.data_ptr()
        for t0 in range(0, tiles, chunk):
            t = min(chunk, tiles - t0)
            f_in(xp, v_buf.data_ptr(), h, w, c, ph, pw, t0, t, fp)
            wp = direct.ptr() if bool(flags[:t].any()) else None  # read for flagged tiles only
            if mm is not None:
                mm.run(t, v_buf.data_ptr(), m_buf.data_ptr())
            else:
                torch.bmm(
                    v_buf[: pos * t * c].view(pos, t, c),
                    u,
                    out=m_buf[: pos * t * k].view(pos, t, k),
                )
            f_out(m_buf.data_ptr(), bias_ptr, res_ptr, y.data_ptr(), oh, ow, k, t0, t,
                  fp, xp, wp, h, w, c, ph, pw)  # fmt: skip

    def dense(t: torch.Tensor) -> torch.Tensor:
        return t if t.is_contiguous(memory_format=cl) else t.contiguous(memory_format=cl)

    def conv_winograd(x, _w, *rest):
        x = dense(x)
        y = torch.empty((x.shape[0], k, oh, ow), dtype=torch.float32, memory_format=cl)
        run(x, dense(rest[-1]) if residual else None, y)
        return y

    shape = (out_t.shape[0], k, oh, ow)

    def conv_winograd_out(x, _w, *rest):
        """Destination form: ``rest`` ends with the dense channels_last output to write (the
        plan's memory: no fresh output, and no page faults, per call)."""
        y = rest[-1]
        if tuple(y.shape) != shape or not y.is_contiguous(memory_format=cl):
            raise ValueError(
                f"{node.name}: Winograd writes a dense channels_last {shape} output, got "
                f"{tuple(y.shape)} strided {y.stride()}"
            )
        run(dense(x), dense(rest[-2]) if residual else None, y)

    conv_winograd_out.dense_only = True  # type: ignore[attr-defined]
    if mm is not None:
        conv_winograd_out.native = _native_form(  # type: ignore[attr-defined]
            options, transforms, mm, direct, bias, (h, w, c, k, oh, ow, ph, pw), pos, tiling,
            residual,
        )  # fmt: skip
    conv_winograd.out = conv_winograd_out  # type: ignore[attr-defined]
    conv_winograd.algorithm = algorithm  # type: ignore[attr-defined]
    conv_winograd.workspace_bytes = workspace  # type: ignore[attr-defined]
    # the tensors behind the raw pointers the C calls get: alive as long as the call (the
    # graph drops its arrays once the plan is built: pipeline.release_held_params)
    conv_winograd.keep = [u, direct, bias, mm, *(mm.tensors if mm is not None else ())]  # type: ignore[attr-defined]
    if mm is not None:
        conv_winograd.product = "oneDNN matmul"  # type: ignore[attr-defined]
        # not at interpreter exit: a daemon thread may still be inside a call then
        weakref.finalize(conv_winograd, mm.close).atexit = False
    if residual:

        def conv_winograd_into_residual(x, _w, *rest):
            # writes over the residual (each element is read, then written, by one thread)
            r = rest[-1]
            if not r.is_contiguous(memory_format=cl):
                return conv_winograd(x, _w, *rest)
            run(dense(x), r, r)
            return r

        native = getattr(conv_winograd_out, "native", None)
        if native is not None:
            # the in-place form's call: the destination form's with the residual as output
            conv_winograd_into_residual.native = (  # type: ignore[attr-defined]
                lambda x, _w, *rest: native(x, _w, *rest, rest[-1])
            )
        conv_winograd.into_residual = conv_winograd_into_residual  # type: ignore[attr-defined]
    return holds_constants(conv_winograd, node)
