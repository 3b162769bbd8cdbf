"""Vendor calls and algorithms for CPU and CUDA: what runs the compute- and param-bound
nodes (convolutions, matrix products) instead of generated depth-first kernels.

``calls.py``: the framework's fast calls (oneDNN with prepacked weights and fused
post-ops on CPU, cuDNN/cuBLAS on CUDA); ``winograd.py``: Winograd F(4x4,3x3) on x86
(generated transforms around oneDNN's batched matmul); ``winograd_f2.py``: Winograd
F(2x2,3x3), its transforms generated from its matrices; ``im2col.py``: im2row + GEMM;
``algorithms.py``: each op's algorithms as data (vendor, winograd_f4x4, im2col_gemm,
winograd_f2x2, user ones) and the per-layer choice (:func:`choose`: a name, "default",
"autotune" or "auto"); ``tuning.py``: autotuning and its stored decisions;
``onednn.py``: CPU convolutions as oneDNN primitives created once (PyTorch's own oneDNN
through its C API), with ``primitives_note`` for the report.
"""

from .algorithms import (
    ALGORITHMS,
    Algorithm,
    Choice,
    Layer,
    algorithm_names,
    check_selection,
    choose,
    layer_indices,
    register_algorithm,
    unregister_algorithm,
    vendor_call,
)
from .calls import ONEDNN_DTYPES, vendor_kernel
from .onednn import primitives_note

__all__ = [
    "ALGORITHMS",
    "ONEDNN_DTYPES",
    "Algorithm",
    "Choice",
    "Layer",
    "algorithm_names",
    "check_selection",
    "choose",
    "layer_indices",
    "primitives_note",
    "register_algorithm",
    "unregister_algorithm",
    "vendor_call",
    "vendor_kernel",
]
