"""The CPU backend of the pipeline: x86 kernels for io groups, vendor calls for the rest."""

from .backend import CpuBackend, IspcCpuBackend

__all__ = ["CpuBackend", "IspcCpuBackend"]
