"""The header relax-train prints at start and in a dry run (relax.runner.summary.config_summary) tells agentic runs
apart: what answers the model's turns (data.env, data.tools, data.agent, data.openai_agent) on the data line, and the
episode limits (rollout.max_turns, rollout.max_episode_tokens) on the rollout line; a single-turn run's lines stay as
they were."""

from relax.config import load_config
from relax.runner.summary import config_summary


def _lines(overrides: list[str]) -> dict[str, str]:
    text = config_summary(load_config(overrides))
    return {line.split()[0]: line for line in text.splitlines()}


def test_the_arms_of_a_max_turns_sweep_print_different_headers():
    five = _lines(["data=guess_number", "rollout.max_turns=5"])
    one = _lines(["data=guess_number", "rollout.max_turns=1"])
    assert five["data"] == one["data"] == "data       guess_number (reward=none, env=guess_number)"
    # conf/data/guess_number.yaml: max_response_len 2, max_episode_tokens 60
    assert five["rollout"] == ("rollout    embedded: 8 prompts x 8 samples, max_response_len=2, max_turns=5, "
                               "max_episode_tokens=60, temperature=1.0")
    assert one["rollout"] == five["rollout"].replace("max_turns=5", "max_turns=1")


def test_an_openai_agent_run_names_the_agent_and_its_episode_limits():
    agent = "relax.agents.openai_examples:plan_then_answer"
    lines = _lines(["rollout=sglang", "rollout.sglang.server=embedded", f"data.openai_agent={agent}",
                    "rollout.max_turns=2", "rollout.max_episode_tokens=64"])
    assert lines["data"] == f"data       digits (reward=digits, openai_agent={agent})"
    assert ", max_response_len=8, max_turns=2, max_episode_tokens=64, temperature=1.0" in lines["rollout"]
    # the default limit is resolved as the run uses it: 2 x max_turns x max_response_len = 2 x 3 x 48
    # (conf/data/calculator.yaml's max_turns and max_response_len, its own limit unset)
    tools = _lines(["data=calculator", "rollout.max_episode_tokens=null"])
    assert tools["data"].endswith(", tools=[calculator])"), tools["data"]
    assert ", max_response_len=48, max_turns=3, max_episode_tokens=288," in tools["rollout"], tools["rollout"]


def test_a_single_turn_run_names_no_agent_and_no_episode_limits():
    lines = _lines([])
    assert lines["data"] == "data       digits (reward=digits)"
    assert lines["rollout"] == "rollout    embedded: 8 prompts x 8 samples, max_response_len=8, temperature=1.0"
