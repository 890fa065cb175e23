"""A short run that continues training a PEFT LoRA adapter (model.lora_adapter_path), the roles in this process
(tests/inprocess_ray.py): the KL term's reference is the policy at the start (base + the adapter), so the first
step's KL is zero, and the engines sample from base + adapter from the first rollout. The adapter is written by
PEFT in tmp_path."""

from __future__ import annotations

import pytest
import torch

from relax.config import load_config
from relax.data.tokenizer import load_tokenizer
from relax.models.hf import build_model
from relax.runner.plan import build_plan
from relax.runner.train import run

pytestmark = pytest.mark.slow


def sft_adapter(model_cfg, directory) -> None:
    """Adapters as an SFT run leaves them (B nonzero: the policy is not the base), saved by PEFT."""
    from peft import LoraConfig, get_peft_model

    tok = load_tokenizer(model_cfg)
    peft_model = get_peft_model(build_model(model_cfg, len(tok), tok.pad_token_id, seed=1),
                                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    peft_model.save_pretrained(str(directory))


def test_continuing_an_adapter_starts_with_zero_kl_to_the_policy_at_the_start(in_process, small_run, tmp_path):
    base = load_config(small_run()).model
    sft_adapter(base, tmp_path / "sft")
    cfg = load_config(small_run(f"model.lora_adapter_path={tmp_path / 'sft'}", "algorithm.use_kl_loss=true",
                                "algorithm.kl_loss_coef=0.01", "train.lr=0.05", "model.dtype=float32"))
    assert cfg.model.lora_rank == 4 and cfg.model.lora_alpha == 8
    plan = build_plan(cfg)
    assert plan.role("reference") is None and "the policy at the start" in plan.role("actor").why
    result = run(cfg, plan, output_dir=tmp_path / "out")
    kl = result.series("train/kl_loss")
    # the reference is base + adapter, the policy of step 0: KL 0 there (the base as reference would not be: control
    # in tests/backends/test_lora_continue.py), then > 0 once the adapters moved
    assert len(kl) == 2 and kl[0] == pytest.approx(0.0, abs=1e-6) and kl[1] > 0
    # the engines sampled from base + adapter from the first rollout: the trainer's log-probs are theirs
    k3 = result.series("rollout/mismatch_k3")
    assert len(k3) == 2 and max(k3) < 1e-6, k3
    # relax-export of the last checkpoint: an adapter directory PEFT loads on the run's base (written beside it for a
    # model built from config), the trained adapters (not the SFT ones), merged and not merged alike
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from relax.runner.export import export_checkpoint

    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    export_checkpoint(tmp_path / "ckpt", tmp_path / "merged", merge=True)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf" / "base")),
                                           str(tmp_path / "hf")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    sft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf" / "base")),
                                    str(tmp_path / "sft")).eval()
    ids = torch.tensor([[5, 9, 13, 2, 7, 11]])
    with torch.no_grad():
        ours, theirs, start = (m(input_ids=ids).logits for m in (peft_model, merged, sft))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert float((ours - start).abs().max()) > 1e-4  # the export holds the trained adapters
