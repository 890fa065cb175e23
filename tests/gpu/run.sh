#!/usr/bin/env bash
# Every GPU check in one short run on a PREPARED machine (Relax installed with its dependencies: Ray, MLflow, and
# SGLang for its part; a bare lent machine runs tests/gpu/bare.sh instead: tests/gpu/README.md), where a CUDA GPU
# is available (they skip without one):
#   bash tests/gpu/run.sh
# 1. tests/gpu: the Megatron backend on CUDA (NCCL, bf16; Transformer Engine's layer spec where transformer_engine
#    is installed, sequence parallelism where there are two GPUs) and Relax driving a real SGLang server (launch,
#    bf16 parity with transformers, weight sync by CUDA IPC buckets and by an NCCL/gloo update group, memory
#    release); tests/runner: colocated roles computing on the GPU.
# 2. where sglang is installed: SGLang's protocol conformance suite (tests/sglang/test_conformance.py) against a
#    real `sglang.launch_server` on 127.0.0.1:30000 serving SmolLM2-135M (its GGUF converted to a bf16 HF
#    directory, shared with step 1 through $RELAX_SGLANG_HF_DIR); the server is stopped on exit.
# The GPU numbers of the performance suite are a separate run: bash bench/gpu.sh (docs/performance_gpu.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
sglang=$(python -c 'import importlib.util as u, torch
print(int(torch.cuda.is_available() and u.find_spec("sglang") is not None))')
server=""
cleanup() {
  set +e
  [ -n "$server" ] && { kill -- -"$server" 2>/dev/null || kill "$server" 2>/dev/null; wait "$server" 2>/dev/null; }
  [ -n "${work:-}" ] && rm -rf "$work"
}
trap cleanup EXIT
if [ "$sglang" = 1 ]; then
  work=$(mktemp -d)
  export RELAX_SGLANG_HF_DIR="$work/smollm2-135m"
  python -m tests.gpu.test_sglang_gpu --convert "$RELAX_SGLANG_HF_DIR"
fi
status=0  # (test_bare_script.py is CI's check of bare.sh: it downloads the kit, which a GPU machine cannot)
python -m pytest -q -rs tests/gpu --ignore tests/gpu/test_bare_script.py \
  tests/runner/test_placement.py::test_colocated_roles_compute_on_the_gpu "$@" \
  || status=$?
if [ "$sglang" = 1 ]; then
  url=http://127.0.0.1:30000
  # in a process group of its own (setsid), so that cleanup stops its scheduler and detokenizer processes too
  setsid python -m sglang.launch_server --model-path "$RELAX_SGLANG_HF_DIR" --host 127.0.0.1 --port 30000 \
    --dtype bfloat16 --random-seed 0 --enable-deterministic-inference >"$work/sglang.log" 2>&1 &
  server=$!
  up() { python -c "import urllib.request as u; u.urlopen('$url/health', timeout=30)" 2>/dev/null; }
  for _ in $(seq 600); do up && break; kill -0 "$server" 2>/dev/null || break; sleep 1; done
  up || { echo "sglang.launch_server did not become healthy; its log ends:"; tail -n 40 "$work/sglang.log"; exit 1; }
  SGLANG_URL=$url python -m pytest -q -rs tests/sglang/test_conformance.py || status=$?
fi
exit "$status"
