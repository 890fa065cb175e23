"""model.chat_template that parses but renders wrongly: refused before start, one line naming the option and its file.

A template that renders a prompt as an empty text (blank, or reading a key the messages lack: Jinja renders
`message['contnet']` as '') is refused by the data check (a dry run and a start run the same checks), not by the
engine inside Ray ("every prompt needs at least one token"). A template that fails on the prompts or the observations
names `model.chat_template='<path>'`, not the model's own files, and one cause is one line (the agent check is not
tried on a template the data check refused)."""

from __future__ import annotations

import pytest

from relax.config import load_config
from relax.config.schema import ModelConfig
from relax.data.tokenizer import load_tokenizer
from relax.runner.preflight import preflight

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
EMPTY = {
    "blank": "{% if add_generation_prompt %}{% endif %}",
    "typo": "{% for message in messages %}{{ message['contnet'] | upper }}{% endfor %}",
}
# renders the first message alone: the prompts render, an assistant turn's content is dropped (the observations not)
FIRST_ONLY = "{{ messages[0]['content'] }}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
RAISES = "{{ raise_exception('roles must alternate') }}"
HINT = "(does it read message['content']?)"


def _write(tmp_path, text: str):
    path = tmp_path / "t.jinja"
    path.write_text(text)
    return path


@pytest.mark.parametrize("kind", sorted(EMPTY))
def test_a_template_that_renders_prompts_empty_is_refused_by_the_data_check(tmp_path, kind):
    path = _write(tmp_path, EMPTY[kind])
    # independent of the check: the template parses and renders a prompt as nothing
    tok = load_tokenizer(ModelConfig(chat_template=str(path)))
    assert tok.apply_chat_template([{"role": "user", "content": "repeat 7"}], add_generation_prompt=True,
                                   tokenize=False) == ""
    pre = preflight(load_config([f"model.chat_template={path}", "data.num_prompts=4"]))  # as the dry run runs them
    assert pre.status["tokenizer"] == "ok" and pre.status["data"] == "failed", pre.status
    text = str(pre.error())
    assert "\n" not in text, text
    assert f"model.chat_template={str(path)!r} renders this prompt as an empty text {HINT}" in text
    assert text.startswith("digits") and ":0: " in text  # the prompt it names: the data set's first


def test_a_template_that_reads_the_messages_passes(tmp_path):
    path = _write(tmp_path, CHATML)
    pre = preflight(load_config([f"model.chat_template={path}", "data.num_prompts=4"]),
                    only=("model", "tokenizer", "data"))
    assert pre.ok, pre.problems
    assert pre.train_set[0].prompt_ids


def test_a_template_that_raises_is_one_line_naming_the_option(tmp_path):
    path = _write(tmp_path, RAISES)
    pre = preflight(load_config(["data=guess_number", f"model.chat_template={path}"]))
    assert pre.status["data"] == "failed", pre.status
    text = str(pre.error())
    assert "\n" not in text, text  # one cause: the agent check does not add a second line
    assert f"model.chat_template={str(path)!r} cannot render this prompt" in text and "roles must alternate" in text
    assert "the model's chat template" not in text and "tokenizer_config.json" not in text
    assert pre.status["agent"] == "ok" and "not checked" in pre.notes["agent"]


def test_a_template_that_drops_assistant_turns_names_the_option_not_the_models_files(tmp_path):
    path = _write(tmp_path, FIRST_ONLY)
    pre = preflight(load_config(["data=guess_number", f"model.chat_template={path}"]))
    assert pre.status["data"] == "ok" and pre.status["agent"] == "failed", pre.status
    text = str(pre.error())
    assert "\n" not in text, text
    assert text.startswith(f"model.chat_template={str(path)!r} (the chat template of model 'tiny') cannot "
                           "render the observations"), text
    assert "drops an assistant message's content" in text and "tokenizer_config.json" not in text
