"""`data.tool_parser` set where nothing of the run reads tool calls is refused by relax-train before anything starts
(the pre-start check `tool_parser`, `relax.runner.preflight.unread_tool_parser`), not accepted and ignored. What reads
it: the built-in tool loop (`data.tools`, alone or beside `data.env`) and the gateway of an agent program
(`data.openai_agent`). An environment alone answers each turn with its step and an agent loop of one's own
(`data.agent`) is built without a parser, so before, `data.env=... data.tool_parser=qwen3_coder` trained exactly as
without it. The default, `auto`, is never refused; relax-serve, which reads data.tool_parser on its own, still takes it
(the config's shared rules accept it)."""

from __future__ import annotations

import pytest
from relax_train_inprocess import relax_train

from relax.config import load_config
from relax.runner.preflight import preflight

ECHO = "data.agent=tests.agents.echo_agent:Echo"
SINGLE_TURN = ([], "single-turn data (no data.env, data.tools, data.agent or data.openai_agent) reads no tool call")
ENV_ONLY = (["data=guess_number"], "data.env=guess_number without data.tools answers every turn with its step and "
            "reads no tool call")
AGENT = ([ECHO, "rollout.max_turns=2"],
         "data.agent=tests.agents.echo_agent:Echo is an agent loop of your own, which reads the model's turns itself")
TOOLS = ["data.tools=[calculator]", "rollout.max_turns=2", "rollout.max_prompt_len=400",
         "model.max_position_embeddings=1024"]
OPENAI_AGENT = ["data.openai_agent=relax.agents.openai_examples:plan_then_answer", "rollout=sglang",
                "rollout.sglang.server=embedded", "rollout.max_turns=2"]


def tool_parser_check(overrides: list[str]) -> tuple[str, str | None]:
    pre = preflight(load_config(overrides), only=("tool_parser",))
    return pre.status["tool_parser"], pre.problems.get("tool_parser")


@pytest.mark.parametrize("overrides, why", [SINGLE_TURN, ENV_ONLY, AGENT], ids=["single_turn", "env", "agent"])
@pytest.mark.parametrize("parser", ["hermes", "tests.agents.family_tools:always_calculator"])
def test_a_parser_nothing_reads_is_refused_naming_the_option_and_its_readers(overrides, why, parser):
    status, problem = tool_parser_check([*overrides, f"data.tool_parser={parser}"])
    assert status == "failed"
    assert problem == (f"data.tool_parser={parser} has no effect: {why}; only data.tools (the built-in tool loop) "
                       "and data.openai_agent (its gateway) read tool calls with it. Set data.tools, or leave "
                       "data.tool_parser unset"), problem
    assert "\n" not in problem


@pytest.mark.parametrize("overrides", [[], ["data=guess_number"], [ECHO, "rollout.max_turns=2"], TOOLS,
                                       ["data=guess_number", *TOOLS], OPENAI_AGENT],
                         ids=["single_turn", "env", "agent", "tools", "env_and_tools", "openai_agent"])
def test_the_default_auto_is_never_refused(overrides):
    assert tool_parser_check(overrides) == ("n/a", None)
    assert tool_parser_check([*overrides, "data.tool_parser=auto"]) == ("n/a", None)


@pytest.mark.parametrize("overrides", [TOOLS, ["data=guess_number", *TOOLS], OPENAI_AGENT],
                         ids=["tools", "env_and_tools", "openai_agent"])
def test_a_parser_the_run_reads_passes(overrides):
    """The controls: the tool loop (with or without an environment) and an agent program's gateway read it."""
    assert tool_parser_check([*overrides, "data.tool_parser=qwen3_coder"]) == ("ok", None)


def test_the_shared_config_rules_still_take_it_for_relax_serve():
    assert load_config(["data.tool_parser=hermes"]).data.tool_parser == "hermes"


def test_relax_train_refuses_before_anything_starts_with_one_line(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    code, out, err = relax_train(["dry_run=true", "data=guess_number", "data.tool_parser=qwen3_coder"], capfd)
    assert code == 2, out + err
    (line,) = [x for x in out.splitlines() if " tool_parser " in x]
    assert line.split()[:6] == ["failed", "tool_parser", "data.tool_parser=qwen3_coder", "has", "no", "effect:"], line
    assert "relax-train: error: dry run: a start would stop before Ray: data.tool_parser=qwen3_coder has no " \
           "effect: data.env=guess_number" in err and "Traceback" not in out + err
    code, out, err = relax_train(["dry_run=true", "data=guess_number"], capfd)  # the control: auto
    assert code == 0, out + err
    (line,) = [x for x in out.splitlines() if " tool_parser " in x]
    assert line.split()[:2] == ["n/a", "tool_parser"], line
