"""Generative judges (reward_model=judge): the question from the template, the answer from a real model (on the
embedded engine, or behind an OpenAI-compatible URL: `relax-serve` started here with a key), the score read by the
parser; an answer without a readable score is counted (rollout/judge_parse_fail_frac) and its group left out, never
scored 0.

The judge is a tiny causal LM trained here (tests/rewards/reward_models.py) to answer "1" when the response holds a
digit and "0" when it does not, so what each response should score is known without the judge.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from relax.config import load_config
from relax.data.datasets import PromptItem
from relax.rewards.judge import get_parser, last_number, read_scores, score_tag
from relax.runner.reward_model import JudgeScorer, make_scorer, reward_model_metrics
from relax.runner.rollout_driver.scoring import Scorer, kept_groups

from .reward_models import JUDGE_TEMPLATE, batch, random_response, train_digit_judge

REPO = Path(__file__).resolve().parents[2]
# the tests share the module's trained models (and, for the judge, one relax-serve): one xdist worker runs them in a row
pytestmark = pytest.mark.xdist_group("judge")
QUIET = ["tracking.enabled=false", "tracking.progress=false", "cluster.cpus_per_node=1", "model.dtype=float32"]
KEY_ENV = "RELAX_TEST_JUDGE_KEY"


def judge_config(*extra: str):
    return load_config(["reward_model=judge", f"reward_model.template=\"{JUDGE_TEMPLATE}\"",
                        "reward_model.max_new_tokens=4", "reward_model.score_max=1", *QUIET, *extra])


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory) -> Path:
    return train_digit_judge(tmp_path_factory.mktemp("judge"), steps=150)


def cases(n: int = 12, seed: int = 4) -> tuple[list[PromptItem], list[str], list[float]]:
    """Items, responses (half with a digit), and the score each should get (1: it holds a digit)."""
    import random

    rng = random.Random(seed)
    responses = [random_response(rng, digits=0.0 if i % 2 else 0.4) for i in range(n)]
    responses = [r if i % 2 or any(c.isdigit() for c in r) else r + "5" for i, r in enumerate(responses)]
    items = [PromptItem([1], "5", "repeat 5", i // 2) for i in range(n)]
    return items, responses, [float(any(c.isdigit() for c in r)) for r in responses]


# ---------------------------------------------------------------------------------------------- parsing


def test_the_built_in_parsers_read_the_verdict():
    assert last_number("I would say 7.5") == 7.5 and last_number("3 of them, so 8") == 8.0
    assert last_number("no idea") is None
    assert score_tag("The answer is fine. Score: 9") == 9.0 and score_tag("SCORE = -1.5") == -1.5
    assert score_tag("9") is None
    assert get_parser("number") is last_number
    assert get_parser("rewards.reward_models:yes_no")("1") == 1.0
    with pytest.raises(ValueError, match="reward_model.parser='fancy': unknown parser"):
        get_parser("fancy")
    with pytest.raises(ValueError, match="cannot import module"):
        get_parser("no_such_module:fn")


def test_answers_without_a_score_in_range_are_parse_failures_not_zeros():
    def raising(answer):
        raise KeyError(answer)

    v = read_scores(last_number, ["8", "eleven", "11", "-1", None, "nan", "0"], 0, 10,
                    [None, None, None, None, "HTTP 500", None, None])
    assert v.scores == [8.0, None, None, None, None, None, 0.0]
    assert v.parse_failed == [False, True, True, True, False, True, False]
    assert "eleven" in v.first_error
    bad = read_scores(raising, ["8"], 0, 10)
    assert bad.scores == [None] and bad.parse_failed == [True] and "raised KeyError" in bad.first_error
    gone = read_scores(last_number, [None], 0, 10, ["HTTP 500: down"])
    assert gone.parse_failed == [False] and gone.first_error == "HTTP 500: down"


# ---------------------------------------------------------------------------------------------- embedded


@pytest.fixture(scope="module")
def judge_worker(judge_dir):
    from relax.roles.reward_model import JudgeWorker

    cfg = judge_config(f"reward_model.path={judge_dir}", "reward_model.dtype=float32", "reward_model.batch_size=5")
    return cfg, JudgeWorker(cfg)


def role_call(worker):
    return lambda method, *args: getattr(worker, method)(*args)


def test_a_judge_on_the_embedded_engine_scores_and_parses(judge_worker, judge_dir):
    cfg, worker = judge_worker
    items, responses, expected = cases()
    got = JudgeScorer(cfg, role_call(worker)).score(items, responses)
    assert got.values == expected and got.parse_failed == [False] * len(expected) and got.first_error is None

    # its answers are a plain Hugging Face greedy generation of the same question
    from transformers import AutoModelForCausalLM

    from relax.models.reward_model import judge_prompt_ids

    model = AutoModelForCausalLM.from_pretrained(str(judge_dir), dtype=torch.float32)
    answers, _, cut = worker.answer([JUDGE_TEMPLATE.format(response=r) for r in responses[:4]])
    assert cut == [False] * 4  # each answer ended at the judge's stop token
    for response, answer in zip(responses[:4], answers, strict=True):
        ids = torch.tensor([judge_prompt_ids(worker.tokenizer, JUDGE_TEMPLATE.format(response=response))])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                             eos_token_id=worker.tokenizer.eos_token_id, pad_token_id=0)
        assert answer == worker.tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


def test_a_judge_answering_outside_its_range_is_counted_and_its_group_left_out(judge_worker, judge_dir):
    """score_max=0.5: the judge's "1" is no score in range (a garbage answer), its "0" is one: every group holding a
    response with a digit is left out, the others are scored, and the failures are counted, not zeroed."""
    from relax.data.tokenizer import build_tiny_tokenizer
    from relax.rewards.digits import digits_reward

    _, worker = judge_worker
    cfg = judge_config(f"reward_model.path={judge_dir}", "reward_model.dtype=float32", "reward_model.score_max=0.5",
                       "rollout.n_samples_per_prompt=2", "reward_model.rule_weight=2", "data.reward_timeout_s=null")
    items, responses, expected = cases(8, seed=9)
    items = [PromptItem([1], "5", "repeat 5", g) for g in range(4)]
    responses = [responses[0], responses[2], responses[1], responses[3], responses[4], responses[5],
                 responses[7], responses[5]]  # groups: digit+digit, none+none, digit+none, none+none
    tokenizer = build_tiny_tokenizer()
    judge = JudgeScorer(cfg, role_call(worker))
    scores = Scorer(cfg, tokenizer, digits_reward, judge).score(items, batch(tokenizer, responses))
    digit = [any(c.isdigit() for c in r) for r in responses]
    assert scores.failed == digit and scores.parse_failures == sum(digit)
    assert digit == [True, True, False, False, True, False, False, False]  # (the groups as the comment says)
    assert kept_groups(scores.failed, 2).tolist() == [False, False, True, True, False, False, True, True]
    for i in (2, 3, 6, 7):  # kept: 2 x digits reward + 1 x the judge's 0
        assert scores.rewards[i] == pytest.approx(2 * digits_reward(responses[i], "5"))
    metrics = reward_model_metrics(cfg, scores.model_scores, scores.parse_failures, scores.model_time)
    assert metrics["rollout/judge_parse_fail_frac"] == pytest.approx(sum(digit) / len(digit))
    assert metrics["rollout/reward_model_score_mean"] == 0.0 and metrics["perf/reward_model_time"] > 0
    assert "holds no score in [0, 0.5]" in scores.first_error


def test_an_answer_cut_at_max_new_tokens_is_a_parse_failure_whatever_it_says(judge_dir):
    """max_new_tokens=1: the judge's "1" or "0" is cut before its stop token, so it is no verdict (counted in
    judge_parse_fail_frac, its group left out), though the parser would read it; the control, the same judge with room
    for its stop token (max_new_tokens=4), scores the same answers."""
    from relax.roles.reward_model import JudgeWorker

    items, responses, expected = cases(6)  # (the first 6 of the cases the test above checks the judge on)
    common = (f"reward_model.path={judge_dir}", "reward_model.dtype=float32", "reward_model.parser=number")
    short = judge_config(*common, "reward_model.max_new_tokens=1")
    worker = JudgeWorker(short)
    answers, errors, cut = worker.answer([JUDGE_TEMPLATE.format(response=r) for r in responses])
    assert answers == [str(int(e)) for e in expected] and cut == [True] * 6 and errors == [None] * 6
    got = JudgeScorer(short, role_call(worker)).score(items, responses)
    assert got.values == [None] * 6 and got.parse_failed == [True] * 6
    assert "cut at reward_model.max_new_tokens=1" in got.first_error
    assert reward_model_metrics(short, [float("nan")] * 6, sum(got.parse_failed), 0.1)[
        "rollout/judge_parse_fail_frac"] == 1.0

    roomy = judge_config(*common)
    got = JudgeScorer(roomy, role_call(JudgeWorker(roomy))).score(items, responses)
    assert got.values == expected and got.parse_failed == [False] * 6 and got.first_error is None


def test_a_judge_whose_weights_do_not_load_is_named_by_its_option_and_path(tmp_path, monkeypatch):
    """A judge directory the preflight passes (a causal LM's config.json, its tokenizer, a weights file: present, not
    read) whose weights do not load: the judge's role names reward_model.path and the path, as the preflight names
    the judge's files (before: safetensors' words alone, "Error while deserializing header: header too large"), the
    cause kept. What names the path already (relax's ModelFileError) and running out of memory (no bad file) pass
    as they are, not wrapped. The control: the same directory with the model's weights saved in it loads."""
    from safetensors import SafetensorError
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from relax.data.tokenizer import ModelFileError, build_tiny_tokenizer
    from relax.models.hf import build_model
    from relax.roles import reward_model as role
    from relax.runner.reward_model import check_reward_model

    tok, judge = build_tiny_tokenizer(), tmp_path / "judge"
    config = Qwen3Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, architectures=["Qwen3ForCausalLM"])
    config.save_pretrained(str(judge))
    tok.save_pretrained(str(judge))
    (judge / "model.safetensors").write_bytes(b"not safetensors")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # the role sets it for its process: restored after
    cfg = judge_config(f"reward_model.path={judge}", "reward_model.dtype=float32")
    check_reward_model(cfg)  # the preflight: the files are there
    with pytest.raises(ModelFileError) as info:
        role.JudgeWorker(cfg)
    assert str(info.value).startswith(f"the judge (reward_model.path={judge}) cannot be loaded: "), info.value
    assert isinstance(info.value.__cause__, SafetensorError), info.value.__cause__
    named, oom = ModelFileError(f"reward_model.path={str(judge)!r}: no weights"), torch.OutOfMemoryError("CUDA OOM")
    for error in (named, oom):
        def fail(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(role, "build_model", fail)
        with pytest.raises(type(error)) as raised:
            role.JudgeWorker(cfg)
        assert raised.value is error  # as it was raised
    Qwen3ForCausalLM(config).save_pretrained(str(judge))  # (model.safetensors, loadable)
    model = build_model(role.judge_model_config(cfg), len(tok), tok.pad_token_id, seed=0, key=role.PATH_KEY)
    assert model.config.num_hidden_layers == 1


# ---------------------------------------------------------------------------------------------- a URL


@contextlib.contextmanager
def relax_serve(model_dir: Path, log: Path, key: str) -> Iterator[str]:
    """`relax-serve` of the judge (its own process, its key from $RELAX_SERVE_API_KEY): its URL; stopped after."""
    from relax.rollout.sglang.process import start_server, stop_process

    env = {"RELAX_SERVE_API_KEY": key, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    # start_server: another port when the one picked free was taken before the server bound it (a run's own way)
    proc, port = start_server(lambda port: [sys.executable, "-m", "relax.cli.serve", "--port", str(port), "--threads",
                                            "1", "model.source=hf", f"model.path={model_dir}", "model.dtype=float32"],
                              host="127.0.0.1", url_host="127.0.0.1", log_path=log, timeout_s=180,
                              what="relax-serve", env=env)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def served_judge(judge_dir, tmp_path_factory) -> Iterator[str]:
    with relax_serve(judge_dir, tmp_path_factory.mktemp("serve") / "serve.log", "judge-secret-1") as url:
        yield url


@pytest.mark.slow
def test_a_judge_behind_an_openai_url_scores_and_parses_with_its_key(served_judge, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "judge-secret-1")
    cfg = judge_config("reward_model.engine=openai", f"reward_model.url={served_judge}/v1",
                       f"reward_model.api_key_env={KEY_ENV}", "reward_model.batch_size=4")
    items, responses, expected = cases()
    judge = make_scorer(cfg, None)
    try:
        got = judge.score(items, responses)
    finally:
        judge.close()
    assert got.values == expected and got.parse_failed == [False] * len(expected)

    # a wrong key: every call fails (counted as failed scores, not parse failures), and the key is never printed
    monkeypatch.setenv(KEY_ENV, "not-the-key")
    judge = make_scorer(cfg, None)
    try:
        got = judge.score(items[:2], responses[:2])
    finally:
        judge.close()
    assert got.values == [None, None] and got.parse_failed == [False, False]
    assert "HTTP 401" in got.first_error and "not-the-key" not in got.first_error


def series_run(tmp_path: Path, *extra: str, steps: int = 3):
    from relax.runner.train import run

    cfg = judge_config("data.reward=none", f"train.num_rollout={steps}", "rollout.rollout_batch_size=2",
                       "rollout.n_samples_per_prompt=4", "train.save=false", *extra)
    return run(cfg, output_dir=tmp_path / "out")


@pytest.mark.slow
def test_relax_train_scores_with_the_judge_on_its_role_and_through_the_url(judge_dir, served_judge, tmp_path,
                                                                            in_process, monkeypatch):
    # hybrid: the next batch generates while the judge scores this one (in the rollout stream's scoring thread)
    embedded = series_run(tmp_path / "embedded", f"reward_model.path={judge_dir}", "reward_model.dtype=float32",
                          "train.mode=hybrid")
    monkeypatch.setenv(KEY_ENV, "judge-secret-1")
    url = series_run(tmp_path / "url", "reward_model.engine=openai", f"reward_model.url={served_judge}/v1",
                     f"reward_model.api_key_env={KEY_ENV}", "train.mode=hybrid")
    for result in (embedded, url):
        assert result.series("rollout/judge_parse_fail_frac") == [0.0] * 3
        assert all(0.0 <= s <= 1.0 for s in result.series("rollout/reward_model_score_mean"))
        assert all(t > 0 for t in result.series("perf/reward_model_time"))
    # the same policy (same seed) and the same judge model: the same scores on either path
    assert embedded.series("rollout/reward_model_score_mean") == url.series("rollout/reward_model_score_mean")


@pytest.mark.slow
def test_a_garbage_judge_is_counted_and_the_job_fails_at_its_end(tmp_path, in_process):
    """An untrained judge answers noise: with parser score_tag nothing it says is a score. Every group is left out
    and counted (judge_parse_fail_frac 1, reward_dropped_frac 1, reward_errors), nothing trains on a 0, and the run
    goes through its steps (2, fewer than data.max_failed_reward_steps=3), then fails: no step trained
    (NothingTrained, relax-train's exit 1; before Dec 6 it finished, exit 0)."""
    from relax.data.tokenizer import build_tiny_tokenizer
    from relax.models.hf import build_model
    from relax.runner.errors import NothingTrained

    garbage = tmp_path / "garbage_judge"
    tokenizer = build_tiny_tokenizer()
    build_model(load_config([]).model, len(tokenizer), 0, seed=5).save_pretrained(str(garbage))
    tokenizer.save_pretrained(str(garbage))
    with pytest.raises(NothingTrained, match=r"^nothing trained: every group of every step was left out \(steps 1-2: "
                       ) as info:
        series_run(tmp_path, f"reward_model.path={garbage}", "reward_model.dtype=float32",
                   "reward_model.parser=score_tag", steps=2)
    result = info.value.result  # what the run logged
    assert result.series("rollout/judge_parse_fail_frac") == [1.0, 1.0]
    assert result.series("rollout/reward_dropped_frac") == [1.0, 1.0]
    assert result.series("rollout/reward_errors") == [8.0, 8.0]
    assert all(not any(k.startswith("train/") for k in metrics) for _, metrics in result.history)  # no step trained
