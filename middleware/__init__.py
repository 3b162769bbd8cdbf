"""middleware: a depth-first-fusion compiler middleware for PyTorch CNNs.

import middleware
optimized = middleware.optimize(model, device="cpu")
compiled = torch.compile(model, backend="middleware", options={"device": "cpu"})
"""

from .api import (
    Layer,
    available_backends,
    optimize,
    register_algorithm,
    trace,
    unregister_algorithm,
)
from .compile_backend import Backend, compile_report
from .compile_backend import register_when_dynamo_loads as _register_backend
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
    "Backend",
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
    "compile_report",
    "optimize",
    "profile",
    "register_algorithm",
    "trace",
    "unregister_algorithm",
]

# torch.compile(backend="middleware"): registered once TorchDynamo's registry loads
_register_backend()
