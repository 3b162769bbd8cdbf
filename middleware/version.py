"""The package version (core: kernel cache keys and the group index hash it)."""

__version__ = "0.1.0"
