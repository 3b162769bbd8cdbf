"""Vendor calls and algorithms for CPU and CUDA: what runs the compute- and param-bound
nodes (convolutions, matrix products) instead of generated depth-first kernels.

``calls.py``: the framework's fast calls (oneDNN with prepacked weights and fused
post-ops on CPU, cuDNN/cuBLAS on CUDA); ``winograd.py``: Winograd F(4x4,3x3) on x86
(generated transforms around the framework's GEMM); ``algorithms.py``: the table of each
op's algorithms, tried in order (:func:`vendor_call`).
"""

from .algorithms import ALGORITHMS, Algorithm, vendor_call
from .calls import ONEDNN_DTYPES, vendor_kernel

__all__ = ["ALGORITHMS", "ONEDNN_DTYPES", "Algorithm", "vendor_call", "vendor_kernel"]
