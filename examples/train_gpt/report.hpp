// examples/train_gpt/report.hpp: what the dense run prints and writes: the header (model, data, packing, ranks and
// cap, strategies), the per-step table (a row per step: trained, out of memory, over the cap under MPI, or no plan
// that fits) with its CSV (--csv), and the summary.
#pragma once

#include "paradyse/core/csv_table.hpp"
#include "caps.hpp"
#include "training_data.hpp"
#include "training_options.hpp"

#include "paradyse/core/error.hpp"
#include "paradyse/cost/dry_run.hpp"
#include "paradyse/cost/model_flops.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/data/packing.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/plan/plan_names.hpp"
#include "paradyse/plan/planner.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace paradyse::examples {

// The lines before the table: the model, the data, the packing, the ranks and their cap, the strategies.
inline void print_dense_header(const TrainingOptions& o, const GptConfig& config, const TrainingData& data,
                               int n_steps, const DenseCap& c, bool mpi) {
  const std::vector<data::Document>& docs = data.docs;
  fmt::print("model: GPT, {} layers, h={}, {} heads, ffn={}, vocab {} (bytes), causal + RoPE, zigzag tokens, untied "
             "replicated LM head; {:.2f} M parameters\n",
             o.layers, o.hidden, o.heads, config.layer.ffn, config.vocab, double(config.parameter_count()) / 1e6);
  const std::size_t shortest =
      std::min_element(docs.begin(), docs.end(), [](auto& a, auto& b) { return a.bytes.size() < b.bytes.size(); })->bytes.size();
  fmt::print("data: {} documents in {} ({}..{} bytes); {} steps, one window each, lengths {}..{} (the longest "
             "document gives {}), documents stratified by length, order {}, seed {}\n",
             docs.size(), data.corpus_dir.string(), shortest, data.longest_document, o.steps, o.min_len, o.max_len,
             o.max_len, o.sorted ? "sorted (curriculum)" : "random", o.seed);
  if (o.pack_tokens > 0)
    fmt::print("packing: {} documents in {} steps of up to {} tokens (one document per row, rows padded to the "
               "step's longest with masked tokens)\n", o.steps, n_steps, o.pack_tokens);
  if (o.pack_documents > 0)
    fmt::print("packing: {} documents in {} steps, each one sequence of up to {} tokens (documents back to back, "
               "attention within each, positions restarting at each)\n", o.steps, n_steps, o.pack_documents);
  fmt::print("ranks: {} {}; memory cap {:.0f} MiB per rank{} (predicted peak at s={}: all-METP {:.1f} MiB, "
             "all-MegatronTS {:.1f} MiB)\n",
             o.ranks, mpi ? "MPI processes" : "threads", double(c.cap) / kMiB,
             o.cap_mib > 0 ? " (given)"
             : c.raised_for_save ? " (from the memory model, raised to fit the model and its save)"
                                 : " (from the memory model)",
             o.max_len,
             double(c.metp_peak) / kMiB, double(c.ts_peak) / kMiB);
  fmt::print("strategies: {}\n\n", o.strategy.empty() ? "chosen per layer and sublayer by the exact planner (attn/mlp per layer)"
                                                      : fmt::format("{} everywhere (static)", o.strategy));
}

// One step as its row reports it.
struct DenseStepRow {
  int step = 0;
  std::int64_t length = 0;     // s
  std::int64_t rows = 0;       // sequences
  std::int64_t documents = 0;  // the "docs" column
  std::int64_t real = 0;       // real tokens
  std::int64_t padding = 0;    // masked tokens the step padded with
  double flops = 0;            // model FLOPs

  explicit DenseStepRow(int k, const data::Step& batch, const GptConfig& config)
      : step(k), length(batch.length), rows(batch.sequences()), documents(std::int64_t(batch.rows.size())),
        real(batch.real_tokens()), padding(batch.padded_tokens()) {
    std::vector<std::int64_t> lengths;
    for (const data::Window& w : batch.rows) lengths.push_back(w.length);
    flops = cost::training_flops(config, lengths);
  }
};

// The per-step table (stdout and --csv) and what the summary adds up.
class DenseReport {
public:
  DenseReport(const TrainingOptions& o, const cost::HardwareProfile& hardware, bool reports, double cap_bytes)
      : o_(o), hardware_(hardware), gemm_rate_(cost::gemm_rate_per_rank(hardware)), cap_mib_(cap_bytes / kMiB),
        csv_(reports ? o.csv : std::string(),
             {"step", "length", "rows", "tokens", "padding", "plan", "loss", "seconds", "mfu", "peak_mib",
              "predicted_mib", "cap_mib", "status", "predicted_s", "cpu_s", "optimizer_cpu_s"},
             CsvTable::OnFailure::warns) {
    fmt::print("peak: the largest per-rank peak measured by the memory trackers; pred: the memory model's peak for "
               "the plan (what the planner budgets)\n");
    fmt::print("MFU: model FLOPs per second against the GEMM rate of the profile, {:.1f} GFLOP/s per rank x {} "
               "ranks{}\n",
               gemm_rate_ / 1e9, o.ranks, hardware.source.find("calibrated") == std::string::npos
                                             ? " (not calibrated on this machine: MFU against that device)" : "");
    fmt::print("{:>4}  {:>6}  {:>4}  {:<{}}  {:>7}  {:>7}  {:>5}  {:>9}  {:>9}  {:>6}\n", "step", "len", "docs",
               "plan", 8 * o.layers, "loss", "time s", "MFU%", "peak MiB", "pred MiB", "cap");
  }

  void no_plan(const DenseStepRow& r, const std::string& why) {
    fmt::print("{:>4}  {:>6}  {:>4}  no plan fits the cap: {}\n", r.step, r.length, r.documents, why);
    ++unplanned_;
    records_.push_back({r.real, r.padding, r.flops, 0, 0, true});
    csv_.row(r.step, r.length, r.rows, r.real, r.padding, "", "", 0, "", "", "", cap_mib_, "no plan fits", "", "", "");
  }
  void out_of_memory(const DenseStepRow& r, const plan::Plan& plan, double seconds, int rank, const OutOfMemory& e) {
    fmt::print("{:>4}  {:>6}  {:>4}  {:<{}}  {:>7}  {:>7.2f}  OUT OF MEMORY on rank {} (predicted {:.1f} MiB, cap "
               "{:.0f} MiB): {} more bytes asked with {:.1f} MiB in use\n",
               r.step, r.length, r.documents, plan::compact_plan(plan), 8 * o_.layers, "-", seconds, rank,
               double(plan.peak_bytes()) / kMiB, cap_mib_, e.requested(), double(e.in_use()) / kMiB);
    ++ooms_;
    records_.push_back({r.real, r.padding, r.flops, 0, seconds, true});
    csv_.row(r.step, r.length, r.rows, r.real, r.padding, plan::full_plan(plan), "", seconds, "", "",
             double(plan.peak_bytes()) / kMiB, cap_mib_, "out of memory", plan.time_s, "", "");
  }
  // MPI: a rank peaked at `peak` bytes, over the cap; the step was undone.
  void over_cap(const DenseStepRow& r, const plan::Plan& plan, double seconds, double peak) {
    fmt::print("{:>4}  {:>6}  {:>4}  {:<{}}  {:>7}  {:>7.2f}  OUT OF MEMORY: a rank peaked at {:.1f} MiB, over the cap "
               "of {:.0f} MiB (predicted {:.1f} MiB); the step is undone\n",
               r.step, r.length, r.documents, plan::compact_plan(plan), 8 * o_.layers, "-", seconds, peak / kMiB,
               cap_mib_, double(plan.peak_bytes()) / kMiB);
    ++ooms_;
    records_.push_back({r.real, r.padding, r.flops, 0, seconds, true});
    csv_.row(r.step, r.length, r.rows, r.real, r.padding, plan::full_plan(plan), "", seconds, "", peak / kMiB,
             double(plan.peak_bytes()) / kMiB, cap_mib_, "out of memory", plan.time_s, "", "");
  }
  // cpu_s, optimizer_cpu_s: the slowest rank's thread CPU time of the step and of its AdamW (dense_step.hpp).
  void trained(const DenseStepRow& r, const plan::Plan& plan, double loss, double seconds, double peak,
               double cpu_s, double optimizer_cpu_s) {
    const double mfu = cost::model_flops_utilisation(r.flops, seconds, o_.ranks, hardware_);
    fmt::print("{:>4}  {:>6}  {:>4}  {:<{}}  {:>7.4f}  {:>7.2f}  {:>5.1f}  {:>9.1f}  {:>9.1f}  {:>6.0f}\n", r.step,
               r.length, r.documents, plan::compact_plan(plan), 8 * o_.layers, loss, seconds, 100 * mfu, peak / kMiB,
               double(plan.peak_bytes()) / kMiB, cap_mib_);
    records_.push_back({r.real, r.padding, r.flops, loss, seconds, false});
    csv_.row(r.step, r.length, r.rows, r.real, r.padding, plan::full_plan(plan), fmt::format("{:.17g}", loss), seconds,
             mfu, peak / kMiB, double(plan.peak_bytes()) / kMiB, cap_mib_, "ok", plan.time_s, cpu_s, optimizer_cpu_s);
    for (const auto& l : plan.strategies()) {
      ++usage_[std::string(plan.strategy_name(l.attention))];
      ++usage_[std::string(plan.strategy_name(l.mlp))];
    }
  }

  // The steps that ran, and the summary after the table: `documents` of the steps this invocation ran, `total`
  // seconds of the loop, `planning` seconds of it in the planner.
  std::size_t steps_run() const {
    return std::size_t(std::count_if(records_.begin(), records_.end(), [](const Record& r) { return !r.failed; }));
  }
  void summary(std::size_t documents, double total, double planning) const {
    std::vector<const Record*> done;
    std::int64_t tokens = 0, padded = 0;
    double flops = 0, step_seconds = 0;
    for (const Record& r : records_)
      if (!r.failed) {
        done.push_back(&r);
        tokens += r.length;
        padded += r.padding;
        flops += r.flops;
        step_seconds += r.seconds;
      }
    const auto mean_loss = [&](std::size_t from, std::size_t to) {
      double sum = 0;
      for (std::size_t i = from; i < to; ++i) sum += done[i]->loss;
      return to > from ? fmt::format("{:.4f}", sum / double(to - from)) : std::string("-");
    };
    const std::size_t k = std::min<std::size_t>(10, done.size());
    fmt::print("\nsummary\n");
    fmt::print("  steps                      {} run, {} out of memory, {} with no plan that fits\n", done.size(), ooms_,
               unplanned_);
    fmt::print("  tokens trained             {} in {} documents; {} padding tokens ({:.1f}% of the tokens run)\n",
               tokens, documents, padded,
               tokens + padded > 0 ? 100.0 * double(padded) / double(tokens + padded) : 0.0);
    fmt::print("  mean loss, first {:>2} steps  {}\n", k, mean_loss(0, k));
    fmt::print("  mean loss, last {:>2} steps   {}\n", k, mean_loss(done.size() - k, done.size()));
    fmt::print("  total time                 {:.1f} s ({:.0f} tokens/s; planning {:.1f} ms in all)\n", total,
               double(tokens) / total, planning * 1e3);
    fmt::print("  model FLOPs utilisation    {:.1f}% over the steps run ({:.2f} GFLOP/s of model FLOPs; GEMM rate "
               "{:.1f} GFLOP/s x {} ranks)\n",
               100 * cost::model_flops_utilisation(flops, step_seconds, o_.ranks, hardware_),
               step_seconds > 0 ? flops / step_seconds / 1e9 : 0.0, gemm_rate_ / 1e9, o_.ranks);
    fmt::print("  strategy usage (sublayers) ");
    bool first = true;
    for (const std::string& name : cost::default_catalog().names()) {
      const auto it = usage_.find(name);
      fmt::print("{}{} {}", first ? "" : ", ", name, it == usage_.end() ? 0 : it->second);
      first = false;
    }
    fmt::print("\n");
    if (!o_.strategy.empty()) fmt::print("  OOM steps under --strategy {:<10} {}\n", o_.strategy, ooms_);
  }

  // Puts the --csv table in place; whether it failed (then warned on stderr), now or on the way.
  bool close_csv() {
    csv_.close();
    return csv_.failed();
  }

private:
  struct Record {
    std::int64_t length = 0;   // real tokens
    std::int64_t padding = 0;  // masked tokens the step padded with
    double flops = 0;          // model FLOPs
    double loss = 0;
    double seconds = 0;
    bool failed = false;
  };
  const TrainingOptions& o_;
  const cost::HardwareProfile& hardware_;
  double gemm_rate_, cap_mib_;
  CsvTable csv_;
  std::vector<Record> records_;
  std::map<std::string, int> usage_;
  int ooms_ = 0, unplanned_ = 0;
};

}  // namespace paradyse::examples
