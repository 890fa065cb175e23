"""The reference model of the embedded backend: frozen weights and a forward pass, nothing else.

No optimizer, no scheduler, no gradients: parameters have `requires_grad=False` and every call runs under
`torch.no_grad`. Weights and precision are the trainer's (fp32 weights, bf16 autocast where `pick_dtype`
says so), so the reference's log-probs at the initial policy equal the actor's before its first update.
"""

from __future__ import annotations

from typing import Optional

import torch

from relax.batch import Samples
from relax.config.schema import ModelConfig
from relax.models.hf import build_model, pick_device, pick_dtype
from relax.train.torch_policy import micro_batched_logprobs
from relax.train.trainer import available_cpus


class TorchReference:
    """Log-probs of a frozen policy: the initial weights (`model_cfg`, `seed`) or a Hugging Face directory."""

    def __init__(self, model_cfg: ModelConfig, *, vocab_size: int, pad_token_id: int, seed: int,
                 temperature: float = 1.0, device: Optional[torch.device | str] = None,
                 num_threads: Optional[int] = None, packed: bool = False) -> None:
        """`packed` (train.pack_sequences): micro-batches run as packed sequences (`relax.train.packing`)."""
        self.device = torch.device(device) if device is not None else pick_device()
        if self.device.type == "cpu":
            torch.set_num_threads(num_threads or available_cpus())
        self.compute_dtype = pick_dtype(model_cfg, self.device)
        self.temperature = temperature
        self.packed = packed
        self.model = build_model(model_cfg, vocab_size, pad_token_id, seed=seed, dtype=torch.float32,
                                 device=self.device)
        self.model.requires_grad_(False)
        self.model.eval()

    @torch.no_grad()
    def compute_logprobs(self, samples: Samples, micro_batch_size: int,
                         max_tokens: Optional[int] = None) -> torch.Tensor:
        """log p(response tokens) [N, T] fp32 on the CPU, 0 where masked."""
        return micro_batched_logprobs(self.model, samples, micro_batch_size, device=self.device,
                                      compute_dtype=self.compute_dtype, temperature=self.temperature,
                                      max_tokens=max_tokens, packed=self.packed)
