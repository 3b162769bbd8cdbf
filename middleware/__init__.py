"""middleware: a depth-first-fusion compiler middleware for PyTorch CNNs.

import middleware
optimized = middleware.optimize(model, device="cpu")
"""

import os as _os

# Installed, setuptools maps the stage folders (frontends/, passes/, backends/, runtime/)
# inside this package. In a source checkout they sit beside it: let imports find them
# there too, so that ``python -m middleware`` and the tests run from the repository root.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "frontends", "__init__.py")) and _root not in __path__:
    __path__.append(_root)

from .api import available_backends, optimize, trace
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

__version__ = "0.1.0"

__all__ = [
    "CompileError",
    "DeviceError",
    "Graph",
    "InputMismatchError",
    "InputTypeError",
    "InternalError",
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
    "trace",
]
