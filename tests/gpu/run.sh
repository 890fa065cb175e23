#!/usr/bin/env bash
# Every GPU check in one short run, where a CUDA GPU is available (they skip without one):
#   bash tests/gpu/run.sh
# the Megatron backend on CUDA (NCCL, bf16; tests/gpu) and colocated roles computing on the GPU (tests/runner).
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m pytest -q -rs tests/gpu tests/runner/test_placement.py::test_colocated_roles_compute_on_the_gpu "$@"
