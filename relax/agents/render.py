"""Observations as tokens: chat messages rendered with the model's chat template after a model turn.

The observation's text is found in one render of a whole conversation: a probe user message, a probe assistant
message, then the observation's messages, with the generation prompt of the next assistant turn. What follows the
probe assistant's content in that render is the observation: the end of the assistant's turn (ChatML `<|im_end|>\\n`,
Llama 3 `<|eot_id|>`, DeepSeek `<｜end▁of▁sentence｜>`, nothing for GLM), the messages as the template renders them
after an assistant turn, and the generation prompt. What the model's stop token already wrote at its start (ChatML's
`<|im_end|>`; GLM's `<|observation|>` or `<|user|>`, which open the next message) is dropped.

Renders are not assumed to extend each other: Qwen3's template, for one, writes an empty `<think>\\n\\n</think>\\n\\n`
into an assistant turn only while it is the last message, so the render of `[..., assistant]` is not a prefix of the
render of `[..., assistant, tool]`; only the text after the assistant's content in the longer render is used.

A template that renders a tool result only after an assistant's call (gpt-oss's names the result by its call:
`<|start|>functions.NAME to=assistant...`, and refuses a tool message after a plain assistant message) gets a probe
assistant that makes the turn's calls (their names given, or read from the turn's harmony messages); the
observation is what follows that assistant's call in the render. gpt-oss's `<|return|>`, the stop token of its final
answer, ends the message as the `<|end|>` its template writes there, which is dropped likewise.

Token in, token out: only the observation's text is tokenized (on its own); the model's tokens before it are never
decoded and re-encoded, so the trainer trains exactly what the engine sampled.

`check_template` tries a probe observation of each role a run writes before anything starts, and names the model and
what its template does wrong.

Image observations (a vision-language model's `processor`): messages whose content lists image parts render with the
template's image placeholders; the model's processor then reads the observation's text with its images, expanding
each placeholder into the image's tokens (`VisionTokens`: the token ids, with the images' vision inputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

# Probe contents: plain words (a template may trim a message or write it as JSON, as Llama 3.1 does with tool results)
# that no real message contains. Only the first occurrence of the assistant's counts (it precedes every observation).
_USER = "Relax probe user message 5f3a9c"
_ASSISTANT = "Relax probe assistant message 5f3a9c"
_PROBES = {"tool": {"role": "tool", "content": "Relax probe tool result 5f3a9c"},
           "user": {"role": "user", "content": "Relax probe environment message 5f3a9c"}}
OBSERVATION_ROLES = tuple(_PROBES)
_PROBE_CALL = "relax_probe_tool"  # the call a tool probe answers where no name is known (check_template)
# a stop token that ends a message as another marker does where the template writes history (gpt-oss's final answer)
_ENDS_AS = {"<|return|>": "<|end|>"}


class VisionTokens(list):
    """An observation's token ids (a list) with `vision`: its images as the processor gave them
    ({"pixel_values", "image_grid_thw", "image_tokens"}, and "image_data" when the renderer's `wire` is set), what the
    engine encodes and the trainer scores."""

    vision: Optional[dict] = None


class ObservationRenderer:
    """`tokens(messages, stop_token)`: the token ids to append after a model turn that ended with `stop_token`;
    `processor`: a vision-language model's (image observations); `wire`: an image observation's vision inputs also
    keep its images as lossless PNG data URLs (`image_data`), what rollout=sglang sends with every later turn;
    `blank`: `data.blank_images` (the blind control arm), each observation image replaced by a grey one of its size
    before both (`relax.data.images.seen_images`), so the policy sees no image on either rollout."""

    def __init__(self, tokenizer: Any, processor: Any = None, *, wire: bool = False, blank: bool = False):
        self.processor = processor
        self.wire = wire
        self.blank = blank
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("agentic rollouts render observations with the chat template, and this tokenizer has "
                             "none (model.path's tokenizer_config.json needs a chat_template)")
        self.tokenizer = tokenizer
        self.probe = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        self._stop_text: dict[int, str] = {}

    def after_turn(self, messages: list[dict], calls: Sequence[str] = ()) -> str:
        """What the template writes after an assistant message's content when `messages` follow it, the next
        assistant turn's generation prompt included (the stop token not yet dropped); `calls`: the names of the
        calls the turn made, for a template that renders tool results only after a call (`_after_call`). Raises
        ValueError when the template fails on the messages or drops the assistant's content."""
        from jinja2 import TemplateError

        try:
            full = self.tokenizer.apply_chat_template(self.probe + list(messages), tokenize=False,
                                                      add_generation_prompt=True)
        except TemplateError as exc:  # also the template's own raise_exception(...)
            if any(m.get("role") == "tool" for m in messages):
                try:
                    return self._after_call(messages, calls)
                except TemplateError:
                    pass
            roles = ", ".join(dict.fromkeys(str(m.get("role")) for m in messages))
            raise ValueError(f"the chat template fails on {roles} messages after an assistant message: "
                             f"{type(exc).__name__}: {exc}") from None
        at = full.find(_ASSISTANT)
        if at < 0:
            raise ValueError("the chat template drops an assistant message's content when messages follow it, so "
                             "the end of the model's turn cannot be found")
        return full[at + len(_ASSISTANT):]

    def _after_call(self, messages: list[dict], calls: Sequence[str]) -> str:
        """`after_turn` for a template that renders a tool result only after an assistant's call (gpt-oss's): what
        the template writes after a probe assistant message that makes the calls `calls` (the tool messages'
        `name`s where none are given; a probe name where they have none), which the render of the conversation
        without `messages` ends with. Raises TemplateError where the template still refuses them, ValueError where
        the two renders differ before the messages."""
        names = list(calls) or [m["name"] for m in messages if m.get("role") == "tool" and m.get("name")] \
            or [_PROBE_CALL]
        turn = [self.probe[0], {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": f"call_{k}", "function": {"name": name, "arguments": {}}}
            for k, name in enumerate(names)]}]
        head = self.tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=False)
        full = self.tokenizer.apply_chat_template(turn + list(messages), tokenize=False, add_generation_prompt=True)
        if not full.startswith(head):
            raise ValueError("the chat template writes an assistant's tool call differently once its results "
                             "follow, so the end of the model's turn cannot be found")
        return full[len(head):]

    def text(self, messages: list[dict], stop_token: Optional[int], calls: Sequence[str] = ()) -> str:
        """The observation's text (see the module docstring)."""
        text = self.after_turn(messages, calls)
        if stop_token is not None:
            stop = self._stop_text.setdefault(stop_token, self.tokenizer.decode([stop_token]))
            for written in (stop, _ENDS_AS.get(stop)):
                if written and text.startswith(written):
                    text = text[len(written):]
                    break
        return text

    def tokens(self, messages: list[dict], stop_token: Optional[int], calls: Sequence[str] = ()) -> list[int]:
        """The observation's tokens; `calls`: the names of the calls the turn made (`after_turn`)."""
        messages = [dict(m) if isinstance(m, dict) else m for m in messages]
        images = _images(messages)  # (their image parts made plain {"type": "image"} in these copies)
        if not images:
            return list(self.tokenizer(self.text(messages, stop_token, calls), add_special_tokens=False)["input_ids"])
        if self.processor is None:
            raise ValueError("an image observation for a text-only model (a vision-language model's processor reads "
                             "its images)")
        from relax.data.files import DataError
        from relax.data.images import encode_observation, image_data_url, seen_images

        images = seen_images(images, self.blank)
        try:
            ids, vision = encode_observation(self.processor, self.text(messages, stop_token, calls), images)
        except DataError:
            raise
        except ValueError as exc:  # the image processor refuses an image (an aspect ratio over its limit, ...)
            sizes = ", ".join(f"{im.width}x{im.height}" for im in images)
            raise DataError(f"the environment's observation: its images ({sizes} pixels) cannot be read by the "
                            f"model's processor: {exc}") from None
        if self.wire:
            vision["image_data"] = [image_data_url(im) for im in images]
        out = VisionTokens(ids)
        out.vision = vision
        return out


def _images(messages: list[dict]) -> list[Any]:
    """The images of `messages`' image parts, in order (their parts become `{"type": "image"}` for the template)."""
    from relax.data.images import load_image

    found = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image":
                    found.append(load_image(part.get("image"), f"observation message {i} image part"))
                    parts.append({"type": "image"})
                else:
                    parts.append(part)
            m["content"] = parts
    return found


def observation_roles(data: Any) -> tuple[str, ...]:
    """The roles of the observations a run's episodes carry, from its data config: `tool` with `data.tools`, `user`
    with `data.env`; both for an agent loop or an agent program (`data.agent`, `data.openai_agent`), which may send
    either."""
    if getattr(data, "agent", None) or getattr(data, "openai_agent", None):
        return OBSERVATION_ROLES
    roles = (["tool"] if getattr(data, "tools", None) else []) + (["user"] if getattr(data, "env", None) else [])
    return tuple(roles)


def check_template(tokenizer: Any, model_name: str, roles: Sequence[str] = OBSERVATION_ROLES,
                   template: Optional[str] = None) -> None:
    """Raises ValueError, one message naming `model_name` and what its chat template does wrong, unless observations
    of every role in `roles` (`tool`, `user`) can be rendered after a model turn: the template renders without an
    error, keeps the assistant's content, and writes the observation's content after it. `template`: the option that
    gave the template (`model.chat_template='<path>'`), which the message names in place of the model's files."""
    problems: list[str] = []
    try:
        renderer = ObservationRenderer(tokenizer)
        for role in roles:
            probe = _PROBES[role]
            try:
                text = renderer.after_turn([probe])
            except ValueError as exc:
                problems.append(str(exc))
                if "drops an assistant message" in str(exc):
                    break  # the same for every role
                continue
            if probe["content"] not in text:
                problems.append(f"it does not write the content of a {role} message that follows an assistant "
                                "message")
    except ValueError as exc:  # no chat template
        problems.append(str(exc))
    if problems:
        if template is not None:
            raise ValueError(f"{template} (the chat template of model {model_name!r}) cannot render the "
                             f"observations of an agentic rollout after a model turn: {'; '.join(problems)}. Change "
                             "that file so that it renders tool results and user messages after assistant messages")
        raise ValueError(f"model {model_name!r}: its chat template cannot render the observations of an agentic "
                         f"rollout after a model turn: {'; '.join(problems)}. Give the model a chat template that "
                         "renders tool results and user messages after assistant messages (chat_template in its "
                         "tokenizer_config.json or chat_template.jinja, or model.chat_template=<file>)")


def parser_choice(spec: str, tokenizer: Any) -> str:
    """Which tool-call parser `data.tool_parser=spec` gives for `tokenizer`, and why, in a few words for the pre-start
    check's line: for `auto`, the marker of the chat template it went by (`relax.agents.parsers.parser_for_template`,
    first match wins), or that the template has no place for tools (Relax's tools prompt then teaches Hermes'
    format). A template `auto` refuses raises its ToolParserSpecError."""
    import json

    from relax.agents.parsers import AUTO, TEMPLATE_MARKERS, TEMPLATE_TOOLS, parser_for_template

    if spec != AUTO:
        return f"data.tool_parser={spec}"
    template = getattr(tokenizer, "chat_template", None)
    name = parser_for_template(template)
    text = template if isinstance(template, str) else json.dumps(template or "")
    marker = next((m for m, n in TEMPLATE_MARKERS if m in text and n == name), None)
    if marker is not None:
        return f"data.tool_parser=auto -> {name} (the chat template holds {marker!r})"
    if TEMPLATE_TOOLS not in text:
        return f"data.tool_parser=auto -> {name} (the chat template has no place for tools: Relax's tools prompt " \
               "teaches this format)"
    return f"data.tool_parser=auto -> {name}"
