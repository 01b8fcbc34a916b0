#!/usr/bin/env bash
# scripts/search_then_run.sh: search, then run (issue 26, item 4). On this machine's calibrated profile (train_gpt's,
# for RANKS thread ranks, calibrated by $BUILD's own train_gpt, so at its -O level: $BUILD/train_gpt_profile_p<RANKS>.json)
# the search (search_parallel) ranks the configurations of a small train_gpt model on RANKS devices; the best ones
# train_gpt can run are emitted (search_parallel --config ... --emit FILE) and run (train_gpt --mesh-file FILE), and
# their measured step times are printed beside the predictions: the median of the steps after the first, their spread
# (min..max), and the cores the run got (its CPU time over its wall time: other work on the machine takes the rest).
#
# The cluster is one node of RANKS devices on CORES cores (default: nproc): the profile's device (compute rates,
# memory, calibrated in each thread's own CPU time) and its intra-node link (launch, step latency, bus and
# point-to-point bandwidth; with EMULATE, search_parallel --emulate replaces them as train_gpt paces them); cores_per_node = CORES, so the model
# runs the ranks' work in turn (search/cluster.hpp's serialisation). The model prices fp32 (train_gpt's CPU
# precision). Peak FLOP/s (for MFU only) is the profile's GEMM rate.
#
#   scripts/search_then_run.sh                        (from the repository root; programs from $BUILD, default build-test)
#   BUILD=build-rel RANKS=8 LAYERS=4 HIDDEN=256 HEADS=8 SEQ=256 BATCH=16 STEPS=6 TOP=3 GAP=0.15 scripts/search_then_run.sh
#   EMULATE=h100 scripts/search_then_run.sh          (links priced and paced as train_gpt --emulate h100)
#   CONFIGS="dp=2,pp=2,cp=2,micro_batch=8,recompute=none;dp=2,cp=4,micro_batch=8" scripts/search_then_run.sh
#                                                     (these configurations too, as search_parallel --config takes
#                                                      them, ';' apart, after the search's TOP; TOP=0: these alone)
#
# Which configurations run: the search's ranking from the best, skipping any whose mesh (dp, pp, cp, tp) already ran
# (the ZeRO stages of one mesh predict within a fraction of a percent) and any predicted less than GAP (a fraction)
# slower than the last one run, so that the TOP that run differ by more than the noise of a shared machine (GAP=0:
# the plain ranking). A configuration the trainer refuses (an axis or knob it cannot run yet) is listed with
# train_gpt's reason and skipped; the next takes its place, up to the search's SEARCHED best.
#
# The baseline in the same run ("before"): each configuration also scored as the search priced it before the launch
# term (its emitted file with the links' launch_s and p2p_bytes_per_s dropped, trainer megatron, cp_gathers_weights
# off: config_before_<rank>.json).
source "$(dirname "$0")/common.sh"
BUILD=${BUILD:-build-test}
RANKS=${RANKS:-8}
LAYERS=${LAYERS:-4}
HIDDEN=${HIDDEN:-128}
HEADS=${HEADS:-8}
SEQ=${SEQ:-256}
BATCH=${BATCH:-16}
STEPS=${STEPS:-6}
TOP=${TOP:-3}
CONFIGS=${CONFIGS:-}
SPACE=${SPACE:-4d}
SEARCHED=${SEARCHED:-1000}  # search_parallel --top at most 1000
GAP=${GAP:-0.15}
CORES=${CORES:-$(nproc)}
EMULATE=${EMULATE:-}
WORK=${WORK:-$BUILD/search_then_run${EMULATE:+_$EMULATE}}
train=$BUILD/examples/train_gpt
search=$BUILD/examples/search_parallel
require_built "$train"
require_built "$search"
case $EMULATE in ""|a100|h100|h200) ;; *) fail "EMULATE=$EMULATE; expected a100, h100, h200 or empty";; esac
[[ $GAP =~ ^[0-9]*\.?[0-9]+$ ]] || fail "GAP=$GAP; expected a fraction such as 0.15"
positive_integers CORES
[[ $TOP =~ ^[0-9]+$ ]] || fail "TOP=$TOP; expected a count such as 3 (0: CONFIGS alone)"
IFS=';' read -r -a given <<< "$CONFIGS"
[[ $TOP -gt 0 || ${#given[@]} -gt 0 ]] || fail "TOP=0 and no CONFIGS: nothing to run"
mkdir -p "$WORK"
model_flags=(--layers "$LAYERS" --hidden "$HIDDEN" --heads "$HEADS")
data_flags=(--steps $((STEPS * BATCH)) --min-len "$SEQ" --max-len "$SEQ" --pack-tokens $((SEQ * BATCH)) --cap-mib 4096)
emulate_flags=()
[[ -z $EMULATE ]] || emulate_flags=(--emulate "$EMULATE")

# 1. This machine's profile for RANKS thread ranks, calibrated by this build's train_gpt (its -O level) and kept in
# $BUILD. train_gpt caches what it calibrates in build/ under its working folder: calibrate in a folder of our own.
profile=$(cd "$BUILD" && pwd)/train_gpt_profile_p$RANKS.json
if [[ ! -f $profile ]]; then
  corpus=$PWD/build/sotu
  if [[ ! -d $corpus ]]; then  # the bundled corpus, extracted by a run on a built-in profile (no calibration)
    "$train" "${model_flags[@]}" --profile A100-SXM4-80GB-x8 --steps 1 --min-len "$SEQ" --max-len "$SEQ" > "$WORK/extract.log"
  fi
  echo "calibrating $RANKS thread ranks with $train (kept in $profile) ..."
  rm -rf "$WORK/calibrate" && mkdir -p "$WORK/calibrate"
  exe=$(cd "$(dirname "$train")" && pwd)/$(basename "$train")
  (cd "$WORK/calibrate" && "$exe" --ranks "$RANKS" "${model_flags[@]}" --steps 1 --min-len "$SEQ" \
    --max-len "$SEQ" --corpus "$corpus" > calibrate.log)
  cp "$WORK/calibrate/build/train_gpt_profile_p$RANKS.json" "$profile.tmp" && mv "$profile.tmp" "$profile"
fi

# train_gpt reads its profile from build/ under its working folder (--emulate takes no --profile): the same one, so
# that the trainer's planner and the search price with one calibration.
mkdir -p build
[[ $profile -ef build/train_gpt_profile_p$RANKS.json ]] || cp "$profile" "build/train_gpt_profile_p$RANKS.json"

# 2. The cluster of RANKS such devices, and train_gpt's model as a config.json.
python3 - "$profile" "$RANKS" "$LAYERS" "$HIDDEN" "$HEADS" "$WORK" "$CORES" <<'EOF'
import json, os, sys
profile_path, ranks, layers, hidden, heads, work, cores = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:6]), sys.argv[6], int(sys.argv[7])
profile = json.load(open(profile_path))
peak = profile["gemm"]["flops_per_s"]
for choice in profile.get("gemm_engines", []):
    if choice.get("size_class") == "large":
        peak = choice["cblas_flops_per_s"] if choice["engine"] == "cblas" else choice["fallback_flops_per_s"]
link = profile["intra_node"]
cluster = {"name": f"this-machine-{ranks}-threads", "source": f"calibrated: {profile_path}",
           "peak_flops_per_s": peak, "device": profile, "cores_per_node": cores,
           "levels": [{"name": "threads", "domain_devices": 0, "alpha_s": link["step_latency_s"],
                       "bytes_per_s": link["bus_bytes_per_s"], "launch_s": link["launch_s"],
                       "p2p_bytes_per_s": link["p2p_bytes_per_s"]}]}
json.dump(cluster, open(f"{work}/cluster.json.tmp", "w"), indent=1)
os.replace(f"{work}/cluster.json.tmp", f"{work}/cluster.json")
model = {"_name_or_path": "train_gpt", "num_hidden_layers": layers, "hidden_size": hidden,
         "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": hidden // heads,
         "intermediate_size": 4 * hidden, "vocab_size": 256, "hidden_act": "gelu", "tie_word_embeddings": False}
json.dump(model, open(f"{work}/model.json.tmp", "w"), indent=1)
os.replace(f"{work}/model.json.tmp", f"{work}/model.json")
EOF
# train_gpt's step as it runs: tp inside cp gathers each sublayer's weights over cp (MegatronRing's unified shards),
# the gradients reduced per packed tensor after the backward, the loss and peak memory over every rank.
trainer_flags=(--trainer train_gpt --cp-gathers-weights)
setup=(--model "$WORK/model.json" --cluster "$WORK/cluster.json" --devices "$RANKS" --seq "$SEQ" --global-batch "$BATCH"
       --precision fp32 "${emulate_flags[@]}" "${trainer_flags[@]}")

# 3. The search's ranking: "rank|configuration|predicted step".
"$search" "${setup[@]}" --space "$SPACE" --top "$SEARCHED" > "$WORK/search.txt"
mapfile -t ranked < <(awk '$1 ~ /^[0-9]+$/ && $2 ~ /^dp=/ {print $1 "|" $2 " " $3 " " $4 " " $5 " " $6 " " $7 " " $8 " " $9 " " $10 " " $11 "|" $12}' "$WORK/search.txt")
[[ ${#ranked[@]} -gt 0 ]] || { echo "search_then_run.sh: the search found nothing (see $WORK/search.txt)" >&2; exit 1; }

# "dp=8 pp=1 cp=1 tp=1x2 ep=1 etp=1 zero=0 mb=2 v=1 rc=none" as --config text.
config_text() {
  local dp pp cp tp ep etp zero mb v rc
  read -r dp pp cp tp ep etp zero mb v rc <<< "$1"
  local tpx=${tp#tp=}; local tx=${tpx%x*} ty=${tpx#*x}
  echo "${dp},${pp},${cp},tp_x=${tx},tp_y=${ty},${ep},${etp},${zero},micro_batch=${mb#mb=},virtual_stages=${v#v=},recompute=${rc#rc=}"
}
load() { cut -d' ' -f1 /proc/loadavg; }

# 4. Emit, predict (--score, 4 digits) and run the best TOP the trainer accepts, one per mesh, GAP apart; then CONFIGS.
rows=()
refused=()
ran_ranks=()
# run_one RANK LABEL TEXT: emit, score and run the configuration TEXT (--config form) as RANK, LABEL in the tables.
# Sets `predicted`; returns 0 when it ran, 1 when train_gpt refused it, 2 when the run failed for every configuration.
run_one() {
  local rank=$1 config=$2 text=$3
  local file=$WORK/config_$rank.json
  "$search" "${setup[@]}" --config "$text" --emit "$file" > "$WORK/score_$rank.txt"
  predicted=$(awk '$1 == "step" {print $2; exit}' "$WORK/score_$rank.txt")
  python3 - "$file" "$WORK/config_before_$rank.json" <<'EOF'
import json, sys
f = json.load(open(sys.argv[1]))
for level in f["cluster"]["levels"]:
    level.pop("launch_s", None)
    level.pop("p2p_bytes_per_s", None)
f["trainer"], f["cp_gathers_weights"] = "megatron", False
json.dump(f, open(sys.argv[2], "w"), indent=1)
EOF
  "$search" --score "$WORK/config_before_$rank.json" --precision fp32 > "$WORK/score_before_$rank.txt"
  local before log csv load_before load_after reason measured
  before=$(awk '$1 == "step" {print $2; exit}' "$WORK/score_before_$rank.txt")
  log=$WORK/run_$rank.log
  csv=$WORK/run_$rank.csv
  rm -f "$csv"
  load_before=$(load)
  if ! /usr/bin/time -f "%e %U %S" -o "$WORK/time_$rank.txt" "$train" "${model_flags[@]}" "${data_flags[@]}" \
       "${emulate_flags[@]}" --mesh-file "$file" --csv "$csv" > "$log" 2>&1; then
    reason=$(grep -m1 -o 'mesh-file [^:]*: .*' "$log" | sed 's/^mesh-file [^:]*: //; s/ \[train_mesh.hpp.*//' || true)
    if [[ -z $reason ]]; then  # not this configuration: the run itself (a flag the mesh cannot take, a failure)
      reason=$(grep -m1 '^train_gpt: ' "$log" | sed 's/^train_gpt: //' || true)
      refused+=("$(printf '%3s  %-60s  %s' "$rank" "$config" "${reason:-failed, see $log}") (every configuration)")
      return 2
    fi
    refused+=("$(printf '%3s  %-60s  %s' "$rank" "$config" "$reason")")
    return 1
  fi
  load_after=$(load)
  measured=$(python3 - "$csv" "$predicted" "$WORK/time_$rank.txt" "$load_before" "$load_after" "$before" <<'EOF'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
times = [float(r["seconds"]) for r in rows[1:]] or [float(r["seconds"]) for r in rows]  # the first step warms up
med = statistics.median(times)
pred = float(sys.argv[2])
wall, user, system = map(float, open(sys.argv[3]).read().split()[-3:])
cores = (user + system) / wall if wall > 0 else 0.0  # the cores the whole run got, on average
before = float(sys.argv[6])
print(f"{before:10.4f}  {med / before:11.2f}  {pred:10.4f}  {med:10.4f}  {min(times):8.4f}..{max(times):<8.4f}  {len(times):5d}  {med / pred:9.2f}  {cores:5.2f}  {sys.argv[4]:>5}..{sys.argv[5]:<5}")
EOF
)
  rows+=("$(printf '%3s  %-60s  %s' "$rank" "$config" "$measured")")
  ran_ranks+=("$rank")
}
ran=0
last=""
declare -A mesh_ran=()
for entry in "${ranked[@]}"; do
  [[ $ran -lt $TOP ]] || break
  IFS='|' read -r rank config step <<< "$entry"
  read -r dp pp cp tp _ <<< "$config"
  [[ -z ${mesh_ran["$dp $pp $cp $tp"]:-} ]] || continue
  if [[ -n $last ]] && ! awk -v s="$step" -v l="$last" -v g="$GAP" 'BEGIN { exit !(s >= l * (1 + g)) }'; then continue; fi
  status=0
  run_one "$rank" "$config" "$(config_text "$config")" || status=$?
  [[ $status -ne 2 ]] || break
  [[ $status -eq 0 ]] || continue
  ran=$((ran + 1))
  last=$predicted
  mesh_ran["$dp $pp $cp $tp"]=1
done
# CONFIGS: each given configuration as c1, c2, ... (its search rank, where the ranking has it, in the label).
for i in "${!given[@]}"; do
  text=${given[$i]}
  [[ -n $text ]] || continue
  status=0
  run_one "c$((i + 1))" "$text" "$text" || status=$?
  [[ $status -ne 2 ]] || break
done

profile_name=$(python3 -c "import json,sys; p=json.load(open(sys.argv[1])); print(p.get('name',''))" "$profile")
echo
echo "search, then run: train_gpt ${model_flags[*]} on $RANKS thread ranks, $BATCH rows of $SEQ tokens per step${EMULATE:+, links emulated as $EMULATE}"
echo "profile $profile ($profile_name); search space $SPACE, fp32; one configuration per mesh, each predicted at least"
echo "$GAP slower than the one before; step times in seconds (measured: median of steps 1..$((STEPS - 1)), min..max)"
echo "the profile times each rank's own work (thread CPU time); the cluster puts the $RANKS ranks on $CORES cores"
echo "(cores_per_node), so the prediction runs their work in turn; 'cores' is what the run got (CPU time / wall time,"
echo "$(nproc) on this machine when nothing else runs); 'load' is the 1-minute load average before..after the run"
printf '%3s  %-60s  %10s  %11s  %10s  %10s  %-18s  %5s  %9s  %5s  %s\n' "#" "configuration (search's rank)" "before" "meas/before" "predicted" "measured" "spread" "steps" "meas/pred" "cores" "load"
for r in "${rows[@]}"; do echo "$r"; done
# The stage group's picks per sublayer: the search's (search_parallel --score, the same in every dense layer) beside
# what train_gpt's planner ran in each layer of its first step (its table's plan column).
echo
echo "stage-group picks (attention/mlp): the search's, and train_gpt's per layer in step 0"
for rank in "${ran_ranks[@]}"; do
  predicted_pick=$(awk '$1 == "stage" && $2 == "group" {for (i = 1; i <= NF; i++) if ($i == "picks") {print $(i + 1); exit}}' "$WORK/score_$rank.txt")
  ran_pick=$(awk -v n="$LAYERS" '$1 == "0" && NF >= 3 + n {s = $4; for (i = 5; i < 4 + n; i++) s = s " " $i; print s; exit}' "$WORK/run_$rank.log")
  printf '%3s  search %-12s train_gpt %s\n' "$rank" "${predicted_pick:-(none: no stage group)}" "${ran_pick:-?}"
done
if [[ ${#refused[@]} -gt 0 ]]; then
  echo
  echo "ranked higher but refused by train_gpt (not trainable yet):"
  for r in "${refused[@]}"; do echo "$r"; done
fi
echo
echo "(files: $WORK: cluster.json, model.json, search.txt, config_<rank>.json, score_<rank>.txt, run_<rank>.log/csv, time_<rank>.txt)"
