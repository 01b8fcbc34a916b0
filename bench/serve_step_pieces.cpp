// bench/serve_step_pieces.cpp: where one serving step's time goes on this machine, piece by piece, against what the dry
// run (serve/step_dry_run.hpp) prices each piece at on a calibrated profile (issue 25: steps with a prompt chunk were
// simulated at 0.67-0.80x of their measured CPU time while their GEMMs fit within 4%).
//
// moe_infer's synthetic MoE (2 layers, h 256, 8 heads, 4 kv heads, 8 experts top-2, ffn 512), or with --hf DIR a
// Hugging Face folder (the trained 4-layer MoE train_gpt --save writes), on RANKS thread ranks, static TP (--ep: static
// EP, the engine's even placement). The batch's tokens differ (request i's token 11 + 37 i), so the router spreads them
// over the experts as real routing does. Rank 0's decoder_step runs on a backend that computes as ops::Cpu and times
// every op in thread CPU time (what moe_simulate --measure's cpu column and the calibration count); the all-reduces are
// timed too (a communicator that times them, as the engine's CpuClock counts them: a blocked wait is not counted, the
// copies and the wake-up are); the time between two ops is the step's own loops (the attention over the paged cache and
// the KV append follow the chunk's RoPE; DeepSeek's latent appends and attention lie between MLA's two batched GEMMs)
// and its allocations. Two steps: one prompt chunk of PROMPT tokens (a fresh request), and DECODE decode tokens whose
// requests hold CACHED positions. Each is run REPEATS times; the fastest run's pieces are printed (ms), and the untimed
// step's fastest, median, mean and 90% point over the repeats (the profile's rates are each a fastest run; the engine's
// tables are means of steps run once each), beside the dry run of the same step priced on PROFILE (GEMMs, the paged (or
// latent) attention kernel and its key/value stream, the other kernels, the all-reduces at the profile's collective
// line, allocations; the rest of the priced step is waiting for a slower rank).
//
//   serve_step_pieces [--hf DIR] [--ep] PROFILE.json [RANKS=2] [PROMPT=64] [DECODE=8] [CACHED=48] [REPEATS=20] [detail]
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/serve/cluster_spec.hpp"
#include "paradyse/serve/decoder_weights.hpp"
#include "paradyse/serve/step_dry_run.hpp"
#include "paradyse/serve/switch_policy.hpp"
#include "paradyse/serve/synthetic_decoder.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

// A backend that computes as ops::Cpu and times each op (thread CPU seconds): per op, and per gap between two ops.
namespace paradyse::ops::timed_bench {
struct Clock {
  std::map<std::string, double> ops, gaps;
  std::map<std::string, int> calls;
  double last_end = 0;
  std::string last = "step start";
  void start() {
    ops.clear(), gaps.clear(), calls.clear();
    last = "step start";
    last_end = thread_cpu_seconds();
  }
  void stop() { gaps[last + " -> step end"] += thread_cpu_seconds() - last_end; }
};
inline Clock& clock() {
  thread_local Clock c;
  return c;
}
struct Timed {
  const char* name;
  double begin;
  explicit Timed(const char* n) : name(n), begin(thread_cpu_seconds()) {
    Clock& c = clock();
    c.gaps[c.last + " -> " + name] += begin - c.last_end;
  }
  ~Timed() {
    Clock& c = clock();
    c.last_end = thread_cpu_seconds();
    c.ops[name] += c.last_end - begin;
    ++c.calls[name];
    c.last = name;
  }
};
struct TimedOps {
  static constexpr std::string_view name = "timed";
#define PARADYSE_TIMED(op)                 \
  template <class... A>                    \
  static decltype(auto) op(A&&... a) {     \
    const Timed t(#op);                    \
    return cpu::op(std::forward<A>(a)...); \
  }
#define PARADYSE_OP PARADYSE_TIMED
#include "paradyse/ops/op_names.inc"
#undef PARADYSE_OP
#undef PARADYSE_TIMED
};
using TimedCpu = BackendOf<TimedOps>;
}  // namespace paradyse::ops::timed_bench

namespace paradyse {
// The thread communicator with its blocking all-reduce (decoder_step's only collective) timed as an op.
struct TimedCommunicator : ThreadCommunicator {
  explicit TimedCommunicator(ThreadCommunicator&& c) : ThreadCommunicator(std::move(c)) {}
  TimedCommunicator split(int color, int key) { return TimedCommunicator(ThreadCommunicator::split(color, key)); }
  template <CommElement T>
  void all_reduce(std::type_identity_t<std::span<const T>> in, std::span<T> out, ReduceOp op) {
    const ops::timed_bench::Timed t("all_reduce");
    ThreadCommunicator::all_reduce(in, out, op);
  }
};
}  // namespace paradyse

using namespace paradyse;
using namespace paradyse::serve;
using ops::timed_bench::TimedCpu;

namespace {

// The measured pieces of one step (seconds).
struct Pieces {
  double gemm = 0, paged_attention = 0, other_ops = 0, all_reduce = 0, rest = 0, total = 0;
};

Pieces classify(const ops::timed_bench::Clock& c, double total) {
  Pieces p;
  p.total = total;
  for (const auto& [name, s] : c.ops) {
    const bool gemm = name == "matmul" || name == "gemm" || name == "gemm_batched" || name == "gemm_grouped";
    (name == "all_reduce" ? p.all_reduce : gemm ? p.gemm : p.other_ops) += s;
  }
  // The KV append and the attention loop run after each chunk's RoPE of k (before the next chunk's RoPE of q, or
  // the o projection); MLA's latent appends and loop between the absorption's batched GEMM and the expansion's.
  for (const auto& [name, s] : c.gaps) {
    const bool loops = name.rfind("rope_forward -> ", 0) == 0 || name == "gemm_batched -> gemm_batched";
    (loops ? p.paged_attention : p.rest) += s;
  }
  return p;
}

// The dry run's price of the same pieces on rank 0.
Pieces priced(const DecoderConfig& c, const StepTrace& t, const SimulatedCluster& cluster) {
  const cost::HardwareProfile& hw = cluster.profile;
  const RankStepTrace r = dry_run_step(c, t, 0);
  Pieces p;
  for (const TraceEvent& e : r.events) {
    // Each event at the clock's own price (cost/trace_cost.hpp), filed under its piece; GEMMs at the profile's rate
    // (the dry run's weight reuse distances are left to the total).
    const double s = cost::event_seconds(hw, e, cluster.dtype_bytes / 4.0, cluster.dtype_bytes);
    switch (e.kind) {
      case TraceKind::gemm: p.gemm += s; break;
      case TraceKind::attention_forward:
      case TraceKind::paged_attention:
      case TraceKind::latent_attention: p.paged_attention += s; break;
      case TraceKind::elementwise:
      case TraceKind::activation:
      case TraceKind::transcendental: p.other_ops += s; break;
      case TraceKind::allocate:
      case TraceKind::scratch: p.rest += s; break;
      case TraceKind::post:
        if (e.transfer == TransferKind::all_reduce) p.all_reduce += hw.collective_time(cost::Collective::all_reduce, t.ranks, e.bytes);
        break;
      default: break;
    }
  }
  // decoder_step's notes of the paged kernel, the KV append and the key/value stream (serve/step_cost.hpp
  // kv_traffic_time), are elementwise events above, in every layer; move them to the paged attention's piece.
  const double kv = double(c.layers) * kv_traffic_time(c, t, hw, 0, 4);
  p.other_ops -= kv;
  p.paged_attention += kv;
  const StepCost total = dry_run_step_cost(c, t, cluster);
  p.total = total.total_s();
  p.rest += total.communication_s - p.all_reduce;  // the rest: waiting for a slower rank
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  std::string hf;
  MoeMode mode = MoeMode::tp;
  std::vector<char*> args = {argv[0]};  // the positional arguments, after the flags are taken out
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--hf" && i + 1 < argc) hf = argv[++i];
    else if (a == "--ep") mode = MoeMode::ep;
    else args.push_back(argv[i]);
  }
  argc = int(args.size());
  argv = args.data();
  if (argc < 2) {
    fmt::print(stderr, "usage: serve_step_pieces [--hf DIR] [--ep] PROFILE.json [RANKS=2] [PROMPT=64] [DECODE=8] "
                       "[CACHED=48] [REPEATS=20] [detail]\n");
    return 2;
  }
  const auto arg = [&](int i, long fallback) { return argc > i ? std::atol(argv[i]) : fallback; };
  const int ranks = int(arg(2, 2));
  const std::int64_t prompt = arg(3, 64), decode = arg(4, 8), cached = arg(5, 48), repeats = arg(6, 20);
  const SimulatedCluster cluster = simulated_cluster(argv[1], 4);
  const LoadedDecoder model =
      hf.empty() ? synthetic_decoder(synthetic_config(256, 2, 8, 4, 8, 2, 512, 1024), 1, 0.3) : load_decoder(hf);
  const DecoderConfig& c = model.config;
  const ExpertLayout layout =
      mode == MoeMode::tp ? ExpertLayout::tp() : ExpertLayout::ep(ExpertPlacement::chunked(c.moe.experts, ranks).experts_of_rank);
  fmt::print("serve_step_pieces: {} ({} layers, h {}, {} heads, {} kv heads, {} experts top-{}, ffn {}), {} thread "
             "ranks, static {}, rank 0's thread CPU time (fastest of {}), against the dry run priced on {}\n",
             hf.empty() ? "synthetic MoE" : hf, c.layers, c.hidden, c.heads, c.kv_heads, c.moe.experts, c.moe.top_k,
             c.moe.expert_ffn, ranks, mode == MoeMode::tp ? "TP" : "EP", repeats, cluster.profile.name);
  struct Kind {
    std::string name;
    std::vector<ChunkShape> shape;
  };
  std::vector<Kind> kinds = {{fmt::format("prompt chunk of {}", prompt), {{prompt, 0, false}}}, {fmt::format("{} decode tokens at {} cached", decode, cached), {}}};
  for (std::int64_t i = 0; i < decode; ++i) kinds[1].shape.push_back({1, cached, true});
  // The cache's pool: 64 blocks of 16, or every request's positions of either kind, one block more each.
  const std::int64_t pool_blocks =
      std::max<std::int64_t>(64, (prompt + 15) / 16 + 1 + decode * ((cached + 16) / 16 + 1));
  for (const Kind& kind : kinds) {
    Pieces best;
    best.total = 1e30;
    ops::timed_bench::Clock detail;
    std::vector<double> plain;  // the same step on ops::Cpu, untimed, each repeat: the timers' own cost is the difference
    StepTrace trace;
    run_ranks(ranks, [&](ThreadCommunicator& thread_comm) {
      TimedCommunicator comm(std::move(thread_comm));
      ThreadCommunicator& plain_comm = comm;
      const RankShard shard = make_rank_shard(c, model.weights, ranks, comm.rank(), mode);
      PagedKvCache cache(kv_cache_shape(c, shard, pool_blocks, 16));
      BufferPool pool;
      std::vector<SequenceChunk> batch;
      for (std::size_t i = 0; i < kind.shape.size(); ++i) {
        const std::int64_t request = std::int64_t(i);
        if (kind.shape[i].cached > 0) {  // fill the request's cache first
          cache.reserve(request, kind.shape[i].cached);
          const SequenceChunk fill{request, std::vector<std::int32_t>(std::size_t(kind.shape[i].cached), 7)};
          decoder_step(plain_comm, c, shard, cache, std::span(&fill, 1), pool);
        }
        const auto token = std::int32_t((11 + 37 * i) % std::size_t(c.vocab));  // requests' tokens differ: routed apart
        batch.push_back({request, std::vector<std::int32_t>(std::size_t(kind.shape[i].tokens), token)});
      }
      for (std::int64_t rep = 0; rep < repeats; ++rep) {
        for (const SequenceChunk& ch : batch) cache.reserve(ch.request, std::int64_t(ch.tokens.size()));
        std::vector<std::int64_t> before;
        for (const SequenceChunk& ch : batch) before.push_back(cache.length(ch.request));
        comm.barrier();
        ops::timed_bench::clock().start();
        const double start = thread_cpu_seconds();
        const StepResult out = decoder_step<TimedCpu>(comm, c, shard, cache, batch, pool);
        const double total = thread_cpu_seconds() - start;
        ops::timed_bench::clock().stop();
        if (comm.rank() == 0 && total < best.total) {
          best = classify(ops::timed_bench::clock(), total);
          detail = ops::timed_bench::clock();
          trace = {};
          trace.ranks = ranks;
          for (std::size_t i = 0; i < batch.size(); ++i) trace.chunks.push_back(kind.shape[i]);
          for (const MoeLayerLoad& l : out.moe_load) trace.routed.push_back(l.routed);
          trace.layout.assign(std::size_t(c.layers), layout);
          trace.next.assign(std::size_t(c.layers), std::nullopt);
        }
        for (const SequenceChunk& ch : batch) cache.release(ch.request);
        for (std::size_t i = 0; i < batch.size(); ++i) {
          cache.reserve(batch[i].request, before[i] + std::int64_t(batch[i].tokens.size()));
          if (before[i] > 0) {
            const SequenceChunk fill{batch[i].request, std::vector<std::int32_t>(std::size_t(before[i]), 7)};
            decoder_step(plain_comm, c, shard, cache, std::span(&fill, 1), pool);
          }
        }
        comm.barrier();
        const double plain_start = thread_cpu_seconds();
        decoder_step(plain_comm, c, shard, cache, batch, pool);
        if (comm.rank() == 0) plain.push_back(thread_cpu_seconds() - plain_start);
        // Roll the cache back so that every repeat sees the same lengths: release and refill is what a fresh
        // request costs; here the decode requests keep their blocks (reserve is idempotent on length).
        for (std::size_t i = 0; i < batch.size(); ++i) {
          cache.release(batch[i].request);
          if (before[i] > 0) {
            cache.reserve(batch[i].request, before[i]);
            const SequenceChunk fill{batch[i].request, std::vector<std::int32_t>(std::size_t(before[i]), 7)};
            decoder_step(plain_comm, c, shard, cache, std::span(&fill, 1), pool);
          }
        }
      }
    });
    const Pieces dry = priced(c, trace, cluster);
    fmt::print("\n{}: {} tokens, rank 0 (ms)\n{:<44} {:>9} {:>9} {:>7}\n", kind.name, trace.tokens(), "piece",
               "measured", "dry run", "ratio");
    const auto row = [](const char* what, double m, double s) {
      fmt::print("{:<44} {:>9.3f} {:>9.3f} {:>6.2f}x\n", what, m * 1e3, s * 1e3, s / std::max(1e-12, m));
    };
    row("GEMMs", best.gemm, dry.gemm);
    row("paged attention + KV append (the loops)", best.paged_attention, dry.paged_attention);
    row("other backend ops (norms, RoPE, router...)", best.other_ops, dry.other_ops);
    row("all-reduces", best.all_reduce, dry.all_reduce);
    row("between ops (allocations, waits...)", best.rest, dry.rest);
    row("step", best.total, dry.total);
    // The untimed repeats' fastest, median and mean: the engine's tables are means of steps run once each.
    const Spread untimed = spread_of(plain);
    const double mean = std::accumulate(plain.begin(), plain.end(), 0.0) / double(plain.size());
    fmt::print("{:<44} {:>9.3f} (median {:.3f}, mean {:.3f}, 90% {:.3f})\n", "step on ops::Cpu, untimed, fastest",
               untimed.min * 1e3, untimed.median * 1e3, mean * 1e3, percentile(plain, 0.9) * 1e3);
    // The dynamic policy's host work before this step (serve/engine.hpp, rank 0): the switcher's forecast of the step
    // in both layouts and the switch to the other, on a fresh pricer (the engine's misses: the cached lengths move
    // every step). Thread CPU time, median of the repeats.
    std::vector<double> forecast_s;
    std::int64_t dry_runs = 0;
    for (std::int64_t rep = 0; rep < repeats; ++rep) {
      DryRunPricer price(c, cluster);
      const StepPricer pricer = [&](const StepTrace& s) { return price(s); };
      const double start = thread_cpu_seconds();
      (void)forecast_layouts(c, trace.chunks, trace.routed, trace.layout, layout.mode == MoeMode::ep ? layout : ExpertLayout::ep(ExpertPlacement::chunked(c.moe.experts, ranks).experts_of_rank), ranks, true, pricer);
      forecast_s.push_back(thread_cpu_seconds() - start);
      dry_runs = price.misses();
    }
    fmt::print("{:<44} {:>9.3f} ({} dry runs)\n", "the dynamic policy's forecast (host)", median(forecast_s) * 1e3, dry_runs);
    if (argc > 7) {
      for (const auto& [name, s] : detail.ops) fmt::print("  op  {:<40} {:>9.3f} ms {:>5} calls\n", name, s * 1e3, detail.calls[name]);
      for (const auto& [name, s] : detail.gaps) fmt::print("  gap {:<40} {:>9.3f} ms\n", name, s * 1e3);
    }
  }
  return 0;
}
