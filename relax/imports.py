"""Components named by import path: `package.module:attr`, as `data.reward`, `data.env`, `data.tools` and
`data.agent` accept them. One reader of the format (`import_attr`) and one lookup of "a built-in name or an import
path" (`resolve_component`); each option says what it wants the attribute to be."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
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


def resolve_component(builtins: Mapping[str, Any], option: str, spec: str, *, error: Callable[[str], Exception],
                      unknown: str, unloadable: str = "{option}={spec!r}: {exc}", what: str = "",
                      keep_cause: bool = False) -> Any:
    """What `spec`, the value of option `option`, names: the built-in `builtins[spec]`, else the attribute of the
    import path 'package.module:attr' (`import_attr`). Each caller checks the kind of what it gets (a callable, a
    `Tool`).

    Raises `error(message)`: with `unknown` for a `spec` that is neither a built-in nor has a colon, with `unloadable`
    for one that does not load. Both are `str.format` templates over `option`, `spec`, `builtins` (the built-in
    names, sorted) and `what` (what the option wants); `unloadable` also over `exc` (the `ImportPathError`).
    `keep_cause`: the error raised while importing the user's module becomes the new error's cause (its traceback
    printed with it); otherwise the chain is cut (`from None`)."""
    if spec in builtins:
        return builtins[spec]
    words = {"option": option, "spec": spec, "builtins": sorted(builtins), "what": what}
    if ":" not in spec:
        raise error(unknown.format(**words))
    try:
        return import_attr(spec)
    except ImportPathError as exc:
        raise error(unloadable.format(**words, exc=exc)) from (exc.__cause__ if keep_cause else None)


def call_mismatch(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, str] | None:
    """Why `fn` cannot be called with `args` and `kwargs`, placeholders of what its caller passes: (its signature as
    text, `inspect.Signature.bind`'s reason), or None when it can, or when Python cannot read its signature (a builtin
    or an extension: its first call will tell). The pre-start checks of the options that name a function
    (`data.tool_parser`, `data.openai_agent`) refuse with it, naming the option, the signature and the call, instead
    of a TypeError at each call once the run started."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        return str(signature), str(exc)
    return None
