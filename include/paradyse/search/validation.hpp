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
#pragma once

#include "paradyse/search/cluster.hpp"
#include "paradyse/search/perf_model.hpp"
#include "paradyse/search/training_model.hpp"
#include "paradyse/search/training_setup.hpp"

#include <array>
#include <cmath>
#include <cstdint>
#include <string>

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

// The paper's FLOP count of one step (with recomputation).
inline double megatron_flops_per_step(const TrainingModel& m, const TrainingSetup& s) {
  const double B = double(s.global_batch), seq = double(s.seq), l = double(m.layers), h = double(m.hidden);
  return 96.0 * B * seq * l * h * h * (1.0 + seq / (6.0 * h) + double(m.vocab) / (16.0 * l * h));
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

}  // namespace paradyse::search
