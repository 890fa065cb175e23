#!/usr/bin/env bash
# RLOO vs GRPO on this CPU (tiny model, digits task): the sweep, 2 arms x 2 seeds, then the comparison.
#   bash launch/recipes/rloo_vs_grpo_cpu.sh [more overrides, e.g. train.num_rollout=10]
# EXP_DIR (optional) holds the runs, their checkpoints, the MLflow store and compare/; default: the current directory.
set -euo pipefail
source "$(dirname "$0")/_common.sh"
sweep_dirs rloo_vs_grpo_cpu "$@"
own_overrides algorithm=rloo,grpo seed=1,2 -- "$@"
set -x
run_sweep -m +experiment=rloo_vs_grpo_cpu "${own[@]}" "${extra[@]}" "$@"
stop_unless_comparable "$@"  # nothing started, interrupted, a dry run: relax-train's exit code, no comparison
run_compare --sweep "${sweep_ids[0]}" --control algorithm=grpo  # what finished
exit "${sweep_rc}"
