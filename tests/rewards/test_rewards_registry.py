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

        def one_arg(response):
            return 1.0

        def three_args(response, label, extra):
            return 1.0

        def star(*args, **kwargs):
            return 1.0

        def only_prompt_kw(response, label, *, prompt):
            return 1.0

        lam = lambda response, label: 1.0  # noqa: E731
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


def test_a_function_that_cannot_take_response_and_label_fails_at_start(user_module):
    """Otherwise every call fails, every group is left out, and the run trains nothing."""
    with pytest.raises(RewardSpecError, match=r"cannot be called as fn\(response, label\): no parameter takes the "
                                              "label"):
        get_reward_fn(f"{user_module}:one_arg")
    # a third parameter asks for the data record's field of its name: refused when a record lacks it
    # (tests/rewards/test_reward_inputs.py), here the synthetic task's, which has no fields
    from relax.data.datasets import PromptItem
    from relax.rewards.registry import check_record_fields

    with pytest.raises(RewardSpecError, match="its parameter 'extra' asks for the data record's field 'extra'"):
        check_record_fields("x", get_reward_fn(f"{user_module}:three_args"), [PromptItem([1], "7", "t", 0)], "data")
    # the controls: what the run can call
    for name in ("exact", "with_prompt", "star", "only_prompt_kw", "lam"):
        assert callable(get_reward_fn(f"{user_module}:{name}")), name


def test_preflight_refuses_a_reward_a_worker_cannot_receive(user_module):
    """A lambda with a time limit (worker processes): named before Ray, with the fix; without a limit (called in
    the driver) it is fine."""
    from relax.config import load_config
    from relax.runner.preflight import preflight

    pre = preflight(load_config([f"data.reward={user_module}:lam"]), only=("reward",))
    assert "cannot be sent to a worker process" in pre.problems["reward"], pre.render()
    assert "data.reward_timeout_s=null" in pre.problems["reward"]
    ok = preflight(load_config([f"data.reward={user_module}:lam", "data.reward_timeout_s=null"]), only=("reward",))
    assert ok.ok, ok.render()
    ok = preflight(load_config([f"data.reward={user_module}:exact"]), only=("reward",))
    assert ok.ok, ok.render()


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


def test_the_cli_turns_a_reward_its_workers_cannot_load_into_a_message(monkeypatch, capfd, tmp_path):
    """A reward function whose `prepare` raises in its worker processes (`RewardSpecError`, after the start: the
    workers load it at the first scoring) ends as `relax-train: error:` with the worker's account, exit 2, not
    Hydra's "Error executing job" and the runner's own traceback. (That the pool raises it: test_reward_timeout.)"""
    from relax_train_inprocess import relax_train

    from relax.runner import train

    def fails(*args, **kwargs):
        raise RewardSpecError("a reward worker process cannot load the reward function:\nRuntimeError: prepare failed")

    monkeypatch.setattr(train, "run", fails)
    code, out, err = relax_train(["train.num_rollout=3", f"hydra.run.dir={tmp_path / 'out'}"], capfd)
    assert code == 2, out + err
    assert "relax-train: error: a reward worker process cannot load the reward function:" in err
    assert "RuntimeError: prepare failed" in err and "Error executing job" not in err
