#!/usr/bin/env bash
# Builds paradyse (./build) and runs an example program on its bundled default data.
#   scripts/run_example.sh                      the main example: plan_trace, the paper's setting by prediction
#   scripts/run_example.sh PROGRAM [ARGS...]    another example: plan_trace, reshard_walkthrough, ...
set -euo pipefail
cd "$(dirname "$0")/.."
program=plan_trace
if (($#)) && [[ "$1" != -* ]]; then
  program=$1
  shift
fi
mkdir -p build
if ! scripts/build.sh >build/run_example_build.log 2>&1; then
  tail -n 40 build/run_example_build.log >&2
  exit 1
fi
if [ ! -x "build/examples/$program" ]; then
  echo "no example named '$program'; the examples are: $(ls build/examples | grep -v -e CMake -e '\.' | tr '\n' ' ')" >&2
  exit 2
fi
exec "build/examples/$program" "$@"
