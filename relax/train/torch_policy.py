"""The embedded train backend: one Hugging Face causal LM on one device (CPU or one GPU).

Precision: parameters, gradients and AdamW state stay fp32 (master weights); the forward/backward runs
under `torch.autocast(bfloat16)` when `pick_dtype` says bf16 (model.dtype=bfloat16, or "auto" on a GPU
with bf16 or a CPU with AVX512-BF16/AMX). Log-softmax is always fp32. Pure bf16 parameters were measured
slower than autocast on a CPU with AVX512-BF16, and lose small updates, so autocast it is. AdamW is torch's
fused implementation (one pass over parameter, gradient and moments per tensor).

One `train_step` (`relax.train.trainer.PolicyTrainer`) is one optimizer step over a global batch, accumulated
over micro-batches; the loss denominator is the whole step's, so the split never changes the update (up to float
rounding). A step whose loss or gradient norm is not finite is skipped (see `relax.train.trainer`).
"""

from __future__ import annotations

import json
import math
import os
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from relax import algorithms, progress
from relax.algorithms.base import AlgorithmConfig
from relax.batch import Samples, TrainBatch
from relax.config.derive import total_optimizer_steps
from relax.config.schema import ModelConfig, TrainConfig
from relax.metrics import SKIPPED_STEPS
from relax.models import lora, vision
from relax.models.checkpoint_files import (
    CheckpointFileError,
    load_safetensors_dir,
    load_safetensors_file,
    load_tensor_file,
)
from relax.models.hf import build_model, pick_device, pick_dtype, with_fp32_kept
from relax.models.saved_format import to_model_layout
from relax.models.weight_buffers import cpu_state
from relax.models.write_errors import os_write_errors, torch_save
from relax.train.logprobs import autocast, forward_logprobs
from relax.train.routing import TrainerRouting, routed_tokens
from relax.train.trainer import (
    PolicyTrainer,
    SkippedInARow,
    StepLoss,
    StepOutcome,
    available_cpus,
    length_sorted_micro_batches,
    loss_inputs,
    lr_factor,
    nonfinite_grad_tensors,
)

if TYPE_CHECKING:  # modeling_utils costs seconds to import; the driver only needs the names for hints
    from transformers import PreTrainedModel

OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
STATE_FILE = "trainer_state.json"


@torch.no_grad()
def micro_batched_logprobs(model: torch.nn.Module, samples: Samples, micro_batch_size: int, *, device: torch.device,
                           compute_dtype: torch.dtype, temperature: float,
                           max_tokens: Optional[int] = None, packed: bool = False,
                           routing: Optional[TrainerRouting] = None) -> torch.Tensor:
    """log p(response tokens) under `model`, [N, T] fp32 on the CPU, 0 where masked (length-sorted micro-batches,
    packed or padded; `routing`: an MoE model's, relax.train.routing)."""
    N, T = samples.response_ids.shape
    out = torch.zeros(N, T, dtype=torch.float32)
    for rows in length_sorted_micro_batches(samples, micro_batch_size, max_tokens, packed=packed):
        progress.tick()
        mb = samples.select(rows)
        with routing.micro_batch(mb, packed) if routing is not None else nullcontext():
            logp, _, t = forward_logprobs(model, mb, device=device, compute_dtype=compute_dtype,
                                          temperature=temperature, packed=packed)
        out[rows, :t] = logp.float().cpu()
    return out * samples.response_mask.to(out.dtype)


def load_into(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy `state_dict` into `model`; a key may be absent only if it is tied to a present one."""
    own = model.state_dict(keep_vars=True)
    unexpected = sorted(set(state_dict) - set(own))
    present = {own[k].data_ptr() for k in state_dict if k in own}
    missing = sorted(k for k in own if k not in state_dict and own[k].data_ptr() not in present)
    if unexpected or missing:
        raise KeyError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        model.load_state_dict(state_dict, strict=False)


def trainable_model(model_cfg: ModelConfig, vocab_size: int, pad_token_id: int, *, seed: int, device: torch.device,
                    num_threads: Optional[int], model: Optional[PreTrainedModel]) -> PreTrainedModel:
    """The fp32 master copy a trainer owns (built from `model_cfg` unless given), with the CPU thread count set."""
    if device.type == "cpu":
        torch.set_num_threads(num_threads or available_cpus())
    if model is None:
        return build_model(model_cfg, vocab_size, pad_token_id, seed=seed, dtype=torch.float32, device=device)
    return model.to(device=device, dtype=torch.float32)


class TorchTrainer:
    """What the policy and the critic share: device, precision, AdamW, lr schedule, clipping, checkpoints."""

    def __init__(
        self,
        model: torch.nn.Module,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        *,
        lr: float,
        device: torch.device,
        total_steps: Optional[int] = None,
        who: str = "policy",
    ) -> None:
        self.model_cfg = model_cfg
        self.train_cfg = train_cfg
        self.packed = train_cfg.pack_sequences  # micro-batches run as packed sequences (relax.train.packing)
        self.device = device
        self.compute_dtype = pick_dtype(model_cfg, device)
        self.model = model
        self.total_steps = total_steps if total_steps is not None else total_optimizer_steps(train_cfg)
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=lr,
            betas=(train_cfg.adam_beta1, train_cfg.adam_beta2),
            weight_decay=train_cfg.weight_decay,
            # one pass over parameter, gradient and both moments per tensor (torch's default on a CPU is a loop
            # of elementwise ops, each a pass over memory); same update up to float rounding
            fused=device.type in ("cpu", "cuda"),
        )
        cfg, total = train_cfg, self.total_steps

        def factor(step: int) -> float:  # a plain function: LambdaLR's state_dict then stays tensor-free
            return lr_factor(
                step,
                schedule=cfg.lr_schedule,
                warmup_steps=cfg.warmup_steps,
                total_steps=total,
                min_lr_ratio=cfg.min_lr_ratio,
            )

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        self.skips = SkippedInARow(who)

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by load_checkpoint)."""
        return int(self.scheduler.last_epoch)

    def autocast(self):
        """bf16 autocast when the compute dtype is bf16, else nothing (fp32)."""
        return autocast(self.device, self.compute_dtype)

    def _optimizer_step(self, loss: float, batch: TrainBatch) -> StepOutcome:
        """Clip and step the optimizer and the schedule, unless `loss` or the gradient norm is not finite: then
        nothing changes (weights, Adam state, schedule) and the step is skipped."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        max_norm = self.train_cfg.clip_grad if self.train_cfg.clip_grad > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        lr = float(self.optimizer.param_groups[0]["lr"])
        if math.isfinite(grad_norm) and math.isfinite(loss):
            self.optimizer.step()
            self.scheduler.step()
            outcome = self.skips.applied(grad_norm, lr)
        else:
            bad, first = nonfinite_grad_tensors((n, p.grad) for n, p in self.model.named_parameters())
            outcome = self.skips.skipped(applied=self.step, loss=loss, grad_norm=grad_norm, lr=lr, bad_grads=bad,
                                         first_bad=first, batch=batch)
        self.optimizer.zero_grad(set_to_none=True)
        return outcome

    # ---- weights and checkpoints -------------------------------------------------------------------

    def _hf_model(self) -> PreTrainedModel:
        return self.model  # type: ignore[return-value]

    def _save_weights(self, directory: Path) -> None:
        """The weights a checkpoint holds: the whole HF model (a LoRA policy: its adapters only)."""
        self._hf_model().save_pretrained(str(directory))

    def _read_weights(self, directory: Path) -> dict[str, torch.Tensor]:
        """What `_save_weights` wrote, read and checked before anything is restored, under the model's own names
        (a VL or MoE model's save_pretrained writes its original checkpoint layout: relax.models.saved_format)."""
        return to_model_layout(self._hf_model(), load_safetensors_dir(directory, exclude=self._extra_files()))

    def _restore_weights(self, weights: dict[str, torch.Tensor]) -> None:
        load_into(self._hf_model(), weights)

    def _extra_save(self, directory: Path) -> None:
        """Subclasses save what is not part of the HF model (the critic's value head)."""

    def _extra_load(self, directory: Path) -> None:
        """Subclasses load what `_extra_save` wrote."""

    def save_checkpoint(self, directory: str | os.PathLike) -> None:
        """HF model (config.json + safetensors) plus optimizer and scheduler state, into `directory`.

        The optimizer/scheduler files hold only tensors and plain Python values, so they load with
        `torch.load(..., weights_only=True)`. The caller writes to a temporary directory and renames. A write that
        fails at the OS level (disk full, unwritable) raises a plain OSError naming its errno and path
        (`relax.models.write_errors`), whichever library did the write.
        """
        directory = Path(directory)
        with os_write_errors(directory):
            directory.mkdir(parents=True, exist_ok=True)
            self._save_weights(directory)
            self._extra_save(directory)
            torch_save(self.optimizer.state_dict(), directory / OPTIMIZER_FILE)
            torch_save(self.scheduler.state_dict(), directory / SCHEDULER_FILE)
            (directory / STATE_FILE).write_text(json.dumps({"step": self.step}))

    def load_checkpoint(self, directory: str | os.PathLike, *, load_optimizer: bool = True) -> None:
        """Restore what `save_checkpoint` wrote (weights always; optimizer and schedule unless told not to).

        Every file is read (safetensors, `weights_only` torch files) before anything is restored, so a damaged or
        tampered file (CheckpointFileError naming it) leaves the trainer as it was."""
        directory = Path(directory)
        if not directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory {str(directory)!r} does not exist")
        weights = self._read_weights(directory)
        states: dict[str, Any] = {}
        if load_optimizer:
            for name in (OPTIMIZER_FILE, SCHEDULER_FILE):
                if not (directory / name).is_file():
                    raise FileNotFoundError(
                        f"checkpoint {str(directory)!r} has no {name} (load_optimizer=False skips it)"
                    )
            states[OPTIMIZER_FILE] = load_tensor_file(directory / OPTIMIZER_FILE, map_location=self.device)
            states[SCHEDULER_FILE] = load_tensor_file(directory / SCHEDULER_FILE)
        self._extra_load(directory)
        self._restore_weights(weights)
        for name, target in ((OPTIMIZER_FILE, self.optimizer), (SCHEDULER_FILE, self.scheduler)):
            if name in states:
                try:
                    target.load_state_dict(states[name])
                except (ValueError, KeyError, TypeError, RuntimeError) as e:
                    raise CheckpointFileError(f"checkpoint file {directory / name} does not fit this trainer: "
                                              f"{type(e).__name__}: {e}") from None

    def _extra_files(self) -> tuple[str, ...]:
        return ()


class TorchPolicy(TorchTrainer, PolicyTrainer):
    """The policy trainer of the embedded backend.

    Call from one thread (a Ray actor). Inputs and outputs are CPU tensors; the model lives on `device`.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        *,
        vocab_size: int,
        pad_token_id: int,
        seed: int,
        total_steps: Optional[int] = None,
        device: Optional[torch.device | str] = None,
        num_threads: Optional[int] = None,
        model: Optional[PreTrainedModel] = None,
        temperature: float = 1.0,
        lora_sync: str = "merged",
        routing_replay: bool = False,
    ) -> None:
        """`total_steps`: optimizer steps of the run, for cosine/linear schedules (default: from train_cfg).
        `num_threads`: torch CPU threads (default: the CPUs this process may use; process-wide setting).
        `model`: an already built model to train instead of building one from `model_cfg`.
        `temperature`: the rollout's sampling temperature; every log-prob is of `softmax(logits / temperature)`.
        `lora_sync` (rollout.lora_sync, with model.lora_rank > 0): the rollout weights merged, or the adapters alone.
        With LoRA, `model` keeps the adapters in its own layers (`self.peft` wraps it for PEFT's files and switch).
        `routing_replay` (rollout.routing_replay, MoE models): route each token as the engine did
        (relax.train.routing)."""
        device = torch.device(device) if device is not None else pick_device()
        model = trainable_model(model_cfg, vocab_size, pad_token_id, seed=seed, device=device, num_threads=num_threads,
                                model=model)
        self.peft = None  # model.lora_rank > 0: the PeftModel around `model`, whose layers carry the adapters
        if model_cfg.lora_rank > 0:
            self.peft = lora.apply_lora(model, model_cfg, seed=seed)
            if model_cfg.lora_adapter_path:  # continuing a PEFT adapter: its weights, as PeftModel.from_pretrained
                lora.load_adapter_dir(self.peft, model_cfg.lora_adapter_path)
            if model_cfg.gradient_checkpointing:  # recomputed blocks need an input that requires grad
                model.enable_input_require_grads()
            self.base_fingerprint = lora.base_fingerprint(self.peft)
        if vision.frozen_tower(model_cfg):  # model.freeze_vision_tower (default: with LoRA): before the optimizer
            vision.freeze_vision_tower(model)
        super().__init__(model, model_cfg, train_cfg, lr=train_cfg.lr, device=device, total_steps=total_steps)
        self.temperature = float(temperature)
        self.adapters_only_sync = self.peft is not None and lora_sync == "adapter"
        # model.lora_adapter_path: the reference is the policy at the start, the base with the loaded adapters (as
        # TRL's GRPOTrainer copies a PEFT model's adapter into a frozen "ref" adapter), not the base alone; a copy of
        # the adapters as loaded, swapped in for the reference's log-probs (resume keeps it: the directory is read
        # again, the checkpoint's adapters restored over it)
        self.start_adapters = ({n: p.detach().clone() for n, p in lora.adapter_params(self.peft).items()}
                               if self.peft is not None and model_cfg.lora_adapter_path else None)
        if self.peft is not None and train_cfg.moe_expert_bias_update_rate > 0:  # refused before start too
            raise ValueError("train.moe_expert_bias_update_rate > 0 with model.lora_rank > 0 is not available in this "
                             "build: the selection bias is a buffer of the frozen base model")
        self.routing = TrainerRouting.for_model(model, train_cfg, replay=routing_replay)  # None: a dense model

    def train_step(self, batch: TrainBatch, algo_cfg: AlgorithmConfig, *, per_token: bool, micro_batch_size: int,
                   max_tokens: Optional[int] = None, report_entropy: bool = True,
                   rollout_mismatch: bool = False) -> dict[str, float]:
        """`PolicyTrainer.train_step`, then (train.moe_expert_bias_update_rate > 0) the routers' selection bias
        updated from the step's expert loads, unless the step was skipped (`TrainerRouting.update_selection_bias`).
        This trainer is one process: the step's loads are all its own, nothing to sum over ranks."""
        out = super().train_step(batch, algo_cfg, per_token=per_token, micro_batch_size=micro_batch_size,
                                 max_tokens=max_tokens, report_entropy=report_entropy,
                                 rollout_mismatch=rollout_mismatch)
        if self.routing is not None and self.routing.bias_rate > 0:
            out |= self.routing.update_selection_bias(applied=not out.get(SKIPPED_STEPS))
        return out

    def _forward(self, mb: Samples, *, entropy: str) -> tuple[torch.Tensor, Optional[torch.Tensor], int]:
        """(logp [B, T'], entropy [B, T'] or None, T') of a micro-batch; entropy: "grad" | "metric" | "none"."""
        with self.routing.micro_batch(mb, self.packed) if self.routing is not None else nullcontext():
            return forward_logprobs(self.model, mb, device=self.device, compute_dtype=self.compute_dtype,
                                    temperature=self.temperature, entropy=entropy, packed=self.packed)

    @torch.no_grad()
    def compute_logprobs(self, samples: Samples, micro_batch_size: int,
                         max_tokens: Optional[int] = None) -> torch.Tensor:
        """log p(response tokens) under the current weights, [N, T] fp32 on the CPU, 0 where masked."""
        self.model.eval()
        return micro_batched_logprobs(self.model, samples, micro_batch_size, device=self.device,
                                      compute_dtype=self.compute_dtype, temperature=self.temperature,
                                      max_tokens=max_tokens, packed=self.packed, routing=self.routing)

    def accumulate_gradients(
        self,
        batch: TrainBatch,
        algo_cfg: AlgorithmConfig,
        *,
        per_token: bool,
        micro_batch_size: int,
        max_tokens: Optional[int] = None,
        report_entropy: bool = True,
        rollout_mismatch: bool = False,
    ) -> dict[str, float]:
        """The forward/backward half of `train_step`: fresh gradients of the whole batch's loss in `.grad`.

        Rows are sorted by length into micro-batches (less padding); each micro-batch's loss is the sum of its
        rows' losses given the step's denominators, so the split changes nothing but float rounding. For an
        algorithm with `step_statistics` (M2PO), a no-grad log-prob pass over all micro-batches comes first
        and its statistics of the whole step go to every micro-batch's loss (`LossBatch.stats`).
        """
        step = StepLoss(batch, algo_cfg, per_token=per_token, report_entropy=report_entropy,
                        rollout_mismatch=rollout_mismatch)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        splits = length_sorted_micro_batches(batch, micro_batch_size, max_tokens, packed=self.packed)
        stats = self._step_statistics(batch, algo_cfg, splits) if step.algorithm.needs_step_statistics else None
        tokens = routed_tokens(batch)  # the router z-loss is a mean over the step's routed tokens
        for rows in splits:
            progress.tick()
            mb = batch.select(rows)
            logp, ent, t = self._forward(mb, entropy=step.entropy)
            loss = step.micro_batch(mb, None, logp, t, device=self.device, entropy=ent, stats=stats)
            aux = self.routing.loss_terms(len(rows) / len(batch), tokens) if self.routing is not None else None
            (loss if aux is None else loss + step.add_loss(aux)).backward()
        return step.metrics() | (self.routing.metrics() if self.routing is not None else {})

    @torch.no_grad()
    def _step_statistics(
        self, batch: TrainBatch, algo_cfg: AlgorithmConfig, splits: list[torch.Tensor]
    ) -> dict[str, float]:
        """The algorithm's `step_statistics` over every valid token of the step: a no-grad pass over `splits`.

        The forward runs exactly as in the loss pass (train mode, same micro-batches, same precision), so the
        statistics see the log-probs the loss will see. A data-parallel trainer all-gathers the three token
        vectors of every rank here, before the call, and every rank then computes the same statistics.
        """
        logps, olds, advs = [], [], []
        for rows in splits:
            mb = batch.select(rows)
            logp, _, t = self._forward(mb, entropy="none")
            lb = loss_inputs(mb, None, logp.float(), t, device=self.device)
            keep = lb.mask != 0
            logps.append(lb.logp[keep])
            olds.append(lb.old_logp[keep])
            advs.append(lb.advantages[keep])
        logp, old, adv = torch.cat(logps), torch.cat(olds), torch.cat(advs)
        return algorithms.get(algo_cfg.name).step_statistics(algo_cfg, logp, old, adv, torch.ones_like(logp))

    @torch.no_grad()
    def compute_reference_logprobs(self, samples: Samples, micro_batch_size: int,
                                   max_tokens: Optional[int] = None) -> torch.Tensor:
        """A LoRA policy's reference: log-probs of the base model, its adapters switched off (no second copy); with
        model.lora_adapter_path, of the policy at the start (the base with the adapters as loaded)."""
        if self.peft is None:
            raise ValueError("the reference is the base model with its adapters off: only with model.lora_rank > 0")
        if self.start_adapters is not None:
            live = lora.adapter_params(self.peft)
            now = {n: p.detach().clone() for n, p in live.items()}
            try:
                for n, p in live.items():
                    p.copy_(self.start_adapters[n])
                return self.compute_logprobs(samples, micro_batch_size, max_tokens)
            finally:
                for n, p in live.items():
                    p.copy_(now[n])
        with self.peft.disable_adapter():
            return self.compute_logprobs(samples, micro_batch_size, max_tokens)

    def trainable_params(self) -> dict[str, torch.Tensor]:
        """The live tensors an optimizer step changes, by name: every parameter, or a LoRA policy's adapters."""
        if self.peft is None:
            return self.model.state_dict()
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    # ---- LoRA checkpoints: the adapters, and the base they need ------------------------------------

    def _save_weights(self, directory: Path) -> None:
        if self.peft is None:
            return super()._save_weights(directory)
        self.peft.save_pretrained(str(directory))  # adapter_config.json, adapter_model.safetensors
        (directory / lora.BASE_FILE).write_text(json.dumps({"fingerprint": self.base_fingerprint,
                                                            "model": lora.model_identity(self.model_cfg)}))

    def _read_weights(self, directory: Path) -> dict[str, torch.Tensor]:
        if self.peft is None:
            return super()._read_weights(directory)
        lora.check_base(directory, self.base_fingerprint, self.model_cfg)
        return load_safetensors_file(directory / lora.ADAPTER_WEIGHTS)

    def _restore_weights(self, weights: dict[str, torch.Tensor]) -> None:
        if self.peft is None:
            return super()._restore_weights(weights)
        lora.load_adapters(self.peft, weights)

    # ---- weights for other roles -----------------------------------------------------------------

    def state_dict_for_rollout(self, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
        """Current weights as CPU tensors keyed like the HF model's state_dict (fp32, or floating tensors in `dtype`).

        On a CPU device and without a cast these ALIAS the live parameters (no copy): the next train_step
        changes them in place, so a consumer in the same process must copy (load_state_dict does). Tied
        weights are copied (and cast) once and shared. Casting here to the rollout engine's dtype gives the
        engine exactly the values its own copy_ would (same rounding) and halves the bytes shipped for bf16.
        A LoRA policy's: the merged weights, or with rollout.lora_sync=adapter the adapters alone
        (`relax.models.lora.rollout_state`).
        """
        if self.peft is not None:
            state = lora.rollout_state(self.peft, merged=not self.adapters_only_sync, dtype=dtype)
        else:
            state = cpu_state(self.model.state_dict().items(), dtype)
        # what the engine keeps in fp32 travels in fp32 (DeepSeek-V3's / GLM-4.5's routers: weight and selection
        # bias; none in an adapters-only state): bf16 rounding would move its choice away from the trainer's
        return with_fp32_kept(state, self.model, dtype)

    def load_weights(self, state_dict: dict[str, Any]) -> None:
        """Load weights (e.g. from `state_dict_for_rollout` or a reference checkpoint); tied keys optional."""
        load_into(self.model, state_dict)
