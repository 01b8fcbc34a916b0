#!/usr/bin/env bash
# Configures and builds paradyse in ./build (Release, Ninja, ccache). Extra arguments go to the configure step;
# PARADYSE_BUILD_DIR=DIR builds in DIR instead (scripts/test.sh uses build-test).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${PARADYSE_BUILD_DIR:-build}
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" "$@" >/dev/null
cmake --build "$build_dir" --parallel "$(nproc)"
