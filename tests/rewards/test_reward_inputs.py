"""What a reward function receives, by its parameters' names (relax.rewards.calls.reward_inputs): verl's
`compute_score(data_source, solution_str, ground_truth, extra_info)` and a TRL-style function (the prompt as
`messages`, every other column in `**kwargs`) get the data record's fields, in the driver and in the reward worker
processes, alone and in a `data.reward` list, and through a reward service; `messages` of an episode is its
conversation; a required field that a record lacks is refused before the start, naming the parameter. Expected values
are worked out by hand from the files written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.agents.episode import conversation
from relax.data.datasets import PromptItem, load_prompt_file
from relax.data.tokenizer import build_tiny_tokenizer
from relax.rewards.calls import RewardSpecError, reward_inputs
from relax.rewards.combined import reward_of, score_list
from relax.rewards.registry import check_record_fields, get_reward_fn, score_responses
from relax.runner.rollout_driver.scoring import reward_contexts

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _input_rewards(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # input_rewards:<name>, in this process and in spawned reward workers


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def verl_records() -> list[dict]:
    # verl's parquet columns: data_source, prompt (messages), reward_model.ground_truth (here the label), extra_info
    return [{"prompt": [{"role": "user", "content": f"repeat {k}"}], "label": str(k),
             "data_source": "openai/gsm8k" if k % 2 == 0 else "other", "extra_info": {"index": 10 + k, "level": k}}
            for k in range(4)]


@pytest.mark.parametrize("timeout_s", [None, 30.0], ids=["driver", "workers"])
def test_verl_compute_score_gets_the_records_fields(tmp_path, timeout_s):
    items = load_prompt_file(write(tmp_path / "p.jsonl", verl_records()), build_tiny_tokenizer())
    fn = get_reward_fn("input_rewards:compute_score")
    responses = [r for k in range(4) for r in (str(k), "wrong")]  # 2 per prompt: right, then wrong
    scores = score_responses(fn, responses, [i.label for i in items for _ in range(2)], timeout_s=timeout_s,
                             contexts=reward_contexts(items, 2))
    assert not any(scores.failed), scores.first_error
    assert scores.rewards == [1.0, 0.0] * 4
    assert scores.extras["rollout/reward/gsm_mean"] == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert scores.extras["rollout/reward/index_mean"] == [10.0, 10.0, 11.0, 11.0, 12.0, 12.0, 13.0, 13.0]
    assert scores.extras["rollout/reward/level_mean"] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]


def test_trl_style_gets_the_messages_and_every_other_column_in_a_list_in_the_workers(tmp_path):
    records = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"repeat {k}"}],
                "label": str(k), "difficulty": k + 1, "topic": "echo"} for k in range(3)]
    items = load_prompt_file(write(tmp_path / "p.jsonl", records), build_tiny_tokenizer())
    assert items[0].prompt_text.startswith("<|im_start|>system")  # `prompt` stays the templated text
    rewards = reward_of(["input_rewards:trl_style", "input_rewards:maybe_difficulty"])
    scores = score_list(rewards, [1.0, 0.5], ["0", "1", "x"], [i.label for i in items], timeout_s=30,
                        contexts=reward_contexts(items, 1))
    assert not any(scores.failed), scores.first_error
    # trl_style: 1, 1, 0; maybe_difficulty: the record's difficulty (1, 2, 3), weighted 0.5
    assert scores.rewards == [1.0 + 0.5, 1.0 + 1.0, 0.0 + 1.5]
    extras = scores.extras
    assert extras["rollout/reward/trl_style/messages_mean"] == [2.0] * 3  # system, user: the messages, not the text
    assert extras["rollout/reward/trl_style/user_is_last_mean"] == [1.0] * 3
    assert extras["rollout/reward/trl_style/difficulty_mean"] == [1.0, 2.0, 3.0]
    # **kwargs: prompt (the templated text), difficulty, topic (messages has its own parameter)
    assert extras["rollout/reward/trl_style/columns_mean"] == [3.0] * 3
    assert extras["rollout/reward/trl_style/has_prompt_text_mean"] == [1.0] * 3


def test_an_async_reward_gets_an_episodes_conversation_in_the_workers_and_after_a_resume():
    from tests.agents.test_tool_episodes import CALL, episode

    messages = [CALL.format(name="calculator", args='{"expression": "6 * 7"}'), "the answer is 42"]
    for resume_at in (None, 1):
        ep, _ = episode(messages, max_tool_errors=3, resume_at=resume_at)
        prompt = [{"role": "user", "content": "what is 6 * 7?"}]
        item = PromptItem([1], "42", "<templated>", 0, messages=prompt, fields={"topic": "math"})
        record = ep.record()
        assert conversation(record, prompt) == [prompt[0], {"role": "assistant", "content": messages[0]},
                                                {"role": "tool", "content": "42"},
                                                {"role": "assistant", "content": messages[1]}]
        scores = score_responses(get_reward_fn("input_rewards:async_turns"), [messages[-1]], ["42"], timeout_s=30,
                                 contexts=reward_contexts([item], 1, [record]))
        assert not any(scores.failed), scores.first_error
        assert (scores.extras["rollout/reward/assistant_mean"], scores.extras["rollout/reward/tool_mean"]) == \
            ([2.0], [1.0])
    # an OpenAI-style agent's record carries its conversation as the gateway kept it
    kept = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert conversation({"messages": kept, "actions": ["hello"]}, [{"role": "user", "content": "x"}]) == kept


def test_a_reward_service_gets_the_messages_and_fields(tmp_path):
    from .test_remote_reward import Service

    items = load_prompt_file(write(tmp_path / "p.jsonl", verl_records()[:2]), build_tiny_tokenizer())
    service = Service()
    try:
        scores = score_list(reward_of([service.url]), None, ["a", "bb"], ["0", "1"], timeout_s=30,
                            contexts=reward_contexts(items, 1))
    finally:
        service.close()
    assert scores.rewards == [0.1, 0.2]
    sent = sorted((i for items in service.requests for i in items), key=lambda i: i["label"])
    assert [i["messages"] for i in sent] == [[{"role": "user", "content": "repeat 0"}],
                                            [{"role": "user", "content": "repeat 1"}]]
    assert [i["fields"] for i in sent] == [{"data_source": "openai/gsm8k", "extra_info": {"index": 10, "level": 0}},
                                          {"data_source": "other", "extra_info": {"index": 11, "level": 1}}]


def test_how_parameters_are_bound_by_name():
    def old(r, l): ...  # noqa: E741
    def named_label_first(label, response): ...
    def one(response): ...
    assert reward_inputs(old).arguments("R", "L") == ((), {"r": "R", "l": "L"})
    assert reward_inputs(named_label_first).arguments("R", "L") == ((), {"label": "L", "response": "R"})
    assert reward_inputs(lambda a, b, /: 0).arguments("R", "L") == (("R", "L"), {})
    with pytest.raises(ValueError, match="no parameter takes the label"):
        reward_inputs(one)
    with pytest.raises(RewardSpecError, match="cannot be called as fn"):
        get_reward_fn("input_rewards:one_parameter")


def test_a_required_field_a_record_lacks_is_refused_naming_the_parameter(tmp_path):
    items = load_prompt_file(write(tmp_path / "p.jsonl", [{"prompt": "repeat 1", "label": "1", "difficulty": 2},
                                                          {"prompt": "repeat 2", "label": "2"}]),
                             build_tiny_tokenizer())
    with pytest.raises(RewardSpecError) as info:
        check_record_fields("input_rewards:needs_difficulty", get_reward_fn("input_rewards:needs_difficulty"), items,
                            "the training data")
    assert "parameter 'difficulty'" in str(info.value) and "p.jsonl:2" in str(info.value)
    check_record_fields("x", get_reward_fn("input_rewards:maybe_difficulty"), items, "the training data")  # default
    scores = score_responses(get_reward_fn("input_rewards:maybe_difficulty"), ["a", "b"], ["1", "2"],
                             contexts=reward_contexts(items, 1))
    assert scores.rewards == [2.0, 7.0]  # the record's field, then the default


def test_a_dry_run_refuses_a_field_no_record_has(tmp_path, capfd):
    from relax_train_inprocess import relax_train

    data = write(tmp_path / "p.jsonl", [{"prompt": "repeat 1", "label": "1", "difficulty": 2}])
    evals = write(tmp_path / "e.jsonl", [{"prompt": "repeat 3", "label": "3"}])
    base = ["dry_run=true", "data=jsonl", f"data.path={data}", f"train.save_dir={tmp_path}/ckpt"]
    code, out, err = relax_train([*base, "data.reward=input_rewards:needs_difficulty"], capfd)
    assert code == 0, out + err
    code, out, err = relax_train([*base, "data.reward=[digits,input_rewards:needs_difficulty]",
                                  f"data.eval_path={evals}", "train.eval_interval=1",
                                  "train.eval_correct_threshold=1.5"], capfd)
    assert code == 2 and "parameter 'difficulty'" in err and "the eval set" in err and "e.jsonl:1" in err, out + err
    assert "Traceback" not in out + err


@pytest.mark.slow
def test_a_run_gives_a_list_of_rewards_the_records_fields_and_messages(in_process, small_run, tmp_path):
    """A real short run (roles in this process): the prompt items carry their records' fields from the file to the
    reward workers; every record has data_source openai/gsm8k, level 3, difficulty 2 and two prompt messages."""
    from relax.config import load_config
    from relax.runner.train import run

    records = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"repeat {k}"}],
                "label": str(k), "data_source": "openai/gsm8k", "extra_info": {"index": k, "level": 3},
                "difficulty": 2} for k in range(8)]
    data = write(tmp_path / "p.jsonl", records)
    cfg = load_config(small_run("data=jsonl", f"data.path={data}",
                                "data.reward=[input_rewards:compute_score,input_rewards:trl_style]"))
    result = run(cfg, output_dir=tmp_path / "out")
    trained = [m for _, m in result.history if "rollout/raw_reward" in m]
    assert len(trained) == 2
    for m in trained:
        assert m["rollout/reward_dropped_frac"] == 0
        assert m["rollout/reward/compute_score/gsm_mean"] == 1.0
        assert m["rollout/reward/compute_score/level_mean"] == 3.0
        assert 0 <= m["rollout/reward/compute_score/index_mean"] <= 7
        assert m["rollout/reward/trl_style/messages_mean"] == 2.0
        assert m["rollout/reward/trl_style/difficulty_mean"] == 2.0
