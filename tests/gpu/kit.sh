#!/usr/bin/env bash
# The kit for a bare lent GPU machine (tests/gpu/bare.sh): the wheels Relax needs there beyond what that machine has
# (CUDA torch, transformers, peft, pytest, numpy, pyyaml, requests, tqdm: /work/.library/device/KINDS.md), for its
# Python (3.12, x86_64 manylinux), into tests/gpu/.kit/ (ignored by git; it travels with `carry: ["tests/gpu/.kit"]`).
#   bash tests/gpu/kit.sh                 # downloads from the package index; a few MB
#   PYTHON_VERSION=3.11 bash tests/gpu/kit.sh   # for a machine with another Python
#   RELAX_BARE_KIT=DIR bash tests/gpu/kit.sh     # into DIR (bare.sh reads the same variable)
# What cannot travel (Ray's wheel alone is larger than the 64 MiB a call carries, SGLang needs a CUDA build, the
# SmolLM2 GGUF is 98 MB) is left to the prepared machine's script, tests/gpu/run.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
kit=${RELAX_BARE_KIT:-tests/gpu/.kit}
py=${PYTHON_VERSION:-3.12}
rm -rf "$kit" && mkdir -p "$kit"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64 any; do platforms+=(--platform "$p"); done
# pinned to the versions this checkout is tested with (pyproject.toml): one version of each, no dependencies pulled
binary=(hydra-core==1.3.8 omegaconf==2.3.1 gguf==0.19.0 megatron-core==0.16.1)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp "${platforms[@]}" \
  -d "$kit" "${binary[@]}"
# antlr4-python3-runtime 4.9.3 (what omegaconf 2.3 pins) is published as a source archive only: built here (pure Python)
python3 -m pip wheel -q --no-deps -w "$kit" antlr4-python3-runtime==4.9.3
size=$(du -cb "$kit"/*.whl | tail -n 1 | cut -f 1)
limit=$((48 * 1024 * 1024))  # the call carries 64 MiB with the working tree (a few MB)
[ "$size" -le "$limit" ] || { echo "kit.sh: the kit is $size bytes, over $limit"; exit 1; }
ls -1 "$kit"
echo "kit.sh: $(ls "$kit"/*.whl | wc -l) wheels, $((size / 1024)) KiB in $kit"
