#!/usr/bin/env bash
# scripts/seed_report.sh: the seed's setting (issue 26's report; Hypertron, SC'25: 2,048 accelerators, a sparse 141B and
# a dense 310B): for each model x cluster x sequence length, the best configuration of the full (7-D) space against
# the best of the 3-D (dp, tp, pp) space, predicted by search_parallel, as a Markdown table.
#
#   scripts/seed_report.sh                   (from anywhere; search_parallel from $BUILD, default build-test)
#   SEARCH=path/to/search_parallel DEVICES=2048 SETTINGS="4096:1024 32768:128" scripts/seed_report.sh
#
# Models: data/model_shapes/mixtral-8x22b.json, data/model_shapes/dense-310b.json. Clusters: data/clusters/
# ascend-910c-supernode.json, data/clusters/dgx-h100.json (each file's "source" says which figures are published and
# which assumed). SETTINGS: sequence length:sequences per step, one pair per setting (both defaults: 4M tokens a step).
# Each row: the space, its best configuration (the mesh dp x pp x cp x tp_x x tp_y is the device count; ep and etp are
# folded over it), predicted step time, MFU (causal attention counted as the half square), memory per device, the
# search's own time, and for 7d the gain over 3d (3d step time / 7d step time). The 3-D space keeps the knobs Megatron-LM
# has (ZeRO 0-3, recomputation, interleaved stages, micro-batch size; experts sharded like the dense layers, etp = tp);
# the 7-D space adds cp, 2-D tp (tp_x x tp_y), ep and an etp of its own.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$root/build-test}
SEARCH=${SEARCH:-$BUILD/examples/search_parallel}
DEVICES=${DEVICES:-2048}
SETTINGS=${SETTINGS:-4096:1024 32768:128}
MODELS=${MODELS:-mixtral-8x22b dense-310b}
CLUSTERS=${CLUSTERS:-ascend-910c-supernode dgx-h100}
[[ -x $SEARCH ]] || { echo "seed_report.sh: SEARCH=$SEARCH is not an executable (cmake --build build-test --target search_parallel)" >&2; exit 2; }

echo "| model | cluster | seq x batch | space | best configuration | step s | MFU | GiB/device | search s | 7d over 3d |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for setting in $SETTINGS; do
  seq=${setting%%:*}
  batch=${setting#*:}
  [[ $seq =~ ^[0-9]+$ && $batch =~ ^[0-9]+$ ]] || { echo "seed_report.sh: SETTINGS entry \"$setting\" is not SEQ:BATCH (two integers)" >&2; exit 2; }
  for model in $MODELS; do
    for cluster in $CLUSTERS; do
      model_file=$root/data/model_shapes/$model.json
      cluster_file=$root/data/clusters/$cluster.json
      for f in "$model_file" "$cluster_file"; do
        [[ -f $f ]] || { echo "seed_report.sh: $f does not exist (MODELS names data/model_shapes/*.json, CLUSTERS data/clusters/*.json)" >&2; exit 2; }
      done
      out=$("$SEARCH" --model "$model_file" --cluster "$cluster_file" --devices "$DEVICES" --seq "$seq" \
        --global-batch "$batch" --space 7d --top 1)
      # "  best in 7d: dp=.. pp=.. cp=.. tp=XxY ep=.. etp=.. zero=.. mb=.. v=.. rc=..  step S s  MFU M%  G GiB  (T s search)  gain over 3d Rx"
      awk -v model="$model" -v cluster="$cluster" -v setting="$seq x $batch" '
        $1 == "best" && $2 == "in" && ($3 == "3d:" || $3 == "7d:") {
          space = substr($3, 1, 2)
          if ($5 == "fits") { printf "| %s | %s | %s | %s | nothing fits | | | | | |\n", model, cluster, setting, space; next }
          config = $4; for (i = 5; i <= 13; ++i) config = config " " $i
          step = $15; mfu = $18; gib = $19; secs = $21; sub(/^\(/, "", secs)
          gain = "-"; if (space == "7d") { for (i = 22; i <= NF; ++i) if ($i == "3d") gain = $(i + 1) }
          printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", model, cluster, setting, space, config, step, mfu, gib, secs, gain
        }' <<< "$out"
    done
  done
done
