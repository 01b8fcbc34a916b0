#!/usr/bin/env bash
# scripts/device_check.sh: the GPU path's check, in one go, on a machine with a GPU (within 8 minutes on one H200).
#
#   scripts/device_check.sh                 build the CUDA tests and benchmarks in build-gpu, run them, print tables
#   scripts/device_check.sh --bundle DIR    build here (no GPU needed) and put the programs into DIR, self-contained
#                                           but for the driver, cuBLAS and NCCL (for a GPU machine without fmt)
#   scripts/device_check.sh --prebuilt DIR  run the programs of a bundle
#   --quick                                 the benchmarks' reduced sets
#   --parts "tests prediction ..."          only these parts (default: all; the names are the headings below)
#
# Prints: the device, every CUDA test (ops against the CPU ops, strategies on cuda_local against the float64 reference,
# communicators), the attention benchmark (TFLOP/s against cuBLAS bf16 GEMM in the same run), the collectives benchmark
# (bus bandwidth against cudaMemcpy device-to-device), train_gpt on the host and on the GPU (losses side by side, dense
# and MoE), tokens/s on the GPU, the time model's prediction of single-GPU training steps, dense and MoE, against their
# measured time (scripts/validate_trainer.sh DEVICE=cuda: the profile calibrated on the GPU by train_gpt, issue 25),
# where those steps' time goes op by op against each op's price (bench/step_ops, at 8,192 and 2,048 tokens), and the
# served MoE layers' expert banks on one rank of 8, TP against EP, measured against the built-in profile's price
# (bench/serve_experts, Mixtral-8x7B and DeepSeek-V2-Lite). Each part has its own time limit, so one hang cannot eat the
# others' time. Logs go to $LOG_DIR (default build-gpu/logs). A bundle mirrors the build folder's layout (examples/,
# tests/, bench/, its CMakeCache.txt) and carries the shared libraries a bare GPU machine lacks (build it without
# OpenBLAS and MPI to keep it small: -DCMAKE_DISABLE_FIND_PACKAGE_BLAS=ON -DPARADYSE_ENABLE_MPI=OFF).
set -uo pipefail
cd "$(dirname "$0")/.."

all_parts="tests attention collectives train_gpt_cpu train_gpt_gpu train_moe_cpu train_moe_gpu train_gpt prediction
  prediction_moe step_ops_moe step_ops_moe_2048 step_ops_dense step_ops_dense_2048 serve_experts_mixtral
  serve_experts_deepseek"
mode=build dir=build-gpu quick=() parts=$all_parts
while (($#)); do
  case $1 in
    --bundle) mode=bundle dir=$2; shift 2 ;;
    --prebuilt) mode=prebuilt dir=$2; shift 2 ;;
    --quick) quick=(--quick); shift ;;
    --parts) parts=$2; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "device_check.sh: unknown argument '$1' (expected --bundle DIR, --prebuilt DIR, --quick, --parts LIST or --help)" >&2; exit 2 ;;
  esac
done
all_parts=$(echo $all_parts) parts=$(echo $parts)  # one space between names
for p in $parts; do
  [[ " $all_parts " == *" $p "* ]] || { echo "device_check.sh: --parts: '$p' is not one of: $all_parts" >&2; exit 2; }
done
wanted() { [[ " $parts " == *" $1 "* ]]; }

programs=(tests/test_cuda bench/cuda_attention bench/cuda_comm bench/step_ops bench/serve_experts examples/train_gpt
  examples/plan_trace)

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
  cp "$from/CMakeCache.txt" "$dir/"  # the build's settings (scripts/validate_trainer.sh checks it is Release)
  for p in "${programs[@]}"; do
    [[ -x $from/$p ]] && mkdir -p "$dir/$(dirname "$p")" && cp "$from/$p" "$dir/$p"
  done
  # The shared libraries a bare GPU machine may lack (fmt; OpenBLAS, MPI where the build has them); the CUDA runtime
  # is linked statically, cuBLAS and NCCL are the machine's own, the C and C++ runtimes too.
  for p in "${programs[@]}"; do [[ -x $dir/$p ]] && ldd "$dir/$p"; done | awk '$2 == "=>" && $3 ~ /^\// {print $3}' |
    grep -v -E '/usr/local/cuda|/(libc|libm|libgcc_s|libstdc\+\+|libpthread|libdl|librt|libcuda)\.so' | sort -u |
    xargs -r cp -L -t "$dir/lib"
  echo "bundle in $dir:"; du -ah "$dir"
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
  bin() { echo "$dir/$1"; }
fi

logs=${LOG_DIR:-build-gpu/logs}
mkdir -p "$logs"
status=0
part() {  # $1: name, $2: time limit in seconds, rest: the command (run if --parts names it)
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
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
# The same short runs on the host and on the GPU (same plans: same profile and cap), the dense GPT and the MoE GPT:
# the losses must follow each other (fp32 on both; only summation orders differ).
compare_losses() {  # $1: what, $2: the host run's CSV, $3: the GPU run's
  echo; echo "## $1: the GPU's losses against the host's"; echo
  python3 - "$2" "$3" <<'PY' || status=1
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
}
small=(--steps 8 --ranks 2 --layers 2 --hidden 128 --heads 4 --min-len 256 --max-len 2048 --profile H200-SXM-141GB-x8)
part train_gpt_cpu 60 "$(bin examples/train_gpt)" --device cpu "${small[@]}" --csv "$logs/train_cpu.csv"
part train_gpt_gpu 60 "$(bin examples/train_gpt)" --device cuda "${small[@]}" --csv "$logs/train_gpu.csv"
wanted train_gpt_cpu && wanted train_gpt_gpu && compare_losses train_gpt "$logs/train_cpu.csv" "$logs/train_gpu.csv"
moe=(--experts 4 --top-k 2 --steps 6 --ranks 2 --layers 2 --hidden 128 --heads 4 --min-len 256 --max-len 1024
  --profile H200-SXM-141GB-x8)
part train_moe_cpu 60 "$(bin examples/train_gpt)" --device cpu "${moe[@]}" --csv "$logs/moe_cpu.csv"
part train_moe_gpu 60 "$(bin examples/train_gpt)" --device cuda "${moe[@]}" --csv "$logs/moe_gpu.csv"
wanted train_moe_cpu && wanted train_moe_gpu && compare_losses "train_gpt --experts" "$logs/moe_cpu.csv" "$logs/moe_gpu.csv"
# Tokens per second and model FLOPs utilisation on one GPU (4 cuda_local ranks share it), against the datasheet.
part train_gpt 60 "$(bin examples/train_gpt)" --device cuda --steps 20 --layers 4 --hidden 512 --heads 8 \
  --min-len 1024 --max-len 8192 --profile H200-SXM-141GB-x8
# The time model on one GPU (issue 25): train_gpt calibrates the GPU (cost/calibrate.hpp over ops::Cuda, wall-clock
# time, the model's own GEMM shapes), plan_trace predicts each step on that profile and on the datasheet's, and the
# steps' measured wall times are set beside them (scripts/validate_trainer.sh; its files in $dir/validate_trainer/).
part prediction 300 env DEVICE=cuda BUILD="$dir" SKIP_BUILD=1 RECALIBRATE=1 LAYERS=8 HIDDEN=1024 HEADS=8 \
  LENGTHS="2048 4096 8192" STEPS=5 ROUNDS=2 scripts/validate_trainer.sh
# The same for the MoE GPT (8 experts, top-2): the MoE planner's prediction of each step (its files in
# $dir/validate_trainer_moe/).
part prediction_moe 300 env DEVICE=cuda EXPERTS=8 TOP_K=2 BUILD="$dir" SKIP_BUILD=1 RECALIBRATE=1 LAYERS=4 HIDDEN=1024 \
  HEADS=8 LENGTHS="2048 4096 8192" STEPS=5 ROUNDS=2 scripts/validate_trainer.sh
# Where the steps' time goes, op by op, against each op's price on the profile the MoE part calibrated (bench/step_ops:
# every op timed alone): the MoE GPT with the planner's attention on one GPU (ColossalZ), and the dense GPT; at 2,048
# tokens too, where the predictions are furthest off (the dense one as the prediction part ran it: its untimed step
# against train_gpt's measured one is the time train_gpt spends outside the ops).
moe_profile=$dir/validate_trainer_moe/run/build/train_gpt_profile_cuda_h1024_p1.json
part step_ops_moe 120 "$(bin bench/step_ops)" --device cuda --profile "$moe_profile" --layers 4 --hidden 1024 \
  --heads 8 --experts 8 --top-k 2 --length 8192 --steps 3 --attention ColossalZ
part step_ops_moe_2048 120 "$(bin bench/step_ops)" --device cuda --profile "$moe_profile" --layers 4 --hidden 1024 \
  --heads 8 --experts 8 --top-k 2 --length 2048 --steps 3 --attention ColossalZ
part step_ops_dense 120 "$(bin bench/step_ops)" --device cuda --profile "$moe_profile" --layers 4 --hidden 1024 \
  --heads 8 --length 8192 --steps 3 --attention MegatronTS
part step_ops_dense_2048 120 "$(bin bench/step_ops)" --device cuda \
  --profile "$dir/validate_trainer/run/build/train_gpt_profile_cuda_h1024_p1.json" --layers 8 --hidden 1024 --heads 8 \
  --length 2048 --steps 3 --attention MegatronTS
# The served MoE layers' experts on one rank of 8, TP against EP, bf16 grouped GEMMs measured against the built-in
# profile's price (issue 25: whether EP's fuller GEMMs win large batches on the device, which the linear GEMM model
# cannot say, and the grouped call's per-item cost, grouped_item_s). Each writes the built-in profile with the measured
# shapes into $logs (serve_experts_*.json: moe_simulate --cluster FILE prices the served experts by them).
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H200 && echo h200 || echo h100)
part serve_experts_mixtral 120 "$(bin bench/serve_experts)" --device cuda --model data/model_shapes/mixtral-8x7b.json \
  --ranks 8 --profile "$gpu" --profile-out "$logs/serve_experts_mixtral_$gpu.json"
part serve_experts_deepseek 120 "$(bin bench/serve_experts)" --device cuda \
  --model data/model_shapes/deepseek-v2-lite.json --ranks 8 --profile "$gpu" \
  --profile-out "$logs/serve_experts_deepseek_$gpu.json"
exit $status
