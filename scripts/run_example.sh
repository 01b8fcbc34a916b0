#!/usr/bin/env bash
# Builds an example program in ./build and runs it on its bundled default data.
#   scripts/run_example.sh                      the main example: train_gpt, a byte-level GPT trained on the State of
#                                               the Union corpus with per-layer strategy switching (~1-2 minutes)
#   scripts/run_example.sh PROGRAM [ARGS...]    another example: plan_trace, reshard_walkthrough, train_gpt, ...
#   scripts/run_example.sh --steps 8            arguments starting with '-' go to train_gpt
# Only the program asked for is built (ccache makes rebuilds quick); scripts/build.sh builds everything.
set -euo pipefail
cd "$(dirname "$0")/.."
program=train_gpt
if (($#)) && [[ "$1" == --help || "$1" == -h ]]; then
  sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'
  echo "examples: $(ls examples/*.cpp | xargs -n1 basename | sed 's/\.cpp$//' | tr '\n' ' ')"
  echo "each prints its own options with: scripts/run_example.sh PROGRAM --help"
  exit 0
fi
if (($#)) && [[ "$1" != -* ]]; then
  program=$1
  shift
fi
mkdir -p build
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
if ! { cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" &&
       cmake --build build --target "$program" --parallel "$(nproc)"; } >build/run_example_build.log 2>&1; then
  if grep -q "unknown target '$program'" build/run_example_build.log; then
    echo "no example named '$program'; the examples are: $(ls examples/*.cpp | xargs -n1 basename | sed 's/\.cpp$//' | tr '\n' ' ')" >&2
    exit 2
  fi
  tail -n 40 build/run_example_build.log >&2
  exit 1
fi
# train_gpt reads the corpus from build/sotu; extract it on first use (the program would too).
if [[ "$program" == train_gpt && ! -d build/sotu ]]; then
  tar xJf data/corpus/sotu.tar.xz -C build
fi
exec "build/examples/$program" "$@"
