// bench/layer_switch.cpp: what a TP <-> EP layout switch costs on this machine's thread ranks, against the time
// model's price of it (serve/step_cost.hpp layer_switch: host_s, the ranks' new banks and the copies of the pieces
// they keep; exchange_s, the pieces that travel; both copies from memory, at the profile's memory_copy_bytes_per_s
// where calibrated), and a memcpy of the same bytes measured in the same run, priced alike.
//
// moe_infer's synthetic MoE (2 layers, h 256, 8 experts, ffn 512) on RANKS thread ranks. Each repeat switches every
// MoE layer, alternately TP -> EP (the engine's even placement) and back, as a stalled switch (serve/engine.hpp with
// pipelined_switch off: every layer's LayerRedistribution begun, then all finished, nothing computing beside it).
// Per repeat, each rank's thread CPU in begin() (new banks, kept copies, posts: a thread transfer is copied by the
// rank that completes the match, so a rank's copies of received pieces fall in either phase) and in finish(), and
// rank 0's wall time for the whole switch; the table gives the median and the 10-90% range over the repeats, the
// slowest rank's CPU per repeat. The memcpy rows: every rank at once copies its kept bytes, and its kept plus received
// bytes, from one buffer into another (the source read, the destination written, as the switch does), the same
// repeats, the slowest rank's CPU.
//
//   layer_switch PROFILE.json [RANKS=2] [REPEATS=40]
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/host_malloc.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/serve/cluster_spec.hpp"
#include "paradyse/serve/redistribute.hpp"
#include "paradyse/serve/step_cost.hpp"
#include "paradyse/serve/synthetic_decoder.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;

namespace {

// Seconds per repeat of one measured piece.
struct Samples {
  std::vector<double> tp_to_ep, ep_to_tp;
  std::vector<double>& of(bool to_ep) { return to_ep ? tp_to_ep : ep_to_tp; }
};

std::string range_ms(const std::vector<double>& s) {
  if (s.empty()) return "-";
  return fmt::format("{:.3f} ({:.3f}-{:.3f})", 1e3 * median(s), 1e3 * percentile(s, 0.1), 1e3 * percentile(s, 0.9));
}

// Rank r's bytes of changing every MoE layer from `from` to `to` (float banks).
RankMoveBytes switch_move_bytes(const DecoderConfig& c, const ExpertLayout& from, const ExpertLayout& to, int p,
                                int r) {
  RankMoveBytes sum;
  for (std::int64_t l = 0; l < c.layers; ++l) {
    if (!c.is_moe(l)) continue;
    const RankMoveBytes b =
        move_bytes(redistribution_plan(from, to, c.moe.experts, c.moe.expert_ffn, p), c.hidden, p, 4)[std::size_t(r)];
    sum.sent += b.sent, sum.received += b.received, sum.kept += b.kept;
  }
  return sum;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    fmt::print(stderr, "usage: layer_switch PROFILE.json [RANKS=2] [REPEATS=40]\n");
    return 2;
  }
  const int ranks = argc > 2 ? std::atoi(argv[2]) : 2;
  const int repeats = argc > 3 ? std::atoi(argv[3]) : 40;
  check(ranks >= 2 && ranks <= 8, "layer_switch: RANKS = {}; expected 2 to 8 (the model's 8 heads)", ranks);
  check(repeats >= 2, "layer_switch: REPEATS = {}; expected at least 2", repeats);
  retain_freed_host_memory();  // as moe_infer and moe_simulate serve
  const SimulatedCluster cluster = simulated_cluster(argv[1], 4);
  const LoadedDecoder model = synthetic_decoder(synthetic_config(256, 2, 8, 4, 8, 2, 512, 1024), 1, 0.3);
  const DecoderConfig& c = model.config;
  const ExpertLayout tp = ExpertLayout::tp();
  const ExpertLayout ep = ExpertLayout::ep(ExpertPlacement::chunked(c.moe.experts, ranks).experts_of_rank);

  Samples begin_cpu, finish_cpu, wall, copy_kept, copy_all;  // written by rank 0 alone
  run_ranks(ranks, [&](ThreadCommunicator& comm) {
    RankShard s = make_rank_shard(c, model.weights, ranks, comm.rank(), MoeMode::tp);
    for (int i = 0; i < repeats + 2; ++i) {  // the first two (one each way) warm the banks' memory
      const bool to_ep = i % 2 == 0;
      const ExpertLayout &from = to_ep ? tp : ep, &to = to_ep ? ep : tp;
      comm.barrier();
      const Timer timer;
      const double c0 = thread_cpu_seconds();
      std::vector<LayerRedistribution> moving(static_cast<std::size_t>(c.layers));
      for (std::int64_t l = 0; l < c.layers; ++l)
        if (c.is_moe(l)) moving[std::size_t(l)].begin(comm, c, s.layers[std::size_t(l)], from, to);
      const double c1 = thread_cpu_seconds();
      for (std::int64_t l = 0; l < c.layers; ++l)
        if (c.is_moe(l)) moving[std::size_t(l)].finish();
      const double c2 = thread_cpu_seconds(), w = timer.seconds();
      // The slowest rank's CPU per phase (max over the ranks' all_reduce), rank 0's wall.
      std::vector<double> mine{c1 - c0, c2 - c1}, most(2);
      comm.all_reduce(std::span<const double>(mine), std::span<double>(most), ReduceOp::max);
      if (comm.rank() == 0 && i >= 2) {
        begin_cpu.of(to_ep).push_back(most[0]);
        finish_cpu.of(to_ep).push_back(most[1]);
        wall.of(to_ep).push_back(w);
      }
    }
    // The baselines: each rank's bytes of the same switches copied between two buffers of its own (written once,
    // before), all ranks at once as in the switch; the slowest rank's CPU.
    const auto bytes_of = [&](bool to_ep) {
      return switch_move_bytes(c, to_ep ? tp : ep, to_ep ? ep : tp, ranks, comm.rank());
    };
    const double most = std::max(bytes_of(true).kept + bytes_of(true).received,
                                 bytes_of(false).kept + bytes_of(false).received);
    std::vector<char> src(std::size_t(most), 1), dst(std::size_t(most), 0);
    for (int i = 0; i < repeats; ++i) {
      const bool to_ep = i % 2 == 0;
      const RankMoveBytes b = bytes_of(to_ep);
      for (auto [bytes, into] : {std::pair{b.kept, &copy_kept}, std::pair{b.kept + b.received, &copy_all}}) {
        comm.barrier();
        const double c0 = thread_cpu_seconds();
        std::memcpy(dst.data(), src.data(), std::size_t(bytes));
        const std::vector<double> mine{thread_cpu_seconds() - c0};
        std::vector<double> slowest(1);
        comm.all_reduce(std::span<const double>(mine), std::span<double>(slowest), ReduceOp::max);
        if (comm.rank() == 0) into->of(to_ep).push_back(slowest[0]);
      }
    }
  });

  // The model's price of the same switches: per layer the ranks' own work and the exchange (layer_switch), stalled.
  const cost::HardwareProfile& hw = cluster.profile;
  double own[2] = {0, 0}, exchange[2] = {0, 0}, kept_priced[2] = {0, 0}, all_priced[2] = {0, 0};
  for (int k = 0; k < 2; ++k) {
    const ExpertLayout &from = k == 0 ? tp : ep, &to = k == 0 ? ep : tp;
    for (std::int64_t l = 0; l < c.layers; ++l) {
      if (!c.is_moe(l)) continue;
      const LayerSwitch change = layer_switch(c, from, to, ranks, hw, 4);
      own[k] += change.host_s;
      exchange[k] += change.exchange_s;
    }
    for (int r = 0; r < ranks; ++r) {  // the slowest rank's copies
      const RankMoveBytes b = switch_move_bytes(c, from, to, ranks, r);
      kept_priced[k] = std::max(kept_priced[k], hw.memory_copy_time(2 * b.kept));
      all_priced[k] = std::max(all_priced[k], hw.memory_copy_time(2 * (b.kept + b.received)));
    }
  }
  fmt::print("layer_switch: synthetic MoE ({} layers, h {}, {} experts, ffn {}), {} thread ranks, {} repeats, "
             "priced on {}\n", c.layers, c.hidden, c.moe.experts, c.moe.expert_ffn, ranks, repeats, hw.name);
  const RankMoveBytes b0 = switch_move_bytes(c, tp, ep, ranks, 0), b1 = switch_move_bytes(c, ep, tp, ranks, 0);
  fmt::print("rank 0, every layer: TP -> EP keeps {:.2f} MB, receives {:.2f} MB; EP -> TP keeps {:.2f} MB, receives "
             "{:.2f} MB\n\n", b0.kept / 1e6, b0.received / 1e6, b1.kept / 1e6, b1.received / 1e6);
  fmt::print("| piece (ms: median, 10-90%) | TP -> EP measured | priced | EP -> TP measured | priced |\n");
  fmt::print("|---|---|---|---|---|\n");
  const auto row = [](const char* what, Samples& s, double p0, double p1) {
    fmt::print("| {} | {} | {:.3f} | {} | {:.3f} |\n", what, range_ms(s.tp_to_ep), 1e3 * p0, range_ms(s.ep_to_tp),
               1e3 * p1);
  };
  row("begin: new banks, kept copies, posts (slowest rank's CPU)", begin_cpu, own[0], own[1]);
  row("finish: the exchange's waits (slowest rank's CPU)", finish_cpu, exchange[0], exchange[1]);
  row("whole switch, rank 0's wall", wall, own[0] + exchange[0], own[1] + exchange[1]);
  row("memcpy of the kept bytes, every rank at once (baseline)", copy_kept, kept_priced[0], kept_priced[1]);
  row("memcpy of the kept + received bytes, every rank at once (baseline)", copy_all, all_priced[0], all_priced[1]);
  fmt::print("\nratio measured / priced, whole switch: TP -> EP {:.2f}, EP -> TP {:.2f}\n",
             median(wall.tp_to_ep) / (own[0] + exchange[0]), median(wall.ep_to_tp) / (own[1] + exchange[1]));
  return 0;
}
