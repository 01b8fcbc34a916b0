// bench/serve_gemm_reuse.cpp: the served model's GEMMs timed by how many weight bytes are read between two uses of
// the same weight (the reuse distance), against the distance the serving calibration times them at.
//
// The serving profile's GEMMs (serve/serving_calibration.hpp serving_gemm_classes, the classes and the measured
// shapes) are each timed cycling through copies of its weights that add up to the weights a step reads when every
// expert is routed: what a prompt chunk reads. A decode step of one or two tokens reads the attention projections,
// the router, the lm_head and top_k experts a layer, far fewer bytes, and its weights come back sooner; the per-step
// tables priced decode steps after decode steps 13-23% further under their time than prompt steps (docs/
// serving_simulation.md, stop 46). This prints, per cycle size (a decode step's weights, fractions and multiples of
// the calibration's, 128 MB a rank: memory), the shapes' summed time at 1, 16 and `STEP_TOKENS` rows, each the median
// of PASSES passes' slowest rank, and the ratio to the calibration's cycle measured in the same run.
//
//   serve_gemm_reuse [--hf DIR] [RANKS=2] [STEP_TOKENS=64] [PASSES=3]
#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/serve/decoder_weights.hpp"
#include "paradyse/serve/serving_calibration.hpp"
#include "paradyse/serve/synthetic_decoder.hpp"

#include <fmt/core.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;

int main(int argc, char** argv) {
  std::string hf;
  std::vector<char*> args = {argv[0]};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--hf" && i + 1 < argc) hf = argv[++i];
    else args.push_back(argv[i]);
  }
  const auto arg = [&](std::size_t i, long fallback) { return args.size() > i ? std::atol(args[i]) : fallback; };
  const int ranks = int(arg(1, 2));
  const std::int64_t step_tokens = arg(2, 64);
  const int passes = int(arg(3, 3));
  if (ranks < 1 || step_tokens < 16 || passes < 1) {
    fmt::print(stderr, "usage: serve_gemm_reuse [--hf DIR] [RANKS=2] [STEP_TOKENS=64 (>= 16)] [PASSES=3]\n");
    return 2;
  }
  const LoadedDecoder model =
      hf.empty() ? synthetic_decoder(synthetic_config(256, 2, 8, 4, 8, 2, 512, 1024), 1, 0.3) : load_decoder(hf);
  const DecoderConfig& c = model.config;
  const cost::GemmClassOptions calibration = serving_gemm_classes(c, ranks, step_tokens);
  const std::array<std::int64_t, 3> rows = {1, 16, std::min<std::int64_t>(step_tokens, 128)};
  cost::GemmClassOptions options = calibration;
  options.passes = passes;
  options.shapes.clear();
  for (const auto& s : calibration.shapes)
    if (s[0] == rows[0] || s[0] == rows[1] || s[0] == rows[2]) options.shapes.push_back(s);
  const std::int64_t step = calibration.cold_bytes, decode = decode_weight_bytes(c, ranks);
  const std::vector<std::pair<std::string, std::int64_t>> cycles = {
      {"a decode step's weights", decode}, {"1/4 of a step's", step / 4}, {"1/2 of a step's", step / 2},
      {"a step's (calibration)", step},    {"2x a step's", 2 * step},     {"memory (128 MB)", std::int64_t(128) << 20}};
  fmt::print("serve_gemm_reuse: {} ({} layers, h {}, {} experts top-{}, ffn {}), {} thread ranks, {} GEMM shapes at "
             "{}, {} and {} rows, slowest rank, median of {} passes\n",
             hf.empty() ? "synthetic MoE" : hf, c.layers, c.hidden, c.moe.experts, c.moe.top_k, c.moe.expert_ffn, ranks,
             options.shapes.size() / rows.size(), rows[0], rows[1], rows[2], passes);
  // Per cycle: the summed time of the shapes at each row count.
  std::vector<std::array<double, 3>> sums;
  for (const auto& [name, bytes] : cycles) {
    cost::GemmClassOptions o = options;
    o.cold_bytes = bytes;
    std::vector<cost::GemmSample> got;
    run_ranks(ranks, [&](ThreadCommunicator& comm) {
      const cost::GemmClassCalibration r = cost::calibrate_gemm_classes(comm, o);
      if (comm.rank() == 0) got = r.samples;
    });
    std::array<double, 3> sum{};
    for (const cost::GemmSample& x : got)
      for (std::size_t i = 0; i < rows.size(); ++i) sum[i] += x.m == rows[i] ? x.seconds : 0;
    sums.push_back(sum);
  }
  const std::array<double, 3>& base = sums[3];
  fmt::print("{:<26} {:>10} {:>12} {:>12} {:>12}   ratio to the calibration's cycle\n", "weights cycled through",
             "MB a rank", fmt::format("{} rows us", rows[0]), fmt::format("{} rows us", rows[1]),
             fmt::format("{} rows us", rows[2]));
  for (std::size_t i = 0; i < cycles.size(); ++i)
    fmt::print("{:<26} {:>10.1f} {:>12.1f} {:>12.1f} {:>12.1f}   {:.2f} {:.2f} {:.2f}\n", cycles[i].first,
               double(cycles[i].second) / 1e6, sums[i][0] * 1e6, sums[i][1] * 1e6, sums[i][2] * 1e6,
               sums[i][0] / base[0], sums[i][1] / base[1], sums[i][2] / base[2]);
  return 0;
}
