"""Errors a user can cause. The CLI turns each into one line and an exit code, never a traceback."""

from __future__ import annotations

#: exit codes shared by every command
EXIT_OK = 0
EXIT_FAILED_RUN = 1  # the run itself failed (crash inside a training step)
EXIT_USAGE = 2  # bad input: unknown preset, bad knob value, missing GPU, existing output file
EXIT_OOM = 3  # out of memory (GPU or host); the report records it
EXIT_NAN = 4  # the loss was NaN or inf; the report records it


class VlmdoctorError(Exception):
    """A problem the user can fix; carries the exit code the CLI should use."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class UsageError(VlmdoctorError):
    """Unknown preset, knob value, missing device or package: exit 2."""


#: what torch's CPU allocator says when the host has no memory left (a RuntimeError, not a MemoryError)
HOST_OOM_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """Out of memory, on the GPU (torch.OutOfMemoryError) or the host (MemoryError, torch's CPU allocator)."""
    if isinstance(exc, MemoryError):
        return True
    if any(cls.__name__ == "OutOfMemoryError" for cls in type(exc).__mro__):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in HOST_OOM_MESSAGES)


def first_line(e: BaseException) -> str:
    """An error's message in one line (its first, at most 500 characters), or its class name when it says nothing."""
    text = str(e).strip()
    return text.splitlines()[0][:500] if text else type(e).__name__
