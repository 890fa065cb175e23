"""The Megatron-core train backend's policy: one rank of a TP x PP x DP trainer.

Every rank of the trainer builds a `MegatronPolicy` after `relax.train.megatron.parallel.initialize` and
calls the same methods with the same arguments (the whole batch; each data-parallel rank takes its rows).
It implements `relax.train.trainer.Policy` (the actor role drives both backends alike) with the trainer core of
`relax.train.trainer` (`train_step`, micro-batching, denominators, loss inputs, non-finite steps):

- Same start: a `source=config` model is built by `relax.models.hf.build_model` under the same seed and
  converted, so both backends start from the same weights; `hf` models are read from their safetensors.
- Rows of a micro-batch are left-aligned (each row's prompt and response tokens from column 0, padding only at
  the end), so a causal mask alone is exact and RoPE positions equal the HF positions from the mask.
- Loss: `relax.algorithms.loss.compute_loss` per micro-batch with the step's denominators of the WHOLE batch
  (`step_denominators`, as the torch backend), `calculate_per_token_loss=True` so that the schedule neither
  divides by the micro-batch count nor DDP averages over data-parallel ranks: data-parallel gradients are
  summed, which gives exactly the whole batch's gradient. `finalize_model_grads` runs without `num_tokens`
  (passing it would divide by the token count a second time).
- Log-probs of `softmax(logits / temperature)` with a vocab-parallel log-softmax (max, sum of exponentials and
  target logit all-reduced over the tensor-parallel group); vocabulary rows added to make the vocabulary
  divisible by TP are excluded.
- Optimizer: megatron-core's (`get_megatron_optimizer`, Adam with decoupled weight decay, optionally the
  distributed optimizer), lr set each step from `relax.train.trainer.lr_factor`. Megatron applies no weight
  decay to 1-D parameters (norm weights); the torch backend decays every parameter (the same with the default
  weight_decay=0).
- Non-finite steps: as in the torch backend, a step whose loss or gradient norm is not finite is skipped (no
  optimizer update, no lr schedule step, `train/skipped_steps` 1). Every rank decides the same: the loss is the
  whole batch's (all-reduced, broadcast from the last stage) and the norm is reduced over the model-parallel group,
  and a skip flag is max-reduced over all ranks of the trainer besides, so that no rank steps while another skips.
- Mixture of experts (Qwen3-MoE): megatron-core's MoE layers, the experts spread over `train.expert_parallel_size`
  ranks (each holds num_experts / EP of them; the expert-parallel ranks are data-parallel ranks of the rest of the
  model); the engine's routes compared and, with `routing_replay`, replayed through megatron-core's `RouterReplay`
  (`relax.train.megatron.replay`), which also counts the expert load of the training forwards and measures the
  router z-loss, megatron-core's own, its coefficient set for each step's training pass (train.moe_z_loss_coef /
  (MoE layers x the step's routed tokens)) and the layout's padding given as `padding_mask`, and adds the torch
  backend's load-balancing loss (train.moe_aux_loss_coef) of each micro-batch, weighted by its share of the step's
  rows. Weights gathered for the rollout or a checkpoint hold every expert.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from relax import algorithms, progress
from relax.algorithms.base import AlgorithmConfig, Violation
from relax.batch import Samples, TrainBatch
from relax.config.derive import total_optimizer_steps
from relax.config.megatron_rules import (
    micro_batch_tokens_violation,
    pack_sequences_violation,
    sequence_parallel_violation,
)
from relax.config.schema import ModelConfig, TrainConfig
from relax.metrics import LOSS, MOE_AUX_LOSS, MOE_Z_LOSS
from relax.models.hf import build_model, pick_dtype, resolve_model_path
from relax.models.write_errors import os_write_errors, torch_save
from relax.train.megatron import convert
from relax.train.megatron.model import (
    ArchSpec,
    arch_from_hf_config,
    build_gpt_model,
    check_parallel_sizes,
    freeze_padding_embedding,
    resolve_layer_spec,
    tp_partition_dim,
    transformer_config,
)
from relax.train.megatron.replay import MegatronRouting
from relax.train.packing import Packed, pack
from relax.train.routing import routed_tokens
from relax.train.trainer import (
    PolicyTrainer,
    SkippedInARow,
    StepLoss,
    StepOutcome,
    length_sorted_micro_batches,
    loss_inputs,
    lr_factor,
    nonfinite_grad_tensors,
)

GATHER_BUCKET_BYTES = 256 << 20  # rollout.sglang.bucket_mb's default; the actor sets the run's (`MegatronRank`)
_ALIGN = 16  # bytes: each tensor of a gather bucket starts at a multiple (a view of any dtype needs its alignment)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


MODEL_FILE = "model_tp{tp}_pp{pp}_dp{dp}.safetensors"
OPTIMIZER_FILE = "optimizer_tp{tp}_pp{pp}_dp{dp}.pt"
STATE_FILE = "trainer_state.json"


def _group_size(group: Any) -> int:
    return torch.distributed.get_world_size(group=group)


def _rows_only(max_tokens: Optional[int]) -> None:
    """Micro-batches by tokens are not built on this backend (validation rejects train.max_tokens_per_micro_batch)."""
    _refuse(micro_batch_tokens_violation("megatron", max_tokens))


def _refuse(violation: Optional[Violation]) -> None:
    """A rule of `relax.config.megatron_rules` (the one statement that validation also checks), broken by what this
    trainer runs with: ValueError with its message."""
    if violation is not None:
        raise ValueError(violation.message)


@dataclass
class _MicroBatch:
    """A micro-batch as the model sees it: rows left-aligned, response token t of row i predicted at
    column `plen[i] - 1 + t` of the logits; or packed (train.pack_sequences): the rows as one row without padding
    (`packed`), its sequences delimited for Transformer Engine's attention (`packed_seq_params`, THD format)."""

    rows: torch.Tensor  # indices into the (rank's) batch
    tokens: torch.Tensor  # [B, L] long, on the device ([1, L] packed)
    positions: torch.Tensor  # [B, L]
    gather_cols: torch.Tensor  # [B, T'] columns of the logits that predict the response tokens ([1, M] packed)
    targets: torch.Tensor  # [B, T'] response token ids ([1, M] packed)
    t: int  # T': response columns used
    packed: Optional[Packed] = None  # the packing, to place the M log-probs back into [B, T']
    packed_seq_params: Any = None  # megatron-core's PackedSeqParams (cu_seqlens) of a packed micro-batch
    # MoE: the engine's routes of each token as laid out in `tokens`, [B, L, layers, k] long, -1 where none
    routes: Optional[torch.Tensor] = None
    # MoE: [B, L] bool on the device, True at the tokens of `tokens` the routers route for real (padding False): the
    # expert load counts them and megatron-core's z-loss takes the rest as its padding_mask
    real: Optional[torch.Tensor] = None
    # MoE, training: the micro-batch's share of the step's rows (of every data-parallel rank), the weight of its
    # load-balancing loss (train.moe_aux_loss_coef), as the torch backend's
    share: float = 0.0


def routes_in_layout(samples: Samples, layout: Callable[[Samples], torch.Tensor]) -> torch.Tensor:
    """[B, L, layers, k] long: `samples.routed_experts` (aligned with `samples.sequences()`) at the tokens of the
    layout `layout(samples)` builds ([B, L] token ids), -1 at padding and where the engine recorded none. The very
    layout function runs over each token's flat position (pad id -1), so the routes line up with the tokens whatever
    the layout (left-aligned rows, a packed row)."""
    N, P = samples.prompt_ids.shape
    T = samples.response_ids.shape[1]
    flat = torch.arange(N * (P + T)).view(N, P + T)
    index = layout(replace(samples, prompt_ids=flat[:, :P], response_ids=flat[:, P:]))
    routes = samples.routed_experts
    out = routes.reshape(-1, *routes.shape[2:])[index.clamp(min=0)].long()
    if routes.dtype == torch.uint8:
        out[out == 255] = -1
    out[index < 0] = -1
    return out


def real_in_layout(samples: Samples, layout: Callable[[Samples], torch.Tensor]) -> torch.Tensor:
    """[B, L] bool: True at the tokens of the layout `layout(samples)` builds ([B, L] token ids) that are real prompt
    or response tokens of `samples` (`Samples.sequences`' attention mask), False at padding; found as
    `routes_in_layout` finds the routes, by running the layout over each token's flat position (pad id -1)."""
    N, P = samples.prompt_ids.shape
    T = samples.response_ids.shape[1]
    flat = torch.arange(N * (P + T)).view(N, P + T)
    index = layout(replace(samples, prompt_ids=flat[:, :P], response_ids=flat[:, P:]))
    real = samples.sequences()[1].reshape(-1) != 0
    return (index >= 0) & real[index.clamp(min=0)]


def packed_micro_batch(samples: Samples, rows: torch.Tensor, pad_token_id: int, *, multiple: int = 1,
                       device: torch.device | None = None) -> _MicroBatch:
    """Rows `rows` of `samples` as one packed row (`relax.train.packing.pack`) for megatron-core's THD attention:
    `cu_seqlens` at each sequence's start, the row padded at the end (as a sequence of pad tokens of its own) to a
    multiple of `multiple` (the tensor-parallel size under sequence parallelism)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    p = pack(samples.select(rows))
    starts = (p.position_ids[0] == 0).nonzero().flatten()
    total = p.input_ids.shape[1]
    lengths = torch.diff(torch.cat([starts, torch.tensor([total])]))
    tokens, positions = p.input_ids, p.position_ids
    pad = -total % multiple
    if pad:
        tokens = torch.cat([tokens, tokens.new_full((1, pad), pad_token_id)], dim=1)
        positions = torch.cat([positions, torch.arange(pad).unsqueeze(0)], dim=1)
        lengths = torch.cat([lengths, torch.tensor([pad])])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)]).to(device)
    longest = int(lengths.max())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)
    return _MicroBatch(rows=rows, tokens=tokens.to(device), positions=positions.to(device),
                       gather_cols=p.before.unsqueeze(0).to(device), targets=p.targets.unsqueeze(0).to(device),
                       t=p.response_len, packed=p.to(device) if device is not None else p, packed_seq_params=params)


def left_aligned(samples: Samples, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(tokens [N, L], gather columns [N, T'], targets [N, T'], T') of prompt+response rows with real tokens from
    column 0 (the layout contract: prompts left-padded, responses right-padded, both contiguous)."""
    plen = samples.prompt_mask.sum(-1).long()
    used_r = samples.present().bool().any(0).nonzero()
    T = int(used_r[-1]) + 1 if len(used_r) else 1
    P = samples.prompt_ids.shape[1]
    if int(plen.min()) < 1:
        raise ValueError("every row needs at least one prompt token")
    L = int(plen.max()) + T
    N = len(samples)
    tokens = torch.full((N, L), pad_token_id, dtype=torch.long)
    for i in range(N):
        p = int(plen[i])
        tokens[i, :p] = samples.prompt_ids[i, P - p:]
        tokens[i, p:p + T] = samples.response_ids[i, :T]
    cols = (plen.unsqueeze(1) - 1 + torch.arange(T).unsqueeze(0)).clamp(max=L - 1)
    return tokens, cols, samples.response_ids[:, :T].clone(), T


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    vocab_size: int,
    with_entropy: bool,
    group: Any = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log softmax(logits / temperature)[target] [B, T] fp32 (and the entropy) from this rank's vocab shard.

    `logits` [B, T, V/TP] is the shard of tensor-parallel rank r (global vocab rows r*V/TP ..). Rows >=
    `vocab_size` (divisibility padding) are excluded. Sums over the vocabulary are all-reduced with megatron's
    `reduce_from_tensor_model_parallel_region` (all-reduce forward, identity backward); the max is a constant.
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp = _group_size(group) if group is not None else 1
    rank = torch.distributed.get_rank(group=group) if tp > 1 else 0
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    shard = z.shape[-1]
    start = rank * shard
    if start + shard > vocab_size:  # padded rows: a huge negative (finite: 0 * it stays 0 in the entropy)
        pad = torch.arange(start, start + shard, device=z.device) >= vocab_size
        z = z.masked_fill(pad, torch.finfo(torch.float32).min / 4)
    m = z.detach().max(-1, keepdim=True).values
    if tp > 1:
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
    z = z - m

    def reduce(x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tensor_model_parallel_region(x, group=group) if tp > 1 else x

    lse = torch.log(reduce(z.exp().sum(-1)))
    local = targets - start
    inside = (local >= 0) & (local < shard)
    picked = z.gather(-1, local.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1)
    logp = reduce(torch.where(inside, picked, torch.zeros_like(picked))) - lse
    if not with_entropy:
        return logp, None
    logp_all = z - lse.unsqueeze(-1)
    return logp, -reduce((logp_all.exp() * logp_all).sum(-1))


def _hf_getter(path: Path) -> Callable[[str], torch.Tensor]:
    """get(name) of an HF checkpoint directory's safetensors, read lazily (one tensor at a time)."""
    where: dict[str, Path] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                where[key] = f
    if not where:
        raise FileNotFoundError(f"no *.safetensors in {str(path)!r}")

    def get(name: str) -> torch.Tensor:
        if name not in where:
            raise KeyError(f"{str(path)!r} has no tensor {name!r}")
        with safe_open(str(where[name]), framework="pt") as st:
            return st.get_tensor(name).float()

    return convert.hf_expert_getter(get, where.__contains__)


class MegatronPolicy(PolicyTrainer):
    """The policy trainer of the Megatron backend (one rank). Inputs/outputs are CPU tensors."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        *,
        vocab_size: int,
        pad_token_id: int,
        seed: int,
        total_steps: Optional[int] = None,
        temperature: float = 1.0,
        hf_model: Optional[torch.nn.Module] = None,
        use_distributed_optimizer: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        routing_replay: bool = False,
    ) -> None:
        """Needs `relax.train.megatron.parallel.initialize` first.

        `hf_model`: an HF causal LM to start from instead of `model_cfg` (its config and weights are used).
        `params_dtype`: parameter dtype; default fp32 with bf16 autocast where `pick_dtype` says bf16
        (`model.dtype`), or bf16 parameters with fp32 master weights when given bf16 (GPU only).
        `routing_replay` (rollout.routing_replay, MoE models): route each token as the engine did.
        """
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        self.ps = ps
        self.device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                       else torch.device("cpu"))
        self.model_cfg, self.train_cfg = model_cfg, train_cfg
        self.pad_token_id = int(pad_token_id)
        self.temperature = float(temperature)
        self.total_steps = total_steps if total_steps is not None else total_optimizer_steps(train_cfg)
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.dp = ps.get_data_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.ep = ps.get_expert_model_parallel_world_size()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.ep_group = ps.get_expert_model_parallel_group()
        # ranks of expert-data-parallel rank 0 hold every expert between them (the rank of dp rank 0 and its
        # expert-parallel peers): they write the weights of a checkpoint and take part in gathering the experts
        self.edp_rank = ps.get_expert_data_parallel_rank()
        # the most bytes a pipeline stage sends the first stage at once when the weights are gathered (`_gather_hf`)
        self.gather_bucket_bytes = GATHER_BUCKET_BYTES
        self.first_stage = ps.is_pipeline_first_stage()
        self.last_stage = ps.is_pipeline_last_stage()

        hf_config, get, padding_idx = self._hf_source(model_cfg, vocab_size, pad_token_id, seed, hf_model)
        self.hf_config = hf_config
        self.spec: ArchSpec = arch_from_hf_config(hf_config)
        check_parallel_sizes(self.spec, tp=self.tp, pp=self.pp, ep=self.ep)
        if self.spec.moe and (self.tp > 1 or self.pp > 1):
            raise ValueError(f"a mixture-of-experts model on train.backend=megatron trains at tensor_parallel_size=1 "
                             f"and pipeline_parallel_size=1 in this build (got TP={self.tp}, PP={self.pp}); spread "
                             "its experts with train.expert_parallel_size")
        if self.edp_rank == 0 and self.dp_rank != self.ep_rank:  # the layout checkpoint files and gathers assume
            raise RuntimeError(f"expert-parallel rank {self.ep_rank} is data-parallel rank {self.dp_rank}")
        self.local_experts = self.spec.num_experts // self.ep if self.spec.moe else 0
        self.expert_offset = self.ep_rank * self.local_experts
        compute = pick_dtype(model_cfg, self.device)
        self.params_dtype = params_dtype or torch.float32
        autocast = compute if (compute != torch.float32 and self.params_dtype == torch.float32) else None
        self.sequence_parallel = bool(train_cfg.sequence_parallel) and self.tp > 1
        _refuse(sequence_parallel_violation("megatron", train_cfg.sequence_parallel, self.tp))  # the TP it runs with
        self.layer_spec = resolve_layer_spec(train_cfg.layer_spec, self.device)
        # train.pack_sequences: each micro-batch one row without padding, sequences kept apart by Transformer
        # Engine's attention (THD); megatron-core's local attention takes no packed sequences
        self.packed = bool(train_cfg.pack_sequences)
        _refuse(pack_sequences_violation("megatron", self.packed, self.layer_spec))  # the layers it resolved
        self.config = transformer_config(self.spec, tp=self.tp, pp=self.pp, params_dtype=self.params_dtype,
                                         autocast_dtype=autocast, use_cpu_initialization=True,
                                         recompute=model_cfg.gradient_checkpointing,
                                         sequence_parallel=self.sequence_parallel, ep=self.ep,
                                         routing_replay=self.spec.moe)
        model = build_gpt_model(self.spec, self.config, tp=self.tp, pre_process=self.first_stage,
                                post_process=self.last_stage, which=self.layer_spec)
        freeze_padding_embedding(model, padding_idx)
        self.layer_offset = int(get_transformer_layer_offset(self.config))
        self.layers = range(self.layer_offset, self.layer_offset + self.spec.num_layers // self.pp)
        self._load_megatron(model, convert.hf_to_megatron(
            self.spec, get, tp_rank=self.tp_rank, tp_size=self.tp, layers=self.layers,
            pre_process=self.first_stage, post_process=self.last_stage,
            experts=range(self.expert_offset, self.expert_offset + self.local_experts)))
        # MoE: the engine's routes compared (rollout/router_agreement) and, replaying, forced; None: a dense model
        self.routing = (MegatronRouting(model, replay=routing_replay, num_experts=self.spec.num_experts,
                                        layer_offset=self.layer_offset) if self.spec.moe else None)
        if routing_replay and self.routing is None:
            raise ValueError("rollout.routing_replay needs a mixture-of-experts model "
                             f"({self.spec.arch} has no MoE router)")
        for key in ("moe_z_loss_coef", "moe_aux_loss_coef"):
            if getattr(train_cfg, key) > 0 and self.routing is None:
                raise ValueError(f"train.{key}={getattr(train_cfg, key)} needs a mixture-of-experts model "
                                 f"({self.spec.arch} has no MoE router)")
        model = model.to(device=self.device, dtype=self.params_dtype)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
            use_distributed_optimizer=use_distributed_optimizer, check_for_nan_in_grad=False,
        )
        self.model = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=model)
        clip = train_cfg.clip_grad
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=train_cfg.lr, min_lr=0.0, weight_decay=train_cfg.weight_decay,
                adam_beta1=train_cfg.adam_beta1, adam_beta2=train_cfg.adam_beta2, adam_eps=1e-8,
                clip_grad=clip if clip > 0 else 0.0, bf16=self.params_dtype == torch.bfloat16,
                params_dtype=self.params_dtype, use_distributed_optimizer=use_distributed_optimizer,
            ),
            [self.model],
        )
        self.use_distributed_optimizer = use_distributed_optimizer
        self.config.finalize_model_grads_func = self._finalize_grads
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.config.no_sync_func = self.model.no_sync
        self.step = 0
        self.skips = SkippedInARow("policy")

    # ---- construction ---------------------------------------------------------------------------------

    @staticmethod
    def _hf_source(model_cfg: ModelConfig, vocab_size: int, pad_token_id: int, seed: int,
                   hf_model: Optional[torch.nn.Module]) -> tuple[Any, Callable[[str], torch.Tensor], Optional[int]]:
        """(HF config, get(hf tensor name), the HF input embedding's padding_idx) of the starting weights."""
        if hf_model is None and model_cfg.source == "hf":
            from transformers import AutoConfig

            path = resolve_model_path(model_cfg)
            config = AutoConfig.from_pretrained(str(path), local_files_only=True)
            return config, _hf_getter(path), getattr(config, "pad_token_id", None)
        if hf_model is None:  # source=config: the torch backend's builder under the same seed -> the same weights
            hf_model = build_model(model_cfg, vocab_size, pad_token_id, seed=seed, dtype=torch.float32)
        state = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
        config = hf_model.config
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        return config, state.__getitem__, getattr(hf_model.get_input_embeddings(), "padding_idx", None)

    def _load_megatron(self, module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        """Copy tensors (global names) into a stage's module; every weight must be covered."""
        own = {convert.local_to_global(k, self.layer_offset, self.expert_offset): v
               for k, v in module.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}
        missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
        if missing or unexpected:
            raise KeyError(f"Megatron weights do not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
        with torch.no_grad():
            for name, value in tensors.items():
                if own[name].shape != value.shape:
                    raise ValueError(f"{name}: shape {tuple(value.shape)} != model's {tuple(own[name].shape)}")
                own[name].copy_(value)

    def _module(self) -> torch.nn.Module:
        return self.model.module

    # ---- forward --------------------------------------------------------------------------------------

    def _micro_batches(self, samples: Samples, micro_batch_size: int) -> list[_MicroBatch]:
        out = []
        routes = self.routing is not None and samples.routed_experts is not None
        multiple = self.tp if self.sequence_parallel else 1  # each TP rank takes L / tp positions

        def layout(s: Samples, pad: int) -> torch.Tensor:
            tokens = left_aligned(s, pad)[0]
            if tokens.shape[1] % multiple:  # padded at the end: causal attention keeps the padding out of the rest
                extra = multiple - tokens.shape[1] % multiple
                tokens = torch.cat([tokens, tokens.new_full((tokens.shape[0], extra), pad)], dim=1)
            return tokens

        def packed_layout(s: Samples) -> torch.Tensor:
            return packed_micro_batch(s, torch.arange(len(s)), -1, multiple=multiple).tokens

        for rows in length_sorted_micro_batches(samples, micro_batch_size):
            mine = samples.select(rows)
            if self.packed:
                mb = packed_micro_batch(samples, rows, self.pad_token_id, device=self.device, multiple=multiple)
                mb.routes = routes_in_layout(mine, packed_layout) if routes else None
                mb.real = real_in_layout(mine, packed_layout).to(self.device) if self.routing is not None else None
                out.append(mb)
                continue
            _, cols, targets, t = left_aligned(mine, self.pad_token_id)
            tokens = layout(mine, self.pad_token_id)
            positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
            real = real_in_layout(mine, lambda s: layout(s, -1)).to(self.device) if self.routing is not None else None
            out.append(_MicroBatch(rows=rows, tokens=tokens.to(self.device), positions=positions.to(self.device),
                                   gather_cols=cols.to(self.device), targets=targets.to(self.device), t=t,
                                   routes=routes_in_layout(mine, lambda s: layout(s, -1)) if routes else None,
                                   real=real))
        return out

    def _shard_rows(self, n: int) -> torch.Tensor:
        """Rows of an N-row batch this data-parallel rank trains on (contiguous, as even as possible)."""
        if n < self.dp:
            raise ValueError(f"a batch of {n} rows cannot be split over {self.dp} data-parallel ranks")
        return torch.tensor_split(torch.arange(n), self.dp)[self.dp_rank]

    def _logprobs(self, mb: _MicroBatch, logits: torch.Tensor, entropy: bool) -> tuple[torch.Tensor,
                                                                                        Optional[torch.Tensor]]:
        cols = mb.gather_cols.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        picked = logits.gather(1, cols)  # [B, T', V/TP]: only the positions that predict response tokens
        logp, ent = vocab_parallel_logprobs(picked, mb.targets, temperature=self.temperature,
                                            vocab_size=self.spec.vocab_size, with_entropy=entropy, group=self.tp_group)
        if mb.packed is not None:  # [1, M] -> the micro-batch's [B, T'] response positions
            logp = mb.packed.place(logp[0])
            ent = None if ent is None else mb.packed.place(ent[0])
        return logp, ent

    def _run(self, mbs: list[_MicroBatch], loss_fn: Callable[[_MicroBatch, torch.Tensor], torch.Tensor], *,
             forward_only: bool) -> None:
        """Megatron's schedule over `mbs`; `loss_fn(mb, logits)` (last stage) returns the micro-batch's loss."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Iterator[_MicroBatch], model: torch.nn.Module):
            mb = next(data_iterator)
            progress.tick()
            moe: dict[str, Any] = {}
            if self.routing is not None:  # the expert load counted in a training pass; padding out of the z-loss
                self.routing.arm(mb.routes)
                if self.routing.training_pass:
                    self.routing.count_tokens(mb.real)
                    # kept past this forward: a recomputed layer's load-balancing loss is attached in the backward
                    self.routing.aux_share = mb.share
                moe = {"padding_mask": ~mb.real}
            try:
                output = model(mb.tokens, mb.positions, None, packed_seq_params=mb.packed_seq_params, **moe)
            finally:
                if self.routing is not None:
                    self.routing.disarm()

            def loss_func(output_tensor: torch.Tensor):
                loss = loss_fn(mb, output_tensor)
                return loss, torch.ones((), dtype=torch.int, device=loss.device), {}

            return output, loss_func

        if not mbs:
            raise ValueError("no micro-batch to run")
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=[self.model], num_microbatches=len(mbs),
            seq_length=max(mb.tokens.shape[1] for mb in mbs), micro_batch_size=max(mb.tokens.shape[0] for mb in mbs),
            forward_only=forward_only,
        )

    def _finalize_grads(self, model: list[torch.nn.Module], num_tokens: Any = None, **kwargs: Any) -> None:
        """megatron's finalize_model_grads WITHOUT num_tokens: losses already carry the step's denominator."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(model, None, **kwargs)

    def _broadcast_from_last_stage(self, obj: Any) -> Any:
        if self.pp == 1:
            return obj
        holder = [obj]
        src = torch.distributed.get_global_rank(self.pp_group, self.pp - 1)
        torch.distributed.broadcast_object_list(holder, src=src, group=self.pp_group)
        return holder[0]

    def _gather_rows(self, local: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
        """The [N, ...] tensor whose rows `rows` are this data-parallel rank's `local` (CPU, all ranks)."""
        if self.dp == 1:
            out = torch.zeros(n, *local.shape[1:], dtype=local.dtype)
            out[rows] = local
            return out
        parts: list[Any] = [None] * self.dp
        torch.distributed.all_gather_object(parts, (rows, local), group=self.dp_group)
        out = torch.zeros(n, *local.shape[1:], dtype=local.dtype)
        for r, x in parts:
            out[r] = x
        return out

    @torch.no_grad()
    def compute_logprobs(self, samples: Samples, micro_batch_size: int,
                         max_tokens: Optional[int] = None) -> torch.Tensor:
        """log p(response tokens) under the current weights, [N, T] fp32 on the CPU, 0 where masked; every rank
        returns the whole batch's."""
        _rows_only(max_tokens)
        self.model.eval()
        N, T = samples.response_ids.shape
        rows = self._shard_rows(N)
        mine = samples.select(rows)
        local = torch.zeros(len(rows), T, dtype=torch.float32)
        mbs = self._micro_batches(mine, micro_batch_size)

        def loss_fn(mb: _MicroBatch, logits: torch.Tensor) -> torch.Tensor:
            logp, _ = self._logprobs(mb, logits, entropy=False)
            local[mb.rows, : mb.t] = logp.float().cpu()
            return logp.new_zeros(())

        self._run(mbs, loss_fn, forward_only=True)
        local = self._broadcast_from_last_stage(local)
        out = self._gather_rows(local, rows, N)
        return out * samples.response_mask.to(out.dtype)

    # ---- training -------------------------------------------------------------------------------------

    @torch.no_grad()
    def _step_statistics(self, mine: TrainBatch, algo_cfg: AlgorithmConfig,
                         mbs: list[_MicroBatch]) -> Optional[dict[str, float]]:
        """The algorithm's step statistics over every valid token of the step: a no-grad pass over this rank's
        micro-batches (train mode, as the loss pass), the tokens all-gathered over data-parallel ranks.
        Computed on the last pipeline stage (where the loss is); None elsewhere."""
        chunks: list[torch.Tensor] = []

        def loss_fn(mb: _MicroBatch, logits: torch.Tensor) -> torch.Tensor:
            logp, _ = self._logprobs(mb, logits, entropy=False)
            lb = loss_inputs(mine, mb.rows, logp.float(), mb.t, device=self.device)
            keep = lb.mask != 0
            chunks.append(torch.stack([lb.logp[keep], lb.old_logp[keep], lb.advantages[keep]]).cpu())
            return logp.new_zeros(())

        self._run(mbs, loss_fn, forward_only=True)
        if not self.last_stage:
            return None
        tokens = torch.cat(chunks, dim=1) if chunks else torch.zeros(3, 0)
        if self.dp > 1:
            parts: list[Any] = [None] * self.dp
            torch.distributed.all_gather_object(parts, tokens, group=self.dp_group)
            tokens = torch.cat(parts, dim=1)
        logp, old, adv = (x.to(self.device) for x in tokens)
        return algorithms.get(algo_cfg.name).step_statistics(algo_cfg, logp, old, adv, torch.ones_like(logp))

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
        """Fresh, finalized gradients of the whole batch's loss (in the DDP grad buffers, `param.main_grad`);
        returns the step's metrics as `TorchPolicy.accumulate_gradients` does, on every rank."""
        _rows_only(max_tokens)
        step = StepLoss(batch, algo_cfg, per_token=per_token, report_entropy=report_entropy,
                        rollout_mismatch=rollout_mismatch)
        entropy = step.entropy
        self.model.train()
        rows = self._shard_rows(len(batch))
        mine = batch.select(rows)
        mbs = self._micro_batches(mine, micro_batch_size)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        stats = self._step_statistics(mine, algo_cfg, mbs) if step.algorithm.needs_step_statistics else None

        def loss_fn(mb: _MicroBatch, logits: torch.Tensor) -> torch.Tensor:
            logp, ent = self._logprobs(mb, logits, entropy=entropy != "none")
            if ent is not None and entropy == "metric":
                ent = ent.detach()
            return step.micro_batch(mine, mb.rows, logp, mb.t, device=self.device, entropy=ent, stats=stats)

        z_coef = self.train_cfg.moe_z_loss_coef
        # MoE: the router z-loss is a mean over the step's routed tokens (of every data-parallel rank) and MoE layers
        z_norm = len(self.routing.routers) * max(1, routed_tokens(batch)) if self.routing is not None else 1
        aux_coef = self.train_cfg.moe_aux_loss_coef
        if self.routing is not None:
            self.routing.training_pass, self.routing.z_sum, self.routing.aux_sum = True, 0.0, 0.0
            self.routing.z_loss_coeff(z_coef / z_norm if z_coef > 0 else None)
            self.routing.aux_coef = aux_coef
            for mb in mbs:  # the load-balancing loss of the step: the mean over its rows, as the torch backend's
                mb.share = len(mb.rows) / len(batch)
        try:
            self._run(mbs, loss_fn, forward_only=False)
        finally:
            if self.routing is not None:
                self.routing.training_pass = False
                self.routing.z_loss_coeff(None)
                self.routing.aux_coef = self.routing.aux_share = 0.0
        if self.routing is not None:  # MoE trains at PP=1: this stage has every router and the loss
            z = torch.tensor(self.routing.z_sum / z_norm, dtype=torch.float64)
            step.sums.add({MOE_Z_LOSS: z} | ({LOSS: z_coef * z} if z_coef > 0 else {}))
            if aux_coef > 0:  # this rank's micro-batches' share of the step's mean; the all-reduce adds the rest
                aux = torch.tensor(self.routing.aux_sum, dtype=torch.float64)
                step.sums.add({MOE_AUX_LOSS: aux, LOSS: aux_coef * aux})
        out: dict[str, float] = {}
        if self.last_stage:
            step.sums.all_reduce(self.dp_group, device=self.device)  # the whole batch's: over the data-parallel ranks
            out = step.metrics()
        out = self._broadcast_from_last_stage(out)
        if self.routing is not None:  # every token's routers are on one rank of the data-parallel group (TP=PP=1)
            out |= self.routing.metrics(self.dp_group, device=self.device)
        return out

    def _skip_on_every_rank(self, skip: bool) -> bool:
        """True on every rank when any rank of the trainer would skip the step (a max-reduced flag)."""
        flag = torch.tensor([1.0 if skip else 0.0], device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def _nonfinite_grad_tensors(self) -> tuple[int, Optional[str]]:
        """Parameter shards whose gradient holds a NaN/inf, summed over the model-parallel group (a collective),
        and this rank's first such name."""
        bad, first = nonfinite_grad_tensors((n, getattr(p, "main_grad", p.grad))
                                            for n, p in self._module().named_parameters())
        count = torch.tensor([float(bad)], device=self.device)
        torch.distributed.all_reduce(count, group=self.ps.get_model_parallel_group())
        return int(count.item()), first

    def _optimizer_step(self, loss: float, batch: TrainBatch) -> StepOutcome:
        """Set the scheduled lr, clip and step, unless the loss or the gradient norm is not finite on any rank: then
        nothing changes (weights, optimizer state, step count) on every rank."""
        from megatron.core.optimizer import optimizer as mopt

        lr = self.train_cfg.lr * lr_factor(self.step, schedule=self.train_cfg.lr_schedule,
                                           warmup_steps=self.train_cfg.warmup_steps, total_steps=self.total_steps,
                                           min_lr_ratio=self.train_cfg.min_lr_ratio)
        found_inf = self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        if not self._skip_on_every_rank(bool(found_inf) or not math.isfinite(grad_norm) or not math.isfinite(loss)):
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            if self.train_cfg.clip_grad > 0:
                chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
                for opt in chained:
                    params = opt.get_parameters()
                    if params:
                        mopt.clip_grad_by_total_norm_fp32(params, max_norm=self.train_cfg.clip_grad,
                                                          total_norm=grad_norm)
            self.optimizer.step_with_ready_grads()
            self.step += 1
            outcome = self.skips.applied(grad_norm, lr)
        else:
            bad, first = self._nonfinite_grad_tensors()
            outcome = self.skips.skipped(applied=self.step, loss=loss, grad_norm=grad_norm, lr=lr, bad_grads=bad,
                                         first_bad=first, batch=batch, log=torch.distributed.get_rank() == 0)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        return outcome

    # ---- weights --------------------------------------------------------------------------------------

    def _gather_tensor(self, name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Shards of every tensor-parallel rank of one Megatron tensor (replicated tensors: one copy)."""
        if self.tp == 1 or tp_partition_dim(name) is None:
            return [tensor.detach()]
        parts = [torch.empty_like(tensor) for _ in range(self.tp)]
        torch.distributed.all_gather(parts, tensor.detach().contiguous(), group=self.tp_group)
        return parts

    def _expert_tensors(self, mine: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every expert's tensor of one layer (global order) from this rank's (`mine`, local order), gathered over
        the expert-parallel group (a collective of its ranks)."""
        if self.ep == 1:
            return mine
        local = torch.stack([t.detach() for t in mine]).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.ep)]
        torch.distributed.all_gather(parts, local, group=self.ep_group)
        return [e for part in parts for e in part.unbind(0)]

    def _stage_tensors(self, tensor_of: Callable[[torch.nn.Parameter], torch.Tensor],
                       dtype: Optional[torch.dtype], copy: bool = True,
                       emit: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """HF tensors of this pipeline stage, one at a time, as CPU tensors (floating ones in `dtype`), gathered over
        tensor parallelism: every TP rank takes part in each gather, only TP rank 0 yields (the others keep nothing).
        A layer's experts are gathered over expert parallelism once its last local expert's tensor comes, and
        yielded stacked. `copy=False`: a tensor may alias a parameter (the caller copies it before the next one).
        `emit=False`: take part in the gathers only, yield nothing."""
        pending: dict[tuple[int, str], list[torch.Tensor]] = {}  # (layer, linear_fc1|2) -> this rank's experts
        for local_name, param in self._module().named_parameters():
            name = convert.local_to_global(local_name, self.layer_offset, self.expert_offset)
            if name == "output_layer.weight" and self.spec.tie_word_embeddings:
                continue  # a pipeline copy of the embedding
            expert = convert.expert_of(name)
            if expert is not None:
                mine = pending.setdefault((expert[0], expert[2]), [])
                mine.append(tensor_of(param))
                if len(mine) < self.local_experts:
                    continue
                tensors = self._expert_tensors(pending.pop((expert[0], expert[2])))
                if not emit or self.tp_rank != 0:
                    continue
                converted = dict([convert.hf_experts_tensor(expert[0], expert[2],
                                                            [t.detach().to("cpu") for t in tensors])])
            else:
                shards = self._gather_tensor(name, tensor_of(param))
                if not emit or self.tp_rank != 0:
                    continue
                converted = convert.megatron_to_hf_tensor(self.spec, name, shards)
            for hf_name, t in converted.items():
                if hf_name == "lm_head.weight" and self.spec.tie_word_embeddings:
                    continue
                t = t.detach().to("cpu")
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                elif copy:
                    t = t.clone()
                yield hf_name, t

    def _stage_bytes(self, dtype: Optional[torch.dtype]) -> int:
        """At most the bytes of this stage's HF tensors (its parameters, tensor-parallel ones whole, in `dtype`)."""
        total = 0
        for local_name, p in self._module().named_parameters():
            name = convert.local_to_global(local_name, self.layer_offset, self.expert_offset)
            copies = self.tp if tp_partition_dim(name) is not None else self.ep if convert.expert_of(name) else 1
            size = dtype.itemsize if dtype is not None and p.is_floating_point() else p.element_size()
            total += p.numel() * copies * size + 3 * _ALIGN  # up to 3 HF tensors (q, k, v)
        return total

    def _gather_hf(self, tensor_of: Callable[[torch.nn.Parameter], torch.Tensor],
                   dtype: Optional[torch.dtype]) -> dict[str, torch.Tensor]:
        """The whole HF-layout dict on global rank 0 ({} elsewhere): the sending rank. Only data-parallel rank 0
        gathers. Each later pipeline stage's TP-0 rank sends its tensors to the first stage's TP-0 rank (global rank
        0) alone, in buckets of at most `gather_bucket_bytes` (a larger tensor alone), one stage after the other: no
        rank but the sender holds more than a bucket (and the tensor being gathered) beyond its own shards."""
        if self.dp_rank != 0:
            if self.edp_rank == 0 and self.ep > 1:  # an expert-parallel peer of data-parallel rank 0: its experts
                for _ in self._stage_tensors(tensor_of, dtype, emit=False):
                    pass
            return {}
        stage = self._stage_tensors(tensor_of, dtype, copy=self.pp_rank == 0)  # later stages copy into buckets
        if self.tp_rank != 0:
            for _ in stage:  # the tensor-parallel gathers of TP rank 0's stage
                pass
            return {}
        if self.pp_rank != 0:
            self._send_stage(stage, dtype)
            return {}
        out = dict(stage)
        ranks = torch.distributed.get_process_group_ranks(self.pp_group)
        for src in ranks[1:]:
            out.update(self._receive_stage(src))
        return out if torch.distributed.get_rank() == 0 else {}

    def _p2p_device(self) -> torch.device:
        """Where pipeline-stage buckets travel: NCCL sends CUDA tensors, gloo CPU ones."""
        return self.device if torch.distributed.get_backend(self.pp_group) == "nccl" else torch.device("cpu")

    def _send_stage(self, tensors: Iterator[tuple[str, torch.Tensor]], dtype: Optional[torch.dtype]) -> None:
        """This stage's tensors to the pipeline's first rank, bucket by bucket: each bucket is announced (names,
        dtypes, shapes, offsets) and sent as one flat byte tensor that is filled as the tensors come; then None."""
        dst = torch.distributed.get_process_group_ranks(self.pp_group)[0]
        device = self._p2p_device()
        flat = torch.empty(min(self.gather_bucket_bytes, self._stage_bytes(dtype)), dtype=torch.uint8, device=device)
        meta: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
        used = 0

        def send() -> None:
            torch.distributed.send_object_list([(meta, used)], dst=dst, group=self.pp_group)
            torch.distributed.send(flat[:used], dst=dst, group=self.pp_group)

        for name, t in tensors:
            n = t.numel() * t.element_size()
            if meta and used + n > flat.numel():
                send()
                meta, used = [], 0
            if n > flat.numel():  # a tensor larger than a bucket travels alone
                flat = torch.empty(n, dtype=torch.uint8, device=device)
            flat[used:used + n].copy_(t.contiguous().view(-1).view(torch.uint8))
            meta.append((name, t.dtype, tuple(t.shape), used))
            used += _aligned(n)
        if meta:
            send()
        torch.distributed.send_object_list([None], dst=dst, group=self.pp_group)

    def _receive_stage(self, src: int) -> dict[str, torch.Tensor]:
        """What `_send_stage` of the stage at global rank `src` sends: CPU tensors (views of their bucket)."""
        out: dict[str, torch.Tensor] = {}
        device = self._p2p_device()
        while True:
            box: list[Any] = [None]
            torch.distributed.recv_object_list(box, src=src, group=self.pp_group)
            if box[0] is None:
                return out
            meta, size = box[0]
            flat = torch.empty(size, dtype=torch.uint8, device=device)
            torch.distributed.recv(flat, src=src, group=self.pp_group)
            flat = flat.cpu()
            for name, dt, shape, offset in meta:
                n = math.prod(shape) * dt.itemsize
                out[name] = flat[offset:offset + n].view(dt).view(shape)

    def state_dict_for_rollout(self, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
        """Current weights keyed like the HF model's state_dict (tied `lm_head.weight` left out), CPU tensors
        (fp32, or floating tensors in `dtype`) on global rank 0, {} on the other ranks. A collective: every rank
        calls it."""
        return self._gather_hf(lambda p: p, dtype)

    def gradients_hf(self) -> dict[str, torch.Tensor]:
        """The finalized gradients (after `accumulate_gradients`) in the HF layout, on global rank 0."""
        return self._gather_hf(lambda p: p.main_grad, torch.float32)

    def save_hf(self, directory: str | os.PathLike, dtype: Optional[torch.dtype] = None) -> None:
        """A Hugging Face checkpoint (config.json + model.safetensors) loadable by
        `AutoModelForCausalLM.from_pretrained`; written by global rank 0, a collective for all ranks."""
        state = self.state_dict_for_rollout(dtype)
        if torch.distributed.get_rank() == 0:
            directory = Path(directory)
            directory.mkdir(parents=True, exist_ok=True)
            with os_write_errors(directory):  # disk full, unwritable: a plain OSError naming errno and path
                self.hf_config.save_pretrained(str(directory))
                save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"),
                          metadata={"format": "pt"})
        torch.distributed.barrier()

    # ---- checkpoints ----------------------------------------------------------------------------------

    def _rank_names(self) -> dict[str, str]:
        return {"tp": self.tp_rank, "pp": self.pp_rank, "dp": self.dp_rank}  # type: ignore[return-value]

    def save_checkpoint(self, directory: str | os.PathLike) -> None:
        """Per-rank files: this stage's TP shard of the weights (safetensors; written by data-parallel rank 0, and
        with expert parallelism by its expert-parallel peers too: data-parallel rank r < EP writes the experts of
        expert-parallel rank r) and this rank's optimizer state; `trainer_state.json` by global rank 0. Resumable
        with the same TP/PP/DP/EP sizes. A collective: every rank calls it with the same directory."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        names = self._rank_names()
        if self.edp_rank == 0:
            tensors = {convert.local_to_global(k, self.layer_offset, self.expert_offset): v.detach().to("cpu")
                       .contiguous()
                       for k, v in self._module().state_dict().items()
                       if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
            with os_write_errors(directory / MODEL_FILE.format(**names)):  # a plain OSError naming errno and path
                save_file(tensors, str(directory / MODEL_FILE.format(**names)))
        if self.use_distributed_optimizer:
            chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
            param_state = [o.get_parameter_state_dp_reshardable() for o in chained]
            for st in param_state:  # the loader (megatron-core 0.16.1) expects a `padding` flag the getter omits
                for key, by_dtype in st.items():
                    if isinstance(key, int):
                        for buckets in by_dtype.values():
                            for bucket in buckets:
                                for elem in bucket:
                                    elem.setdefault("padding", False)
            opt_state = {"common": self.optimizer.state_dict(), "param_state": param_state}
        else:
            opt_state = {"common": self.optimizer.state_dict()}
        torch_save(opt_state, directory / OPTIMIZER_FILE.format(**names))
        if torch.distributed.get_rank() == 0:
            (directory / STATE_FILE).write_text(json.dumps({
                "step": self.step, "tensor_parallel_size": self.tp, "pipeline_parallel_size": self.pp,
                "data_parallel_size": self.dp, "expert_parallel_size": self.ep, "layer_spec": self.layer_spec}))
        torch.distributed.barrier()

    def load_checkpoint(self, directory: str | os.PathLike, *, load_optimizer: bool = True) -> None:
        """Restore what `save_checkpoint` wrote (weights always; optimizer state and step unless told not to).

        Every rank reads its files first (safetensors, and the optimizer state with `weights_only=True`: tensors and
        plain values only, so a tampered file cannot run code); if any rank cannot, every rank raises (the one that
        failed with a CheckpointFileError naming its file) and nothing is restored. A collective."""
        from relax.models.checkpoint_files import CheckpointFileError, load_safetensors_file, load_tensor_file

        directory = Path(directory)
        names = self._rank_names()
        error: Optional[Exception] = None
        try:
            meta = self._read_checkpoint_meta(directory)
            saved_spec = meta.get("layer_spec", "local")
            if load_optimizer and saved_spec != self.layer_spec:  # weights are named alike; the optimizer's order not
                raise ValueError(f"checkpoint {str(directory)!r} was trained with train.layer_spec={saved_spec}, "
                                 f"this trainer builds {self.layer_spec}: its optimizer state does not apply; set "
                                 f"train.layer_spec={saved_spec} to resume")
            # the weights file of this rank's experts (dense weights are the same in each): dp rank = ep rank there
            weights = load_safetensors_file(directory / MODEL_FILE.format(**{**names, "dp": self.ep_rank}))
            if load_optimizer:
                opt_file = directory / OPTIMIZER_FILE.format(**names)
                opt_state = load_tensor_file(opt_file, map_location=self.device)
                if not isinstance(opt_state, dict) or not isinstance(opt_state.get("common"), (dict, list)) or (
                        self.use_distributed_optimizer and not isinstance(opt_state.get("param_state"), list)):
                    raise CheckpointFileError(f"checkpoint file {opt_file} is not this trainer's optimizer state")
        except (CheckpointFileError, FileNotFoundError, ValueError) as e:
            error = e
        failed = torch.tensor([0.0 if error is None else 1.0], device=self.device)
        torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
        if error is not None:
            raise error
        if failed.item() > 0:
            raise CheckpointFileError(f"checkpoint {str(directory)!r}: another rank of the trainer could not read "
                                      "its files (its error names them); nothing was restored")
        self._load_megatron(self._module(), {k: v.to(self.params_dtype) for k, v in weights.items()})
        if load_optimizer:  # restores the optimizer's main (fp32) weights with its moments
            self.optimizer.load_state_dict(opt_state["common"])
            if self.use_distributed_optimizer:
                chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
                with torch.no_grad():
                    for opt, st in zip(chained, opt_state["param_state"], strict=True):
                        opt.load_parameter_state_from_dp_reshardable(st)
                        # DistributedOptimizer.load_state_dict (torch-optimizer path) gives every parameter the
                        # SAME `step` tensor, which AdamW then increments once per parameter: un-share it.
                        for state in opt.optimizer.state.values():
                            if isinstance(state.get("step"), torch.Tensor):
                                state["step"] = state["step"].clone()
            self.step = int(meta["step"])
        else:  # the loaded weights become the optimizer's main weights
            self.optimizer.reload_model_params()
        torch.distributed.barrier()

    def _read_checkpoint_meta(self, directory: Path) -> dict[str, Any]:
        """`trainer_state.json` of a checkpoint, checked against this trainer's TP/PP/DP sizes."""
        from relax.models.checkpoint_files import CheckpointFileError

        state_file = directory / STATE_FILE
        if not state_file.is_file():
            raise FileNotFoundError(f"{str(directory)!r} is not a Megatron checkpoint (no {STATE_FILE})")
        try:
            meta = json.loads(state_file.read_bytes())
            sizes = (meta["tensor_parallel_size"], meta["pipeline_parallel_size"], meta["data_parallel_size"],
                     meta.get("expert_parallel_size", 1))
            int(meta["step"])
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointFileError(f"checkpoint file {state_file} is damaged: {type(e).__name__}: {e}") from None
        if sizes != (self.tp, self.pp, self.dp, self.ep):
            raise ValueError(f"checkpoint {str(directory)!r} was written with TP/PP/DP/EP={sizes}, this trainer has "
                             f"{(self.tp, self.pp, self.dp, self.ep)}; export it with save_hf to change the layout")
        return meta
