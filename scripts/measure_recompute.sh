#!/usr/bin/env bash
# scripts/measure_recompute.sh: a pipeline's step time under --recompute full against none, measured and as the
# step's planner predicts it (issue 26: plan/activation_stash.hpp prices full as each sublayer's forward twice plus
# its backward).
#
# train_gpt --mesh pp=PP on thread ranks runs the same steps (LAYERS layers, h HIDDEN, packed rows of LEN tokens,
# MICRO micro-batches of one row per step) with --recompute none and with full, alternated ROUNDS times (none, full,
# none, full, ...). Each run's step time is the median of its steps from its --csv (the first WARMUP steps dropped);
# each round gives the ratio full / none of its two runs. The prediction is full's "predicted time per plan" over
# none's (the planner's time of a micro-batch through the whole stack and the work outside it, on the profile).
# Printed: per round both medians and the ratio, then the median ratio and its spread (min..max) over rounds against
# the predicted ratio, and the load average before and after (other processes on the cores lengthen wall time).
#
# The profile: PROFILE=FILE, or this machine's, calibrated once by this train_gpt on 1 thread rank (cached in
# $BUILD/measure_recompute/run/build/ with the checksum of the train_gpt that calibrated it).
#
#   scripts/measure_recompute.sh                    # Release build in build-rel (through /work/bin/pbuild if there)
#   ROUNDS=5 STEPS=8 LEN=512 scripts/measure_recompute.sh
#   SKIP_BUILD=1 BUILD=build-rel scripts/measure_recompute.sh
source "$(dirname "$0")/common.sh"
BUILD=${BUILD:-build-rel}
PP=${PP:-2}
LAYERS=${LAYERS:-4}
HIDDEN=${HIDDEN:-128}
HEADS=${HEADS:-4}
LEN=${LEN:-256}
MICRO=${MICRO:-4}
STEPS=${STEPS:-6}
WARMUP=${WARMUP:-1}
ROUNDS=${ROUNDS:-3}

positive_integers PP LAYERS HIDDEN HEADS LEN MICRO STEPS ROUNDS
[[ "$WARMUP" =~ ^[0-9]+$ && "$STEPS" -gt "$WARMUP" ]] ||
  fail "WARMUP=$WARMUP: expected a non-negative integer below STEPS=$STEPS (the first WARMUP steps are not counted)"
[[ "$PP" -ge 2 ]] || fail "PP=$PP: --recompute full needs pipeline stages (PP >= 2)"
[[ "$LAYERS" -ge "$PP" ]] || fail "LAYERS=$LAYERS: expected at least PP=$PP (a layer per stage)"

if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
  "${PB[@]}" cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
    -DPARADYSE_BUILD_TESTS=OFF -DPARADYSE_BUILD_BENCH=OFF -DPARADYSE_ENABLE_CUDA=OFF -DPARADYSE_ENABLE_MPI=OFF >/dev/null
fi
grep -q '^CMAKE_BUILD_TYPE:STRING=Release$' "$BUILD/CMakeCache.txt" || fail "$BUILD is not a Release build folder"
[[ "${SKIP_BUILD:-0}" == 1 ]] || "${PB[@]}" cmake --build "$BUILD" --target train_gpt -j1 >/dev/null

OUT=$BUILD/measure_recompute
mkdir -p "$OUT/run/build"
ln -sfn "$ROOT/data" "$OUT/run/data"  # train_gpt reads data/corpus/ and caches its profile in build/ of its folder
TRAIN=$ROOT/$BUILD/examples/train_gpt
MODEL=(--layers "$LAYERS" --hidden "$HIDDEN" --heads "$HEADS")
if [[ -n "${PROFILE:-}" ]]; then
  PROFILE_FILE=$(realpath "$PROFILE")
else
  PROFILE_FILE=$ROOT/$OUT/run/build/train_gpt_profile_p1.json
  TRAIN_SUM=$(sha256sum "$TRAIN" | cut -d' ' -f1)
  [[ "$(cat "$PROFILE_FILE.train_gpt.sha256" 2>/dev/null)" == "$TRAIN_SUM" ]] || rm -f "$PROFILE_FILE"
  if [[ ! -f "$PROFILE_FILE" ]]; then
    echo "calibrating this machine on 1 thread rank (Release train_gpt) ..." >&2
    (cd "$OUT/run" && "$TRAIN" --ranks 1 "${MODEL[@]}" --steps 1 --min-len "$LEN" --max-len "$LEN" \
      --cap-mib 1000000 >/dev/null)
    echo "$TRAIN_SUM" > "$PROFILE_FILE.train_gpt.sha256"
  fi
fi
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
for ((r = 1; r <= ROUNDS; ++r)); do
  for mode in none full; do
    (cd "$OUT/run" && "$TRAIN" --mesh "pp=$PP" "${MODEL[@]}" --steps "$STEPS" --min-len "$LEN" --max-len "$LEN" \
      --pack-tokens $((LEN * MICRO)) --micro-batch 1 --recompute "$mode" --cap-mib 1000000 \
      --profile "$PROFILE_FILE" --csv "$ROOT/$OUT/${mode}_r$r.csv") > "$OUT/${mode}_r$r.log"
  done
done
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)
/usr/bin/python3 - "$OUT" "$ROUNDS" "$WARMUP" "$LOAD_START" "$LOAD_END" "$PROFILE_FILE" <<'PY'
import csv, re, statistics, sys
out, rounds, warmup, load_start, load_end, profile = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7]
def step_median(mode, r):
    rows = list(csv.DictReader(open(f"{out}/{mode}_r{r}.csv")))[warmup:]
    return statistics.median(float(row["seconds"]) for row in rows)
def predicted(mode):
    m = re.search(r"predicted time per plan\s+([0-9.eE+-]+) s", open(f"{out}/{mode}_r1.log").read())
    if not m: sys.exit(f"measure_recompute.sh: no predicted time in {out}/{mode}_r1.log")
    return float(m.group(1))
print(f"--recompute full against none (profile {profile}); load average {load_start} before, {load_end} after")
print("| round | none s/step | full s/step | full/none |\n|---|---|---|---|")
ratios = []
for r in range(1, rounds + 1):
    none, full = step_median("none", r), step_median("full", r)
    ratios.append(full / none)
    print(f"| {r} | {none:.4f} | {full:.4f} | {full / none:.3f} |")
p_none, p_full = predicted("none"), predicted("full")
print(f"measured full/none: median {statistics.median(ratios):.3f} (spread {min(ratios):.3f}..{max(ratios):.3f} over "
      f"{rounds} rounds); predicted {p_full / p_none:.3f} ({p_full:.4f} s / {p_none:.4f} s per plan)")
PY
