#!/usr/bin/env bash
# scripts/device_check.sh: the GPU path's check, in one go, on a machine with a GPU (within 8 minutes on one H200).
#
#   scripts/device_check.sh                 build the CUDA tests and benchmarks in build-gpu, run them, print tables
#   scripts/device_check.sh --bundle DIR    build here (no GPU needed) and put the programs into DIR, self-contained
#                                           but for the driver, cuBLAS and NCCL (for a GPU machine without fmt)
#   scripts/device_check.sh --prebuilt DIR  run the programs of a bundle
#   --quick                                 the benchmarks' reduced sets
#
# Prints: the device, every CUDA test (ops against the CPU ops, strategies on cuda_local against the float64
# reference, communicators), the attention benchmark (TFLOP/s against cuBLAS bf16 GEMM in the same run), the
# collectives benchmark (bus bandwidth against cudaMemcpy device-to-device) and train_gpt on the GPU. Each part has
# its own time limit, so one hang cannot eat the others' time. Logs go to $LOG_DIR (default build-gpu/logs).
set -uo pipefail
cd "$(dirname "$0")/.."

mode=build dir=build-gpu quick=()
while (($#)); do
  case $1 in
    --bundle) mode=bundle dir=$2; shift 2 ;;
    --prebuilt) mode=prebuilt dir=$2; shift 2 ;;
    --quick) quick=(--quick); shift ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "device_check.sh: unknown argument '$1' (expected --bundle DIR, --prebuilt DIR, --quick or --help)" >&2; exit 2 ;;
  esac
done

programs=(tests/test_cuda bench/cuda_attention bench/cuda_comm examples/train_gpt)

build() {  # $1: build directory
  local launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPARADYSE_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    "${launcher[@]}" >/dev/null || return 1
  local targets=()
  for p in "${programs[@]}"; do targets+=("$(basename "$p")"); done
  cmake --build "$1" --parallel "$(nproc)" --target "${targets[@]}"
}

if [[ $mode == bundle ]]; then
  from=${BUILD_DIR:-build-gpu}  # an existing build directory configured with CUDA may be reused
  build "$from" || exit 1
  rm -rf "$dir"; mkdir -p "$dir/lib"
  for p in "${programs[@]}"; do [[ -x $from/$p ]] && cp "$from/$p" "$dir/"; done
  # The shared libraries a GPU machine may lack (fmt); the CUDA runtime is linked statically, cuBLAS and NCCL are
  # the machine's own.
  ldd "$dir"/test_cuda | awk '/libfmt/ {print $3}' | xargs -r cp -L -t "$dir/lib"
  echo "bundle in $dir:"; ls -la "$dir"
  exit 0
fi

if [[ $mode == build ]]; then
  build "$dir" || exit 1
  bin() { echo "$dir/$1"; }
else
  # A bundle: its fmt, and the machine's cuBLAS and NCCL wherever the CUDA install or a Python wheel put them.
  libs=$(cd "$dir/lib" && pwd)
  for candidate in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib \
      $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, d, "lib") for p in nvidia.__path__ for d in os.listdir(p)))' 2>/dev/null); do
    [[ -d $candidate ]] && libs+=":$candidate"
  done
  for lib in libcublas.so.13 libnccl.so.2; do  # wherever else the image keeps them
    found=$(find / -xdev \( -path /proc -o -path /sys \) -prune -o -name "$lib" -print 2>/dev/null | head -1)
    [[ -n $found ]] && libs+=":$(dirname "$found")"
  done
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  bin() { echo "$dir/$(basename "$1")"; }
fi

logs=${LOG_DIR:-build-gpu/logs}
mkdir -p "$logs"
status=0
part() {  # $1: name, $2: time limit in seconds, rest: the command
  local name=$1 limit=$2; shift 2
  echo; echo "## $name"; echo
  local start=$SECONDS
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$logs/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "($name: exit $rc after $((SECONDS - start)) s)"
  ((rc == 0)) || status=1
  if ((rc == 127)) || grep -q "error while loading shared libraries" "$logs/$name.log"; then ldd "$1" | grep -i "not found"; fi
}

echo "# paradyse device check, $(date -u '+%Y-%m-%d %H:%M UTC')"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>&1
export PARADYSE_COMM_TIMEOUT=120
part tests 180 "$(bin tests/test_cuda)" --duration=true
part attention 90 "$(bin bench/cuda_attention)" "${quick[@]}"
part collectives 60 "$(bin bench/cuda_comm)" "${quick[@]}"
# The same short run on the host and on the GPU (same plans: same profile and cap): the losses must follow each other
# (fp32 on both; only summation orders differ).
small=(--steps 8 --ranks 2 --layers 2 --hidden 128 --heads 4 --min-len 256 --max-len 2048 --profile H200-SXM-141GB-x8)
part train_gpt_cpu 60 "$(bin examples/train_gpt)" --device cpu "${small[@]}" --csv "$logs/train_cpu.csv"
part train_gpt_gpu 60 "$(bin examples/train_gpt)" --device cuda "${small[@]}" --csv "$logs/train_gpu.csv"
echo; echo "## train_gpt: the GPU's losses against the host's"; echo
python3 - "$logs/train_cpu.csv" "$logs/train_gpu.csv" <<'PY' || status=1
import csv, os, sys
rows = [list(csv.DictReader(open(f))) if os.path.exists(f) else [] for f in sys.argv[1:3]]
if not rows[0] or len(rows[0]) != len(rows[1]):
    print(f"no comparison: the host run wrote {len(rows[0])} steps, the GPU run {len(rows[1])}")
    sys.exit(1)
print("| step | length | host loss | GPU loss | relative difference |\n|---:|---:|---:|---:|---:|")
worst = 0.0
for c, g in zip(*rows):
    if not c["loss"] or not g["loss"]:
        continue
    a, b = float(c["loss"]), float(g["loss"])
    worst = max(worst, abs(a - b) / abs(a))
    print(f"| {c['step']} | {c['length']} | {a:.6f} | {b:.6f} | {abs(a - b) / abs(a):.2e} |")
print(f"\nlargest relative difference {worst:.2e} over {len(rows[0])} steps")
sys.exit(0 if worst < 1e-3 else 1)
PY
# Tokens per second and model FLOPs utilisation on one GPU (4 cuda_local ranks share it).
part train_gpt 60 "$(bin examples/train_gpt)" --device cuda --steps 20 --layers 4 --hidden 512 --heads 8 \
  --min-len 1024 --max-len 8192
exit $status
