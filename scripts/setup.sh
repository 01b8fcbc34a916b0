#!/usr/bin/env bash
# Installs the Debian packages paradyse needs to build and test on the CPU (run as root, or with sudo available).
# The CUDA toolkit (nvcc, cuBLAS, CCCL, NCCL) is optional and expected under /usr/local/cuda.
set -euo pipefail
packages=(g++ cmake ninja-build ccache libfmt-dev doctest-dev libopenmpi-dev openmpi-bin libopenblas-dev
          nlohmann-json3-dev libcli11-dev  # JSON (core/json.hpp) and command lines (examples/, bench/)
          python3-matplotlib)  # scripts/plot.py
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
