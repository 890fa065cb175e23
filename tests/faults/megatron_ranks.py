"""One rank of the Megatron skip check: `python megatron_ranks.py RANK WORLD PORT OUTDIR` (TP=1, DP=WORLD).

Each rank writes OUTDIR/result<RANK>.json; tests/faults/test_megatron_nonfinite.py asserts on them.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "faults")]

from faults_common import PAD, TINY, VOCAB, random_batch  # noqa: E402

from relax.algorithms.grpo import GRPOConfig  # noqa: E402
from relax.config.schema import TrainConfig  # noqa: E402
from relax.metrics import NONFINITE_BATCH_VALUES, SKIPPED_STEPS  # noqa: E402
from relax.train.megatron import parallel  # noqa: E402
from relax.train.megatron.policy import MegatronPolicy  # noqa: E402

TRAIN = TrainConfig(lr=1e-2, clip_grad=1.0, num_rollout=10, lr_schedule="cosine", warmup_steps=3)


def snapshot(policy: MegatronPolicy) -> dict:
    """This rank's weights and optimizer state (Adam moments and step counts, fp32 main weights) and step."""
    return {"model": {k: v.detach().clone() for k, v in policy._module().state_dict().items()
                      if isinstance(v, torch.Tensor)},
            "optimizer": copy.deepcopy(policy.optimizer.state_dict()), "step": policy.step}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    parallel.initialize(rank, world, master_addr="127.0.0.1", master_port=port, seed=3, timeout_s=120)
    res: dict = {}
    try:
        policy = MegatronPolicy(TINY, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=3)
        algo = GRPOConfig()

        def step(batch) -> dict:
            return policy.train_step(batch, algo, per_token=True, micro_batch_size=2)

        step(random_batch(seed=0))  # Adam has moments from here on
        before = snapshot(policy)
        # 1. a NaN advantage in a row of the LAST data-parallel rank only: every rank skips
        bad = random_batch(seed=1)
        adv = bad.advantages.clone()
        adv[-1, 0] = float("nan")
        m = step(bad.with_(advantages=adv))
        res["nan_row"] = {"skipped": m[SKIPPED_STEPS], "batch_values": m[NONFINITE_BATCH_VALUES],
                          "unchanged": same(snapshot(policy), before)}
        # 2. only the last rank sees a non-finite gradient norm: the max-reduced flag makes every rank skip
        original = policy.optimizer.get_grad_norm
        if rank == world - 1:
            policy.optimizer.get_grad_norm = lambda: (original(), float("nan"))[1]
        m = step(random_batch(seed=2))
        policy.optimizer.get_grad_norm = original
        res["one_rank_nan_norm"] = {"skipped": m[SKIPPED_STEPS], "unchanged": same(snapshot(policy), before)}
        # 3. a finite step is applied on every rank
        m = step(random_batch(seed=3))
        res["good"] = {"skipped": m[SKIPPED_STEPS], "unchanged": same(snapshot(policy), before), "step": policy.step}
    except Exception:
        res["error"] = traceback.format_exc()
        raise
    finally:
        (out / f"result{rank}.json").write_text(json.dumps(res))
    parallel.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
