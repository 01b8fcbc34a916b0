#!/usr/bin/env bash
# scripts/zero3_prefetch.sh: train_gpt's step time with ZeRO-3's gathers a layer ahead (--zero3-prefetch on) against
# each waited for where it is posted (off), alternated ROUNDS times on the same steps, links paced as EMULATE's.
# Prints each run's median step time (the first, warm-up step left out) and the on/off ratio of the medians.
#
#   scripts/zero3_prefetch.sh                    (build-rel/examples/train_gpt, dp=4 --zero 3 --emulate h100)
#
# Environment: BUILD (default build-rel), MESH (default dp=4), EMULATE (default h100), ROUNDS (default 3), STEPS
# (default 6; STEPS x dp documents, dp rows a step), MODEL (default "--layers 4 --hidden 256 --heads 4"), LENGTH (default 512; rows of that many tokens,
# one per replica per step).
source "$(dirname "$0")/common.sh"
BUILD=${BUILD:-build-rel}
MESH=${MESH:-dp=4}
EMULATE=${EMULATE:-h100}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-6}
LENGTH=${LENGTH:-512}
read -r -a model <<<"${MODEL:---layers 4 --hidden 256 --heads 4}"
train=$BUILD/examples/train_gpt
positive_integers ROUNDS STEPS LENGTH
require_built "$train"
dp=$(sed -n 's/.*dp=\([0-9]*\).*/\1/p' <<<"$MESH")
work=$BUILD/zero3_prefetch
mkdir -p "$work"
echo "load average before: $(cat /proc/loadavg)"
for round in $(seq 1 "$ROUNDS"); do
  for switch in on off; do
    csv=$work/${switch}_$round.csv
    "$train" "${model[@]}" --mesh "$MESH" --zero 3 --zero3-prefetch "$switch" --emulate "$EMULATE" --steps $((STEPS * ${dp:-1})) \
      --min-len "$LENGTH" --max-len "$LENGTH" --pack-tokens $((LENGTH * ${dp:-1})) --cap-mib 4096 --csv "$csv" \
      > "$work/${switch}_$round.log"
    median=$(python3 -c 'import csv,statistics,sys; r=list(csv.DictReader(open(sys.argv[1]))); print("%.3f" % statistics.median(float(x["seconds"]) for x in r[1:]))' "$csv")
    echo "round $round  --zero3-prefetch $switch  median step ${median} s"
    echo "$switch $median" >> "$work/medians.txt.$$"
  done
done
python3 - "$work/medians.txt.$$" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    switch, s = line.split()
    runs.setdefault(switch, []).append(float(s))
for switch, xs in runs.items():
    print(f"{switch}: median of rounds {statistics.median(xs):.3f} s (min {min(xs):.3f}, max {max(xs):.3f})")
print(f"off / on: {statistics.median(runs['off']) / statistics.median(runs['on']):.2f}x")
PY
rm -f "$work/medians.txt.$$"
echo "load average after: $(cat /proc/loadavg)"

# The search's prediction of both (search_parallel --score, trainer train_gpt, the links as --emulate paces them), on
# the profile train_gpt calibrated for these ranks (build/train_gpt_profile_p<ranks>.json, made by the runs above).
search=$BUILD/examples/search_parallel
ranks=$(python3 -c 'import re,sys,math; print(math.prod(int(x) for x in re.findall(r"=(\d+)", sys.argv[1])))' "$MESH")
profile=build/train_gpt_profile_p$ranks.json
if [[ -x $search && -f $profile ]]; then
  python3 - "$profile" "$work" "$ranks" "$(nproc)" "$LENGTH" "$MESH" "${model[@]}" <<'PY'
import json, re, sys
profile_path, work, ranks, cores, length, mesh = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
flags = dict(zip(sys.argv[7::2], map(int, sys.argv[8::2])))
layers, hidden, heads = flags["--layers"], flags["--hidden"], flags["--heads"]
profile = json.load(open(profile_path))
link = profile["intra_node"]
cluster = {"name": f"this-machine-{ranks}-threads", "peak_flops_per_s": profile["gemm"]["flops_per_s"], "device": profile,
           "cores_per_node": cores, "levels": [{"name": "threads", "domain_devices": 0, "alpha_s": link["step_latency_s"],
           "bytes_per_s": link["bus_bytes_per_s"], "launch_s": link["launch_s"], "p2p_bytes_per_s": link["p2p_bytes_per_s"]}]}
model = {"_name_or_path": "train_gpt", "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
         "num_key_value_heads": heads, "head_dim": hidden // heads, "intermediate_size": 4 * hidden, "vocab_size": 256,
         "hidden_act": "gelu", "tie_word_embeddings": False}
json.dump(cluster, open(f"{work}/cluster.json", "w"), indent=1)
json.dump(model, open(f"{work}/model.json", "w"), indent=1)
axes = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", mesh)}
dp = axes.get("dp", 1)
for switch in (True, False):
    config = {"format": "paradyse.parallel_config/1", "model": "model.json", "cluster": "cluster.json", "devices": ranks,
              "seq": length, "global_batch": dp, "trainer": "train_gpt", **axes, "zero": 3, "micro_batch": 1,
              "zero3_prefetch": switch}
    json.dump(config, open(f"{work}/config_{'on' if switch else 'off'}.json", "w"), indent=1)
PY
  for switch in on off; do
    echo "predicted, --zero3-prefetch $switch:"
    "$search" --score "$work/config_$switch.json" --precision fp32 --emulate "$EMULATE" | grep -iE "step|dp" | head -4
  done
else
  echo "(no prediction: $search or $profile missing)"
fi
