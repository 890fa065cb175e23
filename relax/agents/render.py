"""Observations as tokens: chat messages rendered with the model's chat template after a model turn.

The model's turn ends with its stop token (ChatML: `<|im_end|>`); what the template writes after an assistant
message's content is its end marker (`<|im_end|>\\n`). The observation's tokens are the rest of that marker (what
the stop token did not already write), the messages as the template renders them, and the generation prompt of the
next assistant turn, tokenized on their own: the model's tokens before them are never re-tokenized (token in,
token out), so the trainer trains exactly what the engine sampled.
"""

from __future__ import annotations

from typing import Any

_USER, _ASSISTANT = "\x00user\x00", "\x00assistant\x00"  # contents no real message has


class ObservationRenderer:
    """`tokens(messages, stop_token)`: the token ids to append after a model turn that ended with `stop_token`."""

    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("agentic rollouts render observations with the chat template, and this tokenizer has "
                             "none (model.path's tokenizer_config.json needs a chat_template)")
        self.tokenizer = tokenizer
        self.base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        text = self._render(self.base, generation_prompt=False)
        if _ASSISTANT not in text:
            raise ValueError("the chat template drops assistant messages; observations cannot be rendered after them")
        self.base_text = text
        self.end_marker = text[text.rindex(_ASSISTANT) + len(_ASSISTANT):]  # what follows an assistant's content
        self._stop_text: dict[int, str] = {}

    def _render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def text(self, messages: list[dict], stop_token: int | None) -> str:
        """The observation's text (see the module docstring)."""
        full = self._render(self.base + list(messages), generation_prompt=True)
        if not full.startswith(self.base_text):
            raise ValueError("the chat template renders earlier messages differently once observations follow them; "
                             "observations cannot be appended as tokens")
        marker = self.end_marker
        if stop_token is not None:
            stop = self._stop_text.setdefault(stop_token, self.tokenizer.decode([stop_token]))
            if stop and marker.startswith(stop):
                marker = marker[len(stop):]
        return marker + full[len(self.base_text):]

    def tokens(self, messages: list[dict], stop_token: int | None) -> list[int]:
        return list(self.tokenizer(self.text(messages, stop_token), add_special_tokens=False)["input_ids"])
