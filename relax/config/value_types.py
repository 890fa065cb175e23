"""Overrides whose value is not of its key's type (`train.lr=abc`, `train.num_rollout=1.5`, `data.tools=mymod:T`).

Hydra stops at the first one, in OmegaConf's words ("Error merging override train.lr=abc / Value 'abc' of type
'str' could not be converted to Float"). `relax.config.unknown_keys.compose_known` leaves each such override out
instead (the key keeps its default, only so that the rest of the command line is composed and checked), and this
module names it as a violation: the key, the value given and the type the schema declares, read off the composed
config's node for that key (so an algorithm's own fields and the sweep launcher's options are named as declared).
"""

from __future__ import annotations

import dataclasses
import enum
import re
import typing
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from relax.algorithms.base import Violation

_ESCAPED = re.compile(r"\\(.)")  # a sweep job's override carries Hydra's escapes (mymod\:TOOLS)
_MERGING = "Error merging override "  # Hydra's words for an override whose value the config refused


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _covers(key: str, full_key: str) -> bool:
    """Whether `full_key` (OmegaConf's, `train.eval_pass_k[0]`) is `key` or lies inside it."""
    return full_key == key or full_key.startswith((key + ".", key + "["))


def mistyped_override(exc: BaseException, overrides: Sequence[str]) -> int | None:
    """The index of the override that Hydra refused because its value is not of its key's type (OmegaConf's
    ValidationError under Hydra's "Error merging override"), else None."""
    from omegaconf.errors import ValidationError

    cause = exc.__cause__ or exc.__context__
    full_key = getattr(cause, "full_key", None)
    if not isinstance(cause, ValidationError) or not full_key:
        return None
    # Hydra names the override it was merging (not a group choice such as algorithm=m2po, whose own keys merge
    # first): "Error merging override train.lr=abc"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    for i, o in enumerate(overrides):
        if first == f"{_MERGING}{o}" and _covers(_override_key(o), full_key):
            return i
    return None


def _plural(t: Any) -> str:
    return {int: "ints", float: "floats", str: "strings", bool: "bools (true or false)"}.get(t, "items")


def type_text(ref_type: Any, optional: bool = False) -> str:
    """What a value of the declared type `ref_type` is, in a user's words (`a float`, `a list of ints, in
    brackets`), with `or null` where the key may be null."""
    origin, args = typing.get_origin(ref_type), typing.get_args(ref_type)
    if origin is typing.Union:  # Optional[X] as a declared type
        inner = [a for a in args if a is not type(None)]
        return type_text(inner[0] if len(inner) == 1 else Any, optional=optional or type(None) in args)
    if ref_type is bool:
        text = "a bool (true or false)"
    elif ref_type is int:
        text = "an int"
    elif ref_type is float:
        text = "a float (a number: 0.5, 1e-5)"
    elif ref_type is str:
        text = "a string"
    elif origin in (list, tuple) or ref_type in (list, tuple):
        text = f"a list of {_plural(args[0]) if args else 'items'}, in brackets ([a,b])"
    elif origin is dict or ref_type is dict:
        text = "a mapping, in braces ({key: value})"
    elif isinstance(ref_type, type) and issubclass(ref_type, enum.Enum):
        text = f"one of {', '.join(m.name for m in ref_type)}"
    elif dataclasses.is_dataclass(ref_type):
        text = "a section of keys (set them one by one: <section>.<key>=...)"
    else:
        text = f"a {getattr(ref_type, '__name__', ref_type)}"
    return text + (" or null" if optional else "")


def _value_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the bool {str(value).lower()}"
    kind = {str: "the string", int: "the int", float: "the float"}.get(type(value))
    if kind:
        return f"{kind} {value!r}"
    if isinstance(value, (list, tuple, ListConfig)):
        return "a list"
    if isinstance(value, (dict, DictConfig)):
        return "a mapping"
    return f"{type(value).__name__} {value!r}"


def list_form(key: str, value: str) -> str:
    """The message for a list option given a bare value (`data.tools=mymod:TOOLS`): the accepted form, the value in
    brackets."""
    return (f"{key}={value}: {key} is a list, written in brackets: {key}=[{value}] (several items: "
            f"{key}=[a,b]; in a shell, quote it: '{key}=[{value}]')")


def _declared(dc: DictConfig, key: str) -> tuple[Any, bool] | None:
    """(declared type, may be null) of `key` in the composed `dc` (a key of a free mapping: its element type), None
    where the config has no node for it."""
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(dc, parent_key, default=None) if parent_key else dc
    if not isinstance(parent, DictConfig):
        return None
    node = parent._get_node(leaf) if leaf in parent else None
    if node is not None:
        return node._metadata.ref_type, bool(node._metadata.optional)
    element = parent._metadata.element_type
    return (element, False) if element is not Any else None


def mistyped_violation(dc: DictConfig, override: str, exc: BaseException) -> Violation:
    """The violation of `override`, refused by Hydra with `exc` (see `mistyped_override`), named against `dc`, the
    config composed without it: the key, the value given, the type the key takes."""
    cause = exc.__cause__ or exc.__context__
    return type_violation(dc, _override_key(override), _ESCAPED.sub(r"\1", override.split("=", 1)[1]),
                          cause if cause is not None else exc)


def field_key(full_key: str) -> str:
    """The key of the field that OmegaConf's `full_key` lies in (`train.eval_pass_k[1]` -> train.eval_pass_k)."""
    return re.sub(r"\[.*$", "", full_key)


def type_violation(dc: DictConfig, key: str, text: str, cause: BaseException) -> Violation:
    """The violation of `key`=`text` (as written), whose value OmegaConf refused with `cause` (a ValidationError:
    its `full_key`, `value`), named against `dc`, a config that declares `key`: the type the key takes."""
    full_key = str(getattr(cause, "full_key", "") or key)
    value = getattr(cause, "value", None)
    declared = _declared(dc, key)
    if declared is None:  # nothing declares it here: OmegaConf's own words for what it expected
        reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        return Violation((key,), f"{key}={text}: {reason}")
    ref_type, optional = declared
    is_list = typing.get_origin(ref_type) in (list, tuple) or any(
        typing.get_origin(a) in (list, tuple) for a in typing.get_args(ref_type))
    if is_list and full_key == key and value is not None and not isinstance(value, (list, tuple, ListConfig)):
        return Violation((key,), list_form(key, text))
    if full_key != key:  # an item of a list or mapping: which one, and what it holds
        got = f"not {text}: its item {full_key[len(key):].lstrip('.')} is {_value_text(value)}"
    else:
        got = f"not {_value_text(value)}"
    return Violation((key,), f"{key}={text}: {key} takes {type_text(ref_type, optional)}, {got}")


def about(violation: Violation, keys: Sequence[str]) -> bool:
    """Whether `violation` involves one of `keys` (or a key inside one): a rule that would judge a default put in
    place of a refused value."""
    return any(_covers(k, f) for f in violation.fields for k in keys)
