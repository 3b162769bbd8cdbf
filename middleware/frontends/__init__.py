"""Frontends: lower a framework's network into the middleware's graph."""

from .torch_fx import trace

__all__ = ["trace"]
