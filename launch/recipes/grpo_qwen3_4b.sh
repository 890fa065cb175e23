#!/usr/bin/env bash
# GRPO on Qwen3-4B, 8 GPUs (conf/experiment/grpo_qwen3_4b.yaml).
#   MODEL_DIR=/models DATA_DIR=/data EXP_DIR=/exp bash launch/recipes/grpo_qwen3_4b.sh
# Environment: see _common.sh (MODEL_DIR, DATA_DIR, EXP_DIR, ADVANTAGE_ESTIMATOR, SEED, MODEL_PATH).
set -euo pipefail
source "$(dirname "$0")/_common.sh"
run_recipe grpo_qwen3_4b "$@"
