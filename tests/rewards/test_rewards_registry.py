"""get_reward_fn specs and score_responses' error accounting."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest

from relax.rewards import (
    RewardSpecError,
    arithmetic_reward,
    digits_reward,
    get_reward_fn,
    math_reward,
    score_responses,
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(textwrap.dedent("""
        def exact(response, label):
            return float(response.strip() == label)

        def with_prompt(response, label, prompt=None):
            return 1.0 if prompt and label in prompt else 0.0

        def boom(response, label):
            raise RuntimeError("broken reward")

        def weird(response, label):
            return {"1": 1.0, "nan": float("nan"), "str": "high", "none": None, "inf": float("inf")}[label]

        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_mod"
    sys.modules.pop("my_rewards_mod", None)


def test_builtin_specs():
    assert get_reward_fn("digits") is digits_reward
    assert get_reward_fn("math") is math_reward
    assert get_reward_fn("arithmetic") is arithmetic_reward


def test_user_reward_by_import_path(user_module):
    fn = get_reward_fn(f"{user_module}:exact")
    assert fn("7", "7") == 1.0 and fn("8", "7") == 0.0
    assert get_reward_fn("relax.rewards.digits:digits_reward") is digits_reward


@pytest.mark.parametrize("spec, match", [
    ("chess", "unknown reward"),
    ("", "expected one of"),
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
    ("relax.rewards.digits:nope", "has no attribute 'nope'"),
])
def test_bad_specs_fail_at_start(spec, match):
    with pytest.raises(RewardSpecError, match=match):
        get_reward_fn(spec)
    assert issubclass(RewardSpecError, ValueError)


def test_not_callable(user_module):
    with pytest.raises(RewardSpecError, match="not callable"):
        get_reward_fn(f"{user_module}:NOT_CALLABLE")


def test_score_responses_counts_errors(user_module):
    scores = score_responses(get_reward_fn(f"{user_module}:boom"), ["a", "b"], ["1", "2"])
    assert scores.rewards == [0.0, 0.0] and scores.failed == [True, True] and scores.errors == 2
    assert scores.first_error.startswith("Traceback") and "boom" in scores.first_error
    labels = ["1", "nan", "str", "none", "inf"]
    scores = score_responses(get_reward_fn(f"{user_module}:weird"), ["x"] * 5, labels)
    rewards, errors = scores.rewards, scores.errors
    assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0] and errors == 4 and scores.failed == [False] + [True] * 4
    assert all(math.isfinite(r) for r in rewards)
    scores = score_responses(digits_reward, ["7", "3"], ["7", "7"])
    rewards, errors = scores.rewards, scores.errors
    assert rewards == [1.0, 0.5] and errors == 0
    scores = score_responses(lambda r, label: True, ["a"], ["b"])
    rewards, errors = scores.rewards, scores.errors
    assert rewards == [1.0] and errors == 0 and isinstance(rewards[0], float)
    with pytest.raises(ValueError, match="labels"):
        score_responses(digits_reward, ["7"], [])


def test_prompt_kwarg_passed_when_accepted(user_module):
    fn = get_reward_fn(f"{user_module}:with_prompt")
    scores = score_responses(fn, ["x", "x"], ["7", "7"], prompts=["repeat 7", "repeat 3"])
    rewards, errors = scores.rewards, scores.errors
    assert rewards == [1.0, 0.0] and errors == 0
    # Functions without a prompt parameter are called with (response, label) only.
    scores = score_responses(digits_reward, ["7"], ["7"], prompts=["repeat 7"])
    rewards, errors = scores.rewards, scores.errors
    assert rewards == [1.0] and errors == 0
