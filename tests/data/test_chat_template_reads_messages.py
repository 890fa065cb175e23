"""The chat template's name travels with the data it renders, and a template that reads no message is refused.

- `build_datasets` names the template it renders with itself: `model.chat_template='<path>'` where the run gives one,
  "the model's chat template" otherwise (before, it always wrote the latter and the preflight's data check replaced
  the words in its message, so any other caller of `build_datasets` named the model's own template for the user's).
- A model.chat_template that reads no message (a fixed text, `{{ "hello" }}`, or the roles alone) renders every
  prompt as the same text: the data check refuses it before start, naming the option, as it refuses an empty render.
  Before, it passed the check and the run trained on one prompt's worth of text."""

from __future__ import annotations

import pytest
from relax_train_inprocess import relax_train

from relax.config import load_config
from relax.config.schema import ModelConfig
from relax.data.datasets import DataError, build_datasets
from relax.data.tokenizer import load_tokenizer
from relax.runner.preflight import preflight

BLANK = "{% if add_generation_prompt %}{% endif %}"
FIXED = {
    "text": '{{ "hello" }}',
    "roles": "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
}
# reads the last message alone: every prompt renders differently (a system prompt would be dropped, but not refused)
LAST_ONLY = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
HINT = "(does it read message['content']?)"


def _write(tmp_path, text: str):
    path = tmp_path / "t.jinja"
    path.write_text(text)
    return path


def test_build_datasets_names_the_template_the_run_gives(tmp_path):
    path = _write(tmp_path, BLANK)
    tok = load_tokenizer(ModelConfig(chat_template=str(path)))  # the tokenizer the run loads with the template
    with pytest.raises(DataError) as given:
        build_datasets(load_config([f"model.chat_template={path}", "data.num_prompts=4"]), tok)
    assert f"model.chat_template={str(path)!r} renders this prompt as an empty text {HINT}" in str(given.value)
    assert "the model's chat template" not in str(given.value)
    # the same tokenizer without the option in the config: the template is the model's, and named so
    with pytest.raises(DataError) as own:
        build_datasets(load_config(["data.num_prompts=4"]), tok)
    assert f"the model's chat template renders this prompt as an empty text {HINT}" in str(own.value)


@pytest.mark.parametrize("kind", sorted(FIXED))
def test_a_template_that_reads_no_message_is_refused_by_the_data_check(tmp_path, kind):
    path = _write(tmp_path, FIXED[kind])
    # independent of the check: two different prompts render as one text, and not an empty one
    tok = load_tokenizer(ModelConfig(chat_template=str(path)))
    texts = {tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
             for c in ("repeat 7", "repeat 1234")}
    assert len(texts) == 1 and next(iter(texts)).strip(), texts
    pre = preflight(load_config([f"model.chat_template={path}", "data.num_prompts=4"]))  # as the dry run runs them
    assert pre.status["tokenizer"] == "ok" and pre.status["data"] == "failed", pre.status
    text = str(pre.error())
    assert "\n" not in text, text
    assert text.startswith("digits") and ":0: " in text, text  # the data set's first prompt
    assert (f"model.chat_template={str(path)!r} renders this prompt as the same text whatever its messages say, so "
            f"every prompt alike {HINT}") in text, text


def test_a_template_that_reads_the_last_message_passes(tmp_path):
    path = _write(tmp_path, LAST_ONLY)
    pre = preflight(load_config([f"model.chat_template={path}", "data.num_prompts=4"]),
                    only=("model", "tokenizer", "data"))
    assert pre.ok, pre.problems
    assert len({item.prompt_text for item in pre.train_set}) > 1


def test_relax_train_dry_run_refuses_a_fixed_text_template(tmp_path, capfd):
    path = _write(tmp_path, FIXED["text"])
    code, out, err = relax_train([f"model.chat_template={path}", "data.num_prompts=4", "dry_run=true"], capfd)
    assert code != 0, out + err
    assert f"model.chat_template={str(path)!r} renders this prompt as the same text whatever its messages say" \
        in out + err, out + err
    assert "Traceback" not in out + err


def test_a_template_that_drops_the_system_message_is_not_refused_where_only_the_system_text_could_change():
    """Messages whose only text is the system prompt's (the user's content parts alone: an image prompt): a template
    that drops system messages renders the probe alike, yet reads the conversation; it is not refused (the check
    cannot tell, and says nothing)."""
    from relax.data.datasets import _reads_messages

    tok = load_tokenizer(ModelConfig())
    drops_system = ("{% for m in messages %}{% if m['role'] != 'system' %}{{ m['role'] }}{% endif %}{% endfor %}"
                    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    tok.chat_template = drops_system
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert _reads_messages(messages, text, tok, None)
    # the control: with a user text to change, the same template (which reads no content at all) is caught
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What colour?"}]
    assert not _reads_messages(plain, tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=False),
                               tok, None)
