"""The middleware's error classes: one base, one subclass per kind of failure."""

from __future__ import annotations


class MiddlewareError(Exception):
    """Base class of every error the middleware raises on purpose."""


class UnsupportedError(MiddlewareError):
    """A construct the middleware cannot lower (it runs as the original framework code)."""


class TraceError(UnsupportedError):
    """The framework's tracer could not capture the model (e.g. data-dependent control flow)."""


class DeviceError(MiddlewareError, ValueError):
    """An unknown device, or a device this machine does not have."""


class TrainingModeError(MiddlewareError, ValueError):
    """The model is in training mode; only inference is supported."""


class OptionsError(MiddlewareError, ValueError):
    """An ``optimize()`` setting has a value the middleware does not know."""


class InputMismatchError(MiddlewareError, ValueError):
    """A call's inputs do not match the compiled signature (count, rank, channels)."""


class InputTypeError(MiddlewareError, TypeError):
    """A call's inputs have the wrong type, dtype or device for the compiled signature."""


class InternalError(MiddlewareError, RuntimeError):
    """The compiler failed on a model and input it should handle: a middleware bug.

    Raised only with ``strict=True``; otherwise the input signature concerned runs as the
    original model and ``report()`` carries the failure.
    """


class CompileError(MiddlewareError):
    """A generated kernel failed to compile.

    Carries the compiler's stderr, the command that reproduces the failure and the path of
    the generated source, so that the failure can be replayed by hand.
    """

    def __init__(
        self,
        message: str,
        *,
        stderr: str = "",
        command: list[str] | None = None,
        source_path: str | None = None,
    ) -> None:
        self.stderr = stderr
        self.command = list(command or [])
        self.source_path = source_path
        detail = [message]
        if source_path:
            detail.append(f"source: {source_path}")
        if self.command:
            detail.append("reproduce with: " + " ".join(self.command))
        if stderr:
            detail.append("compiler output:\n" + stderr.strip())
        super().__init__("\n".join(detail))

    def reason(self) -> str:
        """The one-line reason a report gives for the nodes of a kernel that failed to
        compile: the first three lines of the compiler's output (or of the message)."""
        lines = (self.stderr or str(self)).strip().splitlines()
        return "compile failed: " + " | ".join(lines[:3])
