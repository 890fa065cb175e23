"""Reward models, below every backend: a Hugging Face sequence-classification model whose logit is a response's score
(`load_classifier`, `classifier_scores`), the tokens it scores (`classifier_input_ids`), the judge's model checked
(`judge_config`) and its prompts in its own chat template (`judge_prompt_ids`).

A reward model keeps its own tokenizer: it reads the text of the prompt and response, never the policy's token ids,
so any policy can train against any reward model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from relax.data.tokenizer import ModelFileError, ModelPathError


def load_classifier(path: str, dtype: torch.dtype, device: torch.device | str) -> tuple[Any, Any]:
    """(model, tokenizer) of the sequence-classification model in directory `path` (one label: its logit is the
    score), frozen, in `dtype` on `device`. Raises ModelPathError / ModelFileError naming `reward_model.path`."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    classifier_config(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                               attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token_id is None:  # a batch needs one; the model reads the last token that is not padding
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.requires_grad_(False)
    model.eval()
    return model.to(device), tokenizer


def _config(path: str, wanted: str) -> tuple[Any, list[str]]:
    """The transformers config at `path` and its architectures; ModelPathError / ModelFileError naming
    `reward_model.path` and what should be there (`wanted`)."""
    from transformers import AutoConfig

    if not (Path(path) / "config.json").is_file():
        raise ModelPathError(f"reward_model.path={path!r}: not a directory with config.json ({wanted})")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"reward_model.path={path!r}: its config.json does not load: {exc}") from None
    return config, list(getattr(config, "architectures", None) or [])


def classifier_config(path: str) -> Any:
    """The transformers config of the reward model at `path`, checked: a sequence-classification architecture with
    one label. Raises ModelPathError / ModelFileError naming `reward_model.path`."""
    config, archs = _config(path, "a Hugging Face sequence-classification model and its tokenizer")
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ModelFileError(f"reward_model.path={path!r}: architectures {archs} has no *ForSequenceClassification "
                             "model (reward_model=classifier scores with a sequence-classification head; a causal LM "
                             "can be a judge: reward_model=judge)")
    if int(getattr(config, "num_labels", 0)) != 1:
        raise ModelFileError(f"reward_model.path={path!r}: num_labels={getattr(config, 'num_labels', None)}; a reward "
                             "model has one label (its logit is the score)")
    return config


def judge_config(path: str) -> Any:
    """The transformers config of the judge at `path`, checked: a causal-LM architecture (one that
    `AutoModelForCausalLM` loads as itself: `*ForCausalLM`, `GPT2LMHeadModel`, ...). A sequence-classification
    checkpoint would load with a language-model head of random weights and answer noise. Raises ModelPathError /
    ModelFileError naming `reward_model.path`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config, archs = _config(path, "a Hugging Face causal LM and its tokenizer")
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if not any(a.endswith("ForCausalLM") or a in causal for a in archs):
        raise ModelFileError(f"reward_model.path={path!r}: architectures {archs} has no causal LM (*ForCausalLM) "
                             "(reward_model=judge generates its answer with a language-model head; a "
                             "sequence-classification model is a classifier: reward_model=classifier)")
    return config


def prompt_text(prompt: list[dict] | str) -> str:
    """A prompt as plain text: its text, or its messages' contents one per line."""
    return prompt if isinstance(prompt, str) else "\n".join(str(m.get("content", "")) for m in prompt)


def pair_encodes_apart(tokenizer: Any) -> bool:
    """Whether the tokenizer's text-pair encoding marks where the second text starts (special tokens between or
    around the two: BERT's, DeBERTa's `[CLS] a [SEP] b [SEP]`, Llama's `<s> a <s> b`), as classic reward models
    without a chat template are trained on."""
    try:
        return tokenizer.num_special_tokens_to_add(pair=True) > tokenizer.num_special_tokens_to_add(pair=False)
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return False


def conversation_text(tokenizer: Any, prompt: list[dict] | str, response: str) -> str:
    """The conversation as one text: the prompt's messages and the response as the assistant's message, in the
    model's chat template; without a template, the prompt's text and the response on a line of its own."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)
    return prompt_text(prompt) + "\n" + response


def classifier_input_ids(tokenizer: Any, prompt: list[dict] | str, response: str) -> list[int]:
    """The tokens a classifier scores for (prompt, response) (a string, or the prompt's chat messages):
    - with a chat template: `conversation_text` (the template's own special tokens, none added);
    - without one, a tokenizer whose text pair is marked (`pair_encodes_apart`): `tokenizer(prompt_text, response)`,
      the text-pair encoding classic reward models are used with;
    - without either: `tokenizer(prompt_text + "\\n" + response)` (never the two glued together)."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer(conversation_text(tokenizer, prompt, response), add_special_tokens=False)["input_ids"])
    if pair_encodes_apart(tokenizer):
        return list(tokenizer(prompt_text(prompt), response)["input_ids"])
    return list(tokenizer(conversation_text(tokenizer, prompt, response))["input_ids"])


@torch.no_grad()
def classifier_scores(model: Any, inputs: Sequence[list[int]], *, batch_size: int, max_length: int,
                      device: torch.device | str, on_batch: Any = None) -> tuple[list[Optional[float]],
                                                                                 list[Optional[str]]]:
    """(scores, errors): the model's logit of each input (token ids: `classifier_input_ids`), `batch_size` inputs per
    forward pass (padded on the right; the model reads each row's last token that is not padding). An input of more
    than `max_length` tokens gets no score (None, and why in errors): cutting it would score another text.
    `on_batch()` after each forward pass."""
    ids = [list(x) for x in inputs]
    scores: list[Optional[float]] = [None] * len(ids)
    errors: list[Optional[str]] = [None] * len(ids)
    rows = []
    for i, x in enumerate(ids):
        if not x:
            errors[i] = "an empty input"
        elif len(x) > max_length:
            errors[i] = f"{len(x)} tokens, more than reward_model.max_length={max_length}"
        else:
            rows.append(i)
    rows.sort(key=lambda i: len(ids[i]))  # similar lengths together: less padding
    pad = model.config.pad_token_id
    for start in range(0, len(rows), batch_size):
        part = rows[start:start + batch_size]
        width = max(len(ids[i]) for i in part)
        input_ids = torch.full((len(part), width), pad, dtype=torch.long)
        mask = torch.zeros((len(part), width), dtype=torch.long)
        for r, i in enumerate(part):
            input_ids[r, :len(ids[i])] = torch.tensor(ids[i])
            mask[r, :len(ids[i])] = 1
        logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits.float().cpu()
        for r, i in enumerate(part):
            value = float(logits[r, 0])
            if value == value and abs(value) != float("inf"):
                scores[i] = value
            else:
                errors[i] = f"a non-finite logit ({value})"
        if on_batch is not None:
            on_batch()
    return scores, errors


def judge_prompt_ids(tokenizer: Any, question: str) -> list[int]:
    """The judge's prompt: `question` as the user message of its chat template, ready for its answer (the text
    itself without a template)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = question
    return tokenizer(text, add_special_tokens=False)["input_ids"]
