"""The code_tests task and rewards (relax.data.code_tasks, relax.rewards.code_tests), the python tool, and the
sandbox inside a training run: rollout/sandbox_timeout_frac counts the runs stopped at their limit, and the run goes
on."""

from __future__ import annotations

import json
import random

import pytest

from relax.agents.parsers import ToolCall
from relax.agents.tools import ToolRunner, get_tools
from relax.data.code_tasks import generate_code_tests, problems
from relax.data.tasks import generate_task
from relax.rewards.code_tests import code_tests_all_reward, code_tests_reward, program
from relax.rewards.registry import get_reward_fn, score_responses

LABEL = json.dumps({"prefix": "def f(x):\n    return ",
                    "tests": [{"call": f"f({x})", "expected": 3 * x + 4} for x in (0, 1, 2, 5)]})


def test_the_code_is_the_fenced_block_or_the_response_after_the_prefix():
    assert program("3 * x + 4", LABEL)[0] == "def f(x):\n    return 3 * x + 4"
    assert program("return x*3+4\n", LABEL)[0] == "def f(x):\n    return x*3+4"
    fenced = "Here it is:\n```python\ndef f(x):\n    return 3 * x + 4\n```\nDone."
    assert program(fenced, LABEL)[0] == "def f(x):\n    return 3 * x + 4\n"
    with pytest.raises(ValueError, match="not JSON"):
        program("1", "{tests")
    with pytest.raises(ValueError, match="non-empty list 'tests'"):
        program("1", json.dumps({"tests": []}))


def test_the_reward_is_the_share_of_tests_passed_in_the_sandbox():
    assert code_tests_reward("3 * x + 4", LABEL) == 1.0
    assert code_tests_reward("4", LABEL) == 0.25  # f(0) only, by hand
    assert code_tests_reward("x + 4", LABEL) == 0.25
    assert code_tests_reward("3 * x +", LABEL) == 0.0  # a syntax error passes nothing
    assert code_tests_all_reward("4", LABEL) == 0.0 and code_tests_all_reward("x * 3 + 4", LABEL) == 1.0
    assert code_tests_reward("4", LABEL).counts == {"sandbox_runs": 1, "sandbox_timeouts": 0}


def test_a_reward_time_limit_shorter_than_the_sandbox_s_is_refused_before_start():
    from relax.config import ConfigError, load_config
    from relax.rewards.code_tests import LIMITS
    from relax.sandbox_limits import CODE_TESTS_WALL_S

    assert CODE_TESTS_WALL_S == LIMITS.wall_s
    with pytest.raises(ConfigError, match="must be more than 15 s, the sandbox's wall-clock limit"):
        load_config(["data=code_tests", "data.reward_timeout_s=12"])
    load_config(["data=code_tests", "data.reward_timeout_s=20"])


def test_the_task_is_deterministic_and_its_eval_problems_never_occur_in_train():
    assert generate_task("code_tests", 50, 3) == generate_code_tests(50, 3)
    assert generate_code_tests(20, 1) != generate_code_tests(20, 2)
    train = {r["prompt"] for r in generate_code_tests(2000, 0)}
    evals = {r["prompt"] for r in generate_code_tests(500, 0, "eval")}
    assert train and evals and not train & evals


def test_each_family_s_reference_passes_its_tests_and_a_constant_earns_its_share():
    every = problems()
    assert len(every) == 450 and len({p[0] for p in every}) == 450
    rng = random.Random(0)
    for family in range(5):  # two problems of each family (they come in turn)
        for what, prefix, tests, solution in rng.sample(every[family::5], 2):
            label = json.dumps({"prefix": prefix, "tests": tests})
            assert code_tests_reward(solution, label) == 1.0, (what, solution)
    what, prefix, tests, _ = every[0]  # x * 1 + 0: "0" passes f(0) alone
    assert code_tests_reward("0", json.dumps({"prefix": prefix, "tests": tests})) == 0.25


def test_counts_add_up_over_a_batch_and_a_bad_label_is_a_reward_error():
    """(In this process; the counts' way back from the reward worker processes is the run's, below.)"""
    scores = score_responses(get_reward_fn("code_tests"), ["3 * x + 4", "4", "3 * x + 4"], [LABEL, LABEL, "not json"])
    assert scores.rewards[:2] == [1.0, 0.25] and scores.failed == [False, False, True]
    assert scores.counts == {"sandbox_runs": 2, "sandbox_timeouts": 0}
    assert "not JSON" in scores.first_error


def test_the_python_tool_runs_code_in_the_sandbox(monkeypatch):
    from relax.agents import python_tool
    from relax.rewards.sandbox import SandboxLimits

    monkeypatch.setattr(python_tool, "LIMITS", SandboxLimits(wall_s=1.0, cpu_s=1))  # a quicker time-out
    runner = ToolRunner(get_tools(["python"]), timeout_s=None)  # in this process: the sandbox limits the code
    try:
        ok, raised, looped, outside = runner([
            ToolCall(name="python", arguments={"code": "print(sum(range(10)))"}),
            ToolCall(name="python", arguments={"code": "print('before')\n1 / 0"}),
            ToolCall(name="python", arguments={"code": "while True:\n    pass"}),
            ToolCall(name="python", arguments={"code": "print(open('/etc/hostname').read())"})])
    finally:
        runner.close()
    assert (ok.content, ok.error) == ("45\n", False)
    assert raised.content.startswith("before\n") and "ZeroDivisionError" in raised.content
    assert looped.error and "ran past the sandbox's limit" in looped.content
    assert "refused" in outside.content


# ---------------------------------------------------------------------------------------------- in a run
QUIET = ["tracking.enabled=false", "tracking.progress=false", "cluster.cpus_per_node=1", "model.dtype=float32",
         "train.save=false", "train.num_rollout=2", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
         "train.micro_batch_size=8"]


def decoded(batch) -> list[str]:
    from relax.data.tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    return [tokenizer.decode(ids[m.bool()].tolist(), skip_special_tokens=True)
            for ids, m in zip(batch.response_ids, batch.response_mask, strict=True)]


@pytest.mark.slow
def test_relax_train_data_code_tests_runs_and_counts_sandbox_timeouts(tmp_path, in_process, trained_batches):
    """data=code_tests trains the tiny model on CPU, its reward the code_tests reward for odd-length responses and a
    program that never ends for even-length ones: rollout/sandbox_timeout_frac is their share, counted by hand from
    the responses trained, no reward errors, and the run finishes every step."""
    from relax.config import load_config
    from relax.runner.train import run

    result = run(load_config(["data=code_tests", "data.reward=rewards.sandbox_rewards:loops_on_even_length",
                              *QUIET]), output_dir=tmp_path / "run")
    fracs = result.series("rollout/sandbox_timeout_frac")
    expected = [sum(len(t) % 2 == 0 for t in decoded(trained_batches[s])) / 16 for s in sorted(trained_batches)]
    assert len(fracs) == 2 and fracs == pytest.approx(expected)
    assert 0 < sum(expected) < 2  # both kinds of response occurred
    assert result.series("rollout/reward_errors") == [0.0, 0.0]
    rewards = result.series("rollout/raw_reward")
    assert all(0.0 <= r <= 1 - f + 1e-6 for r, f in zip(rewards, expected, strict=True))  # a stopped program: 0
