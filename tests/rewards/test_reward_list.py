"""Several rewards (`data.reward=[...]`, `data.reward_weights`), what a reward is made of in the metrics
(rollout/reward/<name>_mean, a dict return's keys, rollout/rule_reward_mean), `async def` rewards, and pass@k's
threshold where the reward has no fixed scale. Values are checked against sums worked out by hand; the metric names
and values against a real short run (roles in this process)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from relax.config import load_config
from relax.config.compose import compose_checked, to_relax_config
from relax.config.reward_list_rules import component_names
from relax.config.validate import ConfigError
from relax.data.datasets import PromptItem
from relax.rewards.calls import RewardSpecError
from relax.rewards.combined import RewardList, reward_of, score_list
from relax.rewards.registry import get_reward_fn, score_responses
from relax.runner.rollout_driver.scoring import Scorer, count_metrics, merge_scores, scores_state, select_scores

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _list_rewards(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # list_rewards:<name>, in this process and in spawned reward workers


def violations(*overrides: str) -> list[str]:
    dc, unknown = compose_checked(list(overrides))
    try:
        to_relax_config(dc, unknown)
    except ConfigError as exc:
        return [v.message for v in exc.violations]
    return []


def test_the_reward_is_the_weighted_sum_of_the_entries_each_logged_by_name():
    rewards = reward_of(["digits", "list_rewards:first_digit", "list_rewards:as_dict"])
    assert isinstance(rewards, RewardList) and rewards.names == ["digits", "first_digit", "as_dict"]
    responses, labels = ["7 3", "x 7", "4"], ["7", "7", "3"]
    scores = score_list(rewards, [1.0, 0.5, 2.0], responses, labels)
    # by hand: digits("7 3","7") = 0.75 (the review's check), digits("x 7","7") = 0.5 * 1/2 + 0.5 * 1/2 = 0.5,
    # digits("4","3") = 0.5 * 1 + 0.5 * 0 = 0.5; first_digit: 1, 0, 1; as_dict: 0.25 when the label is a word of the
    # response: 0.25, 0.25, 0
    assert scores.rewards == pytest.approx([0.75 + 0.5 + 0.5, 0.5 + 0 + 0.5, 0.5 + 0.5 + 0.0])
    assert scores.failed == [False] * 3 and scores.first_error is None
    metrics = count_metrics(scores)
    assert metrics == pytest.approx({
        "rollout/reward/digits_mean": (0.75 + 0.5 + 0.5) / 3,
        "rollout/reward/first_digit_mean": 2 / 3,
        "rollout/reward/as_dict_mean": 0.5 / 3,
        "rollout/reward/as_dict/words_mean": (2 + 2 + 1) / 3,
        "rollout/reward/as_dict/hit_mean": 2 / 3,  # a bool counts; the text key "note" is not a metric
    })
    # default weights: 1.0 each
    assert score_list(rewards, None, responses, labels).rewards == pytest.approx([2.0, 0.75, 1.5])


def test_a_failed_entry_fails_the_response_and_its_mean_leaves_it_out():
    rewards = reward_of(["digits", "list_rewards:fails_on_x"])
    scores = score_list(rewards, [1.0, 3.0], ["7", "x 7", "7 7"], ["7", "7", "7"])
    assert scores.failed == [False, True, False] and scores.errors == 1
    assert scores.rewards == pytest.approx([1.0 + 3.0, 0.0, 1.0 + 3.0])  # (the failed one: the 0.0 placeholder)
    assert "no x allowed" in scores.first_error
    metrics = count_metrics(scores)
    # means over the responses whose calls all succeeded (digits("x 7","7") = 0.5 succeeded, and is left out)
    assert metrics["rollout/reward/digits_mean"] == pytest.approx(1.0)
    assert metrics["rollout/reward/fails_on_x_mean"] == pytest.approx(1.0)


def test_entries_in_worker_processes_under_the_time_limit():
    rewards = reward_of(["digits", "list_rewards:async_exact"])
    scores = score_list(rewards, [2.0, 1.0], ["7", "7 3"], ["7", "7"], ["p", "p"], timeout_s=30)
    assert scores.rewards == pytest.approx([2 * 1.0 + 1.0, 2 * 0.75 + 0.0]) and scores.failed == [False, False]


def test_every_unusable_entry_is_reported_at_once():
    with pytest.raises(RewardSpecError) as info:
        reward_of(["nope", "math", "list_rewards:missing", "list_rewards:first_digit"])
    text = str(info.value)
    assert "2 entries cannot be used" in text and "'nope': unknown reward" in text
    assert "has no attribute 'missing'" in text and "first_digit" not in text.split("cannot be used")[1]


def test_names_are_unique():
    assert component_names(["math", "a.b:score", "c:score", "http://judge:8000/v1/score"]) == [
        "math", "a.b.score", "c.score", "judge_8000_v1_score"]


def test_the_list_and_its_weights_are_validated_before_start_every_problem_at_once():
    assert violations("data.reward=[math,digits]") == []  # (was OmegaConf's "Cannot convert 'list' to string")
    found = violations("data.reward=[math,none,math,'http://u:p@host:1/s']", "data.reward_weights=[1,nan]")
    assert len(found) == 5, found
    assert any("'none' means no rule reward" in m for m in found)
    assert any("lists math more than once" in m for m in found)
    assert any("data.reward[3]=" in m and "user or password" in m and "u:p" not in m for m in found)
    assert any("has 2 weight(s) and data.reward lists 4" in m for m in found)
    assert any("each weight must be a finite number" in m for m in found)
    assert violations("data.reward=[]") == ["data.reward=[] names no reward (data.reward=none for no rule reward)"]
    assert any("weighs the entries of a list data.reward" in m for m in violations("data.reward_weights=[2]"))
    # the rules of one reward apply to each entry: the code_tests time limit, service options without a service
    found = violations("data.reward=[math,code_tests]", "data.reward_timeout_s=12", "data.reward_service.retries=1")
    assert any("data.reward_timeout_s=12.0 must be more than 15 s" in m for m in found)
    assert any("data.reward_service.retries=1 has no effect" in m for m in found)


def test_pass_at_k_needs_a_threshold_on_the_scale_of_a_reward_model_or_a_weighted_sum():
    rm = ["reward_model=classifier", "reward_model.path=/nonexistent"]
    found = violations(*rm, "train.eval_interval=1")
    assert any(m.startswith("train.eval_correct_threshold is left at its default") and "reward_model=classifier"
               in m and "or set reward_model=none" in m for m in found), found
    assert not any("eval_correct_threshold" in m for m in violations(*rm, "train.eval_interval=1",
                                                                     "train.eval_correct_threshold=6"))
    assert not any("eval_correct_threshold" in m for m in violations(*rm))  # no evaluation: no pass@k
    found = violations("data.reward=[math,digits]", "train.eval_interval=1")
    assert any("is a weighted sum" in m for m in found)
    assert violations("data.reward=math", "train.eval_interval=1") == []  # one rule reward: 1.0 is its full score
    assert violations("data.reward=[math]", "train.eval_interval=1") == []
    assert any("is a weighted sum" in m for m in violations("data.reward=[math]", "data.reward_weights=[2]",
                                                            "train.eval_interval=1"))


def test_a_dict_return_and_its_keys():
    scores = score_responses(get_reward_fn("list_rewards:as_dict"), ["a 7", "b"], ["7", "7"], timeout_s=30)
    assert scores.rewards == [0.25, 0.0] and scores.failed == [False, False]
    assert count_metrics(scores) == {"rollout/reward/words_mean": 1.5, "rollout/reward/hit_mean": 0.5}
    no_score = score_responses(lambda r, lab: {"acc": 1.0}, ["a"], ["7"])
    assert no_score.failed == [True] and "returned a dict without a 'score' (keys: acc)" in no_score.first_error


def test_async_rewards_are_awaited_and_their_time_limit_applies():
    fn = get_reward_fn("list_rewards:async_exact")
    assert score_responses(fn, ["7", "8"], ["7", "7"], ["p", "p"]).rewards == [1.0, 0.0]  # in this process
    limited = score_responses(fn, ["7", "8"], ["7", "7"], timeout_s=30)  # in the reward workers
    assert limited.rewards == [1.0, 0.0] and limited.failed == [False, False]
    hung = score_responses(get_reward_fn("list_rewards:async_hang"), ["7"], ["7"], timeout_s=1.0)
    assert hung.failed == [True] and hung.timeouts == 1


def test_extras_survive_merge_select_and_the_checkpoint_state():
    from relax.rewards.registry import Scores

    a = score_list(reward_of(["digits", "list_rewards:first_digit"]), None, ["7", "x"], ["7", "7"])
    b = score_responses(get_reward_fn("list_rewards:as_dict"), ["7"], ["7"])
    merged = merge_scores([a, b])  # a key one part lacks is NaN in its rows
    digits, words = merged.extras["rollout/reward/digits_mean"], merged.extras["rollout/reward/words_mean"]
    assert digits[:2] == [1.0, 0.0] and math.isnan(digits[2])
    assert math.isnan(words[0]) and math.isnan(words[1]) and words[2] == 1.0
    assert select_scores(merged, [2]).extras["rollout/reward/words_mean"] == [1.0]
    assert Scores(**scores_state(merged)).extras.keys() == merged.extras.keys()


class _Fixed:
    """A reward model scorer that returns fixed scores."""

    def __init__(self, values):
        self.values = values

    def score(self, items, responses):
        from relax.runner.reward_model import ModelScores

        return ModelScores(list(self.values), [False] * len(self.values), None, 0.0)


def test_the_rule_reward_before_the_reward_model_is_logged():
    from relax.data.tokenizer import build_tiny_tokenizer

    from .reward_models import batch

    tokenizer = build_tiny_tokenizer()
    items = [PromptItem([1], "7", "repeat 7", 0), PromptItem([1], "3", "repeat 3", 1)]
    responses = ["7 7", "is", "3", "what 3"]
    for reward in ("digits", "[digits,list_rewards:first_digit]"):
        cfg = load_config(["reward_model=classifier", "reward_model.path=/nonexistent", f"data.reward={reward}",
                           "rollout.n_samples_per_prompt=2", "reward_model.weight=2", "data.reward_timeout_s=null"])
        fn = reward_of(cfg.data.reward)
        scores = Scorer(cfg, tokenizer, fn, _Fixed([0.1, -0.4, 0.9, 0.3])).score(items, batch(tokenizer, responses))
        digits = [1.0, 0.0, 1.0, 0.5]  # digits_reward of each response, by hand
        rule = digits if reward == "digits" else [d + f for d, f in zip(digits, [1, 0, 1, 0], strict=True)]
        assert scores.rewards == pytest.approx([r + 2 * v for r, v in zip(rule, [0.1, -0.4, 0.9, 0.3], strict=True)])
        assert count_metrics(scores)["rollout/rule_reward_mean"] == pytest.approx(sum(rule) / 4)


def test_one_reward_logs_no_parts():
    """A single data.reward's metrics stay what they were: no rollout/reward/* without a dict return."""
    scores = score_responses(get_reward_fn("digits"), ["7"], ["7"])
    assert scores.extras == {} and count_metrics(scores) == {}


@pytest.mark.slow
def test_a_run_logs_each_entry_and_trains_on_their_weighted_sum(in_process, small_run, tmp_path):
    from relax.runner.train import run

    cfg = load_config(small_run("data.reward=[digits,list_rewards:first_digit,list_rewards:as_dict]",
                                "data.reward_weights=[1.0,0.5,2.0]", "data.reward_timeout_s=null",
                                "train.eval_interval=2", "train.eval_correct_threshold=1.5", "data.num_eval_prompts=4"))
    result = run(cfg, output_dir=tmp_path / "out")
    trained = [(step, m) for step, m in result.history if "rollout/raw_reward" in m]
    assert [step for step, _ in trained] == [0, 1]
    evaluated = {k: v for _, m in result.history for k, v in m.items() if k.startswith("eval/")}
    # evaluation scores with the same weighted sum (a failed or unscorable list would count reward_errors)
    assert 0 <= evaluated["eval/digits/pass_at_1"] <= 1 and evaluated["eval/digits/reward_errors"] == 0
    for _, m in trained:
        assert m["rollout/reward_dropped_frac"] == 0
        parts = [m["rollout/reward/digits_mean"], m["rollout/reward/first_digit_mean"],
                 m["rollout/reward/as_dict_mean"]]
        assert m["rollout/raw_reward"] == pytest.approx(parts[0] + 0.5 * parts[1] + 2.0 * parts[2], abs=1e-6)
        assert 0 <= m["rollout/reward/as_dict/hit_mean"] <= 1 and m["rollout/reward/as_dict/words_mean"] >= 0
        assert m["rollout/reward/as_dict_mean"] == pytest.approx(0.25 * m["rollout/reward/as_dict/hit_mean"])
        assert not any("note" in k for k in m)
    from mlflow.tracking import MlflowClient

    logged = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(result.run_id).data.metrics
    assert logged["rollout/reward/as_dict/words_mean"] == pytest.approx(trained[-1][1][
        "rollout/reward/as_dict/words_mean"])
    assert {"rollout/reward/digits_mean", "rollout/reward/first_digit_mean", "rollout/reward/as_dict_mean",
            "rollout/reward/as_dict/hit_mean"} <= logged.keys()


def test_a_dry_run_checks_each_entry_and_prints_the_sum(tmp_path, capfd):
    import socket

    from relax_train_inprocess import relax_train

    code, out, err = relax_train(["dry_run=true", "data.reward=[digits,list_rewards:first_digit]",
                                  "data.reward_weights=[1,0.5]", f"train.save_dir={tmp_path}/ckpt"], capfd)
    assert code == 0, out + err
    assert "reward=1 x digits + 0.5 x list_rewards:first_digit" in out and "every check a start runs" in out
    code, out, err = relax_train(["dry_run=true", "data.reward=[digits,list_rewards:nope]"], capfd)
    assert code == 2 and "has no attribute 'nope'" in err and "Traceback" not in out + err
    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        code, out, err = relax_train(["dry_run=true", f"data.reward=[digits,'http://127.0.0.1:{port}/score']"], capfd)
    assert code == 2 and f"data.reward[1]=http://127.0.0.1:{port}/score" in out + err, out + err


def test_a_service_entry_is_scored_batched_with_the_runs_service_options():
    from relax.config.schema import RewardServiceConfig

    from .test_remote_reward import Service

    service = Service()  # its reward: len(response) / 10
    try:
        rewards = reward_of(["digits", service.url])
        assert rewards.names == ["digits", "127.0.0.1_" + service.url.split(":")[2].replace("/", "_")]
        responses = ["7", "7 3", "x 7"]
        scores = score_list(rewards, [1.0, 2.0], responses, ["7"] * 3, timeout_s=30,
                            service_options=RewardServiceConfig(batch_size=2, backoff_s=0.01))
        # digits by hand: 1.0, 0.75, 0.5; the service: 0.1, 0.3, 0.3
        assert scores.rewards == pytest.approx([1.0 + 0.2, 0.75 + 0.6, 0.5 + 0.6]) and not any(scores.failed)
        # data.reward_service.batch_size=2; the two batches are sent at once, so they may arrive in either order
        assert sorted(len(r) for r in service.requests) == [1, 2]
    finally:
        service.close()
