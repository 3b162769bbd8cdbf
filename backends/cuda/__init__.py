"""CUDA backend: depth-first kernels in CUDA C, cuDNN/cuBLAS via PyTorch."""

from __future__ import annotations

from ...errors import DeviceError


def check_cuda_runtime() -> None:
    """Raise a clear error when the CUDA kernel loader has nothing to load kernels with."""
    import importlib.util

    if importlib.util.find_spec("pycuda") is None and importlib.util.find_spec("cuda") is None:
        raise DeviceError(
            "device='cuda' needs a CUDA kernel loader: install pycuda (pip install "
            "'middleware[cuda]') or cuda-python (pip install cuda-python)"
        )
