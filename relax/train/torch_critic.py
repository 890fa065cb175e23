"""The embedded PPO critic: the policy's backbone plus a scalar value head, trained with the clipped value loss.

Values are aligned with `token_logprobs`: the value of response token t is read from the hidden state
at position P-1+t, the state before token t is generated. The value head runs in fp32 (outside
autocast); the backbone follows the same precision rule as the policy.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from safetensors.torch import save_file

from relax.algorithms.base import AlgorithmConfig
from relax.algorithms.loss import compute_value_loss
from relax.batch import Samples, TrainBatch
from relax.config.schema import ModelConfig, TrainConfig
from relax.metrics import VALUE_LOSS
from relax.models.checkpoint_files import CheckpointFileError, load_safetensors_file
from relax.models.hf import pick_device, response_hidden_states
from relax.models.vision import is_vision_model, vision_hidden_states
from relax.train.packing import Packed, pack, trimmed_sequences
from relax.train.torch_policy import TorchTrainer, trainable_model
from relax.train.trainer import CRITIC_STEP, length_sorted_micro_batches, step_denominators, with_step
from relax.train.vision_packing import packed_vision_hidden_states

if TYPE_CHECKING:  # modeling_utils costs seconds to import; the driver only needs the names for hints
    from transformers import PreTrainedModel

VALUE_HEAD_FILE = "value_head.safetensors"


def critic_lr(train_cfg: TrainConfig, algo_cfg: Optional[AlgorithmConfig]) -> float:
    """algorithm.critic_lr (PPO's one source for the critic's learning rate), else train.lr."""
    lr = getattr(algo_cfg, "critic_lr", None)
    return float(train_cfg.lr if lr is None else lr)


class CriticModel(torch.nn.Module):
    """A causal LM's backbone (its lm_head unused) and Linear(hidden, 1), zero-initialised (V = 0 at start)."""

    def __init__(self, lm: PreTrainedModel) -> None:
        super().__init__()
        self.lm = lm
        hidden = lm.config.get_text_config().hidden_size  # a vision-language config keeps it in its text config
        self.value_head = torch.nn.Linear(hidden, 1, device=lm.device, dtype=torch.float32)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_start: int,
        response_len: int,
        autocast: Any = None,
    ) -> torch.Tensor:
        """Values [N, T] fp32: value_head(hidden state at P-1+t)."""
        ctx = autocast if autocast is not None else torch.autocast(input_ids.device.type, enabled=False)
        with ctx:
            h = response_hidden_states(self.lm.base_model, input_ids, attention_mask, response_start, response_len)
        with torch.autocast(input_ids.device.type, enabled=False):
            return self.value_head(h.float()).squeeze(-1)

    def vision_values(self, mb: Samples, device: torch.device, *, packed: bool,
                      autocast: Any = None) -> tuple[torch.Tensor, int]:
        """(values [N, T] fp32, T) of a micro-batch of a vision-language backbone, with the rows' images: `forward` and
        `packed_values` through the model's own multimodal forward (`relax.models.vision`)."""
        ctx = autocast if autocast is not None else torch.autocast(device.type, enabled=False)
        if packed:
            with ctx:
                p, h = packed_vision_hidden_states(self.lm, mb, device)
            with torch.autocast(device.type, enabled=False):
                return p.place(self.value_head(h.float()).squeeze(-1)), p.response_len
        ids, mask, P, T = trimmed_sequences(mb)
        rows = mb.vision if mb.vision is not None else [None] * len(mb)
        with ctx:
            h = vision_hidden_states(self.lm, ids.to(device), mask.to(device), rows, P, T)
        with torch.autocast(device.type, enabled=False):
            return self.value_head(h.float()).squeeze(-1), T

    def packed_values(self, packed: Packed, autocast: Any = None) -> torch.Tensor:
        """`forward` of a packed micro-batch (`relax.train.packing`): values [N, T] fp32, 0 where masked."""
        ctx = autocast if autocast is not None else torch.autocast(packed.input_ids.device.type, enabled=False)
        with ctx:
            out = self.lm.base_model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
        with torch.autocast(packed.input_ids.device.type, enabled=False):
            return packed.place(self.value_head(out.last_hidden_state[0, packed.before].float()).squeeze(-1))


class TorchCritic(TorchTrainer):
    """PPO critic trainer of the embedded backend; same calling conventions as `TorchPolicy`."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        algo_cfg: Optional[AlgorithmConfig] = None,
        *,
        vocab_size: int,
        pad_token_id: int,
        seed: int,
        total_steps: Optional[int] = None,
        device: Optional[torch.device | str] = None,
        num_threads: Optional[int] = None,
        model: Optional[PreTrainedModel] = None,
    ) -> None:
        """The backbone is built like the policy's (same `seed` gives the policy's initial weights);
        lr = algo_cfg.critic_lr, else train.lr."""
        device = torch.device(device) if device is not None else pick_device()
        model = trainable_model(model_cfg, vocab_size, pad_token_id, seed=seed, device=device, num_threads=num_threads,
                                model=model)
        self.critic = CriticModel(model)
        super().__init__(
            self.critic,
            model_cfg,
            train_cfg,
            lr=critic_lr(train_cfg, algo_cfg),
            device=device,
            total_steps=total_steps,
            who="critic",
        )

    def _values(self, mb: Samples) -> tuple[torch.Tensor, int]:
        if mb.vision is not None or is_vision_model(self.critic.lm):  # as the policy's forward_logprobs
            return self.critic.vision_values(mb, self.device, packed=self.packed, autocast=self.autocast())
        if self.packed:
            packed = pack(mb).to(self.device)
            return self.critic.packed_values(packed, autocast=self.autocast()), packed.response_len
        ids, mask, P, T = trimmed_sequences(mb)
        ids, mask = ids.to(self.device), mask.to(self.device)
        return self.critic(ids, mask, P, T, autocast=self.autocast()), T

    @torch.no_grad()
    def compute_values(self, samples: Samples, micro_batch_size: int,
                       max_tokens: Optional[int] = None) -> torch.Tensor:
        """V(state before response token t), [N, T] fp32 on the CPU, 0 where masked (length-sorted micro-batches of
        at most `micro_batch_size` rows and `max_tokens` tokens, as the policy's)."""
        self.critic.eval()
        N, T = samples.response_ids.shape
        out = torch.zeros(N, T, dtype=torch.float32)
        for rows in length_sorted_micro_batches(samples, micro_batch_size, max_tokens, packed=self.packed):
            values, t = self._values(samples.select(rows))
            out[rows, :t] = values.float().cpu()
        return out * samples.response_mask.to(out.dtype)

    def train_step(
        self, batch: TrainBatch, algo_cfg: AlgorithmConfig, *, per_token: bool, micro_batch_size: int,
        max_tokens: Optional[int] = None,
    ) -> dict[str, float]:
        """One optimizer step of the clipped value loss towards `batch.returns`.

        `batch.old_values` (values at rollout time) anchor the clipping; when absent the current values
        (detached) are used, i.e. no clipping. Returns critic/value_loss (reduced as configured),
        critic/value_clipfrac (share of the step's valid tokens), critic/grad_norm (before clipping), critic/lr and
        critic/skipped_steps: a step whose value loss or gradient norm is not finite is skipped, leaving weights,
        optimizer and schedule unchanged (as the policy's, see `relax.train.trainer`).
        """
        if batch.returns is None:
            raise ValueError("critic train_step needs batch.returns")
        self.critic.train()
        denominator, num_tokens = step_denominators(batch.response_mask, per_token)
        totals: dict[str, torch.Tensor] = {}
        self.optimizer.zero_grad(set_to_none=True)
        for rows in length_sorted_micro_batches(batch, micro_batch_size, max_tokens, packed=self.packed):
            mb = batch.select(rows)
            values, t = self._values(mb)

            def cut(x: torch.Tensor, t: int = t) -> torch.Tensor:
                return x[:, :t].to(self.device).float()

            old = cut(mb.old_values) if mb.old_values is not None else values.detach()
            loss, metrics = compute_value_loss(
                algo_cfg,
                values,
                old,
                cut(mb.returns),
                cut(mb.response_mask),
                per_token=per_token,
                denominator=denominator,
                num_tokens=num_tokens,
            )
            loss.backward()
            for name, value in metrics.items():
                value = value.detach().double()
                totals[name] = totals[name] + value if name in totals else value
        out = {name: float(value) for name, value in totals.items()}
        return with_step(out, self._optimizer_step(out.get(VALUE_LOSS, 0.0), batch), CRITIC_STEP)

    # ---- checkpoints: HF backbone + value head -----------------------------------------------------

    def _hf_model(self) -> PreTrainedModel:
        return self.critic.lm

    def _extra_files(self) -> tuple[str, ...]:
        return (VALUE_HEAD_FILE,)

    def _extra_save(self, directory: Path) -> None:
        head = {k: v.detach().cpu().contiguous() for k, v in self.critic.value_head.state_dict().items()}
        save_file(head, str(directory / VALUE_HEAD_FILE))

    def _extra_load(self, directory: Path) -> None:
        path = directory / VALUE_HEAD_FILE
        if path.is_file():
            head = load_safetensors_file(path, device=str(self.device))
            try:
                self.critic.value_head.load_state_dict(head)
            except RuntimeError as e:  # missing, unexpected or mis-shaped tensors
                raise CheckpointFileError(f"checkpoint file {path} does not fit this critic: {e}") from None
        # else: a policy (or HF) checkpoint as the critic's initial backbone; the head stays zero

    def load_backbone(self, directory: str | os.PathLike) -> None:
        """Initialise the backbone from a policy/HF checkpoint directory (value head and optimizer untouched)."""
        self.load_checkpoint(directory, load_optimizer=False)
