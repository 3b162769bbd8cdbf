"""middleware: a depth-first-fusion compiler middleware for PyTorch CNNs.

import middleware
optimized = middleware.optimize(model, device="cpu")
"""

from .api import available_backends, optimize, trace
from .errors import (
    CompileError,
    DeviceError,
    InputMismatchError,
    InputTypeError,
    MiddlewareError,
    TraceError,
    TrainingModeError,
    UnsupportedError,
)
from .graph import Graph, Node, TensorType
from .options import Options

__version__ = "0.1.0"

__all__ = [
    "CompileError",
    "DeviceError",
    "Graph",
    "InputMismatchError",
    "InputTypeError",
    "MiddlewareError",
    "Node",
    "Options",
    "TensorType",
    "TraceError",
    "TrainingModeError",
    "UnsupportedError",
    "available_backends",
    "optimize",
    "trace",
]
