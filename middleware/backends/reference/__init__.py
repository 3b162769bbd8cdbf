"""The reference backend: a schedule interpreted in Python/numpy (the golden model of the
code-generating backends, used by tests). See ``backend.py``."""

from .backend import (
    ReferenceBackend,
    ReferenceKernel,
    ScheduleError,
    run_schedule,
)
from .functions import FUNCTIONS, MissingFunction

__all__ = [
    "FUNCTIONS",
    "MissingFunction",
    "ReferenceBackend",
    "ReferenceKernel",
    "ScheduleError",
    "run_schedule",
]
