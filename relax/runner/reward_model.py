"""The reward model on the driver's side: the registry of its kinds (`REWARD_MODEL_KINDS`), the checks of its files
before anything starts (`check_reward_model`), and what the scoring thread calls (`RewardModelScorer.score`).

A kind says which role process holds its model (`worker`, None: none) and how the driver turns a batch of responses
into scores (`scorer`): a classifier's role returns logits; a judge's answers (from its role's embedded engine, or
from an OpenAI-compatible URL called here, in the scoring thread) are read by its parser. A response without a score
(a failed call, an answer without a readable score or cut at reward_model.max_new_tokens, a text over
reward_model.max_length) is a failed score: its group is left out of the step like a failed reward call
(`relax.runner.rollout_driver.scoring`, which warns of it), never scored 0.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from relax.config.derive import template_reads
from relax.config.reward_model_rules import has_role
from relax.config.schema import RelaxConfig
from relax.metrics import JUDGE_PARSE_FAIL_FRAC, REWARD_MODEL_SCORE_MEAN, REWARD_MODEL_TIME
from relax.models.reward_model import classifier_config, content_text, judge_config
from relax.rewards.judge import get_parser, judge_content, judge_question, read_scores
from relax.rewards.openai_judge import OpenAIJudge
from relax.roles.reward_model import (
    ClassifierWorker,
    JudgeWorker,
    judge_load_error,
    judge_model_config,
    reward_model_dir,
)
from relax.runner.errors import RunError

# call(method, *args): a method of the reward model's role, answered (the cluster's watched call)
RoleCall = Callable[..., Any]


@dataclass
class ModelScores:
    """The reward model's scores of a batch: `values[i]` None where response i got none; `parse_failed[i]` where a
    judge answered without a readable score; `seconds` the batch took; `timed_out[i]` where the call got no answer
    within its time limit (a judge's reward_model.timeout_s; empty: none did)."""

    values: list[Optional[float]] = field(default_factory=list)
    parse_failed: list[bool] = field(default_factory=list)
    first_error: Optional[str] = None
    seconds: float = 0.0
    timed_out: list[bool] = field(default_factory=list)


def prompt_of(item: Any) -> list[dict] | str:
    """What a reward model reads as the prompt of `item`: its chat messages when the chat template rendered it (the
    reward model renders them in its own template), else its text."""
    return list(item.messages) if getattr(item, "messages", None) else item.prompt_text


def prompt_words(item: Any) -> str:
    """The prompt as a judge's template names it ({prompt}): the last user message (its text parts, an image part
    as `IMAGE_PLACEHOLDER`: `content_text`), else the prompt's text."""
    messages = getattr(item, "messages", None) or []
    users = [m.get("content", "") for m in messages if m.get("role") == "user"]
    return content_text(users[-1]) if users else item.prompt_text


def prompt_parts(item: Any) -> Optional[list[dict]]:
    """The prompt as a judge at a URL reads {prompt} (`relax.rewards.judge.judge_content`) when it holds images: the
    last user message's parts, each image an OpenAI `image_url` part with a PNG data URL of the task's image (read
    again from the item's image reference, never blanked: `relax.data.images.reference_images`), as a reward
    service gets it (`relax.data.images.image_url_messages`); None for a prompt without images (the judge reads
    `prompt_words`). The images cannot be given (a checkpoint's pixel values only, a record or file gone since the
    start): RunError, one line, as for a reward that reads messages."""
    from relax.data.images import image_data_url, image_url_messages, reference_images

    messages = list(getattr(item, "messages", None) or [])
    users = [k for k, m in enumerate(messages) if m.get("role") == "user"]
    if not users or not any(isinstance(m.get("content"), list) and any(
            isinstance(p, dict) and p.get("type") == "image" for p in m["content"]) for m in messages):
        return None
    try:  # (the bare image parts before the last user message take their images first)
        urls = [image_data_url(im) for im in reference_images(getattr(item, "images", None))]
        content = image_url_messages(messages, urls)[users[-1]]["content"]
    except (ValueError, OSError) as e:
        raise RunError(f"reward_model.template names {{prompt}}, whose images cannot be given to the judge: {e}") \
            from None
    if not isinstance(content, list) or not any(p.get("type") == "image_url" for p in content if isinstance(p, dict)):
        return None
    return [p if isinstance(p, dict) and p.get("type") in ("text", "image_url")
            else {"type": "text", "text": content_text([p])} for p in content]


class RewardModelScorer:
    """Scores of one kind of reward model; `score(items, responses)`, one item per response."""

    def score(self, items: Sequence[Any], responses: Sequence[str]) -> ModelScores:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the scorer holds (an HTTP pool)."""


class ClassifierScorer(RewardModelScorer):
    def __init__(self, cfg: RelaxConfig, call: RoleCall):
        self.call = call

    def score(self, items: Sequence[Any], responses: Sequence[str]) -> ModelScores:
        t0 = time.perf_counter()
        values, errors = self.call("score", [prompt_of(i) for i in items], list(responses))
        first = next((e for e in errors if e), None)
        return ModelScores(list(values), [False] * len(values),
                           None if first is None else f"the reward model gave no score: {first}",
                           time.perf_counter() - t0)


class JudgeScorer(RewardModelScorer):
    """A judge: questions from the template, answers from the role's engine or the URL, scores by the parser. At a
    URL a question whose {prompt} holds images is OpenAI content parts with them (`prompt_parts`, `judge_content`),
    as a reward service gets them; the embedded engine reads text (refused beside a vision-language policy)."""

    def __init__(self, cfg: RelaxConfig, call: RoleCall | None):
        rm = cfg.reward_model
        self.rm, self.parser, self.http = rm, get_parser(rm.parser), None
        if rm.engine == "openai":
            self.http = OpenAIJudge(rm.url, model=rm.model, api_key_env=rm.api_key_env,
                                    max_new_tokens=rm.max_new_tokens, temperature=rm.temperature,
                                    timeout_s=rm.timeout_s, concurrency=rm.batch_size)
        self.call = call

    def score(self, items: Sequence[Any], responses: Sequence[str]) -> ModelScores:
        t0 = time.perf_counter()
        questions: list[Any] = [judge_question(self.rm.template, prompt_words(i), r, i.label)
                                for i, r in zip(items, responses, strict=True)]
        if self.http is not None and template_reads(self.rm.template, "prompt"):
            parts: dict[int, Optional[list[dict]]] = {}  # the prompt's parts with its images, once per item
            for k, (item, response) in enumerate(zip(items, responses, strict=True)):
                if id(item) not in parts:
                    parts[id(item)] = prompt_parts(item)
                if parts[id(item)] is not None:
                    questions[k] = judge_content(self.rm.template, parts[id(item)], response, item.label)
        if self.http is not None:
            answers, errors, cut, late = self.http.answer(questions)
        else:  # the role's engine: no time limit of its own (the cluster's watched call bounds the role)
            (answers, errors, cut), late = self.call("answer", questions), []
        return dataclasses.replace(self.verdicts(answers, errors, cut, t0), timed_out=list(late))

    def verdicts(self, answers: Sequence[Optional[str]], errors: Sequence[Optional[str]], cut: Sequence[bool],
                 t0: float) -> ModelScores:
        """The scores the parser reads from `answers`. An answer `cut` at reward_model.max_new_tokens is a parse
        failure whatever it holds: the number in a cut answer is no verdict ("Let me check the 2 claims in")."""
        answers, errors = list(answers), list(errors)
        was_cut = [bool(c) and a is not None for a, c in zip(answers, cut, strict=True)]
        for i in (i for i, c in enumerate(was_cut) if c):
            errors[i] = (f"the judge's answer was cut at reward_model.max_new_tokens={self.rm.max_new_tokens} "
                         f"(it holds no verdict): {answers[i][:200]!r}")
            answers[i] = None  # (read as a failed call: never parsed; counted a parse failure below)
        verdicts = read_scores(self.parser, answers, self.rm.score_min, self.rm.score_max, errors)
        parse_failed = [p or c for p, c in zip(verdicts.parse_failed, was_cut, strict=True)]
        return ModelScores(verdicts.scores, parse_failed, verdicts.first_error, time.perf_counter() - t0)

    def close(self) -> None:
        if self.http is not None:
            self.http.close()


@dataclass(frozen=True)
class RewardModelKind:
    """One kind of reward model (`reward_model.kind`): the role class that holds its model for a config (None: no
    process), the check of its files before start, and the driver's scorer over the role's calls."""

    name: str
    worker: Callable[[RelaxConfig], Optional[type]]
    check: Callable[[RelaxConfig], None]
    scorer: Callable[[RelaxConfig, Optional[RoleCall]], RewardModelScorer]
    describe: Callable[[RelaxConfig], str]


def _check_classifier(cfg: RelaxConfig) -> None:
    from transformers import AutoTokenizer

    from relax.data.tokenizer import missing_tokenizer_files

    path = reward_model_dir(cfg)  # a PEFT adapter directory's merge (or a dry run's stand-in of it)
    classifier_config(path)
    missing = missing_tokenizer_files(Path(path), key=None)  # no .gguf hint: a classifier reads no .gguf file
    if missing is not None:  # transformers would give a tokenizer of no vocabulary
        raise ValueError(f"reward_model.path={path!r}: its tokenizer does not load: {missing}")
    try:
        AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"reward_model.path={path!r}: its tokenizer does not load: {exc}") from None


def _check_judge(cfg: RelaxConfig) -> None:
    from relax.data.tokenizer import check_model_files, load_tokenizer

    get_parser(cfg.reward_model.parser)
    if cfg.reward_model.engine == "embedded":
        model_cfg = judge_model_config(cfg)  # source: gguf for a .gguf file, else hf
        try:
            check_model_files(model_cfg, key="reward_model.path")
            load_tokenizer(model_cfg, key="reward_model.path")
        except (FileNotFoundError, ValueError) as exc:
            # the loaders name the path's option (key), with no model.source (the judge's file's name chooses)
            raise ValueError(judge_load_error(cfg, exc)) from None
        if model_cfg.source == "hf":
            judge_config(reward_model_dir(cfg))  # a causal LM, as a classifier's check refuses one


def _describe_judge(cfg: RelaxConfig) -> str:
    rm = cfg.reward_model
    where = f"{rm.path} on an embedded engine" if rm.engine == "embedded" else f"{rm.url} (OpenAI API, from the " \
        "driver's scoring thread)"
    return f"judge {where}, parser {rm.parser} in [{rm.score_min:g}, {rm.score_max:g}]"


REWARD_MODEL_KINDS: dict[str, RewardModelKind] = {
    "classifier": RewardModelKind(
        "classifier", lambda cfg: ClassifierWorker, _check_classifier, ClassifierScorer,
        lambda cfg: f"classifier {cfg.reward_model.path} (score: its logit)"),
    "judge": RewardModelKind(
        "judge", lambda cfg: JudgeWorker if cfg.reward_model.engine == "embedded" else None, _check_judge,
        JudgeScorer, _describe_judge),
}


def kind_of(cfg: RelaxConfig) -> Optional[RewardModelKind]:
    """The kind of `cfg.reward_model` (None: reward_model=none)."""
    if cfg.reward_model.kind == "none":
        return None
    return REWARD_MODEL_KINDS[cfg.reward_model.kind]


def check_reward_model(cfg: RelaxConfig) -> None:
    """The reward model's files and parser, before anything starts (ValueError / FileNotFoundError naming the
    option)."""
    kind = kind_of(cfg)
    if kind is not None:
        kind.check(cfg)


def worker_class(cfg: RelaxConfig) -> Optional[type]:
    """The role class the plan's reward_model process runs (None: no process)."""
    kind = kind_of(cfg)
    if kind is None or not has_role(cfg):
        return None
    return kind.worker(cfg)


def make_scorer(cfg: RelaxConfig, call: Optional[RoleCall]) -> Optional[RewardModelScorer]:
    kind = kind_of(cfg)
    return None if kind is None else kind.scorer(cfg, call)


def reward_model_metrics(cfg: RelaxConfig, values: Optional[Sequence[float]], parse_failures: int,
                         seconds: float) -> dict[str, float]:
    """perf/reward_model_time, rollout/reward_model_score_mean (over the responses it scored; NaN: none) and, for a
    judge, rollout/judge_parse_fail_frac (answers without a readable score / responses judged)."""
    if values is None:
        return {}
    scored = [v for v in values if not math.isnan(v)]
    out = {REWARD_MODEL_TIME: seconds,
           REWARD_MODEL_SCORE_MEAN: sum(scored) / len(scored) if scored else float("nan")}
    if cfg.reward_model.kind == "judge":
        out[JUDGE_PARSE_FAIL_FRAC] = parse_failures / max(1, len(values))
    return out
