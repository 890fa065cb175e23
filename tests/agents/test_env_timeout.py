"""Episodes that fail: an environment's step or an agent loop's turn past `data.env_timeout_s` ends its episode
(named, with the option), and failed episodes are reported as failed reward calls are: a warning naming the batch's
first failure and the option that ran it, and a stop message that names that option, not data.reward.

The hanging environment waits on an Event the test holds (released at the end), never on a sleep; each test bounds
its own wait on the episode so that code without the limit fails here instead of hanging the suite."""

from __future__ import annotations

import importlib
import logging
import threading
import time
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
HANG_STEPS = threading.Event()  # set: every HangsOn step hangs (the steps a resumed episode replays)


# The environments are loaded by their option's value, 'tests.agents.test_env_timeout:Hangs': that module's events
# (pytest may have imported this file under another name, with events of its own)
HOOKS = importlib.import_module("tests.agents.test_env_timeout")


@pytest.fixture(autouse=True)
def release():
    HOOKS.RELEASE.clear()
    HOOKS.ENTERED.clear()
    HOOKS.HANG_STEPS.clear()
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


class HangsOn:
    """Hangs (until the test releases it) in the step of an episode whose label is "hang", or in its reset when the
    label is "hang in reset"; answers the other episodes at once. With HANG_STEPS set, every step hangs (a replay)."""

    def reset(self, item):
        self.label, self.steps = item["label"], 0
        if self.label == "hang in reset":
            ENTERED.set()
            RELEASE.wait()

    def step(self, action):
        self.steps += 1
        if self.label == "hang" or HANG_STEPS.is_set():
            ENTERED.set()
            RELEASE.wait()
            return "late", 1.0, False
        return f"obs {self.steps}", 0.25, self.steps >= 2


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
    assert message == ("step 1: in 1 step(s) in a row every group was left out because its agent runs failed, so "
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
    assert message.startswith("step 2: in 2 step(s) in a row every group was left out because its episodes failed"), \
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


# ------------------------------------------------------------------------------------------------ hung together
# A batch's episodes whose calls hang together cost about one data.env_timeout_s (LIMIT here), not one each: the
# steps of a round (and a batch's resets and replays) run at the same time. Each test has three hung episodes, so
# calls waited on one after another take 3 x LIMIT at least; the bound, ONE_LIMIT, leaves 1 s of margin over one.
LIMIT = 1.0
ONE_LIMIT = 2 * LIMIT
HANGS_ON = "tests.agents.test_env_timeout:HangsOn"
LABELS = ["hang", "ok", "hang", "hang"]  # one group of one episode each


def hangs_on_maker(tok, timeout_s=LIMIT):
    return EpisodeMaker(AgentFactory(HANGS_ON, [], None, None, env_timeout_s=timeout_s), tok, max_turns=3,
                        max_tool_errors=3)


def scripted_sglang(tok, episodes, **kw):
    """`run_episodes` (rollout=sglang) of `episodes`, their server scripted: every turn is "7" and the stop token."""
    import torch

    from relax.rollout.sglang.client import Sampling
    from relax.rollout.sglang.episodes import run_episodes

    ids = tok.encode("7", add_special_tokens=False) + [tok.eos_token_id]

    def send(payloads):
        return [(list(ids), [-0.5] * len(ids), "stop", 1) for _ in payloads]

    N = len(episodes)
    return run_episodes(send, [[5, 6, 7]] * N, torch.arange(N), torch.zeros(N, dtype=torch.long), [60] * N,
                        episodes, seed=0, sampling=Sampling(4, 1.0, 1.0, -1, (tok.eos_token_id,)), turn_limit=4,
                        aborted=lambda: False, pad_token_id=tok.pad_token_id, **kw)


def timed(fn, limit_s: float = 20.0):
    """(fn(), the seconds it took), waited on for at most `limit_s` (code without the limit fails here, not hangs)."""
    box = {}

    def target():
        try:
            box["out"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t0 = time.perf_counter()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit_s)
    seconds = time.perf_counter() - t0
    assert not thread.is_alive(), f"did not return within {limit_s} s: the calls are not bounded"
    if "error" in box:
        raise box["error"]
    return box["out"], seconds


def check_hung_batch(records, what):
    """Episodes 0, 2, 3 failed naming `what` and the option; episode 1 ran to its environment's end."""
    for i in (0, 2, 3):
        assert records[i]["end"] == "timeout", records[i]
        assert records[i]["error"].startswith(f"data.env={HANGS_ON}: HangsOn.{what} did not return within "
                                              f"data.env_timeout_s={LIMIT:g} s"), records[i]["error"]
    ok = records[1]
    assert ok["end"] == "env_done" and ok["error"] is None and ok["turn_rewards"] == [0.25, 0.25]


def test_hung_steps_of_one_round_over_sglang_cost_one_limit_not_one_each(tok):
    episodes = hangs_on_maker(tok).new_for([{"label": label, "index": i} for i, label in enumerate(LABELS)], 1)
    samples, seconds = timed(lambda: scripted_sglang(tok, episodes))
    assert HOOKS.ENTERED.is_set()
    assert seconds < ONE_LIMIT, f"3 hung steps took {seconds:.2f} s: waited on one after another"
    check_hung_batch(samples.episodes, "step")
    assert samples.finish_reason == ["timeout", "env_done", "timeout", "timeout"]


def test_hung_steps_of_rows_ending_a_turn_together_in_the_embedded_engine_cost_one_limit(tok):
    """No stop token: every row's turn ends at its 3-token limit, at the same decoding step."""
    import torch

    from relax.config.schema import ModelConfig
    from relax.models.hf import build_model
    from relax.rollout.embedded import EmbeddedEngine

    model = build_model(ModelConfig(), len(tok), tok.pad_token_id, seed=0, dtype=torch.float32, device="cpu")
    engine = EmbeddedEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id)
    episodes = hangs_on_maker(tok).new_for([{"label": label, "index": i} for i, label in enumerate(LABELS)], 1)
    samples, seconds = timed(lambda: engine.generate([[5, 6, 7]] * 4, max_new_tokens=40, seed=3, episodes=episodes,
                                                     turn_limit=3))
    assert seconds < ONE_LIMIT, f"3 hung steps took {seconds:.2f} s: waited on one after another"
    check_hung_batch(samples.episodes, "step")


def test_hung_resets_of_a_batch_cost_one_limit_and_fail_their_episodes_at_their_first_turn(tok, caplog):
    from relax.runner.rollout_driver.scoring import score

    labels = ["hang in reset" if label == "hang" else label for label in LABELS]
    maker = hangs_on_maker(tok)
    episodes, seconds = timed(lambda: maker.new_for([{"label": label, "index": i} for i, label in enumerate(labels)],
                                                    1))
    assert HOOKS.ENTERED.is_set()
    assert seconds < ONE_LIMIT, f"3 hung resets took {seconds:.2f} s: waited on one after another"
    samples = scripted_sglang(tok, episodes)
    check_hung_batch(samples.episodes, "reset")
    assert [e["turns"] for e in samples.episodes] == [1, 2, 1, 1]  # a failed episode's first turn ends it
    cfg = load_config(["data=guess_number", f"data.env={HANGS_ON}", "data.reward=none", "data.env_timeout_s=1"])
    with caplog.at_level(logging.WARNING):
        scores = score(cfg, None, None, samples, [None] * 4, 1)
    assert scores.failed == [True, False, True, True] and scores.timeouts == 3
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"data.env={HANGS_ON} failed on 3 of 4 episodes (their groups are left out of the loss); the first failure: "
        "HangsOn.reset did not return within data.env_timeout_s=1 s (the call is abandoned in its thread, not killed)"]


def test_hung_replayed_steps_of_resumed_episodes_cost_one_limit(tok):
    """Partial rollout: episodes interrupted after their first step are restored, which replays that step; it hangs
    now (for the episodes that hung before too: every step hangs) except in the episode that already ended."""
    maker = hangs_on_maker(tok)
    labels = ["ok", "done", "ok", "ok"]
    episodes = maker.new_for([{"label": label, "index": i} for i, label in enumerate(labels)], 1)
    first = [e.turn_end(tok.encode("7", add_special_tokens=False), tok.eos_token_id, 10) for e in episodes]
    assert all(first) and all(e.end is None for e in episodes)
    records = [e.record() for e in episodes]
    records[1]["actions"] = []  # (the episode that goes on: nothing to replay)
    HOOKS.HANG_STEPS.set()
    restored, seconds = timed(lambda: maker.restore_all(records))
    assert HOOKS.ENTERED.is_set()
    assert seconds < ONE_LIMIT, f"3 hung replays took {seconds:.2f} s: waited on one after another"
    for i in (0, 2, 3):
        assert restored[i].end == "timeout" and restored[i].error.startswith(
            f"data.env={HANGS_ON}: HangsOn.step did not return within data.env_timeout_s={LIMIT:g} s")
        assert restored[i].turn_end(tok.encode("7", add_special_tokens=False), tok.eos_token_id, 10) is None
        assert restored[i].record()["turn_rewards"] == [0.25, 0.0]
    assert restored[1].error is None and restored[1].end is None


def test_a_hanging_agent_loop_reset_fails_its_episode_naming_the_option(tok):
    class HangsInReset(HangingLoop):
        def reset(self, item):
            HangingLoop.turn(self, "")

    maker = EpisodeMaker(HangsInReset, tok, max_turns=3, max_tool_errors=3, turn_timeout_s=0.2,
                         source="data.agent=my_loops:HangsInReset")
    (episode,), _ = timed(lambda: maker.new_for([{"label": "1", "index": 0}], 1))
    assert episode.end == "timeout" and episode.error.startswith(
        "data.agent=my_loops:HangsInReset: HangsInReset.reset did not return within data.env_timeout_s=0.2 s")
    assert turn_end_within(episode, tok) is None and episode.record()["error"] == episode.error


def test_a_batch_where_nothing_hangs_gets_the_same_samples_with_and_without_the_limit(tok):
    """Steps run at the same time (a limit) or one after another in the rollout's thread (none): same results."""
    import torch

    items = [{"label": str(k), "index": k} for k in range(1, 9)]
    runs = []
    for timeout_s in (None, 5.0):
        maker = EpisodeMaker(AgentFactory("guess_number", [], None, None, env_timeout_s=timeout_s), tok,
                             max_turns=3, max_tool_errors=3)
        runs.append(scripted_sglang(tok, maker.new_for(items, 2)))
    a, b = runs
    assert torch.equal(a.response_ids, b.response_ids) and a.finish_reason == b.finish_reason
    strip = [{k: v for k, v in e.items() if k != "env_time"} for e in a.episodes]
    assert strip == [{k: v for k, v in e.items() if k != "env_time"} for e in b.episodes]
    assert len({tuple(e["turn_rewards"]) for e in a.episodes}) > 1  # (the episodes differ)
