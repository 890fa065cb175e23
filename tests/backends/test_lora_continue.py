"""Continuing to train a PEFT LoRA adapter (model.lora_adapter_path): the config takes the adapter's own settings
(conflicting ones refused naming both); the torch trainer starts at the adapter's weights bit for bit with
PeftModel.from_pretrained(base, adapter)'s log-probs; the reference of a KL term is the policy at the start (base +
adapter, as TRL's GRPOTrainer keeps a "ref" copy of a PEFT model's adapter), not the base; the engines get the merged
model or the adapters; a checkpoint is an adapter directory PEFT loads, and resumes; bad adapter directories are
refused before start, naming what is wrong. Every adapter is written by PEFT itself into tmp_path."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from relax.algorithms.grpo import GRPOConfig
from relax.config import ConfigError, load_config
from relax.config.derive import adapter_model_config
from relax.models import lora
from relax.models.hf import build_model
from relax.train.torch_policy import TorchPolicy

VOCAB, PAD, SEED = 32, 0, 3


def save_adapter(model_cfg, directory, *, seed: int = SEED, base_name=None, **lora_kw) -> dict[str, torch.Tensor]:
    """A LoRA adapter as SFT would leave it (B nonzero), saved by PEFT; returns its tensors as saved."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    kw = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]) | lora_kw
    peft_model = get_peft_model(build_model(model_cfg, VOCAB, PAD, seed=seed), LoraConfig(**kw))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft_model.save_pretrained(str(directory))
    if base_name is not None:
        file = directory / lora.ADAPTER_CONFIG
        file.write_text(json.dumps(json.loads(file.read_text()) | {"base_model_name_or_path": str(base_name)}))
    return load_file(str(directory / lora.ADAPTER_WEIGHTS))


@pytest.fixture
def adapter(tiny_model_cfg, tmp_path):
    directory = tmp_path / "sft_adapter"
    saved = save_adapter(tiny_model_cfg, directory)
    return directory, saved


@pytest.fixture
def cont_cfg(tiny_model_cfg, adapter):
    return adapter_model_config(dataclasses.replace(tiny_model_cfg, lora_adapter_path=str(adapter[0])))


def policy(model_cfg, train_cfg, **kw) -> TorchPolicy:
    return TorchPolicy(model_cfg, dataclasses.replace(train_cfg, lr=2e-2), vocab_size=VOCAB, pad_token_id=PAD,
                       seed=SEED, device="cpu", **kw)


def peft_logprobs(model, samples) -> torch.Tensor:
    """log p(response tokens) by hand, row by row without padding: log_softmax of the model's logits."""
    out = torch.zeros(samples.response_ids.shape)
    for i in range(samples.response_ids.shape[0]):
        prompt = samples.prompt_ids[i][samples.prompt_mask[i].bool()]
        resp = samples.response_ids[i][samples.response_mask[i].bool()]
        ids = torch.cat([prompt, resp])[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(resp))
        out[i, :len(resp)] = logp[pos, resp]
    return out


def peft_start(model_cfg, directory):
    from peft import PeftModel

    return PeftModel.from_pretrained(build_model(model_cfg, VOCAB, PAD, seed=SEED), str(directory)).eval()


def test_the_config_takes_the_adapters_settings_and_refuses_other_ones(tmp_path):
    """Resolution fills model.lora_* from adapter_config.json; a value set otherwise is refused naming both."""
    base = load_config([]).model  # the default tiny model
    save_adapter(base, tmp_path / "a", r=2, lora_alpha=6, lora_dropout=0.1, target_modules=["k_proj", "o_proj"])
    m = load_config([f"model.lora_adapter_path={tmp_path / 'a'}"]).model
    assert (m.lora_rank, m.lora_alpha, m.lora_dropout, m.lora_target_modules) == (2, 6.0, 0.1, ["k_proj", "o_proj"])
    same = load_config([f"model.lora_adapter_path={tmp_path / 'a'}", "model.lora_rank=2"]).model
    assert same == m
    for override, own in (("model.lora_rank=8", "2"), ("model.lora_alpha=32", "6.0"),
                          ("model.lora_target_modules=[q_proj]", "['k_proj', 'o_proj']")):
        with pytest.raises(ConfigError) as e:
            load_config([f"model.lora_adapter_path={tmp_path / 'a'}", override])
        text = str(e.value)
        assert override.split("=")[0] in text and f"says {own}" in text and "leave" in text, text
    with pytest.raises(ConfigError, match="model.lora_adapter_path with train.backend=megatron"):
        load_config([f"model.lora_adapter_path={tmp_path / 'a'}", "train.backend=megatron"])


def test_the_trainer_starts_at_the_adapter_with_peft_logprobs_and_the_reference_is_the_start(
        cont_cfg, adapter, tiny_model_cfg, train_cfg, make_batch, make_samples):
    directory, saved = adapter
    p = policy(cont_cfg, train_cfg)
    live = {k.replace(".default", ""): v for k, v in lora.adapter_params(p.peft).items()}
    assert set(live) == set(saved) and all(torch.equal(live[k], saved[k]) for k in saved)  # bit for bit
    samples = make_samples(n=5, seed=4)
    start = peft_logprobs(peft_start(tiny_model_cfg, directory), samples)
    mask = samples.response_mask.bool()
    torch.testing.assert_close(p.compute_logprobs(samples, 4)[mask], start[mask], atol=2e-6, rtol=0)
    torch.testing.assert_close(p.compute_reference_logprobs(samples, 4)[mask], start[mask], atol=2e-6, rtol=0)
    base = peft_logprobs(build_model(tiny_model_cfg, VOCAB, PAD, seed=SEED).eval(), samples)
    assert float((base[mask] - start[mask]).abs().max()) > 1e-2  # the adapter changes the model: the base is not it
    for i in range(2):
        p.train_step(make_batch(n=6, seed=20 + i), GRPOConfig(), per_token=True, micro_batch_size=3)
    moved = p.compute_logprobs(samples, 4)
    assert float((moved[mask] - start[mask]).abs().max()) > 1e-3  # the adapters trained
    torch.testing.assert_close(p.compute_reference_logprobs(samples, 4)[mask], start[mask], atol=2e-6, rtol=0)
    torch.testing.assert_close(p.compute_logprobs(samples, 4), moved, atol=0, rtol=0)  # swapped back


@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_the_engines_get_base_plus_adapter(sync, cont_cfg, adapter, tiny_model_cfg, train_cfg):
    directory, saved = adapter
    state = policy(cont_cfg, train_cfg, lora_sync=sync).state_dict_for_rollout()
    if sync == "adapter":
        assert {lora.PEFT_PREFIX + k.replace(".default.", ".") for k in state} == set(saved)
        assert all(torch.equal(state[k], saved[lora.PEFT_PREFIX + k.replace(".default.", ".")]) for k in state)
        return
    merged = peft_start(tiny_model_cfg, directory).merge_and_unload().state_dict()
    assert set(state) == set(merged)
    for k in merged:
        torch.testing.assert_close(state[k], merged[k], atol=1e-6, rtol=0, msg=k)


def test_a_checkpoint_is_a_peft_adapter_dir_and_resumes(cont_cfg, tiny_model_cfg, train_cfg, make_batch,
                                                       make_samples, tmp_path):
    a = policy(cont_cfg, train_cfg)
    for i in range(2):
        a.train_step(make_batch(n=6, seed=20 + i), GRPOConfig(), per_token=True, micro_batch_size=3)
    a.save_checkpoint(tmp_path / "ckpt")
    samples = make_samples(n=5, seed=4)
    mask = samples.response_mask.bool()
    loaded = peft_logprobs(peft_start(tiny_model_cfg, tmp_path / "ckpt"), samples)
    torch.testing.assert_close(a.compute_logprobs(samples, 4)[mask], loaded[mask], atol=2e-6, rtol=0)
    b = policy(cont_cfg, train_cfg)
    b.load_checkpoint(tmp_path / "ckpt")
    for (n, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(x, y), n
    # the resumed run's reference is still the adapter as loaded at the start, not the checkpoint's
    torch.testing.assert_close(b.compute_reference_logprobs(samples, 4), a.compute_reference_logprobs(samples, 4),
                               atol=0, rtol=0)


def test_bad_adapter_directories_are_refused_naming_what_is_wrong(tiny_model_cfg, tmp_path):
    def check(directory, **kw):
        cfg = adapter_model_config(dataclasses.replace(tiny_model_cfg, lora_adapter_path=str(directory), **kw))
        return lora.check_adapter_dir(cfg, VOCAB, PAD)

    good = tmp_path / "good"
    save_adapter(tiny_model_cfg, good)
    assert "rank 4, 4 layers" in check(good)
    with pytest.raises(ValueError, match="is not a directory"):
        check(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        check(tmp_path / "empty")
    dora = tmp_path / "dora"
    save_adapter(tiny_model_cfg, dora, use_dora=True)
    with pytest.raises(ValueError, match=r"uses DoRA \(use_dora\)"):
        check(dora)
    loha = tmp_path / "loha"
    save_adapter(tiny_model_cfg, loha)
    file = loha / lora.ADAPTER_CONFIG
    file.write_text(json.dumps(json.loads(file.read_text()) | {"peft_type": "LOHA"}))
    with pytest.raises(ValueError, match="peft_type 'LOHA'"):
        check(loha)
    # adapters of another base: wider layers (shapes), and a local base of another vocabulary (its config.json)
    wide = tmp_path / "wide"
    save_adapter(dataclasses.replace(tiny_model_cfg, intermediate_size=48), wide, target_modules=["up_proj"])
    with pytest.raises(ValueError, match=r"lora_B.weight is \[48, 4\].*\[64, 4\].*another base"):
        check(wide)
    other = build_model(tiny_model_cfg, VOCAB + 8, PAD, seed=SEED)
    other.save_pretrained(str(tmp_path / "other_base"))
    named = tmp_path / "named"
    save_adapter(tiny_model_cfg, named, base_name=tmp_path / "other_base")
    with pytest.raises(ValueError, match=r"vocab_size 40 \(theirs\) vs 32"):
        check(named)


def test_relax_serve_refuses_the_training_option(tmp_path, capsys):
    """relax-serve serves model.path: with model.lora_adapter_path it would serve the base without the adapters."""
    import argparse

    from relax.cli.serve import _load

    save_adapter(load_config([]).model, tmp_path / "a")
    with pytest.raises(SystemExit) as e:
        _load(argparse.Namespace(config=None, overrides=[f"model.lora_adapter_path={tmp_path / 'a'}"]))
    assert e.value.code == 2 and "set model.path to the adapter directory" in capsys.readouterr().err


def test_a_tokenizer_saved_with_the_adapters_must_be_the_runs(tmp_path):
    """SFT runs save their tokenizer beside the adapters: the run's (model.path's) must be it, vocabulary and chat
    template (unless model.chat_template says which), else the start is refused, naming why."""
    from relax.data.tokenizer import load_tokenizer

    cfg = load_config([])
    tok = load_tokenizer(cfg.model)
    directory = tmp_path / "a"
    save_adapter(cfg.model, directory)
    m = adapter_model_config(dataclasses.replace(cfg.model, lora_adapter_path=str(directory)))
    lora.check_adapter_tokenizer(m, tok)  # no tokenizer files: nothing to compare
    tok.save_pretrained(str(directory))
    lora.check_adapter_tokenizer(m, tok)  # the same tokenizer: accepted
    other = load_tokenizer(cfg.model)
    other.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    other.save_pretrained(str(directory))
    with pytest.raises(ValueError, match="chat template is not model.path's"):
        lora.check_adapter_tokenizer(m, tok)
    template = tmp_path / "t.jinja"
    template.write_text(other.chat_template)
    lora.check_adapter_tokenizer(dataclasses.replace(m, chat_template=str(template)), tok)  # the user chose
    other.add_tokens(["<extra_sft_token>"])
    other.save_pretrained(str(directory))
    with pytest.raises(ValueError, match="another vocabulary"):
        lora.check_adapter_tokenizer(m, tok)
