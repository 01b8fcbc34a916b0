# scripts/common.sh: what the measuring scripts share, sourced first (source "$(dirname "$0")/common.sh"): strict mode,
# the repository root as the working folder ($ROOT), and
#   fail MESSAGE...             the message after the script's name on stderr, exit 2 (bad input);
#   positive_integers NAME...   each named variable a positive integer, else fail naming it and its value;
#   require_built EXE           EXE is executable, else fail naming the target to build in $BUILD;
#   PB                          the shared machine's build slots (/work/bin/pbuild) where there, else nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
fail() { echo "$(basename "$0"): $*" >&2; exit 2; }
positive_integers() {
  local v
  for v; do [[ "${!v}" =~ ^[0-9]+$ && "${!v}" -ge 1 ]] || fail "$v=${!v}: expected a positive integer"; done
}
require_built() { [[ -x $1 ]] || fail "$1 is not built (cmake --build ${BUILD:-?} --target $(basename "$1"))"; }
PB=()
if [[ -x /work/bin/pbuild ]]; then PB=(/work/bin/pbuild); fi
