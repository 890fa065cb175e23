"""The reward-model role (`reward_model` config group): a frozen model that scores responses, one process placed by the
plan (`relax.runner.plan`: on the actor's GPU or its own, a CPU share on a CPU cluster), called by the driver's
scoring thread while the engines generate the next batch (`relax.runner.reward_model`).

- `ClassifierWorker` (reward_model.kind=classifier): a sequence-classification model; a response's score is its
  logit of the prompt's messages and the response in the model's own chat template (without one: the tokenizer's
  text pair, `relax.models.reward_model.classifier_input_ids`).
- `JudgeWorker` (reward_model.kind=judge, engine=embedded): a causal LM on an embedded engine of its own (greedy at
  reward_model.temperature=0), answering the questions the driver wrote; the driver reads the scores from the answers
  (an answer cut at reward_model.max_new_tokens holds none).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError

from relax import progress
from relax.batch import FinishReason
from relax.config.reward_model_rules import is_gguf_file
from relax.config.schema import ModelConfig, RelaxConfig
from relax.config.store import import_plugins
from relax.data.tokenizer import (
    ModelFileError,
    ModelPathError,
    is_adapter_dir,
    load_tokenizer,
    resolve_model_path,
    stop_token_ids,
)
from relax.models.hf import build_model, pick_device, pick_dtype
from relax.models.reward_model import (
    classifier_input_ids,
    classifier_scores,
    judge_config,
    judge_prompt_ids,
    load_classifier,
)
from relax.roles.cores import pin_role_process
from relax.roles.heartbeat import HeartbeatLink, start_heartbeat
from relax.roles.tensor_pickling import install as install_tensor_pickling
from relax.rollout.embedded import EmbeddedEngine

# The option the reward model's files are given as: what a load error of its role names (a ModelConfig's loaders say
# model.path unless told), as relax.runner.reward_model's preflight of the same files does.
PATH_KEY = "reward_model.path"


def _threads(n: Optional[int]) -> None:
    if pin_role_process() is None and n:  # pinned (cluster.role_cores): its pools sized to its cores
        torch.set_num_threads(n)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def judge_model_config(cfg: RelaxConfig) -> ModelConfig:
    """The reward model as a model config, for `build_model` and `load_tokenizer`, and for a classifier's or a
    judge's PEFT adapter directory, its merge (`relax.models.peft_merge`): a Hugging Face directory (source=hf), or
    a judge's .gguf file (source=gguf: loaded, de-quantized, as model.source=gguf loads the policy's)."""
    rm = cfg.reward_model
    source = "gguf" if rm.kind == "judge" and is_gguf_file(rm.path) else "hf"
    return ModelConfig(name="judge" if rm.kind == "judge" else rm.kind, source=source, path=rm.path,
                       base_path=rm.base_path, dtype=rm.dtype)


def reward_model_dir(cfg: RelaxConfig) -> str:
    """The directory of the reward model's files: reward_model.path as given (its loaders name what is wrong with
    it), or for a PEFT adapter directory its merge with its base (written before start)."""
    path = cfg.reward_model.path
    if not path or not is_adapter_dir(Path(path).expanduser()):
        return path
    return str(resolve_model_path(judge_model_config(cfg), key=PATH_KEY))


class ClassifierWorker:
    """A frozen sequence-classification reward model (see the module docstring)."""

    def __init__(self, cfg: RelaxConfig, *, threads: Optional[int] = None, heartbeat: HeartbeatLink | None = None):
        import_plugins(cfg.plugins)  # first, as every role: a plugin may register what loading the model needs
        install_tensor_pickling()  # this process's Ray calls send tensors as raw buffers
        start_heartbeat(self, heartbeat)
        _threads(threads)
        rm = cfg.reward_model
        self.cfg, self.device = cfg, pick_device()
        dtype = pick_dtype(ModelConfig(dtype=rm.dtype), self.device)
        self.model, self.tokenizer = load_classifier(reward_model_dir(cfg), dtype, self.device)

    def ping(self) -> str:
        return "ok"

    def inputs(self, prompts: list[Any], responses: list[str]) -> list[list[int]]:
        """The tokens scored for each (prompt, response): `classifier_input_ids` with this model's tokenizer."""
        return [classifier_input_ids(self.tokenizer, p, r) for p, r in zip(prompts, responses, strict=True)]

    def score(self, prompts: list[Any], responses: list[str]) -> tuple[list[Optional[float]], list[Optional[str]]]:
        """(scores, errors) of each response to its prompt (a string, or the prompt's chat messages)."""
        rm = self.cfg.reward_model
        return classifier_scores(self.model, self.inputs(prompts, responses),
                                 batch_size=rm.batch_size, max_length=rm.max_length, device=self.device,
                                 on_batch=progress.tick)


def judge_load_error(cfg: RelaxConfig, exc: BaseException) -> str:
    """What a judge that cannot be loaded is refused with, before start (the preflight) and in its role: the option
    and its path first, then the loader's own words."""
    return f"the judge (reward_model.path={cfg.reward_model.path}) cannot be loaded: {exc}"


class JudgeWorker:
    """A frozen causal LM that answers judge questions on an embedded engine (see the module docstring)."""

    def __init__(self, cfg: RelaxConfig, *, threads: Optional[int] = None, heartbeat: HeartbeatLink | None = None):
        import_plugins(cfg.plugins)  # first, as every role: a plugin may register what loading the model needs
        install_tensor_pickling()  # this process's Ray calls send tensors as raw buffers
        start_heartbeat(self, heartbeat)
        _threads(threads)
        model_cfg = judge_model_config(cfg)
        if model_cfg.source == "hf":  # a causal LM (a classifier's checkpoint would get a random LM head); a .gguf
            judge_config(reward_model_dir(cfg))  # file is loaded as one by transformers' GGUF reader
        self.cfg, device = cfg, pick_device()
        self.tokenizer = load_tokenizer(model_cfg, key=PATH_KEY)  # its errors name the judge's option
        try:
            model = build_model(model_cfg, len(self.tokenizer), self.tokenizer.pad_token_id, seed=cfg.seed,
                                dtype=pick_dtype(model_cfg, device), device=device, key=PATH_KEY)
        except (ModelPathError, ModelFileError, torch.OutOfMemoryError):
            raise  # the first two name reward_model.path and the file already; out of memory is no bad file
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
            # weights the preflight finds present but that do not load (safetensors' SafetensorError, torch.load's
            # RuntimeError or transformers' OSError/ValueError for a bad .bin, .gguf or shapes: their words name
            # neither the option nor the path): named as the preflight names the judge's files; the cause is kept,
            # with its traceback, for a RuntimeError of another kind
            raise ModelFileError(judge_load_error(cfg, exc)) from exc
        model.requires_grad_(False)
        model.eval()
        self.engine = EmbeddedEngine(model, eos_token_ids=list(stop_token_ids(model_cfg, self.tokenizer)),
                                     pad_token_id=self.tokenizer.pad_token_id, device=device)
        self._drawn = 0  # answers drawn so far: each answer its own random stream (reward_model.temperature > 0)

    def ping(self) -> str:
        return "ok"

    def answer(self, questions: list[str]) -> tuple[list[Optional[str]], list[Optional[str]], list[bool]]:
        """(answers, errors, cut): the judge's answer to each question (None where its prompt is longer than
        reward_model.max_length), `reward_model.batch_size` questions per generation; `cut[i]` where the answer
        stopped at reward_model.max_new_tokens rather than at a stop token."""
        rm = self.cfg.reward_model
        prompts = [judge_prompt_ids(self.tokenizer, q) for q in questions]
        answers: list[Optional[str]] = [None] * len(questions)
        errors: list[Optional[str]] = [None] * len(questions)
        cut = [False] * len(questions)
        rows = []
        for i, ids in enumerate(prompts):
            if len(ids) > rm.max_length:
                errors[i] = f"a judge prompt of {len(ids)} tokens, more than reward_model.max_length={rm.max_length}"
            else:
                rows.append(i)
        for start in range(0, len(rows), rm.batch_size):
            part = rows[start:start + rm.batch_size]
            ids = torch.arange(self._drawn, self._drawn + len(part), dtype=torch.long)
            self._drawn += len(part)
            out = self.engine.generate([prompts[i] for i in part], max_new_tokens=rm.max_new_tokens,
                                       temperature=rm.temperature, seed=self.cfg.seed, sample_ids=ids)
            for r, i in enumerate(part):
                tokens = out.response_ids[r][out.response_mask[r].bool()].tolist()
                answers[i] = self.tokenizer.decode(tokens, skip_special_tokens=True)
                cut[i] = out.finish_reason[r] == FinishReason.LENGTH
        return answers, errors, cut
