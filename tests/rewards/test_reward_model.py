"""The reward-model role (reward_model=classifier): its scores are a plain Hugging Face forward's, they combine with the
rule reward by the declared weights, a failed score leaves its group out (never a 0), bad configs are refused before
anything starts, the plan places it, and a policy learns against it.

The learning run uses the real loop, roles and backends with the roles in this process (tests/inprocess_ray.py); its
negative control is the same run against the negated score (reward_model.weight=-1), which drives the digit share of
the responses down instead of up: the rise is the reward model's signal, not the task's.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from relax_train_inprocess import relax_train

from relax.config import ConfigError, load_config
from relax.config.reward_model_rules import template_problem
from relax.data.datasets import PromptItem
from relax.runner.reward_model import ModelScores, RewardModelScorer, check_reward_model, reward_model_metrics
from relax.runner.rollout_driver.scoring import Scorer, kept_groups

from .reward_models import batch, digit_share, random_response, tiny_classifier, train_digit_classifier

# the tests share the module's trained models (and, for the judge, one relax-serve): one xdist worker runs them in a row
pytestmark = pytest.mark.xdist_group("reward_model")
QUIET = ["tracking.enabled=false", "tracking.progress=false", "cluster.cpus_per_node=1", "model.dtype=float32"]


@pytest.fixture(scope="module")
def untrained(tmp_path_factory) -> Path:
    """A tiny sequence-classification model, untrained, saved with the tiny tokenizer."""
    directory = tmp_path_factory.mktemp("rm_untrained")
    model, tokenizer = tiny_classifier(seed=3)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def rm_config(path: Path, *extra: str):
    return load_config(["reward_model=classifier", f"reward_model.path={path}", "reward_model.dtype=float32",
                        *QUIET, *extra])


# ---------------------------------------------------------------------------------------------- the scores


def test_scores_equal_a_plain_hf_forward_of_each_text_alone(untrained):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from relax.roles.reward_model import ClassifierWorker

    worker = ClassifierWorker(rm_config(untrained, "reward_model.batch_size=3"))
    rng = random.Random(0)
    prompts = [[{"role": "user", "content": f"repeat {rng.randint(0, 9)}"}] for _ in range(7)] + ["what is 3 + 4 ?"]
    responses = [random_response(rng) for _ in prompts]  # lengths differ: batches of 3 are padded
    got, errors = worker.score(prompts, responses)
    assert errors == [None] * len(prompts)

    model = AutoModelForSequenceClassification.from_pretrained(str(untrained), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(untrained))
    for prompt, response, value in zip(prompts, responses, got, strict=True):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            expected = float(model(input_ids=ids).logits[0, 0])
        assert value == pytest.approx(expected, abs=1e-5)
    assert len(set(got)) == len(got)  # (the texts differ, so do their scores: nothing constant passes)


EOS_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"


def eos_terminated(directory: Path, *, declared_pad: str) -> Path:
    """A tiny classifier whose chat template ends every turn with the EOS token, saved with its config declaring no
    pad id and its tokenizer without a pad token (`declared_pad="none"`: many Llama-style reward models ship so), or
    declaring pad = eos (`"eos"`: what TRL's RewardTrainer saves for a tokenizer without one)."""
    model, tokenizer = tiny_classifier(seed=5)
    tokenizer.chat_template = EOS_TEMPLATE
    if declared_pad == "none":
        tokenizer.pad_token = None
        model.config.pad_token_id = None
    else:
        tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def hf_alone(directory: Path, rows: list[list[int]]) -> list[float]:
    """Each row's logit from a plain Hugging Face forward of that row alone, the model as saved (no padding)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(directory), dtype=torch.float32)
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([row])).logits[0, 0]) for row in rows]


@pytest.mark.parametrize("declared_pad", ["none", "eos"])
def test_a_batch_scores_as_each_text_alone_when_texts_end_in_eos(tmp_path, declared_pad):
    """The reviewer's case: a reward model declaring no pad id, whose texts end in its EOS token. Relax made pad =
    eos, so the head read the token before every trailing EOS: scores differed from the checkpoint's own (a forward
    of the text alone reads its last token). Now a batch scores as each text alone, for a checkpoint declaring no
    pad id and for one declaring pad = eos (whose own reading skips trailing EOS tokens)."""
    from relax.roles.reward_model import ClassifierWorker

    directory = eos_terminated(tmp_path / "rm", declared_pad=declared_pad)
    worker = ClassifierWorker(rm_config(directory, "reward_model.batch_size=3"))
    eos = worker.tokenizer.eos_token_id
    rng = random.Random(1)
    prompts = [[{"role": "user", "content": f"repeat {rng.randint(0, 9)}"}] for _ in range(7)]
    responses = [random_response(rng) for _ in prompts]  # lengths differ: batches of 3 are padded
    rows = worker.inputs(prompts, responses)
    assert all(row[-1] == eos for row in rows)  # every scored text ends in EOS
    got, errors = worker.score(prompts, responses)
    assert errors == [None] * len(rows)
    assert got == pytest.approx(hf_alone(directory, rows), abs=1e-5)
    if declared_pad == "none":  # (the control: the token before the EOS, what Relax read, scores otherwise)
        before = hf_alone(directory, [row[:-1] for row in rows])
        assert all(abs(a - b) > 1e-3 for a, b in zip(got, before, strict=True))


def test_a_batch_holding_every_token_id_scores_each_text_alone(tmp_path):
    """Without a declared pad id, a batch that holds every id of the vocabulary (no id is free to pad with) is scored
    one text at a time: still each text's own score."""
    from relax.models.reward_model import classifier_scores, load_classifier

    directory = eos_terminated(tmp_path / "rm", declared_pad="none")
    model, _ = load_classifier(str(directory), torch.float32, "cpu")
    vocab = model.get_input_embeddings().num_embeddings
    rows = [list(range(vocab)), [3, 5, 2], list(range(vocab - 1, 10, -1))]
    got, errors = classifier_scores(model, rows, batch_size=3, max_length=4 * vocab, device="cpu")
    assert errors == [None] * 3
    assert got == pytest.approx(hf_alone(directory, rows), abs=1e-5)


def test_a_text_longer_than_max_length_gets_no_score_rather_than_a_cut_one(untrained):
    from relax.roles.reward_model import ClassifierWorker

    worker = ClassifierWorker(rm_config(untrained, "reward_model.max_length=20"))
    values, errors = worker.score(["repeat 7", "repeat 7"], ["7", "7 7 7 7 7 7 7 7 7 7 7 7 7 7"])
    assert values[0] is not None and values[1] is None
    assert "reward_model.max_length=20" in errors[1]


def template_free(directory: Path, *, pair_marked: bool) -> Path:
    """A tiny classifier whose tokenizer has no chat template: the tiny tokenizer as it is (its text pair is the two
    texts glued: "repeat 7" + "7" encodes as "repeat 77"), or with BERT's pair marks ([CLS] a [SEP] b [SEP])."""
    from tokenizers.processors import TemplateProcessing
    from transformers import Qwen3ForSequenceClassification

    from relax.config.schema import ModelConfig
    from relax.data.tokenizer import build_tiny_tokenizer
    from relax.models.hf import qwen3_config

    tokenizer = build_tiny_tokenizer(extra_special=["[CLS]", "[SEP]"] if pair_marked else [])
    if pair_marked:
        cls, sep = tokenizer.convert_tokens_to_ids(["[CLS]", "[SEP]"])
        tokenizer._tokenizer.post_processor = TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tokenizer.chat_template = None
    config = qwen3_config(ModelConfig(), len(tokenizer), tokenizer.pad_token_id)
    config.num_labels, config.tie_word_embeddings = 1, False
    torch.manual_seed(4)
    Qwen3ForSequenceClassification(config).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


@pytest.mark.parametrize("pair_marked", [True, False])
def test_without_a_chat_template_prompt_and_response_are_kept_apart(tmp_path, pair_marked):
    """The reviewer's case: "repeat 7" and the response "7" were scored as "repeat 77". Now the score is a plain HF
    forward of the tokenizer's text pair, tokenizer(prompt, response), where the tokenizer marks the pair, else of
    tokenizer(prompt + "\\n" + response); either way not of the glued text (the control: its score differs)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from relax.models.reward_model import conversation_text
    from relax.roles.reward_model import ClassifierWorker

    directory = template_free(tmp_path / "rm", pair_marked=pair_marked)
    worker = ClassifierWorker(rm_config(directory))
    assert not worker.tokenizer.chat_template
    prompts = [[{"role": "user", "content": "repeat 7"}], "repeat 3", [{"role": "user", "content": "repeat 7"}]]
    responses = ["7", "3 3", "is 7"]
    got, errors = worker.score(prompts, responses)
    assert errors == [None] * 3

    model = AutoModelForSequenceClassification.from_pretrained(str(directory), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))

    def forward(encoded) -> float:
        with torch.no_grad():
            return float(model(input_ids=torch.tensor([encoded["input_ids"]])).logits[0, 0])

    texts = ["repeat 7", "repeat 3", "repeat 7"]
    for text, response, value in zip(texts, responses, got, strict=True):
        documented = tokenizer(text, response) if pair_marked else tokenizer(text + "\n" + response)
        assert value == pytest.approx(forward(documented), abs=1e-5)
        assert value != pytest.approx(forward(tokenizer(text + response)), abs=1e-5)  # the glued text's score
    if pair_marked:
        sep = tokenizer.convert_tokens_to_ids("[SEP]")
        assert worker.inputs(prompts[:1], responses[:1])[0].count(sep) == 2
    assert conversation_text(tokenizer, prompts[0], "7") == "repeat 7\n7"  # (was "repeat 77")


class Fixed(RewardModelScorer):
    """A reward model whose scores the test sets (None: no score), to check how the scorer combines them."""

    def __init__(self, values, parse_failed=None):
        self.values, self.parse_failed = values, parse_failed
        self.seen: list = []

    def score(self, items, responses):
        self.seen.append((list(items), list(responses)))
        return ModelScores(list(self.values), self.parse_failed or [False] * len(self.values),
                           "no score" if None in self.values else None, 0.25)


@pytest.mark.parametrize("rule", ["digits", "none"])
def test_scores_combine_with_the_rule_reward_by_the_declared_weights(untrained, rule):
    from relax.data.tokenizer import build_tiny_tokenizer
    from relax.rewards.digits import digits_reward

    extra = ["reward_model.rule_weight=0.5"] if rule == "digits" else []
    cfg = rm_config(untrained, f"data.reward={rule}", "rollout.n_samples_per_prompt=2", "reward_model.weight=2",
                    "data.reward_timeout_s=null", *extra)  # (rule calls in this process: no worker processes)
    tokenizer = build_tiny_tokenizer()
    items = [PromptItem([1], "7", "repeat 7", 0, messages=[{"role": "user", "content": "repeat 7"}]),
             PromptItem([1], "3", "repeat 3", 1)]
    responses = ["7 7", "is", "3", "what 3"]
    model = Fixed([0.1, -0.4, 0.9, 0.3])
    scores = Scorer(cfg, tokenizer, None if rule == "none" else digits_reward, model).score(items,
                                                                                         batch(tokenizer, responses))
    labels = ["7", "7", "3", "3"]
    rule_part = [0.5 * digits_reward(r, lab) if rule == "digits" else 0.0 for r, lab in zip(responses, labels,
                                                                                             strict=True)]
    assert scores.rewards == pytest.approx([p + 2 * v for p, v in zip(rule_part, model.values, strict=True)])
    assert scores.failed == [False] * 4 and scores.model_scores == pytest.approx(model.values)
    seen_items, seen_texts = model.seen[0]
    assert seen_texts == responses and [i.index for i in seen_items] == [0, 0, 1, 1]
    metrics = reward_model_metrics(cfg, scores.model_scores, scores.parse_failures, scores.model_time)
    assert metrics == {"perf/reward_model_time": 0.25,
                       "rollout/reward_model_score_mean": pytest.approx(sum(model.values) / 4)}


def test_a_response_without_a_score_leaves_its_group_out_and_is_counted_not_zeroed(untrained):
    from relax.data.tokenizer import build_tiny_tokenizer
    from relax.rewards.digits import digits_reward

    cfg = rm_config(untrained, "rollout.n_samples_per_prompt=2", "data.reward_timeout_s=null")
    tokenizer = build_tiny_tokenizer()
    items = [PromptItem([1], "7", "repeat 7", 0), PromptItem([1], "3", "repeat 3", 1)]
    scores = Scorer(cfg, tokenizer, digits_reward, Fixed([0.5, None, 0.2, 0.3])).score(
        items, batch(tokenizer, ["7", "7", "3", "3"]))
    assert scores.failed == [False, True, False, False] and scores.errors == 1
    assert "reward_model=classifier" in scores.first_error
    assert kept_groups(scores.failed, 2).tolist() == [False, False, True, True]
    assert torch.isnan(torch.tensor(scores.model_scores[1]))
    metrics = reward_model_metrics(cfg, scores.model_scores, scores.parse_failures, scores.model_time)
    assert metrics["rollout/reward_model_score_mean"] == pytest.approx((0.5 + 0.2 + 0.3) / 3)

    raising = rm_config(untrained, "rollout.n_samples_per_prompt=2", "data.reward_error=raise",
                        "data.reward_timeout_s=null")
    from relax.runner.errors import RunError

    with pytest.raises(RunError, match="reward_model=classifier failed"):
        Scorer(raising, tokenizer, digits_reward, Fixed([0.5, None, 0.2, 0.3])).score(
            items, batch(tokenizer, ["7", "7", "3", "3"]))


def test_failed_scores_are_warned_of_on_the_console_like_failed_reward_calls(untrained, caplog):
    """The reviewer's case: texts over reward_model.max_length left every group out with nothing on the console. Now
    the batch's first failure is warned of by the same warning as data.reward's (one per batch); the control, a batch
    the classifier scores whole, warns of nothing."""
    import logging

    from relax.data.tokenizer import build_tiny_tokenizer
    from relax.roles.reward_model import ClassifierWorker
    from relax.runner.reward_model import ClassifierScorer

    tokenizer = build_tiny_tokenizer()
    items = [PromptItem([1], "7", "repeat 7", 0), PromptItem([1], "3", "repeat 3", 1)]
    responses = ["7 7 7 7 7 7 7 7 7 7 7 7 7 7", "7 7 7 7 7 7 7 7 7 7 7 7 7", "3", "3 3"]
    for max_length, warned in ((20, True), (1024, False)):
        cfg = rm_config(untrained, "rollout.n_samples_per_prompt=2", "data.reward=none",
                        f"reward_model.max_length={max_length}")
        worker = ClassifierWorker(cfg)
        scorer = ClassifierScorer(cfg, lambda method, *args, w=worker: getattr(w, method)(*args))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="relax"):
            scores = Scorer(cfg, tokenizer, None, scorer).score(items, batch(tokenizer, responses))
        lines = [r.getMessage() for r in caplog.records if "failed on a response" in r.getMessage()]
        assert scores.failed == [warned, warned, False, False]
        if warned:
            assert len(lines) == 1 and lines[0].startswith("reward_model=classifier failed on a response (its group "
                                                           "is left out of the loss): the reward model gave no score")
            assert "more than reward_model.max_length=20" in lines[0]
        else:
            assert lines == [], lines


# ------------------------------------------------------------------------------------- refused before start


def test_bad_reward_model_configs_are_refused_together_before_anything_starts(monkeypatch):
    monkeypatch.delenv("RELAX_TEST_JUDGE_KEY", raising=False)
    with pytest.raises(ConfigError) as caught:
        load_config(["reward_model=judge", "reward_model.engine=openai", "reward_model.template=\"rate it\"",
                     "reward_model.api_key_env=RELAX_TEST_JUDGE_KEY", "reward_model.path=/some/judge",
                     "reward_model.score_min=5", "reward_model.score_max=1", "reward_model.parser=fancy"])
    text = str(caught.value)
    for part in ("reward_model.template has no {response} placeholder", "reward_model.url=http(s)://",
                 "environment variable RELAX_TEST_JUDGE_KEY is not set", "reward_model.path='/some/judge' has no "
                 "effect with reward_model.engine=openai", "reward_model.score_min=5.0 must be <",
                 "reward_model.parser='fancy': unknown"):
        assert part in text, text
    assert len(caught.value.violations) == 6

    with pytest.raises(ConfigError) as caught:
        load_config(["reward_model=classifier", "reward_model.weight=0", "reward_model.template=\"{response}\""])
    text = str(caught.value)
    assert "reward_model.kind=classifier needs reward_model.path" in text
    assert "reward_model.weight=0" in text and "reward_model.template" in text

    with pytest.raises(ConfigError, match="without a reward model"):
        load_config(["reward_model.path=/x"])
    with pytest.raises(ConfigError, match="has no effect without GPUs"):
        load_config(["reward_model=classifier", "reward_model.path=/x", "reward_model.colocate=true"])
    with pytest.raises(ConfigError, match="rule_weight=0.5 has no effect with data.reward=none"):
        load_config(["reward_model=classifier", "reward_model.path=/x", "data.reward=none",
                     "reward_model.rule_weight=0.5"])
    # data.reward=none needs a reward model on single-turn data (then it is the only reward)
    with pytest.raises(ConfigError, match="need a reward function or a reward model"):
        load_config(["data.reward=none"])
    assert load_config(["reward_model=classifier", "reward_model.path=/x", "data.reward=none"]).data.reward == "none"


def test_template_problems_name_the_field():
    assert template_problem("score {response} for {prompt} ({label})") is None
    assert "{answer}" in template_problem("score {answer}")
    assert "no {response}" in template_problem("score it")
    assert "not a format string" in template_problem("score {response")
    # a field nested in a format spec would be filled by each sample's label as the judge is called
    assert "{response:>{label}}" in template_problem("score {response:>{label}}")
    assert template_problem("score {response:>20}") is None  # the control: a spec written as it is


def test_the_files_are_checked_before_start(untrained, tmp_path):
    check_reward_model(rm_config(untrained))
    with pytest.raises(FileNotFoundError, match="reward_model.path='.*nowhere'"):
        check_reward_model(rm_config(tmp_path / "nowhere"))
    # a causal LM is no classifier
    from relax.data.tokenizer import build_tiny_tokenizer
    from relax.models.hf import build_model

    lm = tmp_path / "lm"
    tokenizer = build_tiny_tokenizer()
    build_model(load_config([]).model, len(tokenizer), 0, seed=0).save_pretrained(str(lm))
    with pytest.raises(ValueError, match="no \\*ForSequenceClassification"):
        check_reward_model(rm_config(lm))

    # ... and a classifier is no judge (the reviewer's case: it loaded with a random LM head and passed dry_run);
    # the control: the causal LM, with its tokenizer, is one
    tokenizer.save_pretrained(str(lm))
    judge = ["reward_model=judge", "reward_model.template=\"{response}\"", *QUIET]
    with pytest.raises(ValueError, match="Qwen3ForSequenceClassification'\\] has no causal LM"):
        check_reward_model(load_config([*judge, f"reward_model.path={untrained}"]))
    check_reward_model(load_config([*judge, f"reward_model.path={lm}"]))


def test_dry_run_shows_the_reward_model_and_refuses_a_missing_one(tmp_path, capfd, ray_not_started, untrained):
    common = [*QUIET, f"train.save_dir={tmp_path}/ckpt", "reward_model=classifier"]
    code, out, err = relax_train(["dry_run=true", f"reward_model.path={untrained}", *common], capfd)
    assert code in (0, None), err
    assert f"classifier {untrained} (score: its logit)" in out
    assert "reward_model=classifier: 1 x data.reward + 1 x its score" in out  # the config's summary
    assert any(line.split()[:2] == ["ok", "reward_model"] for line in out.splitlines()), out

    code, out, err = relax_train(["dry_run=true", f"reward_model.path={tmp_path / 'missing'}", *common], capfd)
    assert code == 2 and "reward_model.path=" in err and "missing" in err
    assert any(line.split()[:2] == ["failed", "reward_model"] for line in out.splitlines()), out

    # a judge pointed at the classifier's checkpoint is refused too
    code, out, err = relax_train(["dry_run=true", f"reward_model.path={untrained}", *QUIET,
                                  f"train.save_dir={tmp_path}/ckpt", "reward_model=judge"], capfd)
    assert code == 2 and "has no causal LM" in err, err
    assert any(line.split()[:2] == ["failed", "reward_model"] for line in out.splitlines()), out
    assert not ray_not_started


def test_a_start_refuses_a_missing_reward_model_before_ray(tmp_path, ray_not_started):
    from relax.runner.errors import RunError
    from relax.runner.train import prepare, run

    cfg = rm_config(tmp_path / "missing", f"train.save_dir={tmp_path}/ckpt")
    with pytest.raises(RunError, match="reward_model.path='.*missing'"):
        run(cfg, output_dir=tmp_path / "out")
    with pytest.raises(RunError, match="reward_model.path='.*missing'"):
        prepare(cfg)
    assert not ray_not_started


# ---------------------------------------------------------------------------------------------- the plan


def test_the_plan_places_the_reward_model():
    from relax.runner.plan import build_plan

    cpu = build_plan(load_config(["reward_model=classifier", "reward_model.path=/rm"]))
    rm = cpu.role("reward_model")
    assert (rm.replicas, rm.backend, rm.gpus, rm.cpus) == (1, "torch", 0.0, 0.1)
    assert "reward_model" in cpu.render() and "classifier /rm" in cpu.render()

    shared = build_plan(load_config(["reward_model=classifier", "reward_model.path=/rm", "cluster=1xgpu"]))
    rm = shared.role("reward_model")
    assert rm.bundles == (0,) and rm.colocated_with == "actor" and 0 < rm.gpus < 1
    assert sum(r.gpus for r in shared.roles if 0 in r.bundles) <= 1  # everything fits one GPU
    assert "shares actor's GPU" in shared.render()

    own = build_plan(load_config(["reward_model=classifier", "reward_model.path=/rm", "cluster=1xgpu",
                                  "cluster.gpus_per_node=2", "reward_model.colocate=false"]))
    rm = own.role("reward_model")
    assert rm.gpus == 1.0 and rm.bundles == (1,) and own.bundles[1]["GPU"] == 1.0
    with pytest.raises(ConfigError, match="1 for the reward model"):  # one GPU cannot hold it apart
        load_config(["reward_model=classifier", "reward_model.path=/rm", "cluster=1xgpu",
                     "reward_model.colocate=false"])

    url = build_plan(load_config(["reward_model=judge", "reward_model.engine=openai",
                                  "reward_model.url=http://127.0.0.1:9/v1", "cluster=1xgpu"]))
    rm = url.role("reward_model")
    assert (rm.backend, rm.gpus, rm.cpus, rm.bundles) == ("openai", 0.0, 0.0, ())
    assert "the driver's scoring thread" in url.render()


# ---------------------------------------------------------------------------------------------- learning


@pytest.fixture(scope="module")
def digit_rm(tmp_path_factory) -> Path:
    return train_digit_classifier(tmp_path_factory.mktemp("digit_rm"), steps=150)


def test_the_trained_reward_model_prefers_digit_answers(digit_rm):
    from relax.roles.reward_model import ClassifierWorker

    rng = random.Random(11)
    responses = [random_response(rng) for _ in range(64)]
    values, _ = ClassifierWorker(rm_config(digit_rm)).score(["repeat 5"] * 64, responses)
    shares = [digit_share(r) for r in responses]
    assert torch.corrcoef(torch.tensor([values, shares]))[0, 1] > 0.95


def learn(digit_rm: Path, tmp_path: Path, weight: float, trained_batches: dict) -> tuple[list[float], list[float]]:
    """A short GRPO run of the tiny policy against the reward model alone (data.reward=none); (the reward model's mean
    score per step, the digit share of the responses trained per step)."""
    from relax.data.tokenizer import build_tiny_tokenizer
    from relax.runner.train import run

    cfg = rm_config(digit_rm, "data.reward=none", f"reward_model.weight={weight}", "train.num_rollout=16",
                    "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=8", "train.lr=3e-3",
                    "train.save=false")
    result = run(cfg, output_dir=tmp_path / "out")
    tokenizer = build_tiny_tokenizer()
    shares = []
    for step in sorted(trained_batches):
        s = trained_batches[step]
        texts = [tokenizer.decode(ids[m.bool()].tolist(), skip_special_tokens=True)
                 for ids, m in zip(s.response_ids, s.response_mask, strict=True)]
        shares.append(sum(map(digit_share, texts)) / len(texts))
    return result.series("rollout/reward_model_score_mean"), shares


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


@pytest.mark.slow
def test_a_policy_learns_against_the_reward_model(digit_rm, tmp_path, in_process, trained_batches):
    scores, shares = learn(digit_rm, tmp_path, 1.0, trained_batches)
    assert len(scores) == len(shares) == 16
    # the reward model's score rises well beyond its step-to-step noise, and so does what it measures
    assert mean(scores[-4:]) > mean(scores[:4]) + 0.15, scores
    assert mean(shares[-4:]) > mean(shares[:4]) + 0.15, shares


@pytest.mark.slow
def test_negative_control_the_negated_score_drives_digits_down(digit_rm, tmp_path, in_process, trained_batches):
    scores, shares = learn(digit_rm, tmp_path, -1.0, trained_batches)
    assert mean(shares[-4:]) < mean(shares[:4]) - 0.05, shares
    assert mean(scores[-4:]) < mean(scores[:4]), scores
