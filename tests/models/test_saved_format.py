"""relax.models.saved_format: what `save_pretrained` writes for a vision-language (renamed modules) or MoE (per-expert
tensors for the fused experts) model, back under the model's own names, exactly; a checkpoint that does not fit is
refused naming why. The trainer's checkpoint restore (`TorchPolicy.load_checkpoint`) relies on it."""

from __future__ import annotations

import re

import pytest
import torch

from relax.config.schema import ModelConfig
from relax.data.tokenizer import build_tiny_tokenizer, build_tiny_vl_tokenizer
from relax.models.checkpoint_files import load_safetensors_dir
from relax.models.hf import build_model
from relax.models.saved_format import to_model_layout

CASES = {"qwen2_5_vl": build_tiny_vl_tokenizer, "qwen3_vl": build_tiny_vl_tokenizer, "qwen3_moe": build_tiny_tokenizer,
         "qwen3": build_tiny_tokenizer}


def _model(arch: str, seed: int):
    tokenizer = CASES[arch]()
    return build_model(ModelConfig(name=f"tiny_{arch}", arch=arch, dtype="float32"), len(tokenizer),
                       tokenizer.pad_token_id, seed=seed, dtype=torch.float32)


@pytest.mark.parametrize("arch", sorted(CASES))
def test_saved_weights_come_back_under_the_models_names_exactly(arch, tmp_path):
    model = _model(arch, seed=1)
    model.save_pretrained(str(tmp_path))
    saved = load_safetensors_dir(tmp_path)
    back = to_model_layout(model, saved)
    own = model.state_dict()
    if arch == "qwen3":  # a dense text model is saved under its own names: nothing to move
        assert back is saved
    else:
        assert set(saved) != set(own)  # the layout differs (else this test would prove nothing)
    if arch.endswith("_vl"):  # whole tensors renamed: handed back as read, not copied
        assert {id(t) for t in back.values()} == {id(t) for t in saved.values()}
    other = _model(arch, seed=2)
    assert any(not torch.equal(a, b) for a, b in zip(own.values(), other.state_dict().values(), strict=True))
    other.load_state_dict(back, strict=False)  # a tied weight saved once is left out; loading ties it
    for name, tensor in own.items():
        assert torch.equal(other.state_dict()[name], tensor), name


def test_a_checkpoint_that_does_not_fit_is_refused(tmp_path):
    model = _model("qwen3_moe", seed=1)
    model.save_pretrained(str(tmp_path))
    saved = load_safetensors_dir(tmp_path)
    name = next(k for k in saved if ".experts.1.up_proj" in k)
    with pytest.raises(KeyError, match=re.escape(f"missing ['{name}']")):
        to_model_layout(model, {k: v for k, v in saved.items() if k != name})
    with pytest.raises(KeyError, match=re.escape(f"{name} has shape")):
        to_model_layout(model, {**saved, name: saved[name][:-1]})
