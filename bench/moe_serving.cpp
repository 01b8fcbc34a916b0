// bench/moe_serving.cpp: the MoE serving engine's two layouts against batch size, and the cost of switching.
//
// Table 1: one decoder step (a synthetic Mixtral-shaped MoE, serve/synthetic_decoder.hpp) over B single-token
// requests on p thread ranks with the experts TP-sliced and EP-whole, against the same step on one rank (the
// baseline, measured in the same run): median ms per step, tokens/s, and the cost model's predicted TP/EP ratio
// (serve/switch_policy.hpp, rates measured here) beside the measured one; the crossover batch where EP overtakes TP.
// Table 2: the TP -> EP redistribution of every MoE layer against its bytes, for growing expert widths: stalled
// (all layers moved between steps, nothing to hide behind) and pipelined (each layer posted right after it
// computed during a step of 64 tokens, waited for at the end: the exposed part), with that step's own time.
// Table 3: on-demand expert loading (serve/expert_balance.hpp, PeerFetchWork) on a router-skewed model: one EP step
// of B single-token requests with the default split (the baseline, same run) and with on-demand loading from a cold
// cache (every moved piece fetched), its fetches overlapped with the held experts' compute or waited for at once:
// step time, the busiest rank's rows over the mean, bytes fetched, and the time spent waiting on the fetch messages
// (summed over the ranks); hidden = 1 - overlapped wait / at-once wait. Twice: with the thread ranks' plain copies,
// and with point-to-point messages paced to an emulated 1 GB/s link (comm/threads_detail.hpp, LinkPacing).
//
//   moe_serving [--p P] [--reps R]     P thread ranks (default 2), R timed repetitions per point (default 5)
//   moe_serving --help                (the flags, generated)
#include "paradyse/cli/flags.hpp"

#include "paradyse/comm/threads.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/serve/decoder_step.hpp"
#include "paradyse/serve/expert_balance.hpp"
#include "paradyse/serve/redistribute.hpp"
#include "paradyse/serve/switch_policy.hpp"
#include "paradyse/serve/synthetic_decoder.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;

namespace {

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
      const Timer timer;
      const StepResult out = decoder_step(comm, c, s, cache, std::span<const SequenceChunk>(chunks), pool);
      if (comm.rank() == 0 && r >= 0) times.push_back(timer.seconds());
      if (comm.rank() == 0 && routed && r < 0) *routed = out.moe_load[0].routed;
      for (std::int64_t i = 0; i < batch; ++i) cache.release(i);
    }
  });
  return median(times);
}

// One EP step of `batch` single-token requests on `p` ranks in three ways, alternated within each repetition (a load
// change on the shared machine hits all three alike): [0] the default split, [1] on-demand loading waiting for every
// fetch at once, [2] on-demand loading overlapped; both from a cold cache (every moved piece fetched). Medians over
// `reps` of the step (rank 0's clock) and of the fetch waits summed over the ranks; the bytes fetched (all ranks);
// the busiest rank's rows over the mean rank's (over the MoE layers).
struct EpPoint {
  double step_s = 0, wait_s = 0, bytes = 0, rank_imbalance = 0;
};
std::vector<EpPoint> ep_steps(const LoadedDecoder& m, int p, std::int64_t batch, int reps, double p2p_bytes_per_s) {
  std::vector<std::vector<double>> times(3), waits(3);
  std::vector<EpPoint> points(3);
  run_ranks(p, [&](ThreadCommunicator& comm) {
    const DecoderConfig& c = m.config;
    if (p2p_bytes_per_s > 0) comm.set_link_pacing({0, 0, 0, 1.0 / p2p_bytes_per_s});  // point-to-point only
    const RankShard s = make_rank_shard(c, m.weights, p, comm.rank(), MoeMode::ep);
    PagedKvCache cache({c.layers, batch + 1, 4, s.kv_heads.length, c.head_dim});
    BufferPool pool;
    std::vector<SequenceChunk> chunks;
    for (std::int64_t i = 0; i < batch; ++i) chunks.push_back({i, {std::int32_t((i * 37) % c.vocab)}, false});
    comm.barrier();
    for (int r = -1; r < reps; ++r)  // one warm-up
      for (std::size_t way = 0; way < 3; ++way) {
        PeerFetchWork<ThreadCommunicator> fetch(comm, false, c.moe.experts, way == 2);  // cold: every piece fetched
        ExpertWorkFn work;
        if (way > 0) work = [&](const RankShard& rs, std::int64_t l, const Dispatch& d) { return fetch(rs, l, d); };
        for (std::int64_t i = 0; i < batch; ++i) cache.reserve(i, 1);
        comm.barrier();
        const Timer timer;
        const StepResult out = decoder_step(comm, c, s, cache, std::span<const SequenceChunk>(chunks), pool, work);
        const double t = timer.seconds();
        std::vector<double> sums{fetch.stats().wait_s, double(fetch.stats().bytes_fetched)};
        comm.all_reduce(std::span<const double>(sums), std::span<double>(sums), ReduceOp::sum);
        for (std::int64_t i = 0; i < batch; ++i) cache.release(i);
        if (comm.rank() != 0 || r < 0) continue;
        times[way].push_back(t);
        waits[way].push_back(sums[0]);
        points[way].bytes = sums[1];
        double max_rows = 0, all_rows = 0, moe_layers = 0;
        for (const MoeLayerLoad& load : out.moe_load) {
          if (load.rank_rows.empty()) continue;
          ++moe_layers;
          for (const std::int64_t rows : load.rank_rows) {
            max_rows = std::max(max_rows, double(rows));
            all_rows += double(rows);
          }
        }
        points[way].rank_imbalance = all_rows > 0 ? max_rows / (all_rows / (double(p) * moe_layers)) : 1.0;
      }
  });
  for (std::size_t way = 0; way < 3; ++way) points[way].step_s = median(times[way]), points[way].wait_s = median(waits[way]);
  return points;
}

}  // namespace

int main(int argc, char** argv) {
  int p = 2, reps = 5;
  cli::Flags flags("moe_serving", "MoE serving: one decoder step against batch size in TP and EP layouts on p "
                                    "thread ranks against one rank, the crossover batch, the exposed time of a TP -> EP "
                                    "switch against its bytes, and on-demand expert loading's fetch wait.");
  flags.integer("--p", p, 1, 8, "thread ranks");
  flags.integer("--reps", reps, 1, 1000, "timed repetitions per point (medians are printed)");
  flags.parse(argc, argv);
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
        Timer step_timer;
        for (std::int64_t l = 0; l < cf.layers; ++l) moving[std::size_t(l)].begin(comm, cf, s.layers[std::size_t(l)], ExpertLayout::tp(), ep);
        for (std::int64_t l = 0; l < cf.layers; ++l) moving[std::size_t(l)].finish();
        const double t_stalled = step_timer.seconds();
        std::size_t sent = 0;
        for (const auto& mv : moving) sent += mv.bytes_sent();
        // Pipelined: posted after each layer of a 64-token step, finished at its end.
        RankShard s2 = make_rank_shard(cf, mf.weights, p, me, MoeMode::tp);
        std::vector<LayerRedistribution> moving2(std::size_t(cf.layers));
        double t_exposed = 0;
        for (std::int64_t i = 0; i < 64; ++i) cache.reserve(i, 1);
        comm.barrier();
        step_timer.restart();
        decoder_step(comm, cf, s2, cache, std::span<const SequenceChunk>(chunks), pool, {}, [&](std::int64_t l) {
          const Timer posting;
          moving2[std::size_t(l)].begin(comm, cf, s2.layers[std::size_t(l)], ExpertLayout::tp(), ep);
          t_exposed += posting.seconds();
        });
        const Timer finishing;
        for (std::int64_t l = 0; l < cf.layers; ++l) moving2[std::size_t(l)].finish();
        t_exposed += finishing.seconds();
        const double t_step = step_timer.seconds() - t_exposed;
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

  const double skew = 1.0;
  const DecoderConfig cs = synthetic_config(256, 2, 8, 4, 8, 2, 512, 1024);
  const LoadedDecoder ms = synthetic_decoder(cs, 3, skew);
  fmt::print("\non-demand expert loading (router skew {}: expert e's router row scaled by (1 + skew)^-e; rows: the "
             "busiest rank's over the mean; wt: ms waiting on fetch messages, summed over the ranks)\n",
             skew);
  fmt::print("{:>9} {:>6} {:>9} {:>8} {:>9} {:>8} {:>11} {:>11} {:>11} {:>11} {:>11} {:>7}\n", "p2p link", "batch",
             "EP ms", "EP rows", "OD ms", "OD rows", "MB fetched", "at-once ms", "at-once wt", "overlap ms",
             "overlap wt", "hidden");
  for (const double link : {0.0, 1e9})
    for (const std::int64_t batch : {16, 64, 256}) {
      const std::vector<EpPoint> w = ep_steps(ms, p, batch, reps, link);
      const EpPoint &ep = w[0], &late = w[1], &hidden = w[2];
      fmt::print("{:>9} {:>6} {:>9.3f} {:>8.2f} {:>9.3f} {:>8.2f} {:>11.2f} {:>11.3f} {:>11.3f} {:>11.3f} {:>11.3f} "
                 "{:>6.0f}%\n", link > 0 ? fmt::format("{:g} GB/s", link / 1e9) : "memcpy", batch, ep.step_s * 1e3,
                 ep.rank_imbalance, hidden.step_s * 1e3, hidden.rank_imbalance, hidden.bytes / 1e6,
                 late.step_s * 1e3, late.wait_s * 1e3, hidden.step_s * 1e3, hidden.wait_s * 1e3,
                 late.wait_s > 0 ? 100 * (1 - hidden.wait_s / late.wait_s) : 0.0);
    }
  fmt::print("(EP: the default split, each expert's rows to its holder; OD: on-demand loading, rows moved from the "
             "busiest rank to the least busy, which fetches the expert from its owner; at-once: every fetch waited "
             "for as soon as it is posted, the baseline of the overlap; thread ranks copy the weights inside the wait, "
             "so unpaced (memcpy) the overlap can hide only the owner's late arrival, not the copy; 1 GB/s: point-to-point "
             "messages held to 1 GB/s from their match (LinkPacing), an emulated link whose transfer the held experts' "
             "compute can hide)\n");
  return 0;
}
