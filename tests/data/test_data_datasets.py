"""Prompt files (JSONL, Parquet), malformed data, build_datasets and the sampler's determinism/resume."""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax.config.schema import DataConfig, RelaxConfig, RolloutConfig
from relax.data.datasets import DataError, PromptDataset, PromptSampler, build_datasets, load_prompt_file
from tests.data.conftest import write_jsonl


def cfg(**data):
    return RelaxConfig(data=DataConfig(**data))


def test_jsonl_with_custom_keys_and_chat_messages(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"question": "repeat 3", "answer": 3},
        {"question": [{"role": "system", "content": "is"}, {"role": "user", "content": "repeat 5"}], "answer": "5"},
    ])
    ds = load_prompt_file(path, tok, DataConfig(prompt_key="question", label_key="answer"))
    assert len(ds) == 2 and ds.num_dropped == 0
    first, second = ds[0], ds[1]
    assert first.label == "3" and isinstance(first.label, str)
    assert first.prompt_text == "<|im_start|>user\nrepeat 3<|im_end|>\n<|im_start|>assistant\n"
    assert first.prompt_ids == tok(first.prompt_text, add_special_tokens=False)["input_ids"]
    assert all(isinstance(i, int) for i in first.prompt_ids)
    assert second.prompt_text.startswith("<|im_start|>system\nis<|im_end|>\n<|im_start|>user\nrepeat 5")
    assert first.source == f"{path}:1"


def test_raw_text_without_chat_template(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "repeat 3", "label": "3"}])
    ds = load_prompt_file(path, tok, DataConfig(apply_chat_template=False))
    assert ds[0].prompt_text == "repeat 3" and tok.decode(ds[0].prompt_ids) == "repeat 3"


def test_parquet(tmp_path, tok):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"q": ["repeat 1", "repeat 2"], "a": ["1", "2"]}), path)
    ds = load_prompt_file(path, tok, DataConfig(prompt_key="q", label_key="a"))
    assert [x.label for x in ds] == ["1", "2"] and "repeat 2" in ds[1].prompt_text


@pytest.mark.parametrize("content, match", [
    ('{"prompt": "repeat 1", "label": "1"}\n{"prompt": "repeat 2", "label": \n', r"p\.jsonl:2: invalid JSON"),
    ('{"prompt": "repeat 1", "label": "1"}\n\n{"prompt": "repeat 2"}\n', r"p\.jsonl:3: missing key 'label'"),
    ('{"label": "1"}\n', r"p\.jsonl:1: missing key 'prompt'"),
    ('[1, 2]\n', r"p\.jsonl:1: expected a JSON object"),
    ('{"prompt": 5, "label": "1"}\n', r"p\.jsonl:1: 'prompt' must be a string"),
    ("", r"p\.jsonl is empty"),
    ("\n\n", r"p\.jsonl is empty"),
])
def test_malformed_jsonl_fails_naming_file_and_line(tmp_path, tok, content, match):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=match):
        load_prompt_file(path, tok)
    assert issubclass(DataError, ValueError)


def test_missing_file(tmp_path, tok):
    with pytest.raises(DataError, match="does not exist"):
        load_prompt_file(tmp_path / "nope.jsonl", tok)


def test_long_prompts_dropped_or_rejected(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "repeat 1", "label": "1"},
                                               {"prompt": "repeat " + "1 " * 50, "label": "1"}])
    ds = load_prompt_file(path, tok, DataConfig(), max_prompt_len=20)
    assert len(ds) == 1 and ds.num_dropped == 1
    with pytest.raises(DataError, match=r"p\.jsonl:2: prompt has \d+ tokens > rollout.max_prompt_len=20"):
        load_prompt_file(path, tok, DataConfig(prompt_overflow="error"), max_prompt_len=20)
    with pytest.raises(DataError, match="no prompts left"):
        load_prompt_file(path, tok, DataConfig(), max_prompt_len=3)


def test_build_datasets_synthetic(tok):
    train, evals = build_datasets(cfg(num_prompts=100, num_eval_prompts=10), tok)
    assert len(train) == 100 and len(evals) == 10
    again, _ = build_datasets(cfg(num_prompts=100, num_eval_prompts=10), tok)
    assert [x.prompt_ids for x in train] == [x.prompt_ids for x in again]
    assert all(x.prompt_text.endswith("<|im_start|>assistant\n") for x in train)
    assert build_datasets(cfg(num_prompts=10, num_eval_prompts=0), tok)[1] is None
    arith, _ = build_datasets(cfg(task="arithmetic", num_prompts=20, num_eval_prompts=5), tok)
    assert tok.unk_token_id not in arith[0].prompt_ids  # the tiny vocabulary covers the arithmetic prompt


def test_build_datasets_from_files(tmp_path, tok):
    train_path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"repeat {i}", "label": str(i)} for i in range(10)])
    eval_path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": f"repeat {i}", "label": str(i)} for i in range(5)])
    c = RelaxConfig(data=DataConfig(path=str(train_path), eval_path=str(eval_path), num_eval_prompts=3),
                    rollout=RolloutConfig(max_prompt_len=64))
    train, evals = build_datasets(c, tok)
    assert len(train) == 10 and len(evals) == 3
    with pytest.raises(DataError, match="data.path"):
        build_datasets(cfg(task="file"), tok)


def test_sampler_deterministic_and_reshuffles_each_epoch():
    data = list(range(10))
    a = PromptSampler(data, batch_size=4, seed=7)
    b = PromptSampler(data, batch_size=4, seed=7)
    batches_a = [a.next_batch() for _ in range(10)]
    assert batches_a == [b.next_batch() for _ in range(10)]
    flat = [x for batch in batches_a for x in batch]
    epochs = [flat[i:i + 10] for i in range(0, 40, 10)]
    assert all(sorted(e) == data for e in epochs)  # every epoch visits every prompt exactly once
    assert len({tuple(e) for e in epochs}) > 1  # and the order changes between epochs
    assert PromptSampler(data, 4, seed=8).next_batch() != PromptSampler(data, 4, seed=7).next_batch()
    assert PromptSampler(data, 4, seed=7, shuffle=False).next_batch() == [0, 1, 2, 3]


@pytest.mark.parametrize("steps_before", [0, 1, 2, 3, 7])
def test_sampler_resume_equals_uninterrupted(steps_before):
    data = list(range(10))
    uninterrupted = PromptSampler(data, batch_size=4, seed=3)
    expected = [uninterrupted.next_batch() for _ in range(steps_before + 6)]
    first = PromptSampler(data, batch_size=4, seed=3)
    for _ in range(steps_before):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = PromptSampler(data, batch_size=4, seed=3)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(6)] == expected[steps_before:]


def test_sampler_state_checks():
    s = PromptSampler(list(range(10)), 4, seed=1)
    s.next_batch()
    state = s.state_dict()
    assert state["epoch"] == 0 and state["position"] == 4
    with pytest.raises(DataError, match="10 prompts"):
        PromptSampler(list(range(11)), 4, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="seed"):
        PromptSampler(list(range(10)), 4, seed=2).load_state_dict(state)
    with pytest.raises(DataError, match="empty"):
        PromptSampler([], 4)


def test_sampler_on_prompt_dataset(tok):
    train, _ = build_datasets(cfg(num_prompts=64, num_eval_prompts=0), tok)
    assert isinstance(train, PromptDataset)
    batch = PromptSampler(train, batch_size=8, seed=1).next_batch()
    assert len(batch) == 8 and all(dataclasses.is_dataclass(x) for x in batch)


def test_a_prompt_the_chat_template_cannot_render_is_one_clear_error():
    """A template that refuses a role the prompt uses (a worked tool example on a template without a tool role)
    is a ValueError naming the roles, which relax-train reports before Ray starts, not a jinja2 traceback."""
    from jinja2 import TemplateError

    from relax.data.datasets import render_prompt

    class Refusing:
        chat_template = "{{ raise_exception('no tool role') }}"

        def apply_chat_template(self, messages, **_):
            if any(m["role"] == "tool" for m in messages):
                raise TemplateError("Conversation roles must alternate user/assistant")
            return "ok"

    prompt = [{"role": "user", "content": "3*4?"}, {"role": "tool", "content": "12"}]
    with pytest.raises(ValueError, match=r"cannot render this prompt \(roles: user, tool\): Conversation roles"):
        render_prompt(prompt, Refusing())
    assert render_prompt("3*4?", Refusing()) == ("ok", True)  # the control: a prompt it can render
