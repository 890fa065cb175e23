"""Fault scenarios of tests/megatron/ranks.py (imported there; run in its rank processes over gloo, TP=1 x DP=2), in
test_megatron_cpu's shared launch, so that the fault tests start no rank processes of their own:
- `nonfinite` (tests/faults/test_megatron_nonfinite.py): a NaN in one rank's rows, then a non-finite gradient norm on
  one rank only, skip the step on every rank (weights, Adam moments and step count unchanged); the next finite step
  is applied on every rank.
- `checkpoint_refusal` (tests/faults/test_checkpoint_safety.py): MegatronPolicy.load_checkpoint, with the plain and
  the distributed optimizer, refuses a tampered (code-running pickle), a truncated optimizer file and a damaged
  trainer_state.json with a CheckpointFileError naming the file, and unpickles nothing; each rank tampers with its
  own optimizer file. First only the last rank's file is tampered with: the other ranks refuse too (the failure is
  all-reduced), without a file of theirs to name.
Rank 0 gathers every rank's results (res["ranks"], in rank order): the tests assert on each rank's.
"""

from __future__ import annotations

import copy
from pathlib import Path

import faults_common  # tests/faults/faults_common.py (ranks.py puts it on sys.path)
import torch
from conftest import random_batch  # tests/backends/conftest.py (ranks.py puts it on sys.path)

from relax.algorithms.grpo import GRPOConfig
from relax.config.schema import ModelConfig, TrainConfig
from relax.metrics import NONFINITE_BATCH_VALUES, SKIPPED_STEPS
from relax.models.checkpoint_files import CheckpointFileError
from relax.train.megatron.policy import MegatronPolicy

# a cosine schedule with warm-up: a skipped step that still moved the scheduler would change the next step's lr
NONFINITE_TRAIN = TrainConfig(lr=1e-2, clip_grad=1.0, num_rollout=10, lr_schedule="cosine", warmup_steps=3)


def _gather(rank: int, mine: dict, res: dict) -> None:
    """Every rank's `mine`, in rank order, as rank 0's res["ranks"]."""
    everyone: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    if rank == 0:
        res["ranks"] = everyone


def _snapshot(policy: MegatronPolicy) -> dict:
    """This rank's weights and optimizer state (Adam moments and step counts, fp32 main weights) and step."""
    return {"model": {k: v.detach().clone() for k, v in policy._module().state_dict().items()
                      if isinstance(v, torch.Tensor)},
            "optimizer": copy.deepcopy(policy.optimizer.state_dict()), "step": policy.step}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def scenario_nonfinite(rank: int, out: Path, res: dict) -> None:
    """Non-finite steps skipped alike on every data-parallel rank (see the module's docstring)."""
    world = torch.distributed.get_world_size()
    policy = MegatronPolicy(faults_common.TINY, NONFINITE_TRAIN, vocab_size=faults_common.VOCAB,
                            pad_token_id=faults_common.PAD, seed=3)
    algo = GRPOConfig()
    mine: dict = {}

    def step(batch) -> dict:
        return policy.train_step(batch, algo, per_token=True, micro_batch_size=2)

    step(faults_common.random_batch(seed=0))  # Adam has moments from here on
    before = _snapshot(policy)
    # 1. a NaN advantage in a row of the LAST data-parallel rank only: every rank skips
    bad = faults_common.random_batch(seed=1)
    adv = bad.advantages.clone()
    adv[-1, 0] = float("nan")
    m = step(bad.with_(advantages=adv))
    # .get: a metric that is missing (a step not skipped has no count of non-finite values) fails these tests alone,
    # not the whole shared launch
    mine["nan_row"] = {"skipped": m.get(SKIPPED_STEPS), "batch_values": m.get(NONFINITE_BATCH_VALUES),
                       "unchanged": _same(_snapshot(policy), before)}
    # 2. only the last rank sees a non-finite gradient norm: the max-reduced flag makes every rank skip
    original = policy.optimizer.get_grad_norm
    if rank == world - 1:
        policy.optimizer.get_grad_norm = lambda: (original(), float("nan"))[1]
    m = step(faults_common.random_batch(seed=2))
    policy.optimizer.get_grad_norm = original
    mine["one_rank_nan_norm"] = {"skipped": m.get(SKIPPED_STEPS), "unchanged": _same(_snapshot(policy), before)}
    # 3. a finite step is applied on every rank
    m = step(faults_common.random_batch(seed=3))
    mine["good"] = {"skipped": m.get(SKIPPED_STEPS), "unchanged": _same(_snapshot(policy), before), "step": policy.step}
    _gather(rank, mine, res)


class RunsCode:
    """Unpickling this creates `marker` (via `builtins.open`): what a malicious checkpoint file would do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def scenario_checkpoint_refusal(rank: int, out: Path, res: dict) -> None:
    """Tampered Megatron checkpoints refused on load (see the module's docstring). Each rank's outcomes, per optimizer
    kind: the CheckpointFileError's message of each load, or None where the load went through. OUTDIR/<scenario>
    (res["dir"]) holds the checkpoints (ckpt0: plain optimizer, ckpt1: distributed) and would hold a PWNED<rank>
    marker had a load unpickled the tampered file."""
    world = torch.distributed.get_world_size()
    mine: dict = {}
    for dist in (False, True):
        policy = MegatronPolicy(ModelConfig(name="tiny-test", source="config", dtype="float32", hidden_size=32,
                                            num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                            intermediate_size=64, max_position_embeddings=64),
                                TrainConfig(), vocab_size=33, pad_token_id=0, seed=0, use_distributed_optimizer=dist)
        policy.train_step(random_batch(8, seed=1), GRPOConfig(), per_token=True, micro_batch_size=4)
        ckpt = out / f"ckpt{int(dist)}"
        policy.save_checkpoint(ckpt)
        policy.load_checkpoint(ckpt)  # the optimizer state loads with weights_only=True
        opt = ckpt / f"optimizer_tp0_pp0_dp{rank}.pt"
        saved = opt.read_bytes()

        def malicious(opt=opt) -> None:
            torch.save({"common": RunsCode(out / f"PWNED{rank}")}, opt)

        tampers = {  # each rank tampers with its own file; global rank 0 with the shared trainer_state.json
            "last_rank_only": lambda: rank == world - 1 and malicious(),
            "malicious": malicious,
            "truncated": lambda opt=opt, saved=saved: opt.write_bytes(saved[: len(saved) // 2]),
            "meta": lambda ckpt=ckpt: rank == 0 and (ckpt / "trainer_state.json").write_text("{"),
        }
        outcome: dict = {}
        for name, tamper in tampers.items():
            tamper()
            torch.distributed.barrier()  # every rank's file is tampered with before any rank loads
            try:
                policy.load_checkpoint(ckpt)
                outcome[name] = None
            except CheckpointFileError as e:
                outcome[name] = str(e)
        mine[f"ckpt{int(dist)}"] = outcome
    torch.distributed.barrier()
    _gather(rank, mine, res)
    res["dir"] = str(out)


SCENARIOS = {"nonfinite": (scenario_nonfinite, 1, 1), "checkpoint_refusal": (scenario_checkpoint_refusal, 1, 1)}
