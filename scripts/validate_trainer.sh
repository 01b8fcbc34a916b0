#!/usr/bin/env bash
# scripts/validate_trainer.sh: the training-side simulation against measured training steps on this machine (issue 25).
#
# plan_trace (the planner's time model: every strategy's dry-run trace costed on a hardware profile) predicts the
# step time of train_gpt's byte-level GPT for each static strategy and for the exact planner's plan; train_gpt then
# runs the same steps on thread ranks with that strategy (or that planner). Both use the same profile: this machine's,
# calibrated by the Release train_gpt on the same thread ranks (or PROFILE=FILE.json). The table, per length and
# strategy: predicted s, measured median s (min..max) of the steps after the warm-up ones, in the slowest rank's
# thread CPU time (what the profile's rates are measured in: waits block and do not count) and in wall time, and
# the ratios predicted / measured. The load average at the start and at the end says how shared the cores were (on
# a machine whose cores other processes use, wall time holds the time a rank waited for a core; CPU time does not).
#
# The machine's speed. Every measured run probes it before its first step and after its last (train_gpt --speed-probe
# on: the profile's compute-bound GEMM shapes timed as calibrated, measured / the profile's price; cost/speed_probe.hpp),
# and the "@speed" column compares each round with the prediction times its run's mean probe (the median over the
# rounds): on this shared machine the calibration and the runs minutes later can see cores 10-25% apart in speed.
# The step probe: the machine's speed on a whole training step. Before the first run and after every run, train_gpt
# runs PROBE_STEPS steps of MegatronTS at PROBE_LEN tokens (default 16 at 512, about 0.5 s) on the same profile, and the
# probe reads its median counted step's CPU time over plan_trace's prediction of it; the "@steps" column compares each
# round with the prediction times the mean of the probes either side of its run (the median over the rounds). The GEMM
# probe times only GEMMs; a slow spell on this VM (stop 53: every row under together, the GEMM probe up to 1.48) also
# moves the memory-bound terms. Why 16: a probe's median resists a spell shorter than half its steps; with 6 (stop 54)
# two probes read short spells (one had four of its five counted steps at 0.05 s against 0.03) between runs that ran
# at 0.88-0.97 of their price, and moved 4 rows of 12 outside at the probes' speed. PROBE_STEPS=0: no step probe (and
# none on a GPU).
# The noise beside the error. Every strategy is measured ROUNDS times (a round runs every length and strategy, the
# rounds one after another, so a burst of load elsewhere falls on one round of a row, not on all of it): the table
# gives the median over every counted step of every round, the step spread ((max - min) / median of those steps) and
# the run-to-run spread ((largest - smallest round median) / median). An error inside the run-to-run spread is not
# resolved by this machine at that moment.
# The allocation state: train_gpt keeps freed host memory for reuse (core/host_malloc.hpp: allocations below 32 MiB
# from the C library's heap, reused step after step; from 32 MiB new pages), in its calibration and its steps alike,
# and empties its buffer pool before every step (the time model's assumption; its refill is priced once a step).
# The baseline in the same run ("before" columns): plan_trace on the same profile without the terms added since
# (the profile's keys in NEW_TERMS removed), i.e. the time model as it was before them; by default the last one,
# attention priced on the whole tiles the kernel computes (attention_whole_tiles), so "before" prices the visible
# pairs. A profile this script calibrates must have that term on (train_gpt asks for it); the table says whether
# the profile used has it.
#
#   scripts/validate_trainer.sh                      # Release build in build-rel (through /work/bin/pbuild if there)
#   LENGTHS="1024 4096" STEPS=6 RANKS=2 scripts/validate_trainer.sh
#   PROFILE=FILE.json scripts/validate_trainer.sh    # plan with a given profile instead of calibrating
#   RECALIBRATE=1 scripts/validate_trainer.sh        # calibrate again (else the cached one, if the same train_gpt calibrated it)
#   SKIP_BUILD=1 scripts/validate_trainer.sh         # run the binaries in $BUILD as they are (no build step)
#   BACKEND=mpi BUILD=build-mpi scripts/validate_trainer.sh  # one rank per process under mpirun (an MPI build)
#   DEVICE=cuda BUILD=build-gpu scripts/validate_trainer.sh  # on one GPU (a CUDA build; issue 25's single-GPU check)
#   DEVICE=cuda EXPERTS=8 TOP_K=2 BUILD=build-gpu scripts/validate_trainer.sh  # the MoE GPT on one GPU
#
# On a GPU (DEVICE=cuda): train_gpt --device cuda on RANKS cuda_local ranks (default 1), its profile calibrated on the
# GPU by that train_gpt (cost/calibrate.hpp over ops::Cuda, wall-clock time, the model's own GEMM shapes); the
# measured column is the step's wall time (a GPU's work is not the host thread's CPU time), no speed probe (it times
# host GEMMs), the bound 15% (the issue's for a GPU), and the "before" columns the datasheet's profile (BEFORE_PROFILE,
# default H200-SXM-141GB-x8) instead of the profile without NEW_TERMS.
# The MoE GPT (EXPERTS=E > 0, TOP_K=K, DEVICE=cuda only: its runs report wall time alone): plan_trace is dense, so the
# prediction is train_gpt's own, the MoE planner's time of each step's plan on the same profile (the CSV's
# predicted_s, plan/moe_plan.hpp); the strategy is the planner's ("dynamic"); no "before" columns. Its files go to
# $BUILD/validate_trainer_moe/.
#
# Environment: BUILD (build folder, default build-rel), LENGTHS (tokens per step, default "1024 2048"), STEPS (steps
# per strategy, length and round, default 8), WARMUP (first steps of each run not counted, default 1), ROUNDS
# (default 2), RANKS (default 2), HIDDEN/HEADS/LAYERS (the GPT, default 128/4/4), STRATEGIES (default "MegatronTS
# MegatronCZ UlyssesZ ColossalZ METP dynamic"), NEW_TERMS (profile keys the baseline drops, default
# "attention_whole_tiles"), MALLOC_TUNABLES (GLIBC_TUNABLES of every process, default none; train_gpt's own malloc
# settings replace the mmap and trim thresholds), BACKEND (threads, default, or mpi: train_gpt --backend mpi under
# mpirun -np RANKS, calibrated on those MPI ranks; BUILD must then be a Release build with PARADYSE_ENABLE_MPI=ON,
# configured so when absent). Output files go to $BUILD/validate_trainer/ (the per-run CSVs of both programs and
# table.md).
# Under MPI a rank waiting in a collective spins (OpenMPI's progress loop, the shared-memory window's polling): its
# thread CPU time holds its waits, so the CPU columns read as wall time on cores of their own.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD=${BUILD:-build-rel}
LENGTHS=${LENGTHS:-"1024 2048"}
STEPS=${STEPS:-8}
WARMUP=${WARMUP:-1}
ROUNDS=${ROUNDS:-2}
PROBE_LEN=${PROBE_LEN:-512}
PROBE_STEPS=${PROBE_STEPS:-16}
DEVICE=${DEVICE:-cpu}
EXPERTS=${EXPERTS:-0}
TOP_K=${TOP_K:-2}
if [[ "$DEVICE" == cuda ]]; then  # one GPU: a single rank by default, where every strategy is the same computation
  RANKS=${RANKS:-1}
  STRATEGIES=${STRATEGIES:-MegatronTS}
fi
if [[ "$EXPERTS" =~ ^[0-9]+$ && "$EXPERTS" -gt 0 ]]; then STRATEGIES=dynamic; fi  # the MoE planner's steps
RANKS=${RANKS:-2}
HIDDEN=${HIDDEN:-128}
HEADS=${HEADS:-4}
LAYERS=${LAYERS:-4}
STRATEGIES=${STRATEGIES:-"MegatronTS MegatronCZ UlyssesZ ColossalZ METP dynamic"}
NEW_TERMS=${NEW_TERMS:-"attention_whole_tiles"}
MALLOC_TUNABLES=${MALLOC_TUNABLES-}
BACKEND=${BACKEND:-threads}
BEFORE_PROFILE=${BEFORE_PROFILE:-H200-SXM-141GB-x8}
PYTHON=/usr/bin/python3
[[ -x $PYTHON ]] || PYTHON=python3  # a GPU machine's image may keep its Python elsewhere
PB=()
[[ -x /work/bin/pbuild ]] && PB=(/work/bin/pbuild)  # the shared machine's build slots

fail() { echo "validate_trainer.sh: $*" >&2; exit 2; }
[[ "$WARMUP" =~ ^[0-9]+$ ]] || fail "WARMUP=$WARMUP: expected a non-negative integer (steps not counted)"
[[ "$STEPS" =~ ^[0-9]+$ && "$STEPS" -gt "$WARMUP" ]] ||
  fail "STEPS=$STEPS: expected an integer above WARMUP=$WARMUP (the first WARMUP steps of a run are not counted)"
[[ "$ROUNDS" =~ ^[0-9]+$ && "$ROUNDS" -ge 1 ]] || fail "ROUNDS=$ROUNDS: expected a positive integer"
[[ "$PROBE_LEN" =~ ^[0-9]+$ && "$PROBE_LEN" -ge 1 ]] || fail "PROBE_LEN=$PROBE_LEN: expected a positive integer"
[[ "$PROBE_STEPS" =~ ^[0-9]+$ && ( "$PROBE_STEPS" == 0 || "$PROBE_STEPS" -gt "$WARMUP" ) ]] ||
  fail "PROBE_STEPS=$PROBE_STEPS: expected 0 (no step probe) or an integer above WARMUP=$WARMUP"
[[ "$RANKS" =~ ^[0-9]+$ && "$RANKS" -ge 1 ]] || fail "RANKS=$RANKS: expected a positive integer"
for l in $LENGTHS; do [[ "$l" =~ ^[0-9]+$ ]] || fail "LENGTHS: '$l' is not a positive integer"; done
for s in $STRATEGIES; do
  case "$s" in MegatronTS|MegatronCZ|UlyssesZ|ColossalZ|METP|dynamic) ;;
    *) fail "STRATEGIES: '$s' is not one of MegatronTS MegatronCZ UlyssesZ ColossalZ METP dynamic" ;; esac
done
[[ "$BACKEND" == threads || "$BACKEND" == mpi ]] || fail "BACKEND=$BACKEND: expected threads or mpi"
[[ "$DEVICE" == cpu || "$DEVICE" == cuda ]] || fail "DEVICE=$DEVICE: expected cpu or cuda"
[[ "$DEVICE" == cpu || "$BACKEND" == threads ]] || fail "DEVICE=cuda runs cuda_local ranks: BACKEND must be threads"
[[ "$EXPERTS" =~ ^[0-9]+$ && "$TOP_K" =~ ^[0-9]+$ ]] || fail "EXPERTS=$EXPERTS TOP_K=$TOP_K: expected integers"
if ((EXPERTS > 0)); then
  [[ "$DEVICE" == cuda ]] || fail "EXPERTS=$EXPERTS: the MoE validation runs on a GPU (DEVICE=cuda): its runs report wall time only"
fi
export GLIBC_TUNABLES=$MALLOC_TUNABLES
# How train_gpt runs its ranks: RANKS threads in one process, or one process per rank under mpirun.
LAUNCH=()
RANK_FLAGS=(--ranks "$RANKS")
MPI_SETTING=OFF
PROFILE_TAG=
if [[ "$BACKEND" == mpi ]]; then
  command -v mpirun >/dev/null || fail "BACKEND=mpi: mpirun not found (OpenMPI)"
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # as root, mpirun asks for both
  LAUNCH=(mpirun -np "$RANKS" --oversubscribe)
  RANK_FLAGS+=(--backend mpi)
  MPI_SETTING=ON
  PROFILE_TAG=mpi_
fi
PROBE=(--speed-probe on)
if [[ "$DEVICE" == cuda ]]; then
  RANK_FLAGS+=(--device cuda)
  PROFILE_TAG=cuda_h${HIDDEN}_  # train_gpt's cache name for a GPU's profile (its model's GEMM shapes)
  PROBE=()
  PROBE_STEPS=0
fi
((EXPERTS > 0)) && PROBE_STEPS=0

if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
  "${PB[@]}" cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPARADYSE_BUILD_TESTS=OFF \
    -DPARADYSE_BUILD_BENCH=OFF -DPARADYSE_ENABLE_CUDA=OFF -DPARADYSE_ENABLE_MPI=$MPI_SETTING >/dev/null
fi
grep -q '^CMAKE_BUILD_TYPE:STRING=Release$' "$BUILD/CMakeCache.txt" || fail "$BUILD is not a Release build folder"
[[ "${SKIP_BUILD:-0}" == 1 ]] || "${PB[@]}" cmake --build "$BUILD" --target train_gpt plan_trace -j1 >/dev/null
# An MPI run needs a train_gpt linked with MPI (the binary says, whatever the cache kept from an earlier configure).
[[ "$BACKEND" == threads ]] || ldd "$BUILD/examples/train_gpt" 2>/dev/null | grep -q 'libmpi' ||
  fail "BACKEND=mpi: $BUILD/examples/train_gpt is not linked with MPI (configure $BUILD with PARADYSE_ENABLE_MPI=ON; e.g. BUILD=build-mpi)"
if [[ "$DEVICE" == cuda ]] && ! ldd "$BUILD/examples/train_gpt" 2>/dev/null | grep -q 'libcublas'; then
  fail "DEVICE=cuda: $BUILD/examples/train_gpt is not built with CUDA (configure $BUILD with PARADYSE_ENABLE_CUDA=ON; e.g. BUILD=build-gpu)"
fi

OUT=$BUILD/validate_trainer
((EXPERTS > 0)) && OUT=$BUILD/validate_trainer_moe
mkdir -p "$OUT/run/build"
ln -sfn "$ROOT/data" "$OUT/run/data"  # train_gpt reads data/corpus/ and caches its profile in build/ of its folder
TRAIN=$ROOT/$BUILD/examples/train_gpt
PLAN=$ROOT/$BUILD/examples/plan_trace
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
MODEL=(--layers "$LAYERS" --hidden "$HIDDEN" --heads "$HEADS")
((EXPERTS > 0)) && MODEL+=(--experts "$EXPERTS" --top-k "$TOP_K")

# The profile: given, or calibrated once by this train_gpt on RANKS ranks of BACKEND (cached in $OUT/run/build/, with the
# checksum of the train_gpt that calibrated it: a rebuilt train_gpt recalibrates, so a cached profile never lacks the
# terms a newer build measures).
if [[ -n "${PROFILE:-}" ]]; then
  PROFILE_FILE=$(realpath "$PROFILE")
else
  PROFILE_FILE=$ROOT/$OUT/run/build/train_gpt_profile_${PROFILE_TAG}p$RANKS.json  # train_gpt's own cache name
  CALIBRATED_BY=$PROFILE_FILE.train_gpt.sha256
  TRAIN_SUM=$(sha256sum "$TRAIN" | cut -d' ' -f1)
  if [[ "${RECALIBRATE:-0}" == 1 || "$(cat "$CALIBRATED_BY" 2>/dev/null)" != "$TRAIN_SUM" ]]; then
    rm -f "$PROFILE_FILE"
  fi
  if [[ ! -f "$PROFILE_FILE" ]]; then
    if [[ "$DEVICE" == cuda ]]; then echo "calibrating the GPU on $RANKS cuda_local ranks (Release train_gpt) ..." >&2
    else echo "calibrating this machine on $RANKS $BACKEND ranks (Release train_gpt) ..." >&2; fi
    (cd "$OUT/run" && "${LAUNCH[@]}" "$TRAIN" "${RANK_FLAGS[@]}" "${MODEL[@]}" --steps 1 --min-len 256 --max-len 256 \
      --cap-mib 1000000 >/dev/null)
    echo "$TRAIN_SUM" > "$CALIBRATED_BY"
  fi
fi

# The baseline's profile: the same rates without the terms added since. A calibrated profile has whole tiles on.
$PYTHON - "$PROFILE_FILE" "$OUT/profile_before.json" "$NEW_TERMS" "${PROFILE:-}" "$DEVICE" <<'PY'
import json, sys
profile = json.load(open(sys.argv[1]))
if not sys.argv[4] and sys.argv[5] == "cpu" and profile.get("attention_whole_tiles") is not True:
    sys.exit(f"validate_trainer.sh: {sys.argv[1]} was calibrated without attention_whole_tiles (train_gpt asks for it)")
for key in sys.argv[3].split():
    profile.pop(key, None)
json.dump(profile, open(sys.argv[2], "w"), indent=1)
PY
WHOLE_TILES=$($PYTHON -c \
  'import json, sys; print("on" if json.load(open(sys.argv[1])).get("attention_whole_tiles") else "off")' "$PROFILE_FILE")

for L in $LENGTHS; do
  ((EXPERTS > 0)) && break  # plan_trace plans the dense GPT: the MoE steps carry their planner's prediction
  echo "$L" >"$OUT/lengths_$L.txt"
  for variant in "" _before; do
    profile=$PROFILE_FILE
    [[ -n "$variant" ]] && profile=$OUT/profile_before.json
    [[ -n "$variant" && "$DEVICE" == cuda ]] && profile=$BEFORE_PROFILE  # the datasheet's rates
    "$PLAN" --profile "$profile" --lengths "$OUT/lengths_$L.txt" --p "$RANKS" "${MODEL[@]}" --causal --rope \
      --dtype fp32 --budget-gib 1000 --vocab 256 --csv "$OUT/plan${variant}_$L.csv" >"$OUT/plan${variant}_$L.txt"
  done
done
# The step probe's reference step, predicted, and one probe run (its steps in $OUT/step_probe_N.csv).
PROBES=0
if ((PROBE_STEPS > 0)); then
  echo "$PROBE_LEN" >"$OUT/lengths_probe.txt"
  "$PLAN" --profile "$PROFILE_FILE" --lengths "$OUT/lengths_probe.txt" --p "$RANKS" "${MODEL[@]}" --causal --rope \
    --dtype fp32 --budget-gib 1000 --vocab 256 --csv "$OUT/plan_probe.csv" >"$OUT/plan_probe.txt"
fi
step_probe() {
  ((PROBE_STEPS > 0)) || return 0
  (cd "$OUT/run" && "${LAUNCH[@]}" "$TRAIN" "${RANK_FLAGS[@]}" "${MODEL[@]}" --steps "$PROBE_STEPS" \
    --min-len "$PROBE_LEN" --max-len "$PROBE_LEN" --cap-mib 1000000 --profile "$PROFILE_FILE" --strategy MegatronTS \
    --csv "$ROOT/$OUT/step_probe_$PROBES.csv" >/dev/null)
  PROBES=$((PROBES + 1))
}
rm -f "$OUT"/step_probe_*.csv "$OUT/step_probe_runs.txt"
step_probe
for R in $(seq 1 "$ROUNDS"); do
  for L in $LENGTHS; do
    for S in $STRATEGIES; do
      strategy=()
      [[ "$S" != dynamic ]] && strategy=(--strategy "$S")
      echo "round $R: measuring $S at $L tokens ($STEPS steps) ..." >&2
      (cd "$OUT/run" && "${LAUNCH[@]}" "$TRAIN" "${RANK_FLAGS[@]}" "${MODEL[@]}" --steps "$STEPS" --min-len "$L" --max-len "$L" \
        --cap-mib 1000000 --profile "$PROFILE_FILE" "${strategy[@]}" "${PROBE[@]}" \
        --csv "$ROOT/$OUT/train_${S}_${L}_r$R.csv" >"$ROOT/$OUT/train_${S}_${L}_r$R.txt")
      # The probes either side of this run.
      ((PROBE_STEPS > 0)) && echo "$S $L $R $((PROBES - 1)) $PROBES" >>"$OUT/step_probe_runs.txt"
      step_probe
    done
  done
done
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

$PYTHON - "$OUT" "$LENGTHS" "$STRATEGIES" "$LOAD_START" "$LOAD_END" "$PROFILE_FILE" "$RANKS" "$ROUNDS" \
  "$WARMUP" "$GLIBC_TUNABLES" "$WHOLE_TILES" "$NEW_TERMS" "$BACKEND" "$DEVICE" "$BEFORE_PROFILE" "$EXPERTS" "$TOP_K" \
  "$PROBE_STEPS" "$PROBE_LEN" <<'PY' | tee "$OUT/table.md"
import csv, statistics, sys
out, lengths, strategies, load_start, load_end, profile, ranks, rounds, warmup, tunables, whole_tiles, new_terms, \
    backend, device, before_profile, experts, top_k, probe_steps, probe_len = sys.argv[1:20]
moe = int(experts) > 0  # the MoE GPT: its planner's own prediction (no plan_trace, no "before")
rounds, warmup = int(rounds), int(warmup)
# On a GPU the step's wall time is what the profile prices (measured in wall-clock time), within the issue's 15%.
gpu = device == "cuda"
key, clock, bound = ("seconds", "wall", 0.15) if gpu else ("cpu_s", "CPU", 0.10)
variant = {s: s for s in strategies.split()}
variant["dynamic"] = "exact, uncached"  # the exact planner on the step's own cost table, as train_gpt plans
kind = "cuda_local" if gpu else "thread" if backend == "threads" else "MPI"
print(f"{f'the MoE GPT ({experts} experts, top-{top_k}): its planner' if moe else 'plan_trace'} against train_gpt on "
      f"{ranks} {kind} ranks (profile {profile}; GLIBC_TUNABLES={tunables or '-'}); "
      f"{rounds} round(s), the first {warmup} step(s) of each run not counted; load average {load_start} at the "
      f"start, {load_end} at the end; attention on whole tiles: {whole_tiles}; before: "
      f"{'-' if moe else 'the datasheet profile ' + before_profile if gpu else 'without ' + new_terms}")
print()
print(f"| length | strategy | before: predicted s | before: pred / {clock} | predicted s | measured {clock} s median "
      f"(min..max) | step spread | round medians s | run-to-run | pred / {clock} | within {bound:.0%} | speed (probes) "
      f"| @speed: pred / {clock} | within {bound:.0%} @speed | measured wall s median | pred / wall | AdamW CPU s "
      f"| step probes | @steps: pred / {clock} | within {bound:.0%} @steps |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
def probes(path):  # train_gpt --speed-probe on: measured / priced before the steps and after them
    found = [float(line.rsplit(" ", 1)[1]) for line in open(path) if line.startswith("speed probe ")]
    if len(found) != 2:
        sys.exit(f"validate_trainer.sh: {path} holds {len(found)} speed probe lines, expected 2 (before, after)")
    return found
# The step probe (PROBE_STEPS > 0): each probe's median counted step over plan_trace's price of it, and the two
# probes either side of each run.
step_probe, probes_of_run = [], {}
if int(probe_steps) > 0:
    priced = float({r["variant"]: r for r in csv.DictReader(open(f"{out}/plan_probe.csv"))}["MegatronTS"]["time_s"])
    for line in open(f"{out}/step_probe_runs.txt"):
        s, length, k, before_run, after_run = line.split()
        probes_of_run[(s, length, int(k))] = (int(before_run), int(after_run))
    for n in range(max(b for _, b in probes_of_run.values()) + 1):
        steps = [float(r[key]) for r in csv.DictReader(open(f"{out}/step_probe_{n}.csv"))
                 if r.get("status", "ok") == "ok" and r["length"] == probe_len][warmup:]
        if not steps:
            sys.exit(f"validate_trainer.sh: step probe {n} ({out}/step_probe_{n}.csv) has no counted step")
        step_probe.append(statistics.median(steps) / priced)
for length in lengths.split():
    if not moe:
        plan = {r["variant"]: r for r in csv.DictReader(open(f"{out}/plan_{length}.csv"))}
        before = {r["variant"]: r for r in csv.DictReader(open(f"{out}/plan_before_{length}.csv"))}
    for s in strategies.split():
        # A document shorter than the length runs as a shorter step (the corpus has a few): not this row's.
        runs = [[r for r in csv.DictReader(open(f"{out}/train_{s}_{length}_r{k}.csv"))
                 if r.get("status", "ok") == "ok" and r["length"] == length][warmup:] for k in range(1, rounds + 1)]
        if not all(runs):
            print(f"| {length} | {s} | no counted step in some round (see {out}/train_{s}_{length}_r*.txt) |")
            continue
        rows = [r for run in runs for r in run]
        own = statistics.median(float(r["predicted_s"]) for r in rows)
        predicted = own if moe else float(plan[variant[s]]["time_s"])
        baseline = None if moe else float(before[variant[s]]["time_s"])
        if abs(own / predicted - 1) > 1e-6:  # not the same cost table: the comparison would mean nothing
            print(f"| {length} | {s} | train_gpt predicted {own:.4f} s, plan_trace {predicted:.4f} s |")
            continue
        cpu = [float(r[key]) for r in rows]
        wall = [float(r["seconds"]) for r in rows]
        adamw = statistics.median(float(r.get("optimizer_cpu_s") or 0) for r in rows)  # (the MoE runs: none)
        mc, mw = statistics.median(cpu), statistics.median(wall)
        medians = [statistics.median(float(r[key]) for r in run) for run in runs]
        within = "yes" if abs(predicted / mc - 1) <= bound else "no"
        # Each round against the prediction at the speed its run's probes measured (their mean): the median ratio.
        # (no probe on a GPU: its speed is taken as calibrated)
        speeds = [1.0 if gpu else statistics.mean(probes(f"{out}/train_{s}_{length}_r{k}.txt"))
                  for k in range(1, rounds + 1)]
        at_speed = statistics.median(predicted * v / m for v, m in zip(speeds, medians))
        within_at_speed = "yes" if abs(at_speed - 1) <= bound else "no"
        steps_cells = "- | - | -"
        if step_probe:  # as @speed, at the mean of the step probes either side of each round's run
            factors = [statistics.mean(step_probe[n] for n in probes_of_run[(s, length, k)])
                       for k in range(1, rounds + 1)]
            at_steps = statistics.median(predicted * v / m for v, m in zip(factors, medians))
            steps_cells = (f"{' / '.join(f'{v:.2f}' for v in factors)} | {at_steps:.2f} | "
                           f"{'yes' if abs(at_steps - 1) <= bound else 'no'}")
        before_cells = "- | -" if baseline is None else f"{baseline:.4f} | {baseline / mc:.2f}"
        print(f"| {length} | {s} | {before_cells} | {predicted:.4f} | "
              f"{mc:.4f} ({min(cpu):.4f}..{max(cpu):.4f}) | {(max(cpu) - min(cpu)) / mc:.0%} | "
              f"{' / '.join(f'{m:.4f}' for m in medians)} | {(max(medians) - min(medians)) / mc:.0%} | "
              f"{predicted / mc:.2f} | {within} | {' / '.join(f'{v:.2f}' for v in speeds)} | {at_speed:.2f} | "
              f"{within_at_speed} | {mw:.4f} | {predicted / mw:.2f} | {adamw:.4f} | {steps_cells} |")
PY
