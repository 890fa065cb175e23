#!/usr/bin/env bash
# M2PO on the GRPO recipe (Qwen3-4B, 8 GPUs) with the recommended values (conf/experiment/m2po.yaml).
#   MODEL_DIR=/models DATA_DIR=/data EXP_DIR=/exp bash launch/recipes/m2po.sh
# Environment: see _common.sh (MODEL_DIR, DATA_DIR, EXP_DIR, ADVANTAGE_ESTIMATOR, SEED, MODEL_PATH).
set -euo pipefail
source "$(dirname "$0")/_common.sh"
run_recipe m2po "$@"
