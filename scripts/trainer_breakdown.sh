#!/usr/bin/env bash
# scripts/trainer_breakdown.sh: where a train_gpt step's time goes, measured and predicted, by kernel kind (issue 25).
#
# Measured: `perf record` of train_gpt (Release, thread ranks, one strategy, STEPS steps at LENGTH tokens), its
# samples per symbol sorted into kinds (GEMM, attention, materialised softmax, copies and re-layouts, norms,
# elementwise, activations, RoPE, scalar math, AdamW, allocation: memset and the kernel's page faults, collectives,
# planner: the dry runs train_gpt makes to plan each step, other), and each kind's share of the samples of the counted
# steps' rank threads (thread ranks start afresh each step: the RANKS largest threads of every step, the warm-up
# step's left out, as are the main thread's startup and planning) times the median CPU time of those steps.
# Predicted: plan_trace on the same profile with every term but one kind's made free (its rates set to 1e30 or its
# entries to 0), so each column is that kind's share of the prediction as the time model prices it; allocation is the
# whole prediction less the same without its two terms (the pool's misses are priced at the fresh-memory rates).
#
#   PROFILE=build-rel/validate_trainer/run/build/train_gpt_profile_p2.json scripts/trainer_breakdown.sh
#
# Environment: BUILD (default build-rel, built by scripts/validate_trainer.sh), PROFILE (required: the calibrated
# profile both use), LENGTH (default 2048), STEPS (default 4), RANKS (default 2), STRATEGIES (default the five),
# MALLOC_TUNABLES (as validate_trainer.sh). Output: $BUILD/breakdown/ (perf reports, plan CSVs, table.md).
source "$(dirname "$0")/common.sh"
BUILD=${BUILD:-build-rel}
LENGTH=${LENGTH:-2048}
STEPS=${STEPS:-4}
RANKS=${RANKS:-2}
STRATEGIES=${STRATEGIES:-"MegatronTS MegatronCZ UlyssesZ ColossalZ METP"}
export GLIBC_TUNABLES=${MALLOC_TUNABLES-}
[[ -n "${PROFILE:-}" && -f "${PROFILE:-}" ]] || fail "PROFILE='${PROFILE:-}': expected a calibrated profile .json"
positive_integers LENGTH
[[ "$STEPS" =~ ^[0-9]+$ && "$STEPS" -ge 2 ]] || fail "STEPS=$STEPS: expected an integer >= 2"
command -v perf >/dev/null || fail "perf is not installed (linux-perf)"
PROFILE=$(realpath "$PROFILE")
OUT=$BUILD/breakdown
mkdir -p "$OUT/run/build"
ln -sfn "$ROOT/data" "$OUT/run/data"
MODEL=(--layers 4 --hidden 128 --heads 4)
echo "$LENGTH" >"$OUT/lengths.txt"

# Predicted: one profile per kind, every other term free.
/usr/bin/python3 - "$PROFILE" "$OUT" <<'PY'
import copy, json, sys
profile = json.load(open(sys.argv[1]))
FREE = 1e30
def only(kind):
    p = copy.deepcopy(profile)
    if kind != "gemm":
        p["gemm"] = {"overhead_s": 0, "flops_per_s": FREE, "bytes_per_s": 0}
    if kind != "attention":
        p["attention"] = {"overhead_s": 0, "forward_flops_per_s": FREE, "backward_flops_per_s": FREE}
    if kind != "elementwise":
        p["elementwise_bytes_per_s"] = FREE
        p.pop("elementwise_classes", None)
        p.pop("elementwise_families", None)  # a device profile's per-family rates (CPU profiles have none)
    if kind != "activation":  # with scalar math: the materialised softmax's loop has its rate there
        p["activation_elements_per_s"] = FREE
        p.pop("swiglu_forward_elements_per_s", None)
        p.pop("scalar_math", None)
    p.pop("fresh_memory", None)  # allocation: priced apart, below
    p.pop("pool_miss_bytes_per_s", None)
    if kind != "collectives":
        for c in p["collectives"]:
            c["alpha_s"], c["beta_s_per_byte"] = 0, 0
        for link in ("intra_node", "inter_node"):
            p[link] = {"launch_s": 0, "step_latency_s": 0, "bus_bytes_per_s": FREE, "p2p_bytes_per_s": FREE}
    return p
for kind in ("gemm", "attention", "elementwise", "activation", "collectives"):
    json.dump(only(kind), open(f"{sys.argv[2]}/only_{kind}.json", "w"), indent=1)
# Allocation as the whole profile prices it, less the same without it (the pool's misses are priced at the
# fresh-memory rates where the profile has them, so neither term alone prices them).
p = copy.deepcopy(profile)
p.pop("fresh_memory", None)
p.pop("pool_miss_bytes_per_s", None)
json.dump(p, open(f"{sys.argv[2]}/without_allocation.json", "w"), indent=1)
PY
for kind in all gemm attention elementwise activation collectives without_allocation; do
  profile=$OUT/only_$kind.json
  [[ $kind == all ]] && profile=$PROFILE
  [[ $kind == without_allocation ]] && profile=$OUT/$kind.json
  "$BUILD/examples/plan_trace" --profile "$profile" --lengths "$OUT/lengths.txt" --p "$RANKS" "${MODEL[@]}" --causal \
    --rope --dtype fp32 --budget-gib 1000 --vocab 256 --csv "$OUT/plan_$kind.csv" >/dev/null
done

# Measured: perf per strategy.
for S in $STRATEGIES; do
  echo "perf: $S at $LENGTH tokens ($STEPS steps) ..." >&2
  (cd "$OUT/run" && perf record -q -F 1999 -o "$ROOT/$OUT/perf_$S.data" -- "$ROOT/$BUILD/examples/train_gpt" \
    --ranks "$RANKS" "${MODEL[@]}" --steps "$STEPS" --min-len "$LENGTH" --max-len "$LENGTH" --cap-mib 1000000 \
    --profile "$PROFILE" --strategy "$S" --csv "$ROOT/$OUT/train_$S.csv" >/dev/null 2>&1)
  # Samples per thread and symbol (perf's "pid" key is the thread: tid:command).
  perf report -q -i "$OUT/perf_$S.data" --no-children --sort pid,sym --percent-limit 0 --stdio 2>/dev/null \
    >"$OUT/perf_$S.txt"
done

/usr/bin/python3 - "$OUT" "$STRATEGIES" "$LENGTH" "$(cut -d' ' -f1-3 /proc/loadavg)" "$STEPS" "$RANKS" <<'PY' | tee "$OUT/table.md"
import csv, re, statistics, sys
out, strategies, length, load = sys.argv[1:5]
run_steps, ranks = int(sys.argv[5]), int(sys.argv[6])
# Symbol -> kind, first match wins (demangled C++ names of ops/cpu/, OpenBLAS, libc and the kernel).
KINDS = [
    ("planner", r"counting|Counting|DryRun|dry_run|Trace::|trace_cost|cost_of|MemoryWalk|Clock::|build_cost_table|solve_exact|symbolic|Symbolic"),
    ("GEMM", r"sgemm|gemm|GEMM|dgemm|blas_thread|inner_thread|exec_blas"),
    ("attention", r"attention_(forward|backward)|flash|online_softmax|attention_tile|probabilities|softmax_grad|attention_merge"),
    ("softmax (materialised)", r"masked_softmax"),
    ("softmax backward", r"softmax_backward"),  # a stream (ops/counting.hpp): priced with the elementwise kernels
    ("scalar math", r"__expf|expf|__sin|__cos|sincos|__ieee754|__exp1|exp_inline"),
    ("RoPE", r"rope"),
    ("norms", r"layer_norm|rms_norm"),
    ("activations", r"gelu|swiglu|silu|sigmoid"),
    ("AdamW", r"adamw"),
    ("loss and embedding", r"cross_entropy|embedding"),
    ("collectives", r"Communicator|communicator|all_reduce|all_gather|reduce_scatter|all_to_all|shift|barrier|futex|pthread_cond|sched_yield|spin"),
    ("allocation", r"memset|clear_page|page_fault|do_anonymous|handle_mm|mem_cgroup|free_pages|__alloc_pages|get_page|zap_|unmap|mmap|munmap|release_pages|_raw_spin|lru|rmqueue|malloc|free|_int_|sysmalloc|tlb|flush|memcg|charge|folio|pte|vma|alloc_pages|list_del|rcu_read|access_error|p4d_|pud_|pmd_|percpu_counter|mod_node_page|mas_walk"),
    ("copies and re-layouts", r"memcpy|memmove|copy|gather|scatter|transpose|permute|layout|pack|slice|concat|split"),
    ("elementwise", r"add_into|fill|scale|axpy|bias|residual|mask"),
]
def kind_of(sym):
    for name, pattern in KINDS:
        if re.search(pattern, sym):
            return name
    return "other"
names = [k for k, _ in KINDS] + ["other"]
# One row per kind both sides can tell apart: the CPU attention kernels compute their tiles with sgemm calls, so
# GEMM and attention are one row; the predicted kinds are the profile's terms (plan_trace, one priced at a time).
ROWS = [
    ("GEMM + attention", ["GEMM", "attention"], ["gemm", "attention"]),
    ("softmax, activations, scalar math", ["softmax (materialised)", "scalar math", "activations"], ["activation"]),
    ("streams: copies, re-layouts, norms, RoPE, sums, loss, AdamW",
     ["copies and re-layouts", "softmax backward", "norms", "RoPE", "elementwise", "loss and embedding", "AdamW"],
     ["elementwise"]),
    ("allocation: zeroing, page faults, pool misses", ["allocation"], ["allocation"]),
    ("collectives (thread copies and waits)", ["collectives"], ["collectives"]),
    ("other (scheduler, unclassified; not in the model)", ["other"], []),
]
# The counted steps' rank threads: thread ranks start afresh each step, so per step RANKS threads of a step's size
# (other runs of the ranks, at startup, are far smaller), in the order they started (thread ids), the warm-up step's
# left out; not the main thread (startup, planning).
def counted_threads(samples, s, memo={}):
    if s not in memo:
        per_thread = {}
        for thread, percent, _ in samples:
            per_thread[thread] = per_thread.get(thread, 0) + percent
        main = min(per_thread)
        # The run_steps x ranks largest, in the order they started; each must be step-sized (a quarter of the largest).
        largest = sorted((t for t in per_thread if t != main), key=lambda t: -per_thread[t])[:run_steps * ranks]
        big = sorted(t for t in largest if per_thread[t] >= 0.25 * per_thread[largest[0]])
        if len(big) != run_steps * ranks:
            sys.exit(f"trainer_breakdown.sh: {s}: {len(big)} step-sized rank threads, expected {run_steps} x {ranks}")
        memo[s] = set(big[ranks:])
    return memo[s]
def predicted(kind, s):
    if kind == "allocation":  # the pool's misses are priced at the fresh-memory rates: both terms on, then both off
        return predicted("all", s) - predicted("without_allocation", s)
    return float(next(r for r in csv.DictReader(open(f"{out}/plan_{kind}.csv")) if r["variant"] == s)["time_s"])
print(f"Where a step's time goes at {length} tokens, ms: measured (perf samples of the counted steps' rank threads, "
      f"shared out over their median step CPU time) / predicted (plan_trace, one term priced at a time); load average {load}")
print()
header = "| kind | " + " | ".join(strategies.split()) + " |"
print(header)
print("|---" * (len(strategies.split()) + 1) + "|")
cells = {row[0]: [] for row in ROWS}
totals = []
for s in strategies.split():
    samples = []  # (thread, percent, symbol) of train_gpt's threads (not the corpus's tar and xz)
    for line in open(f"{out}/perf_{s}.txt"):
        m = re.match(r"\s*([\d.]+)%\s+(\d+):(\S+)\s+\[[.k]\]\s+(.*)", line)
        if m and m.group(3) == "train_gpt":
            samples.append((int(m.group(2)), float(m.group(1)), m.group(4)))
    shares = {n: 0.0 for n in names}
    for thread, percent, symbol in samples:
        if thread in counted_threads(samples, s):
            shares[kind_of(symbol)] += percent
    total = sum(shares.values())  # of the counted steps' rank threads alone
    shares = {n: x / total for n, x in shares.items()}
    steps = [r for r in csv.DictReader(open(f"{out}/train_{s}.csv")) if r["status"] == "ok" and r["length"] == length][1:]
    cpu = statistics.median(float(r["cpu_s"]) for r in steps)
    step_share = 1 - shares["planner"]
    for label, measured_kinds, predicted_kinds in ROWS:
        meas = sum(cpu * shares[k] / step_share for k in measured_kinds)
        pred = sum(predicted(k, s) for k in predicted_kinds)
        cells[label].append(f"{meas * 1000:.0f} / {pred * 1000:.0f}" if predicted_kinds else f"{meas * 1000:.0f} / -")
    totals.append(f"{cpu * 1000:.0f} / {predicted('all', s) * 1000:.0f} ({predicted('all', s) / cpu:.2f})")
for label, _, _ in ROWS:
    print(f"| {label} | " + " | ".join(cells[label]) + " |")
print("| step: measured / predicted (predicted / measured) | " + " | ".join(totals) + " |")
PY
