"""A LoRA run shows no warning about a feature it did not use: PEFT 0.21's PeftModel reads
`model.is_gradient_checkpointing`, which transformers 5 deprecates with a FutureWarning on every read (the reviewer saw
it on every LoRA run, from the worker and from the export). Relax's injection silences that one warning, and only
there: reading the attribute afterwards still warns (the filter does not leak into the user's code)."""

from __future__ import annotations

import warnings

import torch

from relax.config import load_config
from relax.data.tokenizer import build_tiny_tokenizer
from relax.models.hf import build_model
from relax.models.lora import apply_lora

DEPRECATION = "is_gradient_checkpointing` is deprecated"


def test_apply_lora_shows_no_gradient_checkpointing_deprecation_and_the_filter_stays_local():
    cfg = load_config(["model.lora_rank=4"])
    tokenizer = build_tiny_tokenizer()
    model = build_model(cfg.model, len(tokenizer), tokenizer.pad_token_id, seed=0, dtype=torch.float32, device="cpu")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        peft_model = apply_lora(model, cfg.model, seed=0)
    assert not [w for w in seen if DEPRECATION in str(w.message)], [str(w.message) for w in seen]
    assert peft_model.get_base_model() is model
    # the control: the same read outside Relax's injection still warns (transformers' own, not hidden globally)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _ = model.is_gradient_checkpointing
    assert [w for w in seen if DEPRECATION in str(w.message) and w.category is FutureWarning]
