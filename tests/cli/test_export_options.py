"""relax-export on a model.source=config run: `--model-path` is refused (there is no model file for it to find), and
a LoRA run's adapters come with the base they go on (`OUT_DIR/base/`, named by adapter_config.json), which exists
nowhere else: PEFT loads them with the trainer's log-probs, from the directory alone."""

from __future__ import annotations

import json

import torch
from lora_step import model_info, train_one_step
from test_export import (
    assert_trainer_logprobs,
    commit,
    encode,
    model_logprobs,
    overrides,
    refused,
)

from relax.cli import export
from relax.config import load_config
from relax.roles.workers import PolicyWorker


def test_model_path_is_refused_for_a_model_built_from_config(tmp_path, capsys):
    cfg = load_config(overrides(tmp_path / "ckpt"))
    path = commit(cfg, 1, lambda d: PolicyWorker(cfg, model_info(cfg), threads=1).save(str(d)))
    err = refused([str(path), str(tmp_path / "out"), "--model-path", "/nonexistent"], capsys)
    assert f"--model-path /nonexistent has no effect on checkpoint {path}: its run built its model from config " \
           "(model.source=config, model.name=" in err and "leave --model-path out" in err
    assert not (tmp_path / "out").exists()
    export.main([str(path), str(tmp_path / "out")])  # the control: without it, the export is written
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_lora_adapters_of_a_config_model_come_with_their_base(tmp_path, capsys):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    cfg = load_config(overrides(tmp_path / "ckpt", "model.lora_rank=4", "model.lora_alpha=8", "train.lr=0.05"))
    step = train_one_step(cfg)
    path, tokenizer, pairs, batch, trainer = step.path, step.tokenizer, step.pairs, step.batch, step.trainer
    out = tmp_path / "adapters"
    export.main([str(path), str(out)])
    printed = capsys.readouterr().out
    assert f'AutoPeftModelForCausalLM.from_pretrained("{out}")' in printed and f"{out}/base/" in printed
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str((out / "base").resolve())  # was null
    assert json.loads((out / "relax_export.json").read_text())["base_model"]["dir"] == "base"
    assert not (out / "model.safetensors").exists()  # the adapters stay a PEFT directory
    loaded = [AutoPeftModelForCausalLM.from_pretrained(str(out)).eval(),  # the directory alone
              PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(out / "base")), str(out)).eval()]
    for model in loaded:
        assert_trainer_logprobs(trainer, batch, model_logprobs(model, tokenizer, pairs, cfg.rollout.temperature))
    # the control: the base alone is not the trained policy (the adapters moved it)
    base = AutoModelForCausalLM.from_pretrained(str(out / "base")).eval()
    p, r = encode(tokenizer, *pairs[0])
    with torch.no_grad():
        logits = base(torch.tensor([p + r])).logits[0, len(p) - 1:-1].float()
    row = torch.log_softmax(logits / cfg.rollout.temperature, -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
    assert not torch.allclose(row, trainer[0, :len(r)], atol=1e-4)
    # --merge still writes one merged model, no base beside it
    export.main([str(path), str(tmp_path / "merged"), "--merge"])
    assert (tmp_path / "merged" / "model.safetensors").is_file() and not (tmp_path / "merged" / "base").exists()
