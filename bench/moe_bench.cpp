// bench/moe_bench: one MoE FFN sublayer (moe/moe_layer.hpp), forward + backward, on one rank and under
// ExpertParallel and ExpertTensorParallel on p thread ranks, at a few token counts, with balanced and skewed routing.
//
//   moe_bench                 h = 256, E = 8, k = 2, f = 512, p = 4, tokens 256, 1024, 4096, 16384, 32768
//   moe_bench --help          (the flags, generated from parse())
//
// Table 1, per token count (global, over the p ranks), routing and strategy: forward + backward as the busiest
// rank's thread CPU time (the machine may have fewer cores than ranks; CPU time counts each rank's own work) and
// wall time, medians of --reps; the speedup of the busiest rank over the same layer on ONE rank holding every token
// (measured in this run); the largest expert load over the mean (routing skew); bytes sent by the busiest rank; the
// per-rank peak bytes of the tracker. Then the crossover per routing: the fewest tokens from which
// ExpertTensorParallel is faster than ExpertParallel, measured here (busiest rank's CPU time: thread ranks copy
// instead of sending, so traffic costs little here) and predicted by the cost model for an H100 node (the strategies'
// dry runs, cost/moe_cost.hpp, balanced routing: where moving the experts' 3 E f h weights beats moving the tokens). "skewed" biases the router towards a Zipf(1.2) load through a constant input
// feature (the measured max/mean load is printed, not assumed). Weights and tokens are the same for every strategy.
// Table 2, the machine ratio the grouped GEMM is judged by: the experts' forward over E ragged blocks against one
// GEMM of the same FLOPs (an expert block of T k / E rows) in the same run. Nothing is asserted.
#include "paradyse/cli/flags.hpp"
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/moe_cost.hpp"
#include "paradyse/moe/moe_layer.hpp"
#include "paradyse/ops/backend.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

using namespace paradyse;

namespace {

struct Options {
  std::int64_t h = 256, experts = 8, k = 2, ffn = 512;
  int p = 4, reps = 3;
  std::vector<std::int64_t> tokens = {256, 1024, 4096, 16384, 32768};
};

Options parse(int argc, char** argv) {
  Options o;
  std::string tokens;
  paradyse::cli::Flags flags("moe_bench", "One MoE FFN sublayer, forward + backward, on one rank and under "
                                            "ExpertParallel and ExpertTensorParallel on p thread ranks.");
  // First, so that flags given with it override what it sets (CLI11 applies options in the order defined here).
  flags.flag("--quick", [&o] { o.tokens = {256, 1024}, o.reps = 2; }, "tokens 256,1024 and 2 repetitions");
  constexpr std::int64_t kMax = std::int64_t(1) << 24;
  flags.integer("--h", o.h, std::int64_t(1), kMax, "hidden size");
  flags.integer("--experts", o.experts, std::int64_t(1), kMax, "experts");
  flags.integer("--k", o.k, std::int64_t(1), kMax, "experts per token");
  flags.integer("--ffn", o.ffn, std::int64_t(1), kMax, "expert FFN width");
  flags.integer("--p", o.p, 1, 1 << 24, "thread ranks");
  flags.integer("--reps", o.reps, 1, 1 << 24, "repetitions");
  flags.text("--tokens", tokens, "token counts, each in [1, 2^24] (default: 256,1024,4096,16384,32768)", "A,B,...");
  flags.parse(argc, argv);
  if (!tokens.empty()) {
    o.tokens.clear();
    for (std::size_t at = 0; at <= tokens.size();) {
      const std::size_t comma = std::min(tokens.find(',', at), tokens.size());
      const std::string item = tokens.substr(at, comma - at);
      std::int64_t v = 0;
      if (!paradyse::cli::parse_integer(item, std::int64_t(1), kMax, v))
        flags.fail(fmt::format("--tokens: '{}' must be an integer in [1, 2^24]", item));
      o.tokens.push_back(v);
      at = comma + 1;
    }
  }
  if (o.k > o.experts) throw Error(fmt::format("--k = {} exceeds --experts = {}", o.k, o.experts));
  return o;
}

// The whole layer's weights (every expert), x and dy for `tokens` tokens; skewed: feature 0 is 1 for every token and
// the router's column 0 holds log of expert e's Zipf(1.2) probability (up to a constant), a prior on top of the
// random per-token logits (about Gumbel-max sampling from Zipf: the measured load is printed).
struct Problem {
  MoeConfig config;
  Tensor<float> router, expert_in, expert_out, x, dy;
};

Problem make_problem(const Options& o, std::int64_t tokens, bool skewed) {
  Problem pr;
  MoeConfig& c = pr.config;
  c.hidden = o.h;
  c.experts = o.experts;
  c.top_k = o.k;
  c.expert_ffn = o.ffn;
  c.norm_topk_prob = true;
  c.aux_loss_coef = 0.01;
  Rng rng(17);
  const double s = 1.0 / std::sqrt(double(o.h));
  // Router logits with a spread of about 1.3 per token (x in [-1, 1)): random per-token preferences.
  pr.router = random_uniform<float>(Shape{o.experts, o.h}, rng, -4 * s, 4 * s);
  pr.expert_in = random_uniform<float>(Shape{o.experts, 2 * o.ffn, o.h}, rng, -s, s);
  pr.expert_out = random_uniform<float>(Shape{o.experts, o.ffn, o.h}, rng, -s, s);
  pr.x = random_uniform<float>(Shape{tokens, o.h}, rng);
  pr.dy = random_uniform<float>(Shape{tokens, o.h}, rng);
  if (skewed) {
    for (std::int64_t t = 0; t < tokens; ++t) pr.x(t, 0) = 1.0f;
    for (std::int64_t e = 0; e < o.experts; ++e) pr.router(e, 0) = float(-1.2 * std::log(double(e + 1)));
  }
  return pr;
}

// Rank r's shard of the problem's weights.
MoeShard shard_of(const Problem& pr, int p, int r) {
  const MoeConfig& c = pr.config;
  MoeShard w = MoeShard::zeros(c, p, r);
  const ChunkRange mine = owned_experts(c, p, r);
  ops::Cpu::copy(pr.router.view(), w.router.view());
  ops::Cpu::copy(pr.expert_in.view().slice(0, mine.start, mine.length), w.expert_in.view());
  ops::Cpu::copy(pr.expert_out.view().slice(0, mine.start, mine.length), w.expert_out.view());
  return w;
}

struct Row {
  double cpu = 0, wall = 0, skew = 0;
  std::uint64_t bytes = 0;
  std::size_t peak = 0;
};

// kind 0: one rank with every token; 1: ExpertParallel; 2: ExpertTensorParallel.
Row measure(const Options& o, const Problem& pr, int kind) {
  const int p = kind == 0 ? 1 : o.p;
  const std::int64_t tokens = pr.x.extent(0), h = o.h;
  std::vector<double> cpu(static_cast<std::size_t>(p)), wall(static_cast<std::size_t>(p));
  std::vector<std::uint64_t> bytes(static_cast<std::size_t>(p));
  double skew = 0;
  const RunReport report = run_ranks(p, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    const ChunkRange rows = chunk_range(tokens, p, r);
    Tensor<float> x(Shape{1, rows.length, h}), dy(Shape{1, rows.length, h}), y(Shape{1, rows.length, h}),
        dx(Shape{1, rows.length, h});
    ops::Cpu::copy(pr.x.view().slice(0, rows.start, rows.length), x.view().reshape(Shape{rows.length, h}));
    ops::Cpu::copy(pr.dy.view().slice(0, rows.start, rows.length), dy.view().reshape(Shape{rows.length, h}));
    const MoeShard w = shard_of(pr, p, r);
    MoeShard grad = MoeShard::zeros(pr.config, p, r);
    BufferPool pool;
    const MoeContext ctx(pr.config, pool);
    std::vector<double> cpu_reps, wall_reps;
    for (int rep = 0; rep <= o.reps; ++rep) {  // rep 0 warms up
      comm.barrier();
      comm.reset_stats();
      const double c0 = thread_cpu_seconds(), w0 = wall_seconds();
      MoeSaved saved = kind == 0   ? moe_forward(ctx, w, x.view(), y.view())
                       : kind == 1 ? ExpertParallel<>{}.forward(comm, ctx, w, x.view(), y.view())
                                   : ExpertTensorParallel<>{}.forward(comm, ctx, w, x.view(), y.view());
      if (kind == 0) moe_backward(ctx, w, saved, dy.view(), dx.view(), grad);
      else if (kind == 1) ExpertParallel<>{}.backward(comm, ctx, w, saved, dy.view(), dx.view(), grad);
      else ExpertTensorParallel<>{}.backward(comm, ctx, w, saved, dy.view(), dx.view(), grad);
      const double c1 = thread_cpu_seconds();
      comm.barrier();
      const double w1 = wall_seconds();
      if (rep > 0) cpu_reps.push_back(c1 - c0), wall_reps.push_back(w1 - w0);
      bytes[std::size_t(r)] = comm.stats().bytes_sent;
      if (r == 0) {
        const auto& routed = saved.losses.routed;
        double total = 0, most = 0;
        for (auto n : routed) total += double(n), most = std::max(most, double(n));
        skew = total > 0 ? most / (total / double(routed.size())) : 0;
      }
    }
    cpu[std::size_t(r)] = median(cpu_reps);
    wall[std::size_t(r)] = median(wall_reps);
  });
  Row row;
  row.cpu = *std::max_element(cpu.begin(), cpu.end());
  row.wall = *std::max_element(wall.begin(), wall.end());
  row.bytes = *std::max_element(bytes.begin(), bytes.end());
  row.peak = *std::max_element(report.peak_bytes.begin(), report.peak_bytes.end());
  row.skew = skew;
  return row;
}

}  // namespace

int main(int argc, char** argv) try {
  const Options o = parse(argc, argv);
  fmt::print("moe_bench: h = {}, E = {}, k = {}, f = {} per expert, SwiGLU, p = {} thread ranks, {} reps (median)\n\n",
             o.h, o.experts, o.k, o.ffn, o.p, o.reps);
  fmt::print("{:>7} {:>9} {:>21} {:>10} {:>10} {:>8} {:>8} {:>11} {:>10}\n", "tokens", "routing", "strategy", "cpu ms",
             "wall ms", "speedup", "max/mean", "sent MiB", "peak MiB");
  const char* names[] = {"one rank (baseline)", "ExpertParallel", "ExpertTensorParallel"};
  // [routing][token count]: EP's and ETP's busiest-rank CPU time.
  std::vector<double> ep_cpu[2], etp_cpu[2];
  for (const std::int64_t tokens : o.tokens)
    for (const bool skewed : {false, true}) {
      const Problem pr = make_problem(o, tokens, skewed);
      double baseline = 0;
      for (int kind = 0; kind < 3; ++kind) {
        const Row row = measure(o, pr, kind);
        if (kind == 0) baseline = row.cpu;
        if (kind == 1) ep_cpu[skewed].push_back(row.cpu);
        if (kind == 2) etp_cpu[skewed].push_back(row.cpu);
        fmt::print("{:>7} {:>9} {:>21} {:>10.2f} {:>10.2f} {:>7.2f}x {:>8.2f} {:>11.2f} {:>10.2f}\n", tokens,
                   skewed ? "skewed" : "balanced", names[kind], 1e3 * row.cpu, 1e3 * row.wall,
                   row.cpu > 0 ? baseline / row.cpu : 0.0, row.skew, double(row.bytes) / (1 << 20),
                   double(row.peak) / (1 << 20));
      }
    }

  // The crossover: the fewest tokens from which ETP stays faster than EP (every larger count too).
  const auto crossover = [&](const std::vector<double>& ep, const std::vector<double>& etp) -> std::string {
    std::size_t from = ep.size();
    while (from > 0 && etp[from - 1] < ep[from - 1]) --from;
    if (from == ep.size()) return fmt::format("EP faster at every count ({}..{} tokens)", o.tokens.front(), o.tokens.back());
    if (from == 0) return fmt::format("ETP faster at every count ({}..{} tokens)", o.tokens.front(), o.tokens.back());
    return fmt::format("ETP faster from {} tokens on (EP at {})", o.tokens[from], o.tokens[from - 1]);
  };
  fmt::print("\ncrossover, measured here (busiest rank's CPU time): balanced: {}; skewed: {}\n", crossover(ep_cpu[0], etp_cpu[0]),
             crossover(ep_cpu[1], etp_cpu[1]));
  {
    const cost::HardwareProfile h100 = cost::builtin_profile("H100-SXM-80GB-x8");
    MoeConfig c;
    c.hidden = o.h;
    c.experts = o.experts;
    c.top_k = o.k;
    c.expert_ffn = o.ffn;
    c.norm_topk_prob = true;
    fmt::print("predicted on {} by the strategies' dry runs (balanced routing, p = {}, fp32):\n", h100.name, o.p);
    fmt::print("{:>7} {:>12} {:>12} {:>10} {:>10} {:>8}\n", "tokens", "EP ms", "ETP ms", "EP MiB", "ETP MiB", "faster");
    std::vector<double> ep, etp;
    for (const std::int64_t tokens : o.tokens) {
      const std::int64_t local = (tokens + o.p - 1) / o.p;
      const cost::SublayerTrace ep_trace = moe_dry_run<ExpertParallel>(c, o.p, 0, 1, local);
      const cost::SublayerTrace etp_trace = moe_dry_run<ExpertTensorParallel>(c, o.p, 0, 1, local);
      const cost::SublayerCost a = cost::cost_of(ep_trace, &h100), b = cost::cost_of(etp_trace, &h100);
      const auto sent = [](const cost::SublayerTrace& t) {
        double bytes = 0;
        for (const auto* phase : {&t.forward, &t.backward})
          for (const TraceEvent& e : *phase)
            if (e.kind == TraceKind::post) bytes += e.bytes;
        return bytes / (1 << 20);
      };
      ep.push_back(a.time_s());
      etp.push_back(b.time_s());
      fmt::print("{:>7} {:>12.3f} {:>12.3f} {:>10.2f} {:>10.2f} {:>8}\n", tokens, 1e3 * a.time_s(), 1e3 * b.time_s(),
                 sent(ep_trace), sent(etp_trace), b.time_s() < a.time_s() ? "ETP" : "EP");
    }
    fmt::print("crossover, predicted: {} (MiB: bytes each rank posts, forward + backward)\n", crossover(ep, etp));
  }

  // Grouped GEMM against one GEMM of the same FLOPs: the experts' forward over E equal blocks of T k / E rows vs
  // one [E * rows, h] x [h, 2f] and [E * rows, f] x [f, h] pair (both with the SwiGLU between).
  fmt::print("\ngrouped GEMM (experts_forward over E blocks) vs one GEMM of the same FLOPs, one thread:\n");
  fmt::print("{:>12} {:>14} {:>14} {:>8} {:>10}\n", "block rows", "grouped GF/s", "single GF/s", "ratio", "goal 70%");
  for (const std::int64_t block : {std::int64_t(64), std::int64_t(256), std::int64_t(1024)}) {
    const Problem pr = make_problem(o, 1, false);
    const std::int64_t rows = block * o.experts;
    Rng rng(3);
    const Tensor<float> x = random_uniform<float>(Shape{rows, o.h}, rng);
    Tensor<float> pre(Shape{rows, 2 * o.ffn}), y(Shape{rows, o.h}), act(Shape{rows, o.ffn});
    std::vector<std::int64_t> offsets;
    for (std::int64_t e = 0; e <= o.experts; ++e) offsets.push_back(e * block);
    BufferPool pool;
    const double flops = 2.0 * double(rows) * double(o.h) * double(3 * o.ffn);
    std::vector<double> grouped, single;
    for (int rep = 0; rep <= o.reps; ++rep) {
      double t0 = thread_cpu_seconds();
      experts_forward<ops::Cpu>({pr.expert_in.view(), pr.expert_out.view()}, offsets, x.view(), pre.view(), y.view(), pool);
      double t1 = thread_cpu_seconds();
      if (rep > 0) grouped.push_back(t1 - t0);
      t0 = thread_cpu_seconds();
      ops::Cpu::matmul(x.view(), ops::Transpose::no,
                       pr.expert_in.view().slice(0, 0, 1).reshape(Shape{2 * o.ffn, o.h}), ops::Transpose::yes, pre.view());
      ops::Cpu::swiglu_forward(pre.view().slice(1, 0, o.ffn), pre.view().slice(1, o.ffn, o.ffn), act.view());
      ops::Cpu::matmul(act.view(), ops::Transpose::no, pr.expert_out.view().slice(0, 0, 1).reshape(Shape{o.ffn, o.h}),
                       ops::Transpose::no, y.view());
      t1 = thread_cpu_seconds();
      if (rep > 0) single.push_back(t1 - t0);
    }
    const double g = flops / median(grouped) / 1e9, s = flops / median(single) / 1e9;
    fmt::print("{:>12} {:>14.2f} {:>14.2f} {:>7.0f}% {:>10}\n", block, g, s, 100 * g / s,
               block < 256 ? "(n/a)" : g >= 0.7 * s ? "met" : "missed");
  }
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "moe_bench: {}\n", e.what());
  return 1;
}
