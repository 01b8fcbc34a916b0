// bench/ring_bench: ring attention and the ring strategies on thread ranks, against single-rank baselines measured
// in the same run.
//
//   ring_bench           table 1 at s = 4096, table 2 at s = 2048
//   ring_bench --quick   s = 1024 for both
//
// Table 1, ring attention forward + backward (causal, 4 heads, d = 64, b = 1) over p ranks, contiguous and zigzag
// token layouts. Each rank's time is its thread CPU time (the machine is shared and has fewer cores than ranks:
// CPU time counts the rank's own work and copies, not the time it waited or was descheduled). "busiest" is the
// slowest rank (what the ring's wall time would be with a core per rank), "balance" = busiest / mean, "speedup" =
// the single-rank flash attention forward + backward over the whole sequence (measured in the same run) / busiest;
// ideal = p. Zigzag should be balanced (~1.0); contiguous causal leaves the last rank with most of the work.
// Table 2, one layer's sublayers (forward + backward) per strategy on 2 ranks: busiest-rank CPU time, its ratio to
// MegatronTS (the baseline), and the per-rank peak bytes above the inputs (saved + transient, from the tracker).
// Medians of several repetitions; never asserted.
#include "paradyse/cli/flags.hpp"
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/ring_attention.hpp"
#include "paradyse/strategy/strategies.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

using namespace paradyse;

namespace {

// Per repetition: the busiest and the mean rank CPU seconds.
struct RankTimes {
  std::vector<double> busiest, mean;
};

// Runs body(comm) `reps` times (after a warm-up) on p ranks; each repetition is fenced by barriers.
RankTimes time_ranks(int p, int reps, const std::function<void(ThreadCommunicator&, std::function<void()>&)>& setup) {
  std::vector<std::vector<double>> per_rank(static_cast<std::size_t>(p), std::vector<double>(static_cast<std::size_t>(reps)));
  run_ranks(p, [&](ThreadCommunicator& comm) {
    std::function<void()> body;
    setup(comm, body);
    body();  // warm-up: fills the pools, faults the pages
    for (int rep = 0; rep < reps; ++rep) {
      comm.barrier();
      const double start = thread_cpu_seconds();
      body();
      per_rank[std::size_t(comm.rank())][std::size_t(rep)] = thread_cpu_seconds() - start;
      comm.barrier();
    }
  });
  RankTimes times;
  for (int rep = 0; rep < reps; ++rep) {
    double most = 0.0, sum = 0.0;
    for (int r = 0; r < p; ++r) {
      most = std::max(most, per_rank[std::size_t(r)][std::size_t(rep)]);
      sum += per_rank[std::size_t(r)][std::size_t(rep)];
    }
    times.busiest.push_back(most);
    times.mean.push_back(sum / p);
  }
  return times;
}

// ---- table 1: ring attention --------------------------------------------------------------------------------------
void ring_attention_table(std::int64_t s, int reps) {
  const std::int64_t heads = 4, d = 64, b = 1;
  fmt::print("ring attention, causal, b = {}, heads = {}, d = {}, s = {} (forward + backward, CPU ms)\n", b, heads, d, s);
  // The baseline: one rank, the flash kernels over the whole sequence.
  double baseline = 0.0;
  {
    Rng rng(1);
    const Tensor<float> q = random_uniform<float>(Shape{b, s, heads, d}, rng), k = random_uniform<float>(Shape{b, s, heads, d}, rng),
                        v = random_uniform<float>(Shape{b, s, heads, d}, rng), dout = random_uniform<float>(Shape{b, s, heads, d}, rng);
    Tensor<float> out(q.shape()), lse(Shape{b, heads, s}), dq(q.shape()), dk(q.shape()), dv(q.shape());
    const ops::AttentionMask mask{.causal = true};
    std::vector<double> t;
    for (int rep = 0; rep <= reps; ++rep) {
      const double start = thread_cpu_seconds();
      ops::Cpu::attention_forward(q, k, v, mask, out, lse);
      ops::Cpu::attention_backward(q, k, v, out, lse, dout, mask, dq, dk, dv);
      if (rep > 0) t.push_back(thread_cpu_seconds() - start);
    }
    baseline = median(t);
  }
  fmt::print("{:>3} {:>10} {:>10} {:>10} {:>8} {:>11} {:>8} {:>6} {:>12}\n", "p", "layout", "busiest", "mean", "balance",
             "baseline", "speedup", "ideal", "KV MB/rank");
  for (int p : {1, 2, 4})
    for (bool zigzag : {false, true}) {
      if (p == 1 && zigzag) continue;
      const SequenceLayout layout(s, p, zigzag);
      std::vector<double> megabytes(static_cast<std::size_t>(p));
      const RankTimes times = time_ranks(p, reps, [&](ThreadCommunicator& comm, std::function<void()>& body) {
        const std::int64_t n = layout.local_length(comm.rank());
        Rng rng(10 + std::uint64_t(comm.rank()));
        auto q = std::make_shared<Tensor<float>>(random_uniform<float>(Shape{b, n, heads, d}, rng));
        auto k = std::make_shared<Tensor<float>>(random_uniform<float>(Shape{b, n, heads, d}, rng));
        auto v = std::make_shared<Tensor<float>>(random_uniform<float>(Shape{b, n, heads, d}, rng));
        auto dout = std::make_shared<Tensor<float>>(random_uniform<float>(Shape{b, n, heads, d}, rng));
        auto out = std::make_shared<Tensor<float>>(Shape{b, n, heads, d});
        auto lse = std::make_shared<Tensor<float>>(Shape{b, heads, n});
        auto dq = std::make_shared<Tensor<float>>(Shape{b, n, heads, d});
        auto dk = std::make_shared<Tensor<float>>(Shape{b, n, heads, d});
        auto dv = std::make_shared<Tensor<float>>(Shape{b, n, heads, d});
        auto pool = std::make_shared<BufferPool>();
        const RingAttentionSpec spec{layout, true};
        body = [&comm, spec, q, k, v, dout, out, lse, dq, dk, dv, pool, &megabytes] {
          const CommStats before = comm.stats();
          ring_attention_forward(comm, spec, *pool, q->view(), k->view(), v->view(), out->view(), lse->view());
          ring_attention_backward(comm, spec, *pool, q->view(), k->view(), v->view(), out->view(), lse->view(),
                                  dout->view(), dq->view(), dk->view(), dv->view());
          megabytes[std::size_t(comm.rank())] = double(comm.stats().bytes_sent - before.bytes_sent) / 1e6;
        };
      });
      const double busiest = median(times.busiest), mean = median(times.mean);
      fmt::print("{:>3} {:>10} {:>10.1f} {:>10.1f} {:>8.2f} {:>11.1f} {:>8.2f} {:>6} {:>12.2f}\n", p,
                 zigzag ? "zigzag" : "contiguous", 1e3 * busiest, 1e3 * mean, busiest / mean, 1e3 * baseline,
                 baseline / busiest, p, *std::max_element(megabytes.begin(), megabytes.end()));
    }
  fmt::print("\n");
}

// ---- table 2: the strategies' sublayers ---------------------------------------------------------------------------
void strategy_table(std::int64_t s, int reps) {
  using Strategies = AllStrategies<>;
  const int p = 2;
  LayerConfig c = LayerConfig::make(256, 8);
  c.causal = true;
  c.zigzag = true;
  c.rope = true;
  const std::int64_t b = 1;
  fmt::print("strategies on {} ranks: h = {}, heads = {}, d = {}, ffn = {}, b = {}, s = {}, causal zigzag RoPE "
             "(forward + backward, busiest-rank CPU ms; peak = per-rank bytes above the inputs)\n",
             p, c.hidden, c.heads, c.head_dim, c.ffn, b, s);
  fmt::print("{:>11} {:>11} {:>8} {:>12} {:>9} {:>8} {:>12}\n", "strategy", "attention", "vs TS", "attn peak MB", "mlp",
             "vs TS", "mlp peak MB");
  const Strategies strategies;
  double ts_attention = 0.0, ts_mlp = 0.0;
  for (std::size_t choice = 0; choice < Strategies::count; ++choice) {
    double result[2] = {0.0, 0.0};
    double peak_mb[2] = {0.0, 0.0};
    for (int sublayer = 0; sublayer < 2; ++sublayer) {
      std::vector<double> peaks(static_cast<std::size_t>(p));
      const RankTimes times = time_ranks(p, reps, [&](ThreadCommunicator& comm, std::function<void()>& body) {
        auto pool = std::make_shared<BufferPool>();
        auto ctx = std::make_shared<SublayerContext>(c, p, b, s, *pool);
        auto weights = std::make_shared<LayerWeights>(init_shard(c, p, comm.rank(), 7));
        auto grads = std::make_shared<LayerWeights>(c, p);
        Rng rng(20 + std::uint64_t(comm.rank()));
        const std::int64_t n = ctx->local_tokens(comm.rank());
        auto x = std::make_shared<Tensor<float>>(random_uniform<float>(Shape{b, n, c.hidden}, rng));
        auto dy = std::make_shared<Tensor<float>>(random_uniform<float>(Shape{b, n, c.hidden}, rng));
        auto y = std::make_shared<Tensor<float>>(Shape{b, n, c.hidden});
        auto dx = std::make_shared<Tensor<float>>(Shape{b, n, c.hidden});
        body = [&comm, &strategies, &peaks, choice, sublayer, pool, ctx, weights, grads, x, dy, y, dx] {
          MemoryTracker& tracker = MemoryTracker::current();
          pool->trim();  // count the strategy's transients, not buffers cached from the last repetition
          const std::size_t before = tracker.in_use();
          tracker.reset_peak();
          if (sublayer == 0) {
            auto saved = strategies.attention_forward(choice, comm, *ctx, weights->attention, x->view(), y->view());
            strategies.attention_backward(comm, *ctx, weights->attention, saved, dy->view(), dx->view(), grads->attention);
          } else {
            auto saved = strategies.mlp_forward(choice, comm, *ctx, weights->mlp, x->view(), y->view());
            strategies.mlp_backward(comm, *ctx, weights->mlp, saved, dy->view(), dx->view(), grads->mlp);
          }
          peaks[std::size_t(comm.rank())] = double(tracker.peak() - before) / 1e6;
        };
      });
      result[sublayer] = median(times.busiest);
      peak_mb[sublayer] = *std::max_element(peaks.begin(), peaks.end());
    }
    if (choice == 0) {
      ts_attention = result[0];
      ts_mlp = result[1];
    }
    fmt::print("{:>11} {:>11.1f} {:>8.2f} {:>12.2f} {:>9.1f} {:>8.2f} {:>12.2f}\n", Strategies::name(choice),
               1e3 * result[0], result[0] / ts_attention, peak_mb[0], 1e3 * result[1], result[1] / ts_mlp, peak_mb[1]);
  }
  fmt::print("\n");
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  paradyse::cli::Flags flags("ring_bench", "Ring attention balance and speedup vs single-rank flash; per-strategy "
                                             "sublayer time and peak vs MegatronTS.");
  flags.flag("--quick", quick, "shorter sequences (1024) and fewer repetitions");
  flags.parse(argc, argv);
  ring_attention_table(quick ? 1024 : 4096, quick ? 3 : 5);
  strategy_table(quick ? 1024 : 2048, 3);
  return 0;
}
