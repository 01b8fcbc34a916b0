#!/usr/bin/env bash
# scripts/validate_trainer.sh: the training-side simulation against measured training steps on this machine (issue 25).
#
# plan_trace (the planner's time model: every strategy's dry-run trace costed on a hardware profile) predicts the
# step time of train_gpt's byte-level GPT for each static strategy and for the exact planner's plan; train_gpt then
# runs the same steps on thread ranks with that strategy (or that planner). Both use the same profile: this machine's,
# calibrated by the Release train_gpt on the same thread ranks (or PROFILE=FILE.json). The table, per length and
# strategy: predicted s, measured median s (min..max) of the steps after the first (a warm-up), in the slowest rank's
# thread CPU time (what the profile's rates are measured in: waits block and do not count) and in wall time, and
# the ratios predicted / measured. The load average at the start and at the end says how shared the cores were (on
# a machine whose cores other processes use, wall time holds the time a rank waited for a core; CPU time does not).
# The baseline in the same run: plan_trace on the same profile without the terms added since (fresh memory, scalar
# math: the profile's "fresh_memory" and "scalar_math" removed) and without the work outside the stack (no --vocab),
# i.e. the time model as it was before them ("before" columns).
#
#   scripts/validate_trainer.sh                      # Release build in build-rel (through /work/bin/pbuild if there)
#   LENGTHS="1024 4096" STEPS=6 RANKS=2 scripts/validate_trainer.sh
#   PROFILE=FILE.json scripts/validate_trainer.sh    # plan with a given profile instead of calibrating
#   RECALIBRATE=1 scripts/validate_trainer.sh        # calibrate again (else the cached one of an earlier run)
#   SKIP_BUILD=1 scripts/validate_trainer.sh         # run the binaries in $BUILD as they are (no build step)
#
# Environment: BUILD (build folder, default build-rel), LENGTHS (tokens per step, default "1024 2048"), STEPS (steps
# per strategy and length, default 5; the first is not counted), RANKS (default 2), HIDDEN/HEADS/LAYERS (the GPT,
# default 128/4/4), STRATEGIES (default "MegatronTS MegatronCZ UlyssesZ ColossalZ METP dynamic"). Output files go to
# $BUILD/validate_trainer/ (the per-run CSVs of both programs and table.md).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD=${BUILD:-build-rel}
LENGTHS=${LENGTHS:-"1024 2048"}
STEPS=${STEPS:-5}
RANKS=${RANKS:-2}
HIDDEN=${HIDDEN:-128}
HEADS=${HEADS:-4}
LAYERS=${LAYERS:-4}
STRATEGIES=${STRATEGIES:-"MegatronTS MegatronCZ UlyssesZ ColossalZ METP dynamic"}
PB=()
[[ -x /work/bin/pbuild ]] && PB=(/work/bin/pbuild)  # the shared machine's build slots

fail() { echo "validate_trainer.sh: $*" >&2; exit 2; }
[[ "$STEPS" =~ ^[0-9]+$ && "$STEPS" -ge 2 ]] || fail "STEPS=$STEPS: expected an integer >= 2 (the first step is a warm-up)"
[[ "$RANKS" =~ ^[0-9]+$ && "$RANKS" -ge 1 ]] || fail "RANKS=$RANKS: expected a positive integer"
for l in $LENGTHS; do [[ "$l" =~ ^[0-9]+$ ]] || fail "LENGTHS: '$l' is not a positive integer"; done
for s in $STRATEGIES; do
  case "$s" in MegatronTS|MegatronCZ|UlyssesZ|ColossalZ|METP|dynamic) ;;
    *) fail "STRATEGIES: '$s' is not one of MegatronTS MegatronCZ UlyssesZ ColossalZ METP dynamic" ;; esac
done

if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
  "${PB[@]}" cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPARADYSE_BUILD_TESTS=OFF \
    -DPARADYSE_BUILD_BENCH=OFF -DPARADYSE_ENABLE_CUDA=OFF -DPARADYSE_ENABLE_MPI=OFF >/dev/null
fi
grep -q '^CMAKE_BUILD_TYPE:STRING=Release$' "$BUILD/CMakeCache.txt" || fail "$BUILD is not a Release build folder"
[[ "${SKIP_BUILD:-0}" == 1 ]] || "${PB[@]}" cmake --build "$BUILD" --target train_gpt plan_trace -j2 >/dev/null

OUT=$BUILD/validate_trainer
mkdir -p "$OUT/run/build"
ln -sfn "$ROOT/data" "$OUT/run/data"  # train_gpt reads data/corpus/ and caches its profile in build/ of its folder
TRAIN=$ROOT/$BUILD/examples/train_gpt
PLAN=$ROOT/$BUILD/examples/plan_trace
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
MODEL=(--layers "$LAYERS" --hidden "$HIDDEN" --heads "$HEADS")

# The profile: given, or calibrated once by this train_gpt on RANKS thread ranks (cached in $OUT/run/build/).
if [[ -n "${PROFILE:-}" ]]; then
  PROFILE_FILE=$(realpath "$PROFILE")
else
  PROFILE_FILE=$ROOT/$OUT/run/build/train_gpt_profile_p$RANKS.json
  [[ "${RECALIBRATE:-0}" == 1 ]] && rm -f "$PROFILE_FILE"
  if [[ ! -f "$PROFILE_FILE" ]]; then
    echo "calibrating this machine on $RANKS thread ranks (Release train_gpt) ..." >&2
    (cd "$OUT/run" && "$TRAIN" --ranks "$RANKS" "${MODEL[@]}" --steps 1 --min-len 256 --max-len 256 \
      --cap-mib 1000000 >/dev/null)
  fi
fi

# The baseline's profile: the same rates without the terms added since.
/usr/bin/python3 - "$PROFILE_FILE" "$OUT/profile_before.json" <<'EOF'
import json, sys
profile = json.load(open(sys.argv[1]))
for key in ("fresh_memory", "scalar_math"):
    profile.pop(key, None)
json.dump(profile, open(sys.argv[2], "w"), indent=1)
EOF

for L in $LENGTHS; do
  echo "$L" >"$OUT/lengths_$L.txt"
  "$PLAN" --profile "$PROFILE_FILE" --lengths "$OUT/lengths_$L.txt" --p "$RANKS" "${MODEL[@]}" --causal --rope \
    --dtype fp32 --budget-gib 1000 --vocab 256 --csv "$OUT/plan_$L.csv" >"$OUT/plan_$L.txt"
  "$PLAN" --profile "$OUT/profile_before.json" --lengths "$OUT/lengths_$L.txt" --p "$RANKS" "${MODEL[@]}" --causal \
    --rope --dtype fp32 --budget-gib 1000 --csv "$OUT/plan_before_$L.csv" >"$OUT/plan_before_$L.txt"
  for S in $STRATEGIES; do
    strategy=()
    [[ "$S" != dynamic ]] && strategy=(--strategy "$S")
    echo "measuring $S at $L tokens ($STEPS steps) ..." >&2
    (cd "$OUT/run" && "$TRAIN" --ranks "$RANKS" "${MODEL[@]}" --steps "$STEPS" --min-len "$L" --max-len "$L" \
      --cap-mib 1000000 --profile "$PROFILE_FILE" "${strategy[@]}" --csv "$ROOT/$OUT/train_${S}_$L.csv" \
      >"$ROOT/$OUT/train_${S}_$L.txt")
  done
done
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

/usr/bin/python3 - "$OUT" "$LENGTHS" "$STRATEGIES" "$LOAD_START" "$LOAD_END" "$PROFILE_FILE" "$RANKS" <<'EOF' | tee "$OUT/table.md"
import csv, statistics, sys
out, lengths, strategies, load_start, load_end, profile, ranks = sys.argv[1:8]
variant = {s: s for s in strategies.split()}
variant["dynamic"] = "exact, uncached"  # the exact planner on the step's own cost table, as train_gpt plans
print(f"plan_trace against train_gpt on {ranks} thread ranks (profile {profile}); load average "
      f"{load_start} at the start, {load_end} at the end")
print()
print("| length | strategy | before: predicted s | before: pred / CPU | predicted s | train_gpt's prediction s "
      "| measured CPU s median (min..max) | pred / CPU | within 10% | measured wall s median (min..max) | pred / wall "
      "| AdamW CPU s |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for length in lengths.split():
    plan = {r["variant"]: r for r in csv.DictReader(open(f"{out}/plan_{length}.csv"))}
    before = {r["variant"]: r for r in csv.DictReader(open(f"{out}/plan_before_{length}.csv"))}
    for s in strategies.split():
        rows = [r for r in csv.DictReader(open(f"{out}/train_{s}_{length}.csv")) if r["status"] == "ok"][1:]
        if not rows:
            print(f"| {length} | {s} | - | - | - | - | no step ran (see {out}/train_{s}_{length}.txt) | | | | | |")
            continue
        predicted = float(plan[variant[s]]["time_s"])
        baseline = float(before[variant[s]]["time_s"])
        own = statistics.median(float(r["predicted_s"]) for r in rows)
        cpu = [float(r["cpu_s"]) for r in rows]
        wall = [float(r["seconds"]) for r in rows]
        adamw = statistics.median(float(r["optimizer_cpu_s"]) for r in rows)
        mc, mw = statistics.median(cpu), statistics.median(wall)
        within = "yes" if abs(predicted / mc - 1) <= 0.10 else "no"
        print(f"| {length} | {s} | {baseline:.4f} | {baseline / mc:.2f} | {predicted:.4f} | {own:.4f} | "
              f"{mc:.4f} ({min(cpu):.4f}..{max(cpu):.4f}) | {predicted / mc:.2f} | {within} | "
              f"{mw:.4f} ({min(wall):.4f}..{max(wall):.4f}) | {predicted / mw:.2f} | {adamw:.4f} |")
EOF
