"""x86 backend: OpenMP C (and ISPC when an ``ispc`` binary is on PATH), oneDNN via PyTorch."""
