"""Reward models, below every backend: a Hugging Face sequence-classification model whose logit is a response's score
(`load_classifier`, `classifier_scores`), the tokens it scores (`classifier_input_ids`), the judge's model checked
(`judge_config`) and its prompts in its own chat template (`judge_prompt_ids`).

A reward model keeps its own tokenizer: it reads the text of the prompt and response, never the policy's token ids,
so any policy can train against any reward model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from relax.data.tokenizer import ModelFileError, ModelPathError


def load_classifier(path: str, dtype: torch.dtype, device: torch.device | str) -> tuple[Any, Any]:
    """(model, tokenizer) of the sequence-classification model in directory `path` (one label: its logit is the
    score), frozen, in `dtype` on `device`. Raises ModelPathError / ModelFileError naming `reward_model.path`."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    # here, not at the top: relax.models.hf imports transformers at module level, and this module defers transformers
    # to the functions that use it, like the imports above
    from relax.models.hf import checkpoint_attention

    classifier_config(path)
    attention = checkpoint_attention(path, AutoModelForSequenceClassification)  # gpt-oss refuses sdpa
    model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                               attn_implementation=attention)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    # the model's pad id stays as saved (None included): it decides which token the head reads
    # (`classifier_scores`); an invented pad = eos would make it skip a text's trailing end-of-turn tokens
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


# what an image part of a message becomes in a reward model's text (it reads text only)
IMAGE_PLACEHOLDER = "[image]"


def content_text(content: Any) -> str:
    """A message's content as a reward model reads it: a string as it is; a list of parts (the chat format's
    `{"type": "text", "text": ...}`, `{"type": "image", ...}`, `{"type": "image_url", ...}`) as its text parts joined
    as a chat template joins them (nothing between), each image part as IMAGE_PLACEHOLDER (never a Python repr of
    the parts, which a template written for string contents would otherwise print)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        out = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                out.append(str(part.get("text") or ""))
            elif kind in ("image", "image_url"):
                out.append(IMAGE_PLACEHOLDER)
            else:
                out.append(part if isinstance(part, str) else str(part))
        return "".join(out)
    return str(content)


def text_messages(messages: Sequence[dict]) -> list[dict]:
    """`messages` with each content as text (`content_text`)."""
    return [{**m, "content": content_text(m.get("content"))} for m in messages]


def prompt_text(prompt: list[dict] | str) -> str:
    """A prompt as plain text: its text, or its messages' contents one per line (`content_text`)."""
    return prompt if isinstance(prompt, str) else "\n".join(content_text(m.get("content")) for m in prompt)


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
    model's chat template (each content as text: `content_text`); without a template, the prompt's text and the
    response on a line of its own."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else text_messages(prompt)
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


def _pad_id(model: Any) -> Optional[int]:
    """The pad id the model's config declares (None: none)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "pad_token_id", None)


def _absent_id(rows: Sequence[list[int]], vocab_size: int) -> Optional[int]:
    """The smallest token id below `vocab_size` that no row holds (None: every id occurs)."""
    used = {t for row in rows for t in row}
    return next((t for t in range(vocab_size) if t not in used), None)


@contextlib.contextmanager
def _declared_pad(model: Any, pad: Optional[int]) -> Iterator[None]:
    """The model's config declaring `pad` as its pad id for the duration (restored after)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    before = config.pad_token_id
    config.pad_token_id = pad
    try:
        yield
    finally:
        config.pad_token_id = before


def _forward(model: Any, rows: Sequence[list[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    """The model's logits (float, on the CPU) of `rows`, right-padded with `pad` (masked out)."""
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        input_ids[r, :len(row)] = torch.tensor(row)
        mask[r, :len(row)] = 1
    return model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits.float().cpu()


@torch.no_grad()
def classifier_scores(model: Any, inputs: Sequence[list[int]], *, batch_size: int, max_length: int,
                      device: torch.device | str, on_batch: Any = None) -> tuple[list[Optional[float]],
                                                                                 list[Optional[str]]]:
    """(scores, errors): the model's logit of each input (token ids: `classifier_input_ids`), `batch_size` inputs per
    forward pass, each score the one a forward of that input alone gives with the model as saved. An input of more
    than `max_length` tokens gets no score (None, and why in errors): cutting it would score another text.
    `on_batch()` after each forward pass.

    Which token the head reads is the model's own rule (transformers' sequence classifiers: the last token that is
    not the config's pad id; BERT-like ones their first): with a declared pad id, the rows are padded with it, so a
    row reads what it reads alone (a text ending in that id skips it, as the checkpoint was trained). A checkpoint
    that declares none reads a lone text's last token: the rows are then padded with an id that none of them holds,
    declared for the forward pass only, so each row's last token is read, a trailing end-of-sequence token
    included (an invented pad = eos would skip it)."""
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
    declared = _pad_id(model)
    for start in range(0, len(rows), batch_size):
        part = rows[start:start + batch_size]
        texts = [ids[i] for i in part]
        if declared is not None:
            logits = _forward(model, texts, declared, device)
        else:
            pad = _absent_id(texts, model.get_input_embeddings().num_embeddings)
            if pad is None:  # every id occurs in the batch: each text alone, unpadded (its last token)
                logits = torch.cat([_forward(model, [t], 0, device) for t in texts])
            else:
                with _declared_pad(model, pad):
                    logits = _forward(model, texts, pad, device)
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
