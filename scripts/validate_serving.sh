#!/usr/bin/env bash
# scripts/validate_serving.sh: the serving simulation against measured serving on this machine (issue 25).
#
# moe_simulate --measure serves moe_infer's synthetic MoE (2 layers, h 256, 8 experts top-2, ffn 512) on RANKS thread
# ranks under each policy three ways, the same requests each time: measured on the wall clock, measured on the
# slowest rank's thread CPU time per step (serve/clock.hpp's CpuClock: each step as it takes on cores of its own, so
# other processes on the cores do not lengthen it), and simulated (the dry run of each step, serve/step_dry_run.hpp) on this machine's
# profile, calibrated on the same thread ranks in thread CPU time (once; cached in
# $BUILD/validate_serving/profile_p<RANKS>.json, RECALIBRATE=1 redoes it; the calibration includes the GEMM size
# classes fitted on the served model's own GEMMs with cold weights). REQUESTS requests arrive at RATE per second
# (Poisson; 256 at 50/s keeps 2 thread ranks below their capacity, so the latencies are a stationary queue's, not a
# backlog growing with the trace). It prints TTFT and TPOT p50/p99 and tokens/s per policy and clock (measured median
# of ROUNDS rounds, the rounds' spread, simulated, error), then per step kind the measured wall and CPU time against
# the simulated cost of the same steps' traces, and the load average before and after (on a machine whose cores
# other processes use, wall time holds the time a rank waited for a core).
#
# The machine's speed moves between rounds (docs/serving_simulation.md: the same decode step 0.89 ms in one round,
# 1.39 ms two rounds later; a round's TPOT p50 follows it): moe_simulate --measure times a speed probe before and
# after every round (serve/speed_probe.hpp: the model's decode GEMMs, measured / the profile's price, over the same
# reading of the calibration's own samples, the profile's probe_baseline) and compares each round with the
# simulation at that round's speed (rows "@speed": the median of the rounds' errors). It also times a step probe
# before and after every round (serve/step_probe.hpp: a burst of 32 requests of their own served under the round's
# policy on the synchronised CPU clock, the slowdown at which the simulated clock charges its steps what they took):
# rows "cpu @steps". The policies take turns within each round (TP, EP, dynamic, TP, ...).
#
# The calibration also times the paged attention kernel (serve/paged_attention_calibration.hpp), SwiGLU forward,
# the fixed cost per kernel call (cost/profile.hpp CallOverheadModel), the collectives at the step's own
# all-reduce sizes (serve/serving_calibration.hpp), the dynamic policy's forecast and the engine's other host work
# (fit_planning_rate, fit_serving_host) and the ranks' spread within a step (fit_rank_jitter: each step's wait
# beyond its slowest rank's own work); the GEMM classes cycle through the weights a step reads, and the rows
# "cpu mem" simulate with classes cycling through 128 MB a rank instead. The CPU clock is synchronised (each piece
# between the ranks' collectives at its slowest rank, comm/cpu_marks.hpp). The per-step table prices every round's
# steps on the CPU clock by the simulated clock's dry run (against the CPU clock's step and rank 0's own CPU time;
# each round's ratio beside the mean).
#
# LAYERS=N gives the synthetic MoE N layers (2 by default: a whole step reads 14 MB of weights a rank on 2 ranks, at
# the edge of a 32 MB L3 whose share moves with the machine's neighbours; 8: 54 MB a rank, the weights from memory as
# a GPU's come from HBM), with a profile of its own (profile_p<RANKS>_l<N>.json).
#
# TRAINED=DIR serves a trained 4-layer MoE instead of the synthetic one: the Hugging Face folder train_gpt --save
# writes (trained first when DIR does not exist: 8 experts top-2, h 128, 4 heads, TRAIN_STEPS windows of 256-512
# tokens of the bundled corpus on 2 thread ranks; about a minute), with a profile of its own (its GEMM shapes). Any
# Hugging Face folder the engine loads serves the same way, e.g. DeepSeek's latent attention at its real shapes:
# `/usr/bin/python3 scripts/random_deepseek.py DIR` (random weights), then TRAINED=DIR RATE=12.5 REQUESTS=64.
#
#   scripts/validate_serving.sh                       # Release build in build-rel (through /work/bin/pbuild if there)
#   RANKS=1 REQUESTS=48 RATE=100 ROUNDS=3 scripts/validate_serving.sh
#   SKIP_BUILD=1 scripts/validate_serving.sh           # run the binary in $BUILD as it is (no build step)
#   TRAINED=build-rel/moe4 scripts/validate_serving.sh # the trained 4-layer MoE
#   LAYERS=8 RATE=12.5 REQUESTS=128 scripts/validate_serving.sh  # the synthetic MoE's weights from memory
#   RECALIBRATE=1 PASSES=5 scripts/validate_serving.sh # calibrate again, each measurement the median of 5 passes
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-rel}
RANKS=${RANKS:-2}
REQUESTS=${REQUESTS:-256}
RATE=${RATE:-50}
ROUNDS=${ROUNDS:-5}
PASSES=${PASSES:-3}  # the calibration's passes (moe_simulate --calibration-passes)
POLICIES=${POLICIES:-tp,ep,dynamic}
TRAINED=${TRAINED:-}
LAYERS=${LAYERS:-2}
GEMM_REUSE=${GEMM_REUSE:-off}  # on: each GEMM priced at its weight's reuse distance (moe_simulate --gemm-reuse on)
TRAIN_STEPS=${TRAIN_STEPS:-300}
PB=()
[[ -x /work/bin/pbuild ]] && PB=(/work/bin/pbuild)  # the shared machine's build slots

fail() { echo "validate_serving.sh: $*" >&2; exit 2; }
for v in RANKS REQUESTS ROUNDS TRAIN_STEPS LAYERS; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || fail "$v=${!v}: expected a positive integer"
done
[[ "$GEMM_REUSE" == on || "$GEMM_REUSE" == off ]] || fail "GEMM_REUSE=$GEMM_REUSE: expected on or off"
[[ "$RATE" =~ ^[0-9]+([.][0-9]+)?$ ]] || fail "RATE=$RATE: expected a positive number (requests/s)"

if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
  "${PB[@]}" cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPARADYSE_BUILD_TESTS=OFF \
    -DPARADYSE_BUILD_BENCH=OFF -DPARADYSE_ENABLE_CUDA=OFF -DPARADYSE_ENABLE_MPI=OFF >/dev/null
fi
grep -q '^CMAKE_BUILD_TYPE:STRING=Release$' "$BUILD/CMakeCache.txt" || fail "$BUILD is not a Release build folder"
TARGETS=(moe_simulate)
[[ -n "$TRAINED" ]] && TARGETS+=(train_gpt)
[[ "${SKIP_BUILD:-0}" == 1 ]] || "${PB[@]}" cmake --build "$BUILD" --target "${TARGETS[@]}" -j1 >/dev/null

OUT=$BUILD/validate_serving
mkdir -p "$OUT"
PROFILE=$OUT/profile_p$RANKS.json
MODEL=()
NAME=measure
if [[ "$LAYERS" != 2 ]]; then
  [[ -z "$TRAINED" ]] || fail "LAYERS=$LAYERS: the synthetic MoE's layers, not TRAINED=$TRAINED's"
  MODEL=(--synthetic-layers "$LAYERS")
  NAME=measure_l$LAYERS
  PROFILE=$OUT/profile_p${RANKS}_l$LAYERS.json
fi
if [[ -n "$TRAINED" ]]; then
  if [[ ! -d "$TRAINED" ]]; then
    echo "training the 4-layer MoE into $TRAINED ($TRAIN_STEPS steps) ..."
    "$BUILD/examples/train_gpt" --experts 8 --top-k 2 --layers 4 --hidden 128 --heads 4 --steps "$TRAIN_STEPS" \
      --min-len 256 --max-len 512 --ranks 2 --save "$TRAINED" > "$OUT/train_$(basename "$TRAINED").txt"
    tail -n 3 "$OUT/train_$(basename "$TRAINED").txt"
  fi
  [[ -f "$TRAINED/config.json" ]] || fail "TRAINED=$TRAINED: expected a Hugging Face folder (config.json) train_gpt --save wrote"
  MODEL=(--hf "$TRAINED")
  NAME=measure_$(basename "$TRAINED")
  PROFILE=$OUT/profile_p${RANKS}_$(basename "$TRAINED").json
fi
[[ "$GEMM_REUSE" == on ]] && NAME=${NAME}_reuse_on
[[ "${RECALIBRATE:-0}" == 1 ]] && rm -f "$PROFILE"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg) ($(nproc) cores)"
"$BUILD/examples/moe_simulate" --measure "${MODEL[@]}" --cluster "$PROFILE" --ranks "$RANKS" --requests "$REQUESTS" \
  --rates "$RATE" --prompt 8 64 --output 8 32 --step-tokens 64 --rounds "$ROUNDS" --policies "$POLICIES" \
  --calibration-passes "$PASSES" --gemm-reuse "$GEMM_REUSE" --steps-csv "$OUT/${NAME}_steps.csv" | tee "$OUT/$NAME.txt"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
