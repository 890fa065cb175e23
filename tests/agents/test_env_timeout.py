"""Episodes that fail: an environment's step or an agent loop's turn past `data.env_timeout_s` ends its episode
(named, with the option), and failed episodes are reported as failed reward calls are: a warning naming the batch's
first failure and the option that ran it, and a stop message that names that option, not data.reward.

The hanging environment waits on an Event the test holds (released at the end), never on a sleep; each test bounds
its own wait on the episode so that code without the limit fails here instead of hanging the suite."""

from __future__ import annotations

import importlib
import logging
import threading
from types import SimpleNamespace

import pytest

from relax.agents.episode import EpisodeMaker
from relax.agents.loops import AgentFactory
from relax.agents.protocol import Reply
from relax.config import load_config
from relax.config.validate import ConfigError
from relax.data.tokenizer import build_tiny_tokenizer
from relax.runner.errors import RunError

RELEASE = threading.Event()  # set: the hanging environments and loops return (each test sets it when done)
ENTERED = threading.Event()  # set by a hanging call once it waits


# The environments are loaded by their option's value, 'tests.agents.test_env_timeout:Hangs': that module's events
# (pytest may have imported this file under another name, with events of its own)
HOOKS = importlib.import_module("tests.agents.test_env_timeout")


@pytest.fixture(autouse=True)
def release():
    HOOKS.RELEASE.clear()
    HOOKS.ENTERED.clear()
    yield
    HOOKS.RELEASE.set()  # the abandoned calls return, their threads end


class Hangs:
    """An environment whose service never answers (until the test releases it)."""

    def reset(self, item):
        self.steps = 0

    def step(self, action):
        self.steps += 1
        ENTERED.set()
        RELEASE.wait()
        return "late", 1.0, False


class Answers:
    def reset(self, item):
        pass

    def step(self, action):
        return "42", 0.5, False


class Raises:
    def reset(self, item):
        pass

    def step(self, action):
        raise KeyError("the environment's own bug")


class HangingLoop:
    def reset(self, item):
        pass

    def turn(self, text):
        ENTERED.set()
        RELEASE.wait()
        return Reply(messages=[{"role": "user", "content": "late"}])


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def turn_end_within(episode, tok, limit_s: float = 20.0):
    """`episode.turn_end` on a short model turn, waited on for at most `limit_s` (a hang fails the test)."""
    box = {}

    def target():
        try:
            box["obs"] = episode.turn_end(tok.encode("7", add_special_tokens=False), None, 10)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"turn_end did not return within {limit_s} s: the step is not bounded"
    if "error" in box:
        raise box["error"]
    return box["obs"]


def env_maker(tok, env: str, timeout_s):
    return EpisodeMaker(AgentFactory(env, [], None, None, env_timeout_s=timeout_s), tok, max_turns=3,
                        max_tool_errors=3)


def test_a_hanging_environment_step_ends_its_episode_naming_the_environment_and_the_option(tok):
    spec = "tests.agents.test_env_timeout:Hangs"
    episode = env_maker(tok, spec, 0.2).new({"label": "1", "index": 0})
    assert turn_end_within(episode, tok) is None
    assert HOOKS.ENTERED.is_set()  # the step was called, and is still waiting
    assert episode.end == "timeout"
    assert episode.error.startswith(f"data.env={spec}: Hangs.step did not return within data.env_timeout_s=0.2 s")
    record = episode.record()
    assert record["error"] == episode.error and record["end"] == "timeout" and record["turn_rewards"] == [0.0]


def test_an_environment_that_answers_in_time_goes_on(tok):
    episode = env_maker(tok, "tests.agents.test_env_timeout:Answers", 5.0).new({"label": "1", "index": 0})
    obs = turn_end_within(episode, tok)
    assert obs and episode.end is None and episode.error is None and episode.turn_rewards == [0.5]
    assert "42" in tok.decode(obs)


def test_an_environment_that_raises_still_raises_its_own_error(tok):
    episode = env_maker(tok, "tests.agents.test_env_timeout:Raises", 5.0).new({"label": "1", "index": 0})
    with pytest.raises(KeyError, match="the environment's own bug"):
        turn_end_within(episode, tok)


def test_a_hanging_agent_loop_turn_ends_its_episode(tok):
    maker = EpisodeMaker(HOOKS.HangingLoop, tok, max_turns=3, max_tool_errors=3, turn_timeout_s=0.2,
                         source="data.agent=my_loops:HangingLoop")
    episode = maker.new({"label": "1", "index": 0})
    assert turn_end_within(episode, tok) is None and HOOKS.ENTERED.is_set()
    assert episode.end == "timeout"
    assert episode.error.startswith("data.agent=my_loops:HangingLoop: HangingLoop.turn did not return within "
                                    "data.env_timeout_s=0.2 s")


def test_the_limit_is_validated_before_start():
    assert load_config(["data=guess_number"]).data.env_timeout_s == 60.0
    load_config(["data=guess_number", "data.env_timeout_s=null"])
    with pytest.raises(ConfigError, match=r"data.env_timeout_s=5.0 limits an environment's steps or an agent loop's "
                                          r"turns, and neither is set \(data.env, data.agent\)"):
        load_config(["data.env_timeout_s=5"])
    with pytest.raises(ConfigError, match=r"data.env_timeout_s=0.0 must be > 0"):
        load_config(["data=guess_number", "data.env_timeout_s=0"])
    with pytest.raises(ConfigError, match=r"data.env_timeout_s=60.0 must be below cluster.heartbeat_timeout_s=30"):
        load_config(["data=guess_number", "cluster.heartbeat_timeout_s=30"])
    load_config(["data=guess_number", "cluster.heartbeat_timeout_s=30", "data.env_timeout_s=20"])


def agent_cfg():
    return load_config(["rollout=sglang", "rollout.sglang.server=embedded",
                        "data.openai_agent=relax.agents.openai_examples:plan_then_answer", "data.reward=none",
                        "rollout.max_turns=2"])


def test_failed_agent_runs_are_warned_of_naming_the_option_and_the_first_failure(caplog):
    from relax.runner.rollout_driver.scoring import score

    cfg = agent_cfg()
    error = "Traceback (most recent call last):\n  ...\nRuntimeError: my agent broke"
    episodes = [{"turn_rewards": [1.0], "actions": ["a"], "error": None, "end": "done"},
                {"turn_rewards": [0.0], "actions": ["b"], "error": error, "end": "error"},
                {"turn_rewards": [0.0], "actions": ["c"], "error": "agent call timed out", "end": "timeout"},
                {"turn_rewards": [1.0], "actions": ["d"], "error": None, "end": "done"}]
    with caplog.at_level(logging.WARNING):
        scores = score(cfg, None, None, SimpleNamespace(episodes=episodes), [None], 4)
    assert scores.failed == [False, True, True, False] and scores.rewards == [1.0, 0.0, 0.0, 1.0]
    assert scores.timeouts == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["data.openai_agent=relax.agents.openai_examples:plan_then_answer failed on 2 of 4 episodes "
                        "(their groups are left out of the loss); the first failure: RuntimeError: my agent broke"]
    assert scores.first_error.startswith("data.openai_agent=relax.agents.openai_examples:plan_then_answer: Traceback")
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the control: a batch without a failure warns of nothing
        ok = score(cfg, None, None, SimpleNamespace(episodes=[episodes[0], episodes[3]]), [None], 2)
    assert ok.first_error is None and not any(r.levelno >= logging.WARNING for r in caplog.records)


def test_the_stop_names_the_agent_option_and_a_reward_failure_still_names_data_reward():
    from relax.runner.optimizer_steps import FailedRewardSteps
    from relax.runner.rollout_driver.scoring import score

    cfg = agent_cfg()
    bad = [{"turn_rewards": [0.0], "actions": ["b"], "error": "Traceback ...\nRuntimeError: my agent broke",
            "end": "error"}] * 2
    first = score(cfg, None, None, SimpleNamespace(episodes=bad), [None], 2).first_error
    steps = FailedRewardSteps(1)
    steps.count(2, False, first)
    with pytest.raises(RunError) as info:
        steps.check(0)
    message = str(info.value)
    assert message == ("step 0: in 1 step(s) in a row every group was left out because its agent runs failed, so "
                       "nothing was trained (data.max_failed_reward_steps=1); the first failure: RuntimeError: my "
                       "agent broke. Check data.openai_agent=relax.agents.openai_examples:plan_then_answer (run it "
                       "by hand on one prompt item); the warnings above name each step's first failure.")
    rewards = FailedRewardSteps(1)  # the control: a data.reward call's failure keeps the reward advice
    rewards.count(2, False, "Traceback ...\nValueError: bad label")
    with pytest.raises(RunError, match=r"because its reward calls failed.*the first failure: ValueError: bad label\. "
                                       r"Check data\.reward \(its signature"):
        rewards.check(0)


def one(response: str, label: str) -> float:
    return 1.0


def test_an_episode_failure_stops_a_raise_run_naming_the_episode_option_not_data_reward():
    from relax.runner.rollout_driver.scoring import score

    cfg = load_config(["data=guess_number", "data.reward_error=raise", "data.reward=digits",
                       "data.reward_timeout_s=null"])
    episodes = [{"turn_rewards": [0.0], "actions": ["7"], "error": "data.env=guess_number: GuessNumber.step did not "
                                                                   "return", "end": "timeout"}]
    items = [SimpleNamespace(label="7", prompt_text="p")]
    with pytest.raises(RunError, match=r"^data\.env=guess_number failed \(data\.reward_error=raise\)"):
        score(cfg, None, one, SimpleNamespace(episodes=episodes), items, 1)


@pytest.mark.slow
def test_a_run_whose_environment_hangs_stops_naming_the_environment(in_process, small_run, tmp_path, caplog):
    """Every episode's first step hangs: each ends at data.env_timeout_s (not after the heartbeat's restarts), every
    group is left out, the console names the environment each step, and the run stops naming data.env."""
    from mlflow.tracking import MlflowClient

    from relax.runner.train import run

    spec = "tests.agents.test_env_timeout:Hangs"
    cfg = load_config(small_run("data=guess_number", f"data.env={spec}", "data.env_timeout_s=0.1",
                                "data.reward=none", "rollout.max_turns=2", "rollout.max_response_len=4",
                                "data.max_failed_reward_steps=2", steps=3))
    with caplog.at_level(logging.WARNING), pytest.raises(RunError) as info:
        run(cfg, output_dir=tmp_path / "out")
    message = str(info.value)
    assert message.startswith("step 1: in 2 step(s) in a row every group was left out because its episodes failed"), \
        message
    assert f"the first failure: data.env={spec}: Hangs.step did not return within data.env_timeout_s=0.1 s" in message
    assert f"Check data.env={spec} (run it by hand on one prompt item)" in message
    warned = [r.getMessage() for r in caplog.records if "failed on" in r.getMessage()]
    assert warned == [f"data.env={spec} failed on 16 of 16 episodes (their groups are left out of the loss); the first "
                      "failure: Hangs.step did not return within data.env_timeout_s=0.1 s (the call is abandoned in "
                      "its thread, not killed)"] * 2, warned
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (mlrun,) = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    for metric in ("rollout/reward_errors", "rollout/reward_timeouts"):  # every episode, counted as rewards' are
        assert sorted((m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, metric)) == \
            [(0, 16.0), (1, 16.0)], metric
    assert mlrun.info.status == "FAILED"
