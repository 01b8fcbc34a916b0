// examples/plan_trace.cpp: replays a trace of sequence lengths through the cost models and planners.
//
// For each static strategy (every layer on it), the exact planner, ParaDySe's heuristic and the exact planner
// without each strategy in turn, it prints: the total predicted time, the sequences that do not fit, the longest
// length that fits and the planner's own overhead (wall-clock time of its calls, cache included). Then, as the
// paper's Table 5 does (lengths sorted short to long, training stops at the first sequence that does not fit): the
// longest length reached, the time to reach it, the time the full system needs to reach it, and the saving.
//
// Default: the paper's setting by prediction. 8x A100-SXM4-80GB (NVLink), GPT with h = 12288, 96 heads, 8 layers on
// the node, b = 1, bf16, sequence lengths sampled (seeded) from the GitHubCode and GRCh38 distributions of the
// paper's Table 3 (data/lengths/paradyse_table3.csv): a bucket by its probability, then a length uniform within
// it (log-uniform in the open-ended last bucket), at least 64 tokens.
//
// Inputs are read strictly (data/trace_input.hpp): a bad option or file exits 2 naming the flag or the file, line
// and field. A sequence shorter than the group's minimum (a token per chunk: p, or 2p with --causal's zigzag) is
// planned padded to it, as train_gpt runs it (data::padded_length, the one rule both use); a sequence no strategy
// can run (beyond what any plan can hold) is reported with the reason and counts as not fitting; anything else the
// library refuses exits 1 with its message, never an uncaught exception. Settings whose cost tables would take
// minutes per sequence (--batch x --heads x --p, plan/table_work.hpp) are refused up front, naming the flags.
//
// Long traces: progress is redrawn on a terminal; otherwise (a log, a pipe) a progress line goes to stderr every
// --progress-every seconds. --csv rows are written as each sequence is planned, to FILE.tmp.<pid>.<n> beside FILE
// (a killed run leaves them there), and the table is put in place atomically at the end (core/csv_table.hpp).
//
//   plan_trace --help     (the flags, their ranges and defaults: generated from parse() below)
// --csv FILE: every sequence's predicted step time and peak memory per variant (empty when it does not fit), with
// the memory budget: scripts/plot.py draws time per strategy against length with each strategy's memory limit.
#include "paradyse/cli/flags.hpp"
#include "paradyse/cli/model_flags.hpp"
#include "paradyse/core/csv_table.hpp"
#include "paradyse/core/printable.hpp"
#include "paradyse/core/progress.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/gemm_engines.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/cost/profile_json.hpp"
#include "paradyse/data/document_balance.hpp"
#include "paradyse/data/trace_input.hpp"
#include "paradyse/plan/cache.hpp"
#include "paradyse/plan/heuristic.hpp"
#include "paradyse/plan/planner.hpp"
#include "paradyse/plan/table_work.hpp"

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace pd = paradyse;
using Strategy = int;  // an index into the strategy list (cost::default_catalog())

namespace {

struct Options {
  std::string profile = "a100";
  std::string dataset = "all";
  std::string distribution;
  std::string lengths_file;
  int sequences = 3000;
  std::uint64_t seed = 1;
  bool sorted = true;
  pd::cost::ModelShape layer;
  int layers = 8;
  int p = 8;
  std::int64_t batch = 1;
  double budget_gib = -1;
  double gamma = 0.05;
  std::string csv;
  double progress_every = 10;  // seconds between progress lines on stderr when stdout is not a terminal
  std::int64_t vocab = 0;      // > 0: the GPT's head (embedding, LM head, loss, AdamW) is in the step time
};

using paradyse::data::LengthBucket;

// The longest length read from a file (the planner's own limit: longer is beyond what any plan can hold).
constexpr std::int64_t kMaxLength = pd::plan::kMaxPlanLength;

// The usage, generated from the flags in parse() (usage() is also called for bad input files).
std::string& usage_text() {
  static std::string text;
  return text;
}
[[noreturn]] void usage(const std::string& problem) {
  paradyse::cli::print_usage_and_exit("plan_trace", problem, usage_text());
}

Options parse(int argc, char** argv) {
  Options o;
  o.layer.hidden = 12288;
  o.layer.heads = 96;
  o.layer.kv_heads = -1;
  o.layer.head_dim = -1;
  o.layer.ffn = -1;
  o.layer.dtype_bytes = 2;
  paradyse::cli::Flags flags(
      "plan_trace", "Replays a trace of sequence lengths through the cost models and planners: each static strategy, "
                    "the exact planner, ParaDySe's heuristic and the planner without each strategy.");
  flags.text("--profile", o.profile, "hardware profile", "a100|h100|h200|FILE.json")
      .nonempty("a100, h100, h200 or a profile .json");
  flags.text("--dataset", o.dataset, "length distribution of the paper's Table 3", "githubcode|grch38|all")
      .nonempty("githubcode, grch38 or all");
  flags.text("--distribution", o.distribution, "length distribution CSV (default: data/lengths/paradyse_table3.csv)",
             "FILE")
      .nonempty("a length distribution CSV");
  flags.text("--lengths", o.lengths_file, "sequence lengths to replay, one per line (instead of sampling)", "FILE")
      .nonempty("a file of sequence lengths");
  flags.integer("--sequences", o.sequences, 1, 10'000'000, "sequences to sample");
  flags.integer("--seed", o.seed, std::uint64_t(0), std::numeric_limits<std::uint64_t>::max(), "sampling seed");
  flags.choice("--order", o.sorted, "sorted", "random", "replay order");
  flags.integer("--hidden", o.layer.hidden, std::int64_t(1), std::int64_t(1) << 20, "hidden size");
  flags.integer("--heads", o.layer.heads, std::int64_t(1), std::int64_t(1) << 16, "attention heads");
  flags.integer("--kv-heads", o.layer.kv_heads, std::int64_t(1), std::int64_t(1) << 16, "key/value heads (default: --heads)")
      .without_default();
  flags.integer("--head-dim", o.layer.head_dim, std::int64_t(1), std::int64_t(1) << 16,
                "head dimension (default: hidden / heads)")
      .without_default();
  flags.integer("--ffn", o.layer.ffn, std::int64_t(1), std::int64_t(1) << 24, "FFN width (default: 4 x hidden)")
      .without_default();
  flags.integer("--layers", o.layers, 1, 100'000, "layers on the node");
  flags.integer("--p", o.p, 1, 1024, "ranks (devices)");
  flags.integer("--vocab", o.vocab, std::int64_t(1), std::int64_t(1) << 31,
                "price a GPT's work outside the stack with this vocabulary (embedding, final norm, LM head, "
                "cross-entropy, replicated all-reduce, AdamW: plan/outside_stack.hpp; train_gpt's is 256)")
      .without_default();
  flags.integer("--batch", o.batch, std::int64_t(1), std::int64_t(1) << 20, "sequences per step");
  flags.number("--budget-gib", o.budget_gib, {.min = 0, .max = 1 << 20, .min_open = true},
               "memory budget per device in GiB (default: the profile's)")
      .without_default();
  flags.number("--gamma", o.gamma, {.min = 0, .max = 1}, "the heuristic's gamma");
  flags.flag("--causal", [&o] { o.layer.causal = o.layer.zigzag = true; },  // causal ring attention runs zigzag
             "causal attention");
  flags.flag("--swiglu", o.layer.swiglu, "SwiGLU FFN");
  flags.flag("--rope", o.layer.rope, "rotary position embedding on q and k (train_gpt's byte-level GPT has it)");
  std::string dtype = "bf16";
  flags.choice("--dtype", dtype, {"bf16", "fp32"},
               "activations and weights in compute: bf16 (the paper's setting) or fp32 (train_gpt's default)");
  flags.text("--csv", o.csv, "write every sequence's predicted time and memory per variant (rows written as they "
                             "are planned, to FILE.tmp.<pid>.<n>; FILE put in place at the end)", "FILE")
      .nonempty("a file name");
  flags.number("--progress-every", o.progress_every, {.min = 0, .max = 86400, .min_open = true},
               "seconds between progress lines on stderr when stdout is not a terminal");
  usage_text() = flags.usage();
  flags.parse(argc, argv);
  o.layer.dtype_bytes = dtype == "fp32" ? 4 : 2;
  if (o.layer.heads <= 0 || o.layer.hidden <= 0) usage("--hidden and --heads must be positive");
  if (o.layer.kv_heads < 0) o.layer.kv_heads = o.layer.heads;
  if (o.layer.heads % o.layer.kv_heads)
    usage(fmt::format("--heads {} must be a multiple of --kv-heads {}", o.layer.heads, o.layer.kv_heads));
  if (o.layer.head_dim < 0) {  // hidden / heads, never truncated: another head dimension is given explicitly
    try {
      o.layer.head_dim = pd::cli::head_dim_of(o.layer.hidden, o.layer.heads, "give --head-dim explicitly");
    } catch (const std::invalid_argument& e) {
      usage(e.what());
    }
  }
  if (o.layer.ffn < 0) o.layer.ffn = 4 * o.layer.hidden;
  if (o.layers < 1 || o.p < 1 || o.batch < 1 || o.sequences < 1) usage("--layers, --p, --batch, --sequences >= 1");
  // Bounded work per sequence: every cost table dry-runs the strategies (plan/table_work.hpp).
  if (const double work = pd::plan::cost_table_work(o.batch, o.layer.heads, o.p); work > pd::plan::kMaxCostTableWork)
    usage(fmt::format("--batch {} x --heads {} x --p {} (+ 12 p^2) = {:.3g} units of dry-run work per cost table, "
                      "above the limit of {:.3g} (about 1 us each: every sequence would take {:.0f} s or more); "
                      "lower --batch, --heads or --p",
                      o.batch, o.layer.heads, o.p, work, pd::plan::kMaxCostTableWork, work * 1e-6));
  // The layer must shard over p ranks at all (heads, kv heads and ffn divisible): a setting, not a sequence, problem.
  try {
    pd::cost::ModelShape m = o.layer;
    m.seq = 1;
    m.batch = o.batch;
    m.layers = o.layers;
    pd::cost::validate(m, o.p);
    pd::cost::layer_config_of(m).validate_for(o.p);
  } catch (const pd::Error& e) {
    usage(e.what());
  }
  return o;
}

std::string find_distribution(const std::string& given) {
  if (!given.empty()) return given;
  for (const char* candidate : {"data/lengths/paradyse_table3.csv", "../data/lengths/paradyse_table3.csv",
                                "../../data/lengths/paradyse_table3.csv", "../../../data/lengths/paradyse_table3.csv"})
    if (std::ifstream(candidate)) return candidate;
  usage("cannot find data/lengths/paradyse_table3.csv from here; pass --distribution FILE");
}

std::vector<std::int64_t> sample(const std::vector<LengthBucket>& buckets, int count, std::uint64_t seed) {
  pd::Rng rng(seed);
  double total = 0;
  for (const LengthBucket& b : buckets) total += b.probability;
  std::vector<std::int64_t> lengths;
  for (int i = 0; i < count; ++i) {
    double u = rng.uniform() * total;
    std::size_t k = 0;
    while (k + 1 < buckets.size() && u >= buckets[k].probability) u -= buckets[k++].probability;
    const LengthBucket& b = buckets[k];
    double length;
    if (k + 1 == buckets.size() && b.lo > 0)
      length = std::exp(rng.uniform(std::log(double(b.lo)), std::log(double(b.hi))));  // the long tail
    else length = rng.uniform(double(b.lo), double(b.hi));
    lengths.push_back(std::max<std::int64_t>(64, std::int64_t(std::ceil(length))));
  }
  return lengths;
}

// One way of choosing strategies: a static strategy, or a planner.
struct Variant {
  std::string name;
  std::optional<Strategy> fixed;
  std::function<pd::plan::Plan(const pd::plan::Batch&)> plan;  // may throw NoFeasiblePlan (or Error: no plan at all)
  // Results over the trace.
  double total_s = 0, common_s = 0, overhead_s = 0;
  int failed = 0, calls = 0;
  std::int64_t longest = 0;
  // Curriculum (sorted) metrics: runs until the first failure.
  bool stopped = false;
  std::int64_t reached = 0;
  double reached_s = 0;
  std::vector<double> step_s;  // per sequence, NaN when it did not fit
  std::vector<double> step_peak;  // per sequence, the predicted peak bytes (NaN when no plan)
};

void run_trace(const std::string& title, const std::string& dataset, const std::vector<std::int64_t>& lengths,
               const Options& o, const pd::cost::HardwareProfile& hw, paradyse::CsvTable& csv) {
  pd::plan::ModelConfig model = pd::plan::ModelConfig::uniform(o.layer, o.layers);
  if (o.layer.dtype_bytes == 4) model.precision = {4, 4, 8};  // fp32 weights and gradients, two AdamW moments
  model.outside.vocab = o.vocab;
  const std::int64_t budget =
      o.budget_gib > 0 ? std::int64_t(o.budget_gib * 1073741824.0) : hw.usable_memory_bytes();
  std::vector<Variant> variants;
  const pd::cost::StrategyCatalog& catalog = pd::cost::default_catalog();
  for (Strategy s : catalog.all()) variants.push_back({std::string(catalog.name(s)), s, {}});
  const auto planner = [&](std::string name, pd::plan::PlanSolver solver, double gamma,
                           std::vector<Strategy> candidates) {
    auto cache = std::make_shared<pd::plan::PlanCache>(model, hw, o.p, budget, std::move(solver), gamma,
                                                       pd::plan::Bucketing{}, std::move(candidates));
    variants.push_back({std::move(name), std::nullopt, [cache](const pd::plan::Batch& b) { return cache->plan_for(b); }});
  };
  const std::vector<Strategy> all = catalog.all();
  planner("exact planner", pd::plan::exact_solver(), o.gamma, all);
  auto heuristic_state = std::make_shared<pd::plan::HeuristicState>();
  planner("ParaDySe heuristic", [heuristic_state](const pd::plan::CostTable& t, std::int64_t b) {
    return pd::plan::plan_heuristic(t, b, heuristic_state.get());
  }, o.gamma, all);
  variants.push_back({"exact, uncached", std::nullopt, [&](const pd::plan::Batch& b) {
                        return pd::plan::plan_exact(pd::plan::build_cost_table(model, hw, o.p, b), budget);
                      }});
  planner("exact w/o smoothing", pd::plan::exact_solver(), 0.0, all);
  for (const char* name : {"MegatronTS", "MegatronCZ", "UlyssesZ", "METP"}) {
    const Strategy without = catalog.index_of(name);
    std::vector<Strategy> rest;
    for (Strategy s : all)
      if (s != without) rest.push_back(s);
    planner(fmt::format("exact w/o {}", name), pd::plan::exact_solver(), o.gamma, rest);
  }

  // Every sequence through every variant; times are evaluated at the sequence's own length. A sequence that no
  // strategy can run at all (shorter than p, beyond what any plan can hold, ...) fails in every variant and is
  // reported with the reason.
  std::vector<bool> common(lengths.size(), true);
  std::map<std::string, std::vector<std::int64_t>> unplannable;  // reason -> lengths
  const pd::data::SequenceSplit group{o.p, o.layer.zigzag};
  std::vector<std::int64_t> padded;  // the lengths shorter than the group's minimum (planned padded)
  paradyse::Progress progress(dataset, std::int64_t(lengths.size()), "sequences");
  const pd::Timer since_start;
  double logged_at = 0;  // when the last progress line went to stderr (stdout not a terminal)
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    progress.show(std::int64_t(i), double(i));
    if (!progress.enabled() && since_start.seconds() - logged_at >= o.progress_every) {
      logged_at = since_start.seconds();
      fmt::print(stderr, "plan_trace: {}\n", progress.line(std::int64_t(i), double(i), logged_at));
      std::fflush(stderr);
    }
    // As train_gpt runs it: a sequence shorter than a token per chunk is padded (data/document_balance.hpp).
    const std::int64_t run_length = pd::data::padded_length(lengths[i], group);
    if (run_length > lengths[i]) padded.push_back(lengths[i]);
    const pd::plan::Batch batch = pd::plan::Batch::single(run_length, o.batch);
    std::optional<pd::plan::CostTable> table;
    try {
      table = pd::plan::build_cost_table(model, hw, o.p, batch);
      pd::plan::least_memory_plan(*table, budget);  // throws when a sublayer has no allowed strategy
    } catch (const pd::Error& e) {
      table.reset();
      unplannable[e.what()].push_back(lengths[i]);
    }
    for (Variant& v : variants) {
      std::optional<pd::plan::Evaluation> e;
      if (!table) {
      } else if (v.fixed) {
        e = pd::plan::evaluate(*table, pd::plan::uniform_layers(*table, *v.fixed));
        if (!e->allowed) e.reset();
      } else {
        const pd::Timer timer;
        std::optional<pd::plan::Plan> plan;
        try {
          plan = v.plan(batch);
        } catch (const pd::plan::NoFeasiblePlan&) {
        } catch (const pd::Error& error) {  // the planner's bucket edge may be beyond what a plan can hold
          unplannable[fmt::format("{} (in {})", error.what(), v.name)].push_back(lengths[i]);
        }
        v.overhead_s += timer.seconds();
        ++v.calls;
        if (plan) e = pd::plan::evaluate(*table, plan->strategies());
      }
      const bool fits = e && e->peak_bytes() <= budget;
      v.step_s.push_back(fits ? e->time_s : std::nan(""));
      v.step_peak.push_back(e ? double(e->peak_bytes()) : std::nan(""));
      if (fits) {
        v.total_s += e->time_s;
        v.longest = std::max(v.longest, lengths[i]);
        if (!v.stopped) v.reached = std::max(v.reached, lengths[i]), v.reached_s += e->time_s;
      } else {
        ++v.failed;
        v.stopped = true;
        if (v.fixed) common[i] = false;
      }
    }
    // The sequence's rows now (streamed to the table's temporary file; put in place at the end).
    for (const Variant& v : variants)
      csv.row(dataset, i, lengths[i], v.name, v.fixed ? "static" : "planner",
              std::isnan(v.step_s[i]) ? std::string() : fmt::format("{:.9g}", v.step_s[i]),
              std::isnan(v.step_peak[i]) ? std::string() : fmt::format("{:.0f}", v.step_peak[i]), budget);
  }
  progress.finish();
  if (!progress.enabled() && logged_at > 0)
    fmt::print(stderr, "plan_trace: {}\n", progress.line(std::int64_t(lengths.size()), double(lengths.size()),
                                                          since_start.seconds()));
  int common_count = 0;
  for (std::size_t i = 0; i < lengths.size(); ++i) common_count += common[i];
  for (Variant& v : variants)
    for (std::size_t i = 0; i < lengths.size(); ++i)
      if (common[i]) v.common_s += v.step_s[i];

  std::int64_t max_length = 0;
  for (std::int64_t l : lengths) max_length = std::max(max_length, l);
  fmt::print("\n=== {}: {} sequences (max {} tokens), {} ===\n", title, lengths.size(), max_length,
             o.sorted ? "sorted short to long" : "in random order");
  fmt::print("{:<22} {:>12} {:>9} {:>10} {:>12} {:>9} | {:>12} {:>9}\n", "variant", "total (s)", "no fit",
             "longest", "common (s)", "vs exact", "overhead ms", "us/call");
  const Variant& exact = variants[std::size_t(catalog.count())];
  for (const Variant& v : variants) {
    fmt::print("{:<22} {:>12.1f} {:>9} {:>10} {:>12.1f} {:>9} | ", v.name, v.total_s, v.failed, v.longest,
               v.common_s, exact.common_s > 0 ? fmt::format("{:.2f}x", v.common_s / exact.common_s) : "-");
    if (v.fixed) fmt::print("{:>12} {:>9}\n", "-", "-");
    else fmt::print("{:>12.3f} {:>9.2f}\n", v.overhead_s * 1e3, v.overhead_s * 1e6 / std::max(1, v.calls));
  }
  fmt::print("(total: predicted step time summed over the sequences that fit; common: over the {} sequences every "
             "static strategy runs; overhead: the planner's wall-clock time, cost tables and cache included)\n",
             common_count);
  int lost = 0;
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    bool any = false;
    for (const Variant& v : variants)
      if (v.fixed && !std::isnan(v.step_s[i])) any = true;
    if (any && std::isnan(exact.step_s[i])) ++lost;
  }
  fmt::print("check: sequences some static strategy runs but the exact planner does not: {}\n", lost);
  if (!padded.empty())
    fmt::print("padded: {} sequence{} shorter than the group's minimum of {} tokens (a token per chunk) planned at "
               "{} tokens, as train_gpt runs them (masked padding at the end); lengths {}{}\n", padded.size(),
               padded.size() == 1 ? "" : "s", pd::data::min_sequence_length(group),
               pd::data::min_sequence_length(group),
               fmt::join(padded.begin(), padded.begin() + std::ptrdiff_t(std::min<std::size_t>(padded.size(), 5)), ", "),
               padded.size() > 5 ? ", ..." : "");
  for (const auto& [reason, which] : unplannable) {
    std::vector<std::int64_t> shown(which.begin(), which.begin() + std::ptrdiff_t(std::min<std::size_t>(which.size(), 5)));
    fmt::print("cannot plan {} sequence{} (length {}{}): {}\n", which.size(), which.size() == 1 ? "" : "s",
               fmt::join(shown, ", "), which.size() > shown.size() ? ", ..." : "", reason);
  }

  if (!o.sorted) return;
  // The paper's Table 5: the longest length reached before the first failure and the time to get there.
  fmt::print("\ncurriculum (training stops at the first sequence that does not fit), as the paper's Table 5:\n");
  fmt::print("{:<22} {:>12} {:>12} {:>16} {:>9}\n", "variant", "max length", "time (s)", "exact's time (s)", "saving");
  for (const Variant& v : variants) {
    double exact_to_same = 0;
    for (std::size_t i = 0; i < lengths.size() && lengths[i] <= v.reached; ++i)
      if (!std::isnan(exact.step_s[i])) exact_to_same += exact.step_s[i];
    fmt::print("{:<22} {:>12} {:>12.1f} {:>16.1f} {:>8.2f}%\n", v.name, v.reached, v.reached_s, exact_to_same,
               v.reached_s > 0 ? 100 * (v.reached_s - exact_to_same) / v.reached_s : 0.0);
  }
  fmt::print("(saving: how much less time the exact planner needs to reach the same length)\n");
}

int run(int argc, char** argv) {
  const Options o = parse(argc, argv);
  pd::cost::HardwareProfile hw;
  try {
    hw = pd::cost::named_profile(o.profile);
    // A calibrated profile's GEMM engines are this process's: the dry runs count the workspace of the engines its
    // rates were measured on (a fallback GEMM packs its operands), as train_gpt runs and plans with that profile.
    pd::cost::use_gemm_engines(hw);
  } catch (const pd::Error& e) {
    usage(e.what());
  }
  // The inputs, read strictly (data/trace_input.hpp): a bad file is a usage error naming the file, line and field.
  // Lengths shorter than the group's minimum are read: they are planned padded, as train_gpt runs them.
  std::vector<std::int64_t> file_lengths;
  std::string path;
  std::map<std::string, std::vector<LengthBucket>> distributions;
  try {
    if (!o.lengths_file.empty()) file_lengths = paradyse::data::read_lengths(o.lengths_file, 1, kMaxLength);
    else {
      path = find_distribution(o.distribution);
      distributions = paradyse::data::read_distribution(path, kMaxLength);
      if (o.dataset != "all" && !distributions.count(o.dataset))
        usage(fmt::format("no dataset \"{}\" in {}", pd::printable(o.dataset), pd::printable(path)));
    }
  } catch (const pd::Error& e) {
    usage(e.what());
  }
  fmt::print("plan_trace: {} ({}), p = {}, {} layers of {}, budget {} per device\n", hw.name, hw.description, o.p,
             o.layers, pd::cost::describe([&] {
               pd::cost::ModelShape m = o.layer;
               m.batch = o.batch;
               m.seq = 0;
               return m;
             }()),
             pd::plan::format_bytes(o.budget_gib > 0 ? o.budget_gib * 1073741824.0 : double(hw.usable_memory_bytes())));
  paradyse::CsvTable csv(o.csv, {"dataset", "sequence", "length", "variant", "kind", "time_s", "peak_bytes",
                                            "budget_bytes"});
  if (!o.lengths_file.empty()) {
    if (o.sorted) std::sort(file_lengths.begin(), file_lengths.end());
    run_trace(o.lengths_file, "lengths", file_lengths, o, hw, csv);
    csv.close();  // throws (naming the file and the reason) when the table cannot be put in place
    return 0;
  }
  for (const auto& [name, buckets] : distributions) {
    if (o.dataset != "all" && o.dataset != name) continue;
    std::vector<std::int64_t> lengths = sample(buckets, o.sequences, o.seed);
    if (o.sorted) std::sort(lengths.begin(), lengths.end());
    run_trace(fmt::format("{} ({}, seed {})", name, path, o.seed), name, lengths, o, hw, csv);
  }
  csv.close();  // throws (naming the file and the reason) when the table cannot be put in place
  return 0;
}

}  // namespace

// Nothing ends in an uncaught exception: a bad option or input file exits 2 with the usage (above); anything the
// library refuses while planning exits 1 with its message.
int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "plan_trace: {}\n", paradyse::bounded_message(e.what()));  // a filesystem_error echoes paths whole
    return 1;
  }
}
