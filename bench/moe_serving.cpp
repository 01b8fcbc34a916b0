// bench/moe_serving.cpp: the MoE serving engine's two layouts against batch size, and the cost of switching.
//
// Table 1: one decoder step (a synthetic Mixtral-shaped MoE, serve/synthetic_decoder.hpp) over B single-token
// requests on p thread ranks with the experts TP-sliced and EP-whole, against the same step on one rank (the
// baseline, measured in the same run): median ms per step, tokens/s, and the cost model's predicted TP/EP ratio
// (serve/switch_policy.hpp, rates measured here) beside the measured one; the crossover batch where EP overtakes TP.
// Table 2: the TP -> EP redistribution of every MoE layer against its bytes, for growing expert widths: stalled
// (all layers moved between steps, nothing to hide behind) and pipelined (each layer posted right after it
// computed during a step of 64 tokens, waited for at the end: the exposed part), with that step's own time.
#include "bench_usage.hpp"

#include "paradyse/comm/threads.hpp"
#include "paradyse/serve/decoder_step.hpp"
#include "paradyse/serve/redistribute.hpp"
#include "paradyse/serve/switch_policy.hpp"
#include "paradyse/serve/synthetic_decoder.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;
using Clock = std::chrono::steady_clock;

namespace {

constexpr std::string_view kUsage = R"(usage: moe_serving [P] [REPS]
MoE serving: one decoder step against batch size in TP and EP layouts on P thread ranks (default 2) against one
rank, the crossover batch, and the exposed time of a TP -> EP switch against its bytes. REPS (default 5) timed
repetitions per point; medians are printed.
)";

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

// Median seconds of one step of `batch` single-token requests on `p` ranks in `mode` (rank 0's clock, ranks
// aligned by a barrier before each repetition).
double step_seconds(const LoadedDecoder& m, int p, MoeMode mode, std::int64_t batch, int reps,
                    std::vector<std::int64_t>* routed = nullptr) {
  std::vector<double> times;
  run_ranks(p, [&](ThreadCommunicator& comm) {
    const DecoderConfig& c = m.config;
    const RankShard s = make_rank_shard(c, m.weights, p, comm.rank(), mode);
    PagedKvCache cache({c.layers, batch + 1, 4, s.kv_heads.length, c.head_dim});
    BufferPool pool;
    std::vector<SequenceChunk> chunks;
    for (std::int64_t i = 0; i < batch; ++i) chunks.push_back({i, {std::int32_t((i * 37) % c.vocab)}, false});
    for (int r = -1; r < reps; ++r) {  // one warm-up
      for (std::int64_t i = 0; i < batch; ++i) cache.reserve(i, 1);
      comm.barrier();
      const Clock::time_point start = Clock::now();
      const StepResult out = decoder_step(comm, c, s, cache, std::span<const SequenceChunk>(chunks), pool);
      if (comm.rank() == 0 && r >= 0) times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
      if (comm.rank() == 0 && routed && r < 0) *routed = out.moe_load[0].routed;
      for (std::int64_t i = 0; i < batch; ++i) cache.release(i);
    }
  });
  return median(times);
}

}  // namespace

int main(int argc, char** argv) {
  bench::exit_with_usage_on_help(argc, argv, kUsage);
  const int p = argc > 1 ? std::atoi(argv[1]) : 2;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 5;
  if (p < 1 || p > 8 || reps < 1 || reps > 1000) {
    fmt::print(stderr, "moe_serving: P = {} must be in [1, 8] and REPS = {} in [1, 1000]\n{}", p, reps, kUsage);
    return 2;
  }
  const DecoderConfig c = synthetic_config(256, 2, 8, 4, 8, 2, 512, 1024);
  const LoadedDecoder m = synthetic_decoder(c, 1);
  const MachineRates rates = measure_machine_rates(c.moe, p);
  const auto placement = ExpertPlacement::chunked(c.moe.experts, p).experts_of_rank;
  fmt::print("moe_serving: synthetic MoE, {} layers, h {}, {} experts top-{}, expert ffn {}; {} thread ranks; "
             "median of {} steps\n", c.layers, c.hidden, c.moe.experts, c.moe.top_k, c.moe.expert_ffn, p, reps);
  fmt::print("measured rates: GEMM {:.1f} GFLOP/s (half rate at {:.0f} columns), weights streamed at {:.1f} GB/s\n\n",
             rates.flops_per_s / 1e9, rates.half_rate_columns, rates.memory_bytes_per_s / 1e9);
  fmt::print("{:>6} {:>12} {:>12} {:>12} {:>11} {:>11} {:>11} {:>13} {:>13}\n", "batch", "1 rank ms", "TP ms", "EP ms",
             "1 rank t/s", "TP t/s", "EP t/s", "TP/EP meas.", "TP/EP model");
  std::int64_t crossover = -1;
  for (const std::int64_t batch : {1, 2, 4, 8, 16, 32, 64, 128, 256}) {
    std::vector<std::int64_t> routed;
    const double one = step_seconds(m, 1, MoeMode::tp, batch, reps);
    const double tp = step_seconds(m, p, MoeMode::tp, batch, reps, &routed);
    const double ep = step_seconds(m, p, MoeMode::ep, batch, reps);
    const ModeCosts model = moe_mode_costs(c.moe, routed, placement, rates);
    if (ep < tp && crossover < 0) crossover = batch;
    if (ep >= tp) crossover = -1;  // EP must stay ahead for larger batches
    fmt::print("{:>6} {:>12.3f} {:>12.3f} {:>12.3f} {:>11.0f} {:>11.0f} {:>11.0f} {:>13.2f} {:>13.2f}\n", batch, one * 1e3,
               tp * 1e3, ep * 1e3, double(batch) / one, double(batch) / tp, double(batch) / ep, tp / ep,
               model.tp_s / model.ep_s);
  }
  if (crossover > 0)
    fmt::print("crossover: EP is faster than TP from batch {} on\n\n", crossover);
  else
    fmt::print("crossover: none in this range (EP not ahead at the largest batches)\n\n");

  fmt::print("{:>10} {:>14} {:>12} {:>16} {:>12}\n", "expert f", "bytes moved", "stalled ms", "pipelined exp. ms",
             "step ms");
  for (const std::int64_t f : {256, 512, 1024, 2048}) {
    const DecoderConfig cf = synthetic_config(256, 2, 8, 4, 8, 2, f, 1024);
    const LoadedDecoder mf = synthetic_decoder(cf, 2);
    std::vector<double> stalled, exposed, step;
    std::size_t bytes = 0;
    run_ranks(p, [&](ThreadCommunicator& comm) {
      const int me = comm.rank();
      const ExpertLayout ep = ExpertLayout::ep(ExpertPlacement::chunked(cf.moe.experts, p).experts_of_rank);
      PagedKvCache cache({cf.layers, 65, 4, make_rank_shard(cf, mf.weights, p, me, MoeMode::tp).kv_heads.length, cf.head_dim});
      BufferPool pool;
      std::vector<SequenceChunk> chunks;
      for (std::int64_t i = 0; i < 64; ++i) chunks.push_back({i, {std::int32_t(i % cf.vocab)}, false});
      for (int r = -1; r < reps; ++r) {
        // Stalled: every layer moved with nothing to overlap.
        RankShard s = make_rank_shard(cf, mf.weights, p, me, MoeMode::tp);
        std::vector<LayerRedistribution> moving(std::size_t(cf.layers));
        comm.barrier();
        Clock::time_point t0 = Clock::now();
        for (std::int64_t l = 0; l < cf.layers; ++l) moving[std::size_t(l)].begin(comm, cf, s.layers[std::size_t(l)], ExpertLayout::tp(), ep);
        for (std::int64_t l = 0; l < cf.layers; ++l) moving[std::size_t(l)].finish(cf, p, me);
        const double t_stalled = std::chrono::duration<double>(Clock::now() - t0).count();
        std::size_t sent = 0;
        for (const auto& mv : moving) sent += mv.bytes_sent();
        // Pipelined: posted after each layer of a 64-token step, finished at its end.
        RankShard s2 = make_rank_shard(cf, mf.weights, p, me, MoeMode::tp);
        std::vector<LayerRedistribution> moving2(std::size_t(cf.layers));
        double t_exposed = 0;
        for (std::int64_t i = 0; i < 64; ++i) cache.reserve(i, 1);
        comm.barrier();
        t0 = Clock::now();
        decoder_step(comm, cf, s2, cache, std::span<const SequenceChunk>(chunks), pool, {}, [&](std::int64_t l) {
          const Clock::time_point a = Clock::now();
          moving2[std::size_t(l)].begin(comm, cf, s2.layers[std::size_t(l)], ExpertLayout::tp(), ep);
          t_exposed += std::chrono::duration<double>(Clock::now() - a).count();
        });
        const Clock::time_point a = Clock::now();
        for (std::int64_t l = 0; l < cf.layers; ++l) moving2[std::size_t(l)].finish(cf, p, me);
        t_exposed += std::chrono::duration<double>(Clock::now() - a).count();
        const double t_step = std::chrono::duration<double>(Clock::now() - t0).count() - t_exposed;
        for (std::int64_t i = 0; i < 64; ++i) cache.release(i);
        if (me == 0 && r >= 0) {
          stalled.push_back(t_stalled);
          exposed.push_back(t_exposed);
          step.push_back(t_step);
        }
        std::vector<std::int64_t> total{std::int64_t(sent)};
        comm.all_reduce(std::span<const std::int64_t>(total), std::span<std::int64_t>(total), ReduceOp::sum);
        if (me == 0) bytes = std::size_t(total[0]);
      }
    });
    fmt::print("{:>10} {:>14} {:>12.3f} {:>16.3f} {:>12.3f}\n", f, bytes, median(stalled) * 1e3, median(exposed) * 1e3,
               median(step) * 1e3);
  }
  fmt::print("(thread ranks share one address space: a redistribution is a memory copy, and with as many ranks as "
             "cores nothing runs beside the compute, so the pipelined exposed time is close to the stalled one here)\n");
  return 0;
}
