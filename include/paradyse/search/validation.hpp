// paradyse/search/validation.hpp: the performance model against published training runs, by prediction.
//
// Megatron-LM (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
// Megatron-LM", SC'21, Table 1): GPT models, s = 2048, vocabulary 51,200, A100-SXM4-80GB in DGX A100 nodes,
// tensor parallelism inside a node, interleaved 1F1B, full recomputation, fp16/bf16 with fp32 gradient reduction.
// That software had no flash attention and reduced data-parallel gradients after the pipeline flush, without
// overlap; the setup says so. Table 1 does not give the micro-batch size or the number of virtual stages: the
// prediction takes the model's best micro-batch and v for the published (tp, pp, dp).
// Their throughput counts recomputation: F = 96 B s l h^2 (1 + s / 6h + V / 16 l h) FLOPs per step (paper, eq. 3),
// TFLOP/s per GPU = F / (step time * GPUs).
// Nothing here is fitted: the A100 profile's rates (cost/builtin_profiles.hpp: 75% of peak for large GEMMs, the
// FlashAttention-2 paper's attention rates, 80% of HBM bandwidth) and the link figures (search/cluster.hpp) are
// used as they are.
//
// published_rows() holds the same four rows and Llama 3 405B's (Dubey et al., "The Llama 3 Herd of Models", 2024,
// Table 4: H100-80GB, 8 per node, 400 Gb/s per GPU) as configuration files (search/config_file.hpp) that
// search_parallel --score reads: each a fixed configuration (the micro-batch size and virtual stages, which the
// papers do not give, are the model's best for the published mesh, chosen when the rows are built).
#pragma once

#include "paradyse/search/cluster.hpp"
#include "paradyse/search/config_file.hpp"
#include "paradyse/search/perf_model.hpp"
#include "paradyse/search/training_model.hpp"
#include "paradyse/search/training_setup.hpp"

#include <array>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace paradyse::search {

struct PublishedRun {
  std::string name;
  std::int64_t heads = 0, hidden = 0, layers = 0;
  int tp = 1, pp = 1, gpus = 1;
  std::int64_t global_batch = 0;
  double tflops_per_gpu = 0;  // published
};

// Table 1 rows quoted by issue 13 (the first, a middle two and the last of the paper's ten).
inline std::array<PublishedRun, 4> megatron_sc21_runs() {
  return {{{"gpt-1.7b", 24, 2304, 24, 1, 1, 32, 512, 137},
           {"gpt-18.4b", 48, 6144, 40, 8, 1, 256, 1024, 135},
           {"gpt-145.6b", 96, 12288, 80, 8, 8, 1536, 2304, 148},
           {"gpt-1008b", 160, 25600, 128, 8, 64, 3072, 3072, 163}}};
}

inline TrainingModel megatron_model(const PublishedRun& run) {
  return megatron_gpt(run.name, run.heads, run.hidden, run.layers);
}

// The software of 2021: no flash attention, no overlap of the gradient reduction.
inline TrainingSetup megatron_sc21_setup(const PublishedRun& run) {
  TrainingSetup s;
  s.seq = 2048;
  s.global_batch = run.global_batch;
  s.flash_attention = false;
  s.overlap_grad_reduce = false;
  return s;
}

// The paper's FLOP count of one step (with recomputation); with `causal` the attention term counts the half square.
inline double megatron_flops_per_step(const TrainingModel& m, const TrainingSetup& s,
                                      FlopConvention convention = FlopConvention::full) {
  const double B = double(s.global_batch), seq = double(s.seq), l = double(m.layers), h = double(m.hidden);
  const double attention = convention == FlopConvention::causal && s.causal ? seq / (12.0 * h) : seq / (6.0 * h);
  return 96.0 * B * seq * l * h * h * (1.0 + attention + double(m.vocab) / (16.0 * l * h));
}

// FLOPs of one step as a published throughput counts them, attention by `convention`.
inline double counted_flops_per_step(FlopCounting counting, FlopConvention convention, const TrainingModel& m,
                                     const TrainingSetup& s) {
  if (counting == FlopCounting::megatron) return megatron_flops_per_step(m, s, convention);
  TrainingSetup with = s;
  with.flops = convention;
  return 3.0 * m.forward_flops_per_token(with.flop_context()) * double(s.seq) * double(s.global_batch);
}

struct Prediction {
  PublishedRun run;
  ParallelConfig config;
  Estimate estimate;
  double tflops_per_gpu = 0;  // predicted, counted as the paper counts
  double error() const { return (tflops_per_gpu - run.tflops_per_gpu) / run.tflops_per_gpu; }
};

// The published configuration (tp, pp, dp = gpus / (tp pp), ZeRO 0, full recomputation) with the best micro-batch
// size and virtual stage count the model finds for it.
inline Prediction predict_published(const PublishedRun& run, const ClusterProfile& cluster = dgx_a100()) {
  const TrainingModel m = megatron_model(run);
  const TrainingSetup s = megatron_sc21_setup(run);
  const PerformanceModel model(m, cluster, s, run.gpus);
  Prediction best{run, {}, {}, 0};
  for (int mb = 1; mb <= 16; mb *= 2)
    for (int v = 1; v <= 16; ++v) {
      const ParallelConfig c{.dp = run.gpus / (run.tp * run.pp), .pp = run.pp, .tp_y = run.tp, .zero = 0,
                             .micro_batch = mb, .virtual_stages = v, .recompute = Recompute::full};
      const Estimate e = model.evaluate(c);
      if (!e.feasible) continue;
      if (best.tflops_per_gpu == 0 || e.step_s < best.estimate.step_s)
        best = {run, c, e, megatron_flops_per_step(m, s) / (e.step_s * run.gpus) / 1e12};
    }
  check(best.tflops_per_gpu > 0, "no micro-batch size fits the published configuration of {}", run.name);
  return best;
}

// ---- the published rows as configuration files ------------------------------------------------------------------

struct PublishedRow {
  std::string name;
  json::Value file;  // search/config_file.hpp's schema
};

// `base` with the micro-batch size (from `micro_batches`), virtual stage count (1..max_v) and, unless
// `keep_recompute`, recomputation policy the model predicts fastest, among those that fit.
inline ParallelConfig best_schedule(const TrainingModel& m, const ClusterProfile& cluster, const TrainingSetup& s,
                                    ParallelConfig base, std::initializer_list<int> micro_batches, int max_v,
                                    bool keep_recompute) {
  const PerformanceModel model(m, cluster, s, base.devices());
  ParallelConfig best = base;
  double best_s = 0;
  for (int mb : micro_batches)
    for (int v = 1; v <= max_v; ++v)
      for (Recompute r : kAllRecompute) {
        if (keep_recompute && r != base.recompute) continue;
        ParallelConfig c = base;
        c.micro_batch = mb, c.virtual_stages = v, c.recompute = r;
        const Estimate e = model.evaluate(c);
        if (e.feasible && (best_s == 0 || e.step_s < best_s)) best = c, best_s = e.step_s;
      }
  return best;
}

inline std::vector<PublishedRow> published_rows() {
  std::vector<PublishedRow> rows;
  // Megatron-LM SC'21 Table 1: the 2021 software (no flash attention, no overlapped reduction, tensor parallelism
  // without sequence parallelism), full recomputation, ZeRO 0; (micro-batch, v) the model's best.
  for (const PublishedRun& run : megatron_sc21_runs()) {
    const TrainingSetup s = megatron_sc21_setup(run);
    const ParallelConfig c = best_schedule(megatron_model(run), dgx_a100(), s,
                                           {.dp = run.gpus / (run.tp * run.pp), .pp = run.pp, .tp_y = run.tp,
                                            .recompute = Recompute::full, .sequence_parallel = false},
                                           {1, 2, 4, 8, 16}, 16, true);
    rows.push_back({"megatron-sc21-" + run.name,
                    config_file_to_json(c, megatron_model(run), "", dgx_a100(), "dgx-a100", s,
                                        PublishedThroughput{run.tflops_per_gpu, FlopCounting::megatron,
                                                            "Narayanan et al. SC'21, Table 1"})});
  }
  // Llama 3 405B, Table 4: tp 8, pp 16 (126 layers: the first and last stage one layer fewer), 16M tokens per
  // step; FSDP-style sharding of optimizer states and gradients (ZeRO 1 here), bf16; the 131K row's context
  // parallelism is the all-gather scheme; micro-batches of one sequence; v and recomputation (the paper gives
  // neither) the model's best.
  struct Llama {
    std::string name;
    int dp, cp;
    std::int64_t seq, batch;
    double tflops;
  };
  for (const Llama& l : {Llama{"llama3-405b-8k-8192gpu", 64, 1, 8192, 2048, 430},
                         Llama{"llama3-405b-8k-16384gpu", 128, 1, 8192, 2048, 400},
                         Llama{"llama3-405b-131k-16384gpu", 8, 16, 131072, 128, 380}}) {
    TrainingSetup s;
    s.seq = l.seq;
    s.global_batch = l.batch;
    const ParallelConfig c = best_schedule(
        llama3_405b(), dgx_h100(), s,
        {.dp = l.dp, .pp = 16, .cp = l.cp, .tp_y = 8, .zero = 1,
         .cp_scheme = l.cp > 1 ? CpScheme::all_gather : CpScheme::ring},
        {1}, 7, false);
    rows.push_back({l.name, config_file_to_json(c, llama3_405b(), "llama3-405b", dgx_h100(), "dgx-h100", s,
                                                PublishedThroughput{l.tflops, FlopCounting::model,
                                                                    "Dubey et al. 2024 (Llama 3), Table 4"})});
  }
  return rows;
}

// One configuration file scored: the model, cluster and setup it names (or the defaults given) and the estimate.
struct Scored {
  TrainingModel model;
  ClusterProfile cluster;
  TrainingSetup setup;
  ParallelConfig config;
  Estimate estimate;
  std::optional<PublishedThroughput> published;
  // TFLOP/s per device as the published figure counts them (the model's count when none), by convention.
  double tflops_per_gpu(FlopConvention convention) const {
    const FlopCounting counting = published ? published->counting : FlopCounting::model;
    return counted_flops_per_step(counting, convention, model, setup) /
           (estimate.step_s * double(config.devices())) / 1e12;
  }
};

inline Scored score(const ConfigFile& f, const TrainingModel& default_model, const ClusterProfile& default_cluster,
                    const TrainingSetup& default_setup) {
  Scored r{f.model ? *f.model : default_model, f.cluster ? *f.cluster : default_cluster,
           setup_of(f, default_setup), f.config, {}, f.published};
  const PerformanceModel model(r.model, r.cluster, r.setup, r.config.devices());
  r.estimate = model.evaluate(r.config);
  return r;
}

}  // namespace paradyse::search
