#!/usr/bin/env bash
# RLOO on Qwen3-0.6B / GSM8K, 1 GPU (conf/experiment/rloo_qwen3_0.6b_gsm8k.yaml).
#   MODEL_DIR=/models DATA_DIR=/data NUM_ROLLOUT=60 ROLLOUT_BATCH_SIZE=4 N_SAMPLES=8 GLOBAL_BATCH_SIZE=32 \
#     bash launch/recipes/rloo_qwen3_0.6b_gsm8k.sh
#   ADVANTAGE_ESTIMATOR=grpo bash launch/recipes/rloo_qwen3_0.6b_gsm8k.sh     # the control arm, same seed
# Environment: see _common.sh (MODEL_DIR, DATA_DIR, EXP_DIR, ADVANTAGE_ESTIMATOR, SEED, MODEL_PATH).
# Batch sizes: NUM_ROLLOUT, ROLLOUT_BATCH_SIZE, N_SAMPLES, GLOBAL_BATCH_SIZE (read by the recipe itself).
set -euo pipefail
source "$(dirname "$0")/_common.sh"
run_recipe rloo_qwen3_0.6b_gsm8k "$@"
