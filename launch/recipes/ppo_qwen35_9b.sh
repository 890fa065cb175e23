#!/usr/bin/env bash
# PPO on Qwen3.5-9B, 8 GPUs, synchronous colocated with critic (conf/experiment/ppo_qwen35_9b.yaml).
#   MODEL_DIR=/models DATA_DIR=/data EXP_DIR=/exp bash launch/recipes/ppo_qwen35_9b.sh
# Environment: see _common.sh (MODEL_DIR, DATA_DIR, EXP_DIR, ADVANTAGE_ESTIMATOR, SEED, MODEL_PATH).
set -euo pipefail
source "$(dirname "$0")/_common.sh"
run_recipe ppo_qwen35_9b "$@"
