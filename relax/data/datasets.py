"""Prompt datasets and the prompt sampler.

Files are JSONL (one JSON object per line) or Parquet, with the prompt under `data.prompt_key` and the
label under `data.label_key` (a dotted path reaches a nested field: `relax.data.files.record_field`; a record may
lack it where nothing reads labels, `relax.config.derive.label_reader`: its label is then ""). A prompt is a
string or a chat message list (`[{"role", "content"}, ...]`).
Everything is checked when the dataset is built, so malformed data fails at start with a `DataError`
naming the file and line, never halfway through training.

Prompts longer than `rollout.max_prompt_len` tokens (after the chat template) are, per
`data.prompt_overflow`, dropped and counted in `PromptDataset.num_dropped` (default; a warning is logged;
all prompts dropped is an error) or rejected with an error naming the first offending line.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
from jinja2 import TemplateError

from relax.config.derive import label_reader
from relax.config.evaluation import default_eval_set_name, eval_set_files
from relax.data.files import DataError, Record, check_prompt, read_records, record_field
from relax.data.gsm8k import prepare_gsm8k
from relax.data.images import VisionData, check_text_prompt, draw_vision, prompt_has_images, vision_data
from relax.data.tasks import generate_task

logger = logging.getLogger(__name__)

# renders a prompt's chat messages (after data.system_prompt) into the text the model sees, in place of the plain
# chat template: with data.tools, the tools' chat format (relax.runner.preflight.tools_renderer: the gateway's)
PromptRenderer = Callable[[list[dict]], str]


@dataclass(frozen=True, init=False)
class PromptItem:
    """One prompt ready for rollout: token ids after the chat template, the label for the reward, the
    prompt text the ids encode, and where it came from (`file:line` or `task:index`).

    A prompt with images keeps a reference to them (`images`: the record's paths or inline bytes, the grids and the
    image-token count the processor gave at load; `relax.data.images.is_image_reference`), never their pixel values:
    `vision` computes those when the item is drawn, and an item sent to another process (pickled: Ray) carries them,
    computed where it is sent from (which reads the images), so a rollout worker needs no image file. Its fields (what
    a checkpoint of the rollout stream keeps, `dataclasses.asdict`) hold no pixel values."""

    prompt_ids: list[int]
    label: str
    prompt_text: str
    index: int
    source: str = ""
    messages: Optional[list[dict]] = None  # the prompt as chat messages (when the chat template rendered it)
    # a prompt with images: the reference to them (relax.data.images.VisionData.reference), whose image tokens
    # `prompt_ids` holds; None: text only
    images: Optional[dict] = field(default=None, repr=False)
    # the record's other fields (all but the prompt, the label and the images), as plain data (`plain_fields`): what
    # a reward function asks for by name (relax.rewards.calls.reward_inputs), and what an episode's item carries
    fields: dict = field(default_factory=dict, repr=False)

    def __init__(self, prompt_ids: list[int], label: str, prompt_text: str, index: int, source: str = "",
                 messages: Optional[list[dict]] = None, images: Optional[dict] = None,
                 vision: Optional[dict] = None, fields: Optional[dict] = None):
        # vision: a checkpoint's item written before references (its pixel values, drawn as they are); fields: none
        # in a checkpoint's item written before they were kept
        for name, value in (("prompt_ids", prompt_ids), ("label", label), ("prompt_text", prompt_text),
                            ("index", index), ("source", source), ("messages", messages),
                            ("images", images if images is not None else vision), ("fields", dict(fields or {}))):
            object.__setattr__(self, name, value)

    @property
    def vision(self) -> Optional[dict]:
        """The prompt's vision inputs ({"pixel_values", "image_grid_thw", "image_tokens"}, and "image_data" for
        rollout=sglang), computed from the images now (`relax.data.images.draw_vision`; each access reads them
        again); None for a text-only prompt."""
        drawn = self.__dict__.get("_vision")
        if drawn is not None:
            return drawn
        return None if self.images is None else draw_vision(self.images)

    def __getstate__(self) -> dict:
        """Pickled (sent to another process): with the vision inputs drawn here."""
        state = dict(self.__dict__)
        if self.images is not None and state.get("_vision") is None:
            state["_vision"] = draw_vision(self.images)
        return state


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


# how a prompt's message names the model's own chat template; a run with model.chat_template names the option and
# its file instead (`template_words`)
TEMPLATE_WORDS = "the model's chat template"
# the check that the chat template reads the messages (`_reads_messages`) gives each message the first of these texts
# that differs from its own
_PROBE_TEXTS = ("What is 7 + 5?", "Name a colour.")


def template_words(chat_template: Optional[str]) -> str:
    """How a message names the chat template prompts are rendered with: `model.chat_template='<path>'` where the
    run sets it (the template that replaces the model's own), else `TEMPLATE_WORDS`."""
    return f"model.chat_template={chat_template!r}" if chat_template else TEMPLATE_WORDS


def config_template_words(cfg: Any) -> str:
    """`template_words` of a run's config (its `model.chat_template`)."""
    return template_words(getattr(getattr(cfg, "model", None), "chat_template", None))


def render_prompt(
    prompt: Union[str, list[dict[str, str]]],
    tokenizer: Any,
    apply_chat_template: bool = True,
    system_prompt: Optional[str] = None,
    render: Optional[PromptRenderer] = None,
    template: str = TEMPLATE_WORDS,
    check_reads: bool = False,
) -> tuple[str, bool]:
    """The prompt text the model sees and whether the chat template produced it.

    With a template (and `apply_chat_template`): the messages (a string becomes one user message) after
    `system_prompt` as a system message, rendered with `add_generation_prompt=True`, or by `render` where given (a
    run with data.tools: the template with the tools' schemas, as the gateway renders them). Without: the string
    itself, or a message list's contents joined by newlines. A `system_prompt` that cannot apply (no template,
    or a message list with its own system message) is a ValueError, never silently dropped; so is a template that
    fails on the prompt or renders it as an empty text (blank, or reading a key the messages lack), and, with
    `check_reads` (a data set's first prompt), one that reads no message's text (a fixed text): it renders the
    prompt with other texts in its messages as the same text, so it would render every prompt alike. `template`: how
    the messages name the template (`template_words`).
    """
    if system_prompt and not (apply_chat_template and has_chat_template(tokenizer)):
        raise ValueError("data.system_prompt needs the chat template (data.apply_chat_template=true and a tokenizer "
                         "with a template)")
    if apply_chat_template and has_chat_template(tokenizer):
        messages = prompt_messages(prompt, system_prompt)
        try:
            text = _render_messages(messages, tokenizer, render)
        except TemplateError as exc:  # e.g. a template that refuses a role the prompt uses (a worked tool example)
            roles = ", ".join(dict.fromkeys(m.get("role", "?") for m in messages))
            raise ValueError(f"{template} cannot render this prompt (roles: {roles}): {exc}") from None
        if not text.strip():  # a template that reads no message (a typo'd key renders as ''): nothing to generate after
            raise ValueError(f"{template} renders this prompt as an empty text (does it read "
                             "message['content']?)")
        if check_reads and not _reads_messages(messages, text, tokenizer, render):  # a fixed text: `{{ "hello" }}`
            raise ValueError(f"{template} renders this prompt as the same text whatever its messages say, so every "
                             "prompt alike (does it read message['content']?)")
        return text, True
    if isinstance(prompt, str):
        return prompt, False
    return "\n".join(m["content"] for m in prompt), False


def _render_messages(messages: list[dict], tokenizer: Any, render: Optional[PromptRenderer]) -> str:
    if render is not None:
        return render(messages)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _reads_messages(messages: list[dict], text: str, tokenizer: Any, render: Optional[PromptRenderer]) -> bool:
    """Whether the chat template reads the messages' texts: the same messages with another text in each render
    otherwise than `text` (their render). A template that fails on those is taken to read them (the prompts'
    own renders are what the check before ensures)."""
    other = [{**m, "content": next(t for t in _PROBE_TEXTS if t != m["content"])} if isinstance(m.get("content"), str)
             else m for m in messages]
    # no text of the conversation's own to change (a system prompt beside content parts alone): a template that drops
    # the system message would render both alike, yet reads the conversation
    if all(m.get("role") == "system" or not isinstance(m.get("content"), str) for m in messages):
        return True
    try:
        return _render_messages(other, tokenizer, render) != text
    except (TemplateError, ValueError):
        return True


def prompt_messages(prompt: Union[str, list[dict[str, str]]], system_prompt: Optional[str]) -> list[dict[str, str]]:
    """A prompt as chat messages: a string as one user message, after `system_prompt` as a system message."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt:
        if any(m.get("role") == "system" for m in messages):
            raise ValueError("data.system_prompt is set but this prompt has its own system message")
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def tokenize_prompt(text: str, tokenizer: Any, templated: bool) -> list[int]:
    """Token ids of a prompt text. A templated text already holds its special tokens, so none are added."""
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])


class PromptDataset(Sequence[PromptItem]):
    """Tokenized prompts with labels. `num_dropped`: prompts skipped for exceeding `max_prompt_len`."""

    def __init__(self, items: list[PromptItem], name: str = "", num_dropped: int = 0):
        self.items = items
        self.name = name
        self.num_dropped = num_dropped

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:  # type: ignore[override]
        return self.items[i]

    def __repr__(self) -> str:
        return f"PromptDataset({self.name!r}, {len(self)} prompts, {self.num_dropped} dropped)"

    @classmethod
    def from_records(
        cls,
        records: Sequence[Record],
        tokenizer: Any,
        prompt_key: str = "prompt",
        label_key: str = "label",
        apply_chat_template: bool = True,
        max_prompt_len: Optional[int] = None,
        prompt_overflow: str = "drop",
        system_prompt: Optional[str] = None,
        name: str = "",
        vision: Optional[VisionData] = None,
        render: Optional[PromptRenderer] = None,
        label_for: Optional[str] = "the reward",
        template: str = TEMPLATE_WORDS,
    ) -> PromptDataset:
        """Render, tokenize and length-check records (see the module docstring for `prompt_overflow`). Records with
        images need `vision` (the processor of a vision-language model): a DataError naming the field otherwise.
        `render`: the text of a prompt's messages in place of the plain chat template (`render_prompt`).
        `label_for`: what reads the labels (`relax.config.derive.label_reader`); None: nothing does, and a record
        without a label gets the label "". `template`: how messages name the chat template (`template_words`); the
        first prompt rendered also checks that the template reads the messages (`render_prompt`'s `check_reads`)."""
        if prompt_overflow not in ("drop", "error"):
            raise DataError(f"data.prompt_overflow={prompt_overflow!r}: must be drop | error")
        cache: dict[str, tuple[str, list[int], Optional[list[dict]]]] = {}
        items: list[PromptItem] = []
        dropped = 0
        image_key = vision.image_key if vision is not None else "images"
        for obj, where in records:
            label = record_field(obj, label_key)
            if label is None and label_for is not None:
                raise DataError(f"{where}: missing key {label_key!r} (data.label_key), the label {label_for} reads")
            label = "" if label is None else label
            pictured = None
            if prompt_has_images(obj, prompt_key, image_key):
                if vision is None:
                    raise DataError(f"{where}: the record has images ({prompt_key!r} image parts or {image_key!r}) "
                                    "but the model is text-only: use a vision-language model (model=tiny_vl, "
                                    "qwen2_5_vl_3b, qwen3_vl_2b) or drop the images")
                pictured = vision.encode(obj, prompt_key, where, apply_chat_template, system_prompt)
            if pictured is not None:
                text, ids, messages, images = pictured  # images: a reference (no pixel values)
                if max_prompt_len is not None and len(ids) > max_prompt_len:
                    if prompt_overflow == "error":
                        raise DataError(f"{where}: prompt has {len(ids)} tokens (images included) > "
                                        f"rollout.max_prompt_len={max_prompt_len} (raise rollout.max_prompt_len or "
                                        "set data.prompt_overflow=drop)")
                    dropped += 1
                    continue
                items.append(PromptItem(ids, label_text(label), text, len(items), where, messages, images,
                                        fields=plain_fields(obj, (prompt_key, label_key, image_key))))
                continue
            prompt = check_prompt(obj.get(prompt_key), where, prompt_key)
            cache_key = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
            if cache_key not in cache:
                try:
                    text, templated = render_prompt(prompt, tokenizer, apply_chat_template, system_prompt, render,
                                                    template, check_reads=not cache)
                except ValueError as exc:
                    raise DataError(f"{where}: {exc}") from None
                ids = tokenize_prompt(text, tokenizer, templated)
                if templated and not ids:
                    raise DataError(f"{where}: {template} renders this prompt as no token (does it read "
                                    "message['content']?)")
                if not templated and not text.strip():  # nothing to generate after: refused here, not mid-rollout
                    what = (("is empty" if not prompt else "is only white space") if isinstance(prompt, str)
                            else "has messages whose contents are empty")
                    raise DataError(f"{where}: the prompt {prompt_key!r} {what}, and without a chat template the "
                                    "model gets no text to answer: give it text or drop the record")
                cache[cache_key] = (text, ids, prompt_messages(prompt, system_prompt) if templated else None)
            text, ids, messages = cache[cache_key]
            check_text_prompt(vision, text, ids, where)  # no vision tokens, no <image> markers without images
            if max_prompt_len is not None and len(ids) > max_prompt_len:
                if prompt_overflow == "error":
                    raise DataError(f"{where}: prompt has {len(ids)} tokens > rollout.max_prompt_len={max_prompt_len} "
                                    "(raise rollout.max_prompt_len or set data.prompt_overflow=drop)")
                dropped += 1
                continue
            items.append(PromptItem(list(ids), label_text(label), text, len(items), where, messages,
                                    fields=plain_fields(obj, (prompt_key, label_key, image_key))))
        if dropped:
            logger.warning("%s: dropped %d of %d prompts longer than rollout.max_prompt_len=%s tokens",
                           name, dropped, len(records), max_prompt_len)
        if not items:
            raise DataError(f"{name}: no prompts left: all {len(records)} exceed rollout.max_prompt_len="
                            f"{max_prompt_len} tokens")
        return cls(items, name=name, num_dropped=dropped)


def plain_fields(record: dict, used: Sequence[str]) -> dict:
    """The record's fields other than `used` (its prompt, label and images keys), each as plain data: JSON's types
    as they are, a value of another type (a Parquet date or decimal) as its str, so that they pickle to any process,
    go into a checkpoint and into a reward service's JSON."""
    return {str(k): _plain(v) for k, v in record.items() if k not in used}


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def label_text(label: Any) -> str:
    """The label as the reward receives it: a string as it is; any other value (a JSON object, list, number, true or
    false) as its JSON text (`json.dumps`), so that a reward that parses the label (code_tests) reads what the file
    holds: `{"tests": [...]}` arrives as JSON, never as Python's repr (single quotes, True, None). A value JSON cannot
    write (a Parquet date or decimal) is written as its str."""
    if isinstance(label, str):
        return label
    return json.dumps(label, ensure_ascii=False, default=str)


def load_prompt_file(path: Union[str, Path], tokenizer: Any, data_cfg: Any = None,
                     max_prompt_len: Optional[int] = None, limit: Optional[int] = None,
                     vision: Optional[VisionData] = None, keys: Optional[tuple[str, str]] = None,
                     key_fields: tuple[str, str] = ("data.prompt_key", "data.label_key"),
                     render: Optional[PromptRenderer] = None,
                     label_for: Optional[str] = "the reward", template: str = TEMPLATE_WORDS) -> PromptDataset:
    """A `PromptDataset` from a JSONL/Parquet file, with keys and options from `data_cfg` (a DataConfig); `keys`:
    (prompt key, label key) instead of data_cfg's, `key_fields`: the fields a missing key's message names; `vision`:
    a vision-language model's processor (relative image paths are read from the file's directory); `render`: see
    `render_prompt`; `label_for`: what reads the labels (None: nothing, a record may have none; `read_records`);
    `template`: how messages name the chat template (`template_words`)."""
    opts = _data_options(data_cfg)
    if keys is not None:
        opts.update(prompt_key=keys[0], label_key=keys[1])
    records = read_records(path, opts["prompt_key"], opts["label_key"], key_fields, label_for)
    if limit is not None:
        records = records[:limit]
    if vision is not None:
        vision = vision.at(Path(path).expanduser().parent)
    return PromptDataset.from_records(records, tokenizer, max_prompt_len=max_prompt_len, name=str(path),
                                      vision=vision, render=render, label_for=label_for, template=template, **opts)


def _data_options(data_cfg: Any) -> dict[str, Any]:
    def get(name: str, default: Any) -> Any:
        return getattr(data_cfg, name, default) if data_cfg is not None else default

    return {
        "prompt_key": get("prompt_key", "prompt"),
        "label_key": get("label_key", "label"),
        "apply_chat_template": get("apply_chat_template", True),
        "prompt_overflow": get("prompt_overflow", "drop"),
        "system_prompt": get("system_prompt", None),
    }


def build_datasets(cfg: Any, tokenizer: Any,
                   render: Optional[PromptRenderer] = None) -> tuple[PromptDataset, Optional[PromptDataset]]:
    """(train, eval or None) from `cfg.data`, `cfg.rollout.max_prompt_len` and `cfg.seed`; `render`: how prompts'
    messages become text in place of the plain chat template (`render_prompt`; with data.tools, the tools' chat
    format). Messages about the chat template name it as `config_template_words` does (model.chat_template's file
    where the run sets one).

    Sources, in order: `data.path` (eval: `data.eval_path`; required when `data.task=file`);
    `data.task=gsm8k` (prepared from $DATA_DIR, eval: its test split); else the synthetic `data.task`
    (digits | arithmetic) with `data.num_prompts` train and `data.num_eval_prompts` eval prompts.
    Eval sets hold at most `data.num_eval_prompts` prompts (the first ones of a file); 0 means no eval set.
    """

    data = cfg.data
    max_len = cfg.rollout.max_prompt_len
    seed = cfg.seed
    n_eval = data.num_eval_prompts
    vision = vision_data(cfg, tokenizer)
    opts = _data_options(data)
    template = config_template_words(cfg)
    labels = label_reader(cfg)  # None: a record of the user's files may have no label
    train_path: Optional[Any] = data.path
    eval_path: Optional[Any] = data.eval_path
    if train_path is None and data.task == "file":
        raise DataError(f"data.task=file (data={data.name}): data.path is not set; "
                        "pass data.path=/path/to/prompts.jsonl")
    if train_path is None and data.task == "gsm8k":
        prepared = prepare_gsm8k()
        if "train" not in prepared:
            raise DataError("data.task=gsm8k: no GSM8K train split found under $DATA_DIR")
        # the prepared files are keyed prompt/label (relax.data.gsm8k); data.prompt_key / label_key name the fields
        # of the user's files (data.eval_path, data.eval_sets)
        own = ("prompt", "label")
        train = load_prompt_file(prepared["train"], tokenizer, data, max_len, vision=vision, keys=own, render=render,
                                 template=template)
        evals = None
        if n_eval > 0 and (eval_path is not None or prepared.get("test") is not None):
            evals = load_prompt_file(eval_path or prepared["test"], tokenizer, data, max_len, limit=n_eval,
                                     vision=vision, keys=None if eval_path is not None else own, render=render,
                                     label_for=labels, template=template)
        return train, evals
    if train_path is not None:
        train = load_prompt_file(train_path, tokenizer, data, max_len, vision=vision, render=render, label_for=labels,
                                 template=template)
        evals = None
        if eval_path is not None and n_eval > 0:
            evals = load_prompt_file(eval_path, tokenizer, data, max_len, limit=n_eval, vision=vision, render=render,
                                     label_for=labels, template=template)
        return train, evals
    opts.update(prompt_key="prompt", label_key="label")
    records = [(r, f"{data.task}:train:{i}") for i, r in enumerate(generate_task(data.task, data.num_prompts, seed))]
    if not records:
        raise DataError(f"data.num_prompts={data.num_prompts}: must be > 0")
    train = PromptDataset.from_records(records, tokenizer, max_prompt_len=max_len, name=f"{data.task}/train",
                                       vision=vision, render=render, template=template, **opts)
    evals = None
    if n_eval > 0:
        ev = [(r, f"{data.task}:eval:{i}") for i, r in enumerate(generate_task(data.task, n_eval, seed, "eval"))]
        evals = PromptDataset.from_records(ev, tokenizer, max_prompt_len=max_len, name=f"{data.task}/eval",
                                           vision=vision, render=render, template=template, **opts)
    return train, evals


def build_eval_sets(cfg: Any, tokenizer: Any, default: Optional[PromptDataset],
                    render: Optional[PromptRenderer] = None) -> dict[str, PromptDataset]:
    """The eval sets by name, in evaluation order (names: `relax.config.evaluation`): `default` (the eval set of
    `build_datasets`) under the name of `data.eval_path` or of the task, then each file of `data.eval_sets`, at most
    `data.num_eval_prompts` prompts each, read with the entry's keys (`eval_set_files`). A missing or malformed file
    is a DataError naming its entry: one for every such entry, each on a line of its own."""

    data = cfg.data
    out: dict[str, PromptDataset] = {}
    name = default_eval_set_name(data)
    if default is not None and name is not None:
        out[name] = default
    problems = []
    for name, entry in eval_set_files(data).items():
        # a key the entry names itself is set there; otherwise data.prompt_key sets it for every file, or the
        # entry's own key for this file alone
        fields = tuple(f"data.eval_sets.{name}.{key}" if key in entry.own
                       else f"data.{key}, or for this set alone data.eval_sets={{{name}:{{path:...,{key}:<field>}}}}"
                       for key in ("prompt_key", "label_key"))
        try:
            out[name] = load_prompt_file(entry.path, tokenizer, data, cfg.rollout.max_prompt_len,
                                         limit=data.num_eval_prompts, vision=vision_data(cfg, tokenizer),
                                         keys=(entry.prompt_key, entry.label_key), key_fields=fields, render=render,
                                         label_for=label_reader(cfg), template=config_template_words(cfg))
        except DataError as exc:
            problems.append(f"data.eval_sets.{name}: {exc}")
    if problems:
        raise DataError("\n".join(problems))
    return out


class PromptSampler:
    """Batches of `batch_size` prompts per step, forever.

    Each epoch visits every prompt once in an order drawn from (seed, epoch) (or file order when
    `shuffle=False`); a batch that reaches the end of an epoch continues with the next epoch's order, so
    nothing is skipped. `state_dict()` is (epoch, position): a sampler restored from it yields exactly the
    batches the original would have yielded next.
    """

    def __init__(self, dataset: Sequence[Any], batch_size: int, seed: int = 0, shuffle: bool = True):
        if len(dataset) == 0:
            raise DataError("PromptSampler: the dataset is empty")
        if batch_size <= 0:
            raise ValueError(f"PromptSampler: batch_size must be > 0, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: list[int] = []

    def order(self, epoch: int) -> list[int]:
        """Dataset indices in the order epoch `epoch` visits them."""
        if not self.shuffle:
            return list(range(len(self.dataset)))
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, epoch])
        return rng.permutation(len(self.dataset)).tolist()

    def _current_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            self._order = self.order(self.epoch)
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self, size: Optional[int] = None) -> list[Any]:
        """The next `size` items (None: `batch_size`), advancing (epoch, position)."""
        size = self.batch_size if size is None else size
        if size <= 0:
            raise ValueError(f"PromptSampler.next_batch: size must be > 0, got {size}")
        batch: list[Any] = []
        while len(batch) < size:
            order = self._current_order()
            take = min(size - len(batch), len(order) - self.position)
            batch.extend(self.dataset[i] for i in order[self.position:self.position + take])
            self.position += take
            if self.position >= len(order):
                self.epoch += 1
                self.position = 0
        return batch

    def __iter__(self) -> Iterator[list[Any]]:
        while True:
            yield self.next_batch()

    @property
    def steps_per_epoch(self) -> float:
        return len(self.dataset) / self.batch_size

    def state_dict(self) -> dict[str, Any]:
        """Where the sampler is: enough to resume exactly (plus checks that the data did not change)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle,
                "dataset_size": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; a different dataset size or seed would replay different prompts: an error."""
        size = state.get("dataset_size", len(self.dataset))
        if size != len(self.dataset):
            raise DataError(f"PromptSampler: checkpoint was taken with {size} prompts, the dataset now has "
                            f"{len(self.dataset)}; resuming would not replay the same prompts")
        if state.get("seed", self.seed) != self.seed or state.get("shuffle", self.shuffle) != self.shuffle:
            raise DataError(f"PromptSampler: checkpoint seed/shuffle ({state.get('seed')}, {state.get('shuffle')}) "
                            f"differ from the current ({self.seed}, {self.shuffle})")
        try:
            epoch, position = int(state["epoch"]), int(state["position"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"PromptSampler: the checkpoint's sampler state is damaged ({type(e).__name__}: {e})") \
                from None
        if not 0 <= position < len(self.dataset) or epoch < 0:
            raise DataError(f"PromptSampler: position {position} (epoch {epoch}) out of range for "
                            f"{len(self.dataset)} prompts")
        self.epoch = epoch
        self.position = position
