"""Checkpoint writes that fail at the OS level (disk full, quota, read-only or unwritable directory, file size limit,
I/O error), reported as a plain `OSError` with its errno and path whichever library did the write.

The libraries that write checkpoints do not raise OSError themselves: safetensors raises `SafetensorError("... I/O
error: No space left on device (os error 28)")` and `torch.save` to a path raises `RuntimeError("[enforce fail at
inline_container.cc] ... unexpected pos ...")`, which names neither the errno nor the file. `torch_save` writes through
a Python file, so that the OSError is the RuntimeError's context, and `os_write_errors` turns what a block of writes
raised back into the OSError. A plain OSError pickles with its errno, text and path, so the driver gets it from a Ray
actor as the `cause` of Ray's `RayTaskError`; `os_write_error` finds it there (`relax.runner.session` decides what a
failed checkpoint does: `train.save_failures`).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

# Rust's std::io::Error as safetensors formats it: "No space left on device (os error 28)"
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def os_write_error(exc: BaseException) -> OSError | None:
    """The OS-level failure behind `exc`, or None if it has none: `exc` itself when it is an OSError with an errno
    (not a network error), else one found in Ray's `cause`, in the exception's `__cause__` / `__context__`, or in the
    text of a Rust I/O error (safetensors), rebuilt as an OSError with that errno."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if (isinstance(current, OSError) and current.errno is not None
                and not isinstance(current, (ConnectionError, TimeoutError))):
            return current
        match = _RUST_OS_ERROR.search(str(current)) if not isinstance(current, OSError) else None
        if match:
            code = int(match.group(1))
            return OSError(code, os.strerror(code))
        cause = getattr(current, "cause", None)  # ray.exceptions.RayTaskError: the exception the role raised
        current = cause if isinstance(cause, BaseException) else (current.__cause__ or current.__context__)
    return None


@contextlib.contextmanager
def os_write_errors(path: str | os.PathLike[str]) -> Iterator[None]:
    """Writes into `path` (a file or a directory): an exception they raise with an OS-level failure behind it (see
    `os_write_error`) is raised as that plain OSError, naming the file it failed on or else `path`; other exceptions
    are raised as they are."""
    try:
        yield
    except Exception as exc:
        error = os_write_error(exc)
        if error is None or (error is exc and error.filename is not None):
            raise
        raise OSError(error.errno, error.strerror, error.filename or os.fspath(path)) from None


def torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """`torch.save(obj, path)` through a Python file, so that a failed write raises an OSError naming the file."""
    import torch

    with os_write_errors(path), open(path, "wb") as f:
        torch.save(obj, f)
