"""User code that breaks its contract (an environment's step, a tool parser of one's own) is the user's mistake:
a UserCodeError naming the code and what was expected, which relax-train prints in one line (exit 2), also when a
Ray role raised it (the watchdog makes it a RunError instead of Ray's traceback of the role). And an environment, an
agent loop or an OpenAI agent program with the default rollout.max_turns=1 is warned of at start."""

from __future__ import annotations

import pytest

from relax.agents.parsers import get_parser
from relax.agents.protocol import UserCodeError, as_step
from relax.config import load_config
from relax.rewards.calls import RewardSpecError
from relax.runner.errors import RunError
from relax.runner.preflight import preflight


def bad_parser(text: str) -> list:
    return [{"name": "calculator", "arguments": {}}]


@pytest.mark.parametrize("value, says", [
    (("again", 0.0), "BadEnv.step returned ('again', 0.0); expected (observation, reward, done)"),
    (("again", "high", False), "BadEnv.step returned the reward 'high'; expected a number"),
    ((3, 0.0, False), "BadEnv.step: the observation must be a string"),
])
def test_an_environments_wrong_step_is_a_user_code_error(value, says):
    with pytest.raises(UserCodeError) as caught:
        as_step(value, "BadEnv")
    assert str(caught.value).startswith(says)
    # what relax-train prints in one line (a RewardSpecError), and still a TypeError to code that catches those
    assert isinstance(caught.value, RewardSpecError) and isinstance(caught.value, TypeError)


def test_a_parser_of_ones_own_returning_another_type_is_a_user_code_error():
    parser = get_parser(f"{__name__}:bad_parser")
    with pytest.raises(UserCodeError, match=r"data.tool_parser='.*:bad_parser' returned list: expected a "
                                            r"relax.agents.parsers.ParsedMessage"):
        parser("<tool_call>{}</tool_call>")


def test_on_ray_the_role_s_user_code_error_comes_back_as_one_line(monkeypatch):
    import ray

    from relax.runner.watchdog import Watchdog

    cause = UserCodeError("BadEnv.step returned ('again', 0.0); expected (observation, reward, done)")
    # what ray.get raises in the driver for an error a role raised: Ray's error, an instance of the cause's class
    raised = ray.exceptions.RayTaskError("Rollout.generate", "Traceback (most recent call last):\n  ...\n" * 40,
                                         cause).as_instanceof_cause()

    def get(ref, timeout=None):
        raise raised

    monkeypatch.setattr(ray, "get", get)
    with pytest.raises(RunError) as caught:
        Watchdog(None, None).get([(object(), "rollout[0]")])
    assert str(caught.value) == f"rollout[0]: {cause}"

    other = ray.exceptions.RayTaskError("Rollout.generate", "Traceback ...", KeyError("a bug")).as_instanceof_cause()

    def get_bug(ref, timeout=None):
        raise other

    monkeypatch.setattr(ray, "get", get_bug)
    with pytest.raises(KeyError):  # a bug stays a bug, with its traceback
        Watchdog(None, None).get([(object(), "rollout[0]")])


@pytest.mark.parametrize("turns, warned", [(1, True), (3, False)])
def test_an_environment_with_one_turn_is_warned_of_at_start(capsys, turns, warned):
    cfg = load_config(["data=guess_number", f"rollout.max_turns={turns}"])
    pre = preflight(cfg, only=("model", "tokenizer", "agent"))
    assert pre.ok, pre.problems
    err = capsys.readouterr().err
    line = ("relax-train: warning: data.env=guess_number with rollout.max_turns=1: each episode is one model turn")
    assert (line in err) is warned
    assert ("warning: data.env with rollout.max_turns=1" in pre.render()) is warned


@pytest.mark.parametrize("turns, warned", [(1, True), (2, False)])
def test_an_openai_agent_with_one_call_is_warned_of_at_start(capsys, turns, warned):
    """data.openai_agent with rollout.max_turns=1, as data.env and data.agent: an agent of one call works (so it is not
    refused), one that loops is answered 400 on its second call, so the start says so; plan_then_answer makes two."""
    cfg = load_config(["rollout=sglang", "rollout.sglang.server=embedded", f"rollout.max_turns={turns}",
                       "data.openai_agent=relax.agents.openai_examples:plan_then_answer"])
    pre = preflight(cfg, only=("model", "tokenizer", "openai_agent"))
    assert pre.ok, pre.problems
    err = capsys.readouterr().err
    line = ("relax-train: warning: data.openai_agent=relax.agents.openai_examples:plan_then_answer with "
            "rollout.max_turns=1: a session allows one model call: an agent's second call is answered 400")
    assert (line in err) is warned, err
    assert ("warning: data.openai_agent with rollout.max_turns=1 (one model call per session)" in pre.render()) \
        is warned


def test_the_pre_start_check_says_which_parser_auto_picked_and_why():
    cfg = load_config(["data=calculator"])
    pre = preflight(cfg, only=("model", "tokenizer", "agent"))
    assert pre.ok, pre.problems
    assert "data.tool_parser=auto -> hermes (the chat template has no place for tools" in pre.render()
