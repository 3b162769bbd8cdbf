"""middleware: a depth-first-fusion compiler middleware for PyTorch CNNs.

import middleware
optimized = middleware.optimize(model, device="cpu")
"""

from .api import (
    Layer,
    available_backends,
    optimize,
    register_algorithm,
    trace,
    unregister_algorithm,
)
from .errors import (
    CompileError,
    DeviceError,
    InputMismatchError,
    InputTypeError,
    InternalError,
    MiddlewareError,
    OptionsError,
    TraceError,
    TrainingModeError,
    UnsupportedError,
)
from .graph import Graph, Node, TensorType
from .options import Options
from .profiler import ProfileResult, profile
from .version import __version__ as __version__

__all__ = [
    "CompileError",
    "DeviceError",
    "Graph",
    "InputMismatchError",
    "InputTypeError",
    "InternalError",
    "Layer",
    "MiddlewareError",
    "Node",
    "Options",
    "OptionsError",
    "ProfileResult",
    "TensorType",
    "TraceError",
    "TrainingModeError",
    "UnsupportedError",
    "available_backends",
    "optimize",
    "profile",
    "register_algorithm",
    "trace",
    "unregister_algorithm",
]
