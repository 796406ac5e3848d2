#!/usr/bin/env bash
# Wheels scripts/gpu_check.py needs on a GPU machine that has torch (cu13), numpy, numba and
# triton but not the side channel's msgspec and pyzmq or PyYAML (the profiles) (the lent
# H200's image: CPython 3.12, no registry reachable). Versions are the main environment's
# pins (requirements/cpu.txt). The folder must stay under 64 MiB (what travels with a run).
#   bash scripts/gpu_wheels.sh [PYTHON_VERSION]   # default 3.12; writes build/gpu-wheels (about 2 MB)
# Not Mooncake: its CUDA wheels (mooncake-transfer-engine for cu12, -cuda13 for cu13, the
# [cu12]/[cu13] extras) are about 98 MB, over the 64 MiB a lent machine is sent, and need
# libibverbs1/libnuma1/libcurl4. So the GPU check records transfers (RecordingTransport), and
# Mooncake's CUDA probe (vllm_hawk/transport/mooncake_cuda.py) has not run on a GPU. On a GPU
# host with a registry: pip install mooncake-transfer-engine-cuda13==0.3.13.post1 (CUDA 13 torch).
set -euo pipefail
cd "$(dirname "$0")/.."
pyver="${1:-3.12}"
out=build/gpu-wheels
pins=$(grep -E '^(msgspec|pyzmq|PyYAML)==' requirements/cpu.txt)
py=$(bash scripts/ensure_env.sh path main 2>/dev/null || command -v python3)
rm -rf "$out" && mkdir -p "$out"
# shellcheck disable=SC2086
"$py" -m pip download --quiet --only-binary=:all: --no-deps --implementation cp --python-version "$pyver" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$out" $pins
ls -l "$out"
size=$(du -sb "$out" | cut -f1)
if [ "$size" -gt $((64 << 20)) ]; then
  echo "gpu_wheels: $out is $size bytes, over the 64 MiB that travels with a GPU run" >&2
  exit 1
fi
echo "gpu_wheels: $out, $size bytes"
