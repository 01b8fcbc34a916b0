#!/usr/bin/env bash
# scripts/search_then_run.sh: search, then run (issue 26, item 4). On this machine's calibrated profile (train_gpt's,
# for RANKS thread ranks: build/train_gpt_profile_p<RANKS>.json, calibrated first if missing) the search
# (search_parallel) ranks the configurations of a small train_gpt model on RANKS devices; the best ones train_gpt can
# run are emitted (search_parallel --config ... --emit FILE) and run (train_gpt --mesh-file FILE), and their measured
# step times are printed beside the predictions: the median of the steps after the first, and their spread (min..max).
#
# The cluster is one level of RANKS devices: the profile's device (compute rates, memory) and its intra-node link
# (ring step latency, bus bandwidth); peak FLOP/s (for MFU only) is the profile's GEMM rate.
#
#   scripts/search_then_run.sh                        (from the repository root; programs from $BUILD, default build-test)
#   BUILD=build RANKS=8 LAYERS=4 HIDDEN=128 HEADS=8 SEQ=256 BATCH=16 STEPS=6 TOP=3 SPACE=4d scripts/search_then_run.sh
#
# A configuration the trainer refuses (an axis or knob it cannot run yet) is listed with train_gpt's reason and skipped;
# the next of the search's ranking takes its place, up to the search's SEARCHED best.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-test}
RANKS=${RANKS:-8}
LAYERS=${LAYERS:-4}
HIDDEN=${HIDDEN:-128}
HEADS=${HEADS:-8}
SEQ=${SEQ:-256}
BATCH=${BATCH:-16}
STEPS=${STEPS:-6}
TOP=${TOP:-3}
SPACE=${SPACE:-4d}
SEARCHED=${SEARCHED:-40}
WORK=${WORK:-$BUILD/search_then_run}
train=$BUILD/examples/train_gpt
search=$BUILD/examples/search_parallel
for exe in "$train" "$search"; do
  [[ -x $exe ]] || { echo "search_then_run.sh: $exe is not built (cmake --build $BUILD --target train_gpt search_parallel)" >&2; exit 2; }
done
mkdir -p "$WORK"
model_flags=(--layers "$LAYERS" --hidden "$HIDDEN" --heads "$HEADS")
data_flags=(--steps $((STEPS * BATCH)) --min-len "$SEQ" --max-len "$SEQ" --pack-tokens $((SEQ * BATCH)) --cap-mib 4096)

# 1. This machine's profile for RANKS thread ranks (train_gpt calibrates and caches it).
profile=build/train_gpt_profile_p$RANKS.json
if [[ ! -f $profile ]]; then
  echo "calibrating $RANKS thread ranks (train_gpt caches $profile) ..."
  "$train" --ranks "$RANKS" "${model_flags[@]}" --steps 1 --min-len "$SEQ" --max-len "$SEQ" > "$WORK/calibrate.log"
fi

# 2. The cluster of RANKS such devices, and train_gpt's model as a config.json.
python3 - "$profile" "$RANKS" "$LAYERS" "$HIDDEN" "$HEADS" "$WORK" <<'EOF'
import json, sys
profile_path, ranks, layers, hidden, heads, work = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:6]), sys.argv[6]
profile = json.load(open(profile_path))
peak = profile["gemm"]["flops_per_s"]
for choice in profile.get("gemm_engines", []):
    if choice.get("size_class") == "large":
        peak = choice["cblas_flops_per_s"] if choice["engine"] == "cblas" else choice["fallback_flops_per_s"]
link = profile["intra_node"]
cluster = {"name": f"this-machine-{ranks}-threads", "source": f"calibrated: {profile_path}",
           "peak_flops_per_s": peak, "device": profile,
           "levels": [{"name": "threads", "domain_devices": 0, "alpha_s": link["step_latency_s"],
                       "bytes_per_s": link["bus_bytes_per_s"]}]}
json.dump(cluster, open(f"{work}/cluster.json", "w"), indent=1)
model = {"_name_or_path": "train_gpt", "num_hidden_layers": layers, "hidden_size": hidden,
         "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": hidden // heads,
         "intermediate_size": 4 * hidden, "vocab_size": 256, "hidden_act": "gelu", "tie_word_embeddings": False}
json.dump(model, open(f"{work}/model.json", "w"), indent=1)
EOF
setup=(--model "$WORK/model.json" --cluster "$WORK/cluster.json" --devices "$RANKS" --seq "$SEQ" --global-batch "$BATCH")

# 3. The search's ranking.
"$search" "${setup[@]}" --space "$SPACE" --top "$SEARCHED" > "$WORK/search.txt"
mapfile -t ranked < <(awk '$1 ~ /^[0-9]+$/ && $2 ~ /^dp=/ {print $1 "|" $2 " " $3 " " $4 " " $5 " " $6 " " $7 " " $8 " " $9 " " $10 " " $11}' "$WORK/search.txt")
[[ ${#ranked[@]} -gt 0 ]] || { echo "search_then_run.sh: the search found nothing (see $WORK/search.txt)" >&2; exit 1; }

# "dp=8 pp=1 cp=1 tp=1x2 ep=1 etp=1 zero=0 mb=2 v=1 rc=none" as --config text.
config_text() {
  local dp pp cp tp ep etp zero mb v rc
  read -r dp pp cp tp ep etp zero mb v rc <<< "$1"
  local tpx=${tp#tp=}; local tx=${tpx%x*} ty=${tpx#*x}
  echo "${dp},${pp},${cp},tp_x=${tx},tp_y=${ty},${ep},${etp},${zero},micro_batch=${mb#mb=},virtual_stages=${v#v=},recompute=${rc#rc=}"
}

# 4. Emit, predict (--score, 4 digits) and run the best TOP the trainer accepts.
rows=()
refused=()
ran=0
for entry in "${ranked[@]}"; do
  [[ $ran -lt $TOP ]] || break
  rank=${entry%%|*}
  config=${entry#*|}
  file=$WORK/config_$rank.json
  "$search" "${setup[@]}" --config "$(config_text "$config")" --emit "$file" > "$WORK/score_$rank.txt"
  predicted=$(awk '$1 == "step" {print $2; exit}' "$WORK/score_$rank.txt")
  log=$WORK/run_$rank.log
  csv=$WORK/run_$rank.csv
  rm -f "$csv"
  if ! "$train" "${model_flags[@]}" "${data_flags[@]}" --mesh-file "$file" --csv "$csv" > "$log" 2>&1; then
    reason=$(grep -m1 -o 'mesh-file [^:]*: .*' "$log" | sed 's/^mesh-file [^:]*: //; s/ \[train_mesh.hpp.*//' || true)
    refused+=("$(printf '%3s  %-60s  %s' "$rank" "$config" "${reason:-failed, see $log}")")
    continue
  fi
  ran=$((ran + 1))
  measured=$(python3 - "$csv" "$predicted" "$RANKS" "$(nproc)" <<'EOF'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
times = [float(r["seconds"]) for r in rows[1:]] or [float(r["seconds"]) for r in rows]  # the first step warms up
med = statistics.median(times)
pred, ranks, cores = float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
shared = pred * max(1.0, ranks / cores)  # the ranks' threads time-share the cores
print(f"{pred:10.4f}  {shared:12.4f}  {med:10.4f}  {min(times):8.4f}..{max(times):<8.4f}  {len(times):5d}  {med / pred:9.2f}  {med / shared:9.2f}")
EOF
)
  rows+=("$(printf '%3s  %-60s  %s' "$rank" "$config" "$measured")")
done

profile_name=$(python3 -c "import json,sys; p=json.load(open(sys.argv[1])); print(p.get('name',''))" "$profile")
echo
echo "search, then run: train_gpt ${model_flags[*]} on $RANKS thread ranks, $BATCH rows of $SEQ tokens per step"
echo "profile $profile ($profile_name); search space $SPACE; step times in seconds (measured: median of steps 1..$((STEPS - 1)), min..max)"
echo "the profile is calibrated in each thread's CPU time (cost/calibrate.hpp), so a prediction is the time of $RANKS devices of"
echo "their own; here the $RANKS threads share $(nproc) cores (and whatever else runs): 'x ranks/cores' scales it by $RANKS/$(nproc)"
printf '%3s  %-60s  %10s  %12s  %10s  %-18s  %5s  %9s  %9s\n' "#" "configuration (search's rank)" "predicted" "x ranks/cores" "measured" "spread" "steps" "meas/pred" "meas/x"
for r in "${rows[@]}"; do echo "$r"; done
if [[ ${#refused[@]} -gt 0 ]]; then
  echo
  echo "ranked higher but refused by train_gpt (not trainable yet):"
  for r in "${refused[@]}"; do echo "$r"; done
fi
echo
echo "(files: $WORK: cluster.json, model.json, search.txt, config_<rank>.json, run_<rank>.log/csv)"
