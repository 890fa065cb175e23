#!/usr/bin/env bash
# M2PO vs GRPO under staleness on this CPU (tiny model, digits task, train.mode=fully_async): the staleness
# sweep (2 algorithms x max_staleness 0, 2, 4), M2PO's budget sweep at max_staleness=4, then the comparison.
#   bash launch/recipes/m2po_staleness_cpu.sh [more overrides, e.g. train.num_rollout=20]
# EXP_DIR (optional) holds the runs, their checkpoints, the MLflow store and compare/; default: the current directory.
set -euo pipefail
source "$(dirname "$0")/_common.sh"
sweep_dirs m2po_staleness_cpu "$@"
own_overrides algorithm=grpo,m2po train.max_staleness=0,2,4 -- "$@"
first=("${own[@]}")
own_overrides algorithm=m2po train.max_staleness=4 algorithm.kl2_budget=0.002,0.01,0.05 -- "$@"
set -x
run_sweep -m +experiment=m2po_staleness_cpu "${first[@]}" "${extra[@]}" "$@"
stop_if_not_run  # nothing started or interrupted: relax-train's exit code, no second sweep, no comparison
run_sweep -m +experiment=m2po_staleness_cpu "${own[@]}" "${extra[@]}" "$@"
stop_unless_comparable "$@"  # the same, or a dry run: no comparison
# the runs of the two sweeps just run (what finished of them), not older ones of the experiment in the store
if (( ${#sweep_runs[@]} == 0 )); then echo "the sweeps' tables name no MLflow run: no comparison" >&2; exit 1; fi
run_compare --run-ids "${sweep_runs[@]}" --control algorithm=grpo,train.max_staleness=0 \
  --metrics rollout/raw_reward train/ppo_kl_m2_before train/ppo_kl_m2_after rollout/staleness_mean
exit "${sweep_rc}"
