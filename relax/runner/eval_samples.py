"""Each eval sample of an evaluation as a JSON record (`train.eval_save_samples`, docs/training.md "Evaluation"):
what was asked, what the policy answered, the reward it got and whether it counts as correct, so that an eval metric
can be audited, compared prompt by prompt across checkpoints, and its failures read (a wrong answer, an unreadable
one, a response cut at the length limit). Written as eval/<set>/step_<k>.jsonl, a line per response, prompt-major
(the order of `eval_metrics`)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from relax.batch import FinishReason, Samples
from relax.rewards.registry import Scores

EVAL_SAMPLES_DIR = "eval"  # under the MLflow run's artifacts and the job's output directory


def eval_samples_file(eval_set: str, step: int) -> str:
    """The relative path of eval set `eval_set`'s samples of the evaluation logged at `step`."""
    return f"{EVAL_SAMPLES_DIR}/{eval_set}/step_{step:06d}.jsonl"


def response_texts(tokenizer: Any, samples: Samples) -> list[str]:
    """Each response as the reward read it (`relax.runner.rollout_driver.scoring.score`): an episode's last action,
    else the response's own tokens (observations and padding left out) decoded without special tokens."""
    if samples.episodes is not None:
        return [e["actions"][-1] if e["actions"] else "" for e in samples.episodes]
    return [tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
            for ids, mask in zip(samples.response_ids, samples.response_mask, strict=True)]


def eval_sample_records(items: Sequence[Any], samples: Samples, scores: Scores, texts: Sequence[str], *, n: int,
                        threshold: float) -> list[dict[str, Any]]:
    """A record per response of `samples` (`n` per item of `items`, prompt-major): `prompt_index` (the prompt's place
    in its set, the same at every evaluation), `sample` (0..n-1), `source` (file:line or task:index), `prompt` (the
    text the policy was given, chat template applied), `label`, `response`, `reward` (None: the reward call failed,
    `reward_error` true; such a response is left out of the metrics), `correct` (reward >= `threshold`),
    `finish_reason`, `truncated` (cut at rollout.max_response_len) and `response_len` (tokens)."""
    lengths = samples.response_mask.sum(1).tolist()
    out = []
    for i, (reward, failed, text, reason, length) in enumerate(
            zip(scores.rewards, scores.failed, texts, samples.finish_reason, lengths, strict=True)):
        item = items[i // n]
        ok = not failed and math.isfinite(reward)
        out.append({"prompt_index": i // n, "sample": i % n, "source": item.source, "prompt": item.prompt_text,
                    "label": item.label, "response": text, "reward": float(reward) if ok else None,
                    "reward_error": not ok, "correct": ok and reward >= threshold, "finish_reason": str(reason),
                    "truncated": reason == FinishReason.LENGTH, "response_len": int(length)})
    return out


def to_jsonl(records: Sequence[dict[str, Any]]) -> str:
    """The records as JSON Lines (UTF-8 text kept as it is)."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
