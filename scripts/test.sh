#!/usr/bin/env bash
# Builds the tests and the example programs (not the benchmarks: see below) and runs every test: the doctest suites on
# thread ranks, the MPI suites under mpiexec (2 and 4 processes), the example programs' smoke tests, and a consumer of
# the installed package (tests/package) built with find_package(paradyse). Extra arguments go to the configure step.
#
# The build is its own tree, build-test/, with the examples at -O1 (PARADYSE_PROGRAM_OPTIMIZATION):
# here they are compiled and smoke-tested only, and -O1 halves their compile time, which keeps CI (2 cores) short.
# Programs to run or time come from build/ (scripts/build.sh, scripts/run_example.sh: Release).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
build_dir=build-test
# The benchmarks are not built here but for the ones a test runs and the CUDA ones (a benchmark prints a table, it is
# not a timed test; compiling them all was a sixth of CI's build time on 2 cores). scripts/build.sh builds them into
# build/ (Release), where they are run.
# The CUDA component is compiled wherever nvcc is found (CMake's AUTO): the kernels, test_cuda, the CUDA benchmarks and
# the header checks, so that the GPU path cannot rot unseen; without a device test_cuda's cases say "skipped: ..." and
# pass. scripts/device_check.sh builds and runs them where a GPU is lent.
PARADYSE_BUILD_DIR=$build_dir scripts/build.sh -DPARADYSE_PROGRAM_OPTIMIZATION=-O1 -DPARADYSE_BUILD_BENCH=OFF "$@"
ctest --test-dir "$build_dir" --output-on-failure --parallel "$(nproc)"

# The installed package, used the way a consumer uses it.
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build_dir" --prefix "$prefix" >/dev/null
cmake -S tests/package -B "$build_dir/package" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$build_dir/package"
"$build_dir/package/package_consumer"
if [[ -x "$build_dir/package/cli_consumer" ]]; then "$build_dir/package/cli_consumer" --ranks 3; fi
if [[ -x "$build_dir/package/cuda_consumer" ]]; then "$build_dir/package/cuda_consumer"; fi
