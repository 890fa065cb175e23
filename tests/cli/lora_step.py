"""The relax-export tests' trained LoRA checkpoint (tests/cli/test_export_checks.py, test_export_options.py): one
optimizer step of the actor on `test_export`'s prompt/response pairs, committed as a run commits it, and the trainer's
own log-probs of those pairs from the checkpoint (what an export must reproduce)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from test_export import PROMPTS, RESPONSES, batch_of, commit, trainer_logprobs

from relax.batch import TrainBatch
from relax.data.tokenizer import load_tokenizer, stop_token_ids
from relax.roles.workers import ModelInfo, PolicyWorker


def model_info(cfg) -> ModelInfo:
    """What the actor is told of `cfg`'s model: the tokenizer's size, padding and stop tokens."""
    tokenizer = load_tokenizer(cfg.model)
    return ModelInfo(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                     eos_token_ids=stop_token_ids(cfg.model, tokenizer))


@dataclass
class TrainedStep:
    path: Path  # the committed checkpoint
    tokenizer: object
    pairs: list[tuple[str, str]]  # (prompt, response)
    batch: TrainBatch  # the pairs as trained
    trainer: Optional[torch.Tensor]  # the trainer's log-probs of the batch's responses, from the checkpoint


def train_one_step(cfg, *, logprobs: bool = True) -> TrainedStep:
    """One train step of a fresh actor of `cfg` (a LoRA run: its adapters move) on the pairs, committed at step 1;
    `logprobs`: the trainer's log-probs from the checkpoint too (a fresh actor loads it)."""
    info, tokenizer = model_info(cfg), load_tokenizer(cfg.model)
    pairs = list(zip(PROMPTS, RESPONSES, strict=True))
    batch = batch_of(tokenizer, pairs, tokenizer.pad_token_id)
    actor = PolicyWorker(cfg, info, threads=1)
    actor.train_step(batch)
    path = commit(cfg, 1, lambda d: actor.save(str(d)))
    return TrainedStep(path, tokenizer, pairs, batch, trainer_logprobs(cfg, info, path, batch) if logprobs else None)
