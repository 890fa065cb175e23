"""Evaluation: the pass@k estimator against brute-force enumeration, the eval metrics of a hand-built batch, when
the loop evaluates, eval sets that fail at start, and a real run logging eval/<set>/... for three eval sets."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch

from relax.batch import Samples
from relax.config import load_config
from relax.metrics import eval_metric
from relax.rewards.registry import Scores
from relax.runner.errors import RunError
from relax.runner.step_metrics import eval_metrics, final_eval_summary, pass_at_k
from relax.runner.train import evaluates_after, prepare, run


def brute_force_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """The share of the k-subsets of n responses (the first c of them correct) that hold a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_the_share_of_k_subsets_with_a_correct_response(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(brute_force_pass_at_k(n, c, k)), rel=1e-12, abs=1e-15), \
                (n, c, k)


def test_pass_at_k_edge_cases():
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 0, 5) == 0.0  # nothing correct
    assert pass_at_k(5, 5, 1) == 1.0 and pass_at_k(5, 5, 3) == 1.0  # everything correct
    assert pass_at_k(5, 3, 3) == 1.0 and pass_at_k(5, 2, 4) == 1.0  # n - c < k: every k-subset holds a correct one
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)  # pass_at_1 is the share of correct responses
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0
    for n, c, k in ((3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)):
        with pytest.raises(ValueError, match="pass_at_k"):
            pass_at_k(n, c, k)


def test_pass_at_k_is_stable_where_the_binomials_are_huge():
    n, c, k = 2000, 3, 100  # C(2000, 100) has 189 digits: no float holds it
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)
    assert pass_at_k(10_000, 1, 1) == pytest.approx(1e-4, rel=1e-12)


def hand_built(lengths: list[int], finish: list[str], T: int = 12) -> Samples:
    N = len(lengths)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    return Samples(prompt_ids=torch.zeros(N, 2, dtype=torch.long), prompt_mask=torch.ones(N, 2, dtype=torch.long),
                   response_ids=torch.zeros(N, T, dtype=torch.long), response_mask=mask,
                   rollout_logp=torch.zeros(N, T), finish_reason=finish)


def test_eval_metrics_of_a_hand_built_batch():
    # 3 prompts x 4 responses; correct: reward >= 1. Prompt 2's second call failed (placeholder 0, left out).
    rewards = [1.0, 0.0, 0.5, 1.0,
               0.0, 0.0, 0.0, 0.0,
               1.0, 0.0, 1.0, 0.0]
    failed = [False] * 9 + [False] * 3
    failed[9] = True
    lengths = [3, 12, 5, 4, 12, 12, 1, 2, 6, 7, 8, 12]
    finish = ["length" if n == 12 else "stop" for n in lengths]
    out = eval_metrics("math", hand_built(lengths, finish), Scores(rewards, failed), n=4, pass_k=[1, 2, 4],
                       threshold=1.0)
    # per prompt (scored, correct, mean reward): (4, 2, 0.625), (4, 0, 0), (3, 2, 2/3)
    assert out == pytest.approx({
        "eval/math/mean_at_4": (0.625 + 0 + 2 / 3) / 3,
        "eval/math/pass_at_1": (2 / 4 + 0 + 2 / 3) / 3,
        "eval/math/pass_at_2": ((1 - 1 / 6) + 0 + 1) / 3,  # 1 - C(2,2)/C(4,2); prompt 2: n - c = 1 < 2
        "eval/math/pass_at_4": (1 + 0) / 2,  # prompt 2 has 3 scored responses: left out of pass_at_4
        "eval/math/response_len": sum(lengths) / 12,
        "eval/math/truncated_frac": 4 / 12,
        "eval/math/reward_errors": 1.0,
    })
    # a lower threshold counts the 0.5 as correct
    assert eval_metrics("math", hand_built(lengths, finish), Scores(rewards, failed), n=4, pass_k=[1],
                        threshold=0.5)["eval/math/pass_at_1"] == pytest.approx((3 / 4 + 0 + 2 / 3) / 3)


def test_eval_metrics_without_a_scored_response_are_nan():
    out = eval_metrics("x", hand_built([1, 1], ["stop", "stop"]), Scores([0.0, 0.0], [True, True]), n=2,
                       pass_k=[1, 2], threshold=1.0)
    assert all(math.isnan(out[f"eval/x/{m}"]) for m in ("mean_at_2", "pass_at_1", "pass_at_2"))
    assert out["eval/x/reward_errors"] == 2.0


def test_the_closing_summary_shows_the_last_evaluation():
    history = [(0, {"rollout/raw_reward": 0.1}),
               (1, {"eval/digits/mean_at_4": 0.3125, "eval/digits/pass_at_1": 0.3125, "eval/digits/pass_at_4": 0.75,
                    "eval/digits/response_len": 3.0, "eval/alpha/mean_at_4": 0.5, "eval/alpha/pass_at_1": 0.5}),
               (2, {"rollout/raw_reward": 0.2})]
    assert final_eval_summary(history) == {"eval digits (step 1)": "mean@4 0.3125  pass@1 0.3125  pass@4 0.75",
                                           "eval alpha (step 1)": "mean@4 0.5  pass@1 0.5"}
    assert final_eval_summary(history[:1]) == {}


def test_the_loop_evaluates_every_interval_and_after_the_last_step():
    def steps(interval: int, num_rollout: int) -> list[int]:
        overrides = [f"train.num_rollout={num_rollout}", f"train.eval_interval={interval}"]
        cfg = load_config(overrides)
        return [s for s in range(num_rollout) if evaluates_after(cfg, s)]

    assert steps(2, 5) == [1, 3, 4]
    assert steps(2, 4) == [1, 3]
    assert steps(10, 3) == [2]  # only the final evaluation
    assert steps(0, 3) == []


def write_prompts(path, digits) -> str:
    path.write_text("".join(f'{{"prompt": "repeat {d}", "label": "{d}"}}\n' for d in digits))
    return str(path)


def test_an_eval_set_that_cannot_be_read_stops_the_run_at_start(tmp_path):
    good = write_prompts(tmp_path / "good.jsonl", range(3))
    missing = tmp_path / "missing.jsonl"
    cfg = load_config(["train.eval_interval=1", f"+data.eval_sets={{good:'{good}',extra:'{missing}'}}"])
    with pytest.raises(RunError, match=rf"data.eval_sets.extra: data file {missing} does not exist"):
        prepare(cfg)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "repeat 1", "label": "1"}\n{"prompt": \n')
    cfg = load_config(["train.eval_interval=1", f"+data.eval_sets={{bad:'{tmp_path / 'bad.jsonl'}'}}"])
    with pytest.raises(RunError, match=r"data.eval_sets.bad: .*bad.jsonl:2: invalid JSON"):
        prepare(cfg)


def test_eval_sets_are_named_and_cut_to_num_eval_prompts(tmp_path):
    a = write_prompts(tmp_path / "a.jsonl", range(6))
    cfg = load_config(["train.eval_interval=1", "data.num_eval_prompts=4", f"+data.eval_sets={{alpha:'{a}'}}"])
    eval_sets = prepare(cfg).eval_sets
    assert {name: len(items) for name, items in eval_sets.items()} == {"digits": 4, "alpha": 4}
    assert [item.label for item in eval_sets["alpha"]] == ["0", "1", "2", "3"]
    assert prepare(load_config([])).eval_sets == {}  # no evaluation: no eval set


@pytest.mark.slow
def test_a_run_logs_every_eval_set_at_the_evaluated_steps(in_process, small_run, tmp_path):
    from mlflow.tracking import MlflowClient

    a = write_prompts(tmp_path / "alpha.jsonl", range(6))
    b = write_prompts(tmp_path / "beta.jsonl", range(3, 9))
    n, ks = 4, [1, 2, 4]
    cfg = load_config(small_run(
        "train.eval_interval=2", "data.num_eval_prompts=4", f"rollout.eval_n_samples_per_prompt={n}",
        "rollout.eval_temperature=1.0", "train.eval_pass_k=[1,2,4]", "data.reward=first_digit_reward:reward",
        f"+data.eval_sets={{alpha:'{a}',beta:'{b}'}}", steps=3))
    result = run(cfg, output_dir=tmp_path / "out")
    sets = ["digits", "alpha", "beta"]  # the task's eval split, then data.eval_sets
    names = [f"mean_at_{n}", *(f"pass_at_{k}" for k in ks), "response_len", "truncated_frac", "reward_errors"]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    logged = client.get_run(result.run_id).data.metrics
    assert sorted(k for k in logged if k.startswith("eval/")) == sorted(f"eval/{s}/{m}" for s in sets for m in names)
    for s in sets:
        # every 2 steps (after step 1) and after the last one (step 2), each at the number of training steps in the
        # weights it evaluated: 2 and 3
        assert sorted(h.step for h in client.get_metric_history(result.run_id, eval_metric(s, "pass_at_1"))) == [2, 3]
        assert [step for step, _ in result.history] == [0, 1, 2, 3]  # step 3: the final evaluation alone
        for step, metrics in result.history:
            if step < 2:
                assert not any(k.startswith("eval/") for k in metrics)
                continue
            passes = [metrics[eval_metric(s, f"pass_at_{k}")] for k in ks]
            assert all(0.0 <= p <= 1.0 for p in passes), (s, step, passes)
            assert passes == sorted(passes), (s, step, passes)  # pass@k does not decrease in k
            # 0/1 rewards: pass_at_1 is the share of correct responses, which is the mean reward
            assert passes[0] == pytest.approx(metrics[eval_metric(s, f"mean_at_{n}")], abs=1e-12)
            assert 1.0 <= metrics[eval_metric(s, "response_len")] <= cfg.rollout.max_response_len
            assert 0.0 <= metrics[eval_metric(s, "truncated_frac")] <= 1.0
            assert metrics[eval_metric(s, "reward_errors")] == 0.0
    # the tiny model starts some responses with a digit: the metrics have something to count
    assert any(0.0 < m[f"eval/{s}/pass_at_{n}"] for _, m in result.history[2:] for s in sets)
