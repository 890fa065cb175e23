#!/usr/bin/env bash
# The performance suite on one CUDA device: the trainer, the rollout engine, the actor's memory, the Ray loop
# (cluster=1xgpu) and the algorithm math, bf16 rows included, MFU against the datasheet bf16 peak.
# Writes docs/performance_gpu.md (the CPU report, docs/performance.md, is left alone). About 10 minutes.
#   bash bench/gpu.sh            # --quick sizes
#   bash bench/gpu.sh --full     # the full sizes
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'bench/gpu.sh: no CUDA device')"
mode=--quick
[[ "${1:-}" == "--full" ]] && mode=""
exec python -m bench $mode --only rollout,train,memory,overhead,math --out docs/performance_gpu.md --notes ""
