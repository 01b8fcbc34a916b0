#!/usr/bin/env bash
# Builds everything and runs every test: the doctest suites on thread ranks, the MPI suites under mpiexec (2 and 4
# processes), and a consumer of the installed package (tests/package) built with find_package(paradyse).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
scripts/build.sh "$@"
ctest --test-dir build --output-on-failure --parallel "$(nproc)"

# The installed package, used the way a consumer uses it.
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install build --prefix "$prefix" >/dev/null
cmake -S tests/package -B build/package -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build build/package
build/package/package_consumer
