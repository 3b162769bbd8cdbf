"""x86 backend: OpenMP C (and ISPC when an ``ispc`` binary is on PATH), oneDNN via PyTorch."""

from .backend import GeneratedKernel, IspcBackend, X86Backend

__all__ = ["GeneratedKernel", "IspcBackend", "X86Backend"]
