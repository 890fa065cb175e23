from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional

import pytest

from relax.config.schema import RelaxConfig, TrackingConfig
from relax.tracking import params as P
from relax.tracking.params import (
    PARAM_VALUE_MAX_LEN,
    STANDARD_TAG_KEYS,
    TRUNCATION_MARKER,
    flatten_config,
    standard_tags,
    truncate_value,
)


@dataclasses.dataclass(frozen=True)
class Inner:
    a: int = 1
    b: Optional[float] = None


class Color(enum.Enum):
    RED = "red"


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Inner = dataclasses.field(default_factory=Inner)
    name: str = "x"
    flag: bool = True
    lr: float = 1e-6
    sizes: tuple[int, ...] = (1, 2)
    items: tuple[Inner, ...] = (Inner(a=5),)
    extra: dict[str, Any] = dataclasses.field(default_factory=lambda: {"k": {"deep": 3}})
    empty: dict[str, Any] = dataclasses.field(default_factory=dict)
    color: Color = Color.RED


def test_flatten_nested_dataclass_and_dict() -> None:
    flat = flatten_config(Outer())
    assert flat == {
        "inner.a": "1",
        "inner.b": "None",
        "name": "x",
        "flag": "True",
        "lr": "1e-06",
        "sizes": "[1, 2]",
        "items.0.a": "5",
        "items.0.b": "None",
        "extra.k.deep": "3",
        "empty": "{}",
        "color": "red",
    }


def test_flatten_relax_config_has_dotted_keys() -> None:
    flat = flatten_config(RelaxConfig())
    assert flat["algorithm.eps_clip"] == "0.2"
    assert flat["algorithm.eps_clip_high"] == "None"
    assert flat["rollout.n_samples_per_prompt"] == "8"
    assert flat["seed"] == "1"
    assert flat["tracking.uri"] == "sqlite:///mlflow.db"
    assert all(isinstance(v, str) for v in flat.values())


def test_flatten_plain_dict() -> None:
    assert flatten_config({"a": {"b": None}, "c": 2}) == {"a.b": "None", "c": "2"}


def test_flatten_rejects_scalar() -> None:
    with pytest.raises(TypeError):
        flatten_config(3)


def test_long_values_truncated_with_marker() -> None:
    flat = flatten_config({"long": "x" * (PARAM_VALUE_MAX_LEN + 10), "ok": "y" * PARAM_VALUE_MAX_LEN})
    assert len(flat["long"]) == PARAM_VALUE_MAX_LEN
    assert flat["long"].endswith(TRUNCATION_MARKER)
    assert flat["ok"] == "y" * PARAM_VALUE_MAX_LEN
    assert truncate_value("abcdefghijklmnopqrstuvwxyz", 20) == "abcdef" + TRUNCATION_MARKER


def test_param_limit_matches_mlflow() -> None:
    from mlflow.utils import validation

    assert PARAM_VALUE_MAX_LEN == validation.MAX_PARAM_VAL_LENGTH


def test_standard_tags_arm_defaults_to_algorithm() -> None:
    cfg = RelaxConfig(seed=7)
    tags = standard_tags(cfg)
    assert tags == {
        P.TAG_ALGORITHM: "grpo",
        P.TAG_MODEL: "tiny",
        P.TAG_SEED: "7",
        P.TAG_DATA: "digits",
        P.TAG_CLUSTER: "local",
        P.TAG_ARM: "grpo",
    }
    assert tuple(tags) == STANDARD_TAG_KEYS


def test_standard_tags_explicit_arm() -> None:
    cfg = RelaxConfig(tracking=TrackingConfig(arm="kl=0.01"))
    assert standard_tags(cfg)[P.TAG_ARM] == "kl=0.01"
