#!/usr/bin/env bash
# RLOO vs its GRPO control on GSM8K on this CPU (SmolLM2-135M, conf/experiment/rloo_smollm2_gsm8k_cpu.yaml): the
# sweep, both arms with the same seed, one job at a time (2 cores), then the comparison (docs/experiments.md, section 8).
#   DATA_DIR=/data bash launch/recipes/rloo_smollm2_gsm8k_cpu.sh [more overrides, e.g. seed=1,2,3]
# DATA_DIR holds gsm8k/main/{train,test}-00000-of-00001.parquet (hf download openai/gsm8k --repo-type dataset
# --include 'main/*' --local-dir $DATA_DIR/gsm8k). EXP_DIR (optional) holds the runs, their checkpoints, the MLflow
# store and compare/; default: the current directory.
set -euo pipefail
source "$(dirname "$0")/_common.sh"
sweep_dirs rloo_smollm2_gsm8k_cpu "$@"
own_overrides algorithm=rloo,grpo hydra.launcher.max_concurrent_jobs=1 -- "$@"
set -x
run_sweep -m +experiment=rloo_smollm2_gsm8k_cpu "${own[@]}" "${extra[@]}" "$@"
stop_unless_comparable "$@"  # nothing started, interrupted, a dry run: relax-train's exit code, no comparison
run_compare --sweep "${sweep_ids[0]}" --control algorithm=grpo  # what finished
exit "${sweep_rc}"
