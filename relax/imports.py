"""Components named by import path: `package.module:attr`, as `data.reward`, `data.env`, `data.tools` and
`data.agent` accept them. One reader of the format; each option says what it wants the attribute to be."""

from __future__ import annotations

import importlib
from typing import Any


class ImportPathError(ValueError):
    """`spec` is not a `package.module:attr` that loads; the message says which part failed."""


def import_attr(spec: str) -> Any:
    """The attribute named by `spec` (`package.module:attr`; dots in `attr` walk nested attributes). Raises
    `ImportPathError`: without a colon, when the module does not import (with the error raised while importing it),
    or when it has no such attribute."""
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise ImportPathError(f"{spec!r} is not an import path 'package.module:attr'")
    try:
        value: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or an error raised while importing the user's module
        raise ImportPathError(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        if not part or not hasattr(value, part):
            raise ImportPathError(f"module {module_name!r} has no attribute {attr!r}")
        value = getattr(value, part)
    return value
