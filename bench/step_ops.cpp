// bench/step_ops.cpp: where a training step's time goes, op by op, measured against the time model's price of each op
// (cost/op_times.hpp; issue 25: on one H200 the MoE GPT's steps ran at 0.73x their prediction while the dense GPT's
// were within 4-14%).
//
// One rank of the byte-level GPT (dense; or with --experts E --top-k K the MoE GPT, train_gpt's models) on --device
// cpu (ops::Cpu) or cuda (ops::Cuda, one GPU), every layer on one plan: attention --attention (default MegatronTS),
// the dense MLP MegatronTS, the MoE FFN ExpertParallel. STEPS steps of LENGTH random byte ids, each forward, backward
// and AdamW: the first warms up (allocator, cuBLAS), the others run untimed (the step's wall time) and then again
// with every op timed alone and priced on --profile (the profile train_gpt calibrated there). Prints, per op (sorted
// by measured time): calls, measured ms, priced ms, priced / measured; the sums; and the untimed step's median wall
// time against the priced sum (the time model's step on one rank, less what it prices between ops: allocations,
// where the profile prices them).
//
//   step_ops --profile FILE.json [--device cpu|cuda] [--layers 4] [--hidden 1024] [--heads 8] [--experts 0]
//            [--top-k 2] [--length 4096] [--steps 3] [--attention MegatronTS] [--csv FILE]
#include "paradyse/cli/flags.hpp"
#include "paradyse/comm/ranks.hpp"
#include "paradyse/core/csv_table.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/printable.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/cost/gemm_engines.hpp"
#include "paradyse/cost/op_times.hpp"
#include "paradyse/cost/profile_json.hpp"
#include "paradyse/model/byte_gpt.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/buffer_pool.hpp"
#if PARADYSE_WITH_CUDA
#include "paradyse/device/runtime.hpp"
#include "paradyse/ops/cuda_backend.hpp"
#endif

#include <fmt/core.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace pd = paradyse;

struct Options {
  std::string profile, device = "cpu", attention = "MegatronTS", csv;
  pd::ByteGptShape shape{.layers = 4, .hidden = 1024, .heads = 8};
  std::int64_t length = 4096;
  int steps = 3;
};

Options parse(int argc, char** argv) {
  Options o;
  pd::cli::Flags flags("step_ops", "Where one rank's training step goes, op by op: each op timed alone against "
                                   "the time model's price of it on a calibrated profile.");
  constexpr std::int64_t kMax = std::int64_t(1) << 20;
  flags.text("--profile", o.profile, "the hardware profile to price on (train_gpt's calibrated one, or a built-in)",
             "FILE.json|a100|h100|h200")
      .nonempty("a profile .json or a built-in name");
  flags.choice("--device", o.device, {"cpu", "cuda"}, "where the rank computes (cuda: one GPU, ops::Cuda)");
  flags.integer("--layers", o.shape.layers, 1, 1024, "layers");
  flags.integer("--hidden", o.shape.hidden, std::int64_t(1), kMax, "hidden size");
  flags.integer("--heads", o.shape.heads, std::int64_t(1), kMax, "attention heads");
  flags.integer("--experts", o.shape.experts, std::int64_t(0), kMax, "experts per MoE layer (0: the dense GPT)");
  flags.integer("--top-k", o.shape.top_k, std::int64_t(1), kMax, "experts per token");
  flags.integer("--length", o.length, std::int64_t(2), kMax, "tokens per step");
  flags.integer("--steps", o.steps, 2, 1000, "steps (the first warms up)");
  flags.choice("--attention", o.attention, {"MegatronTS", "MegatronCZ", "UlyssesZ", "ColossalZ", "METP"},
               "every layer's attention strategy");
  flags.text("--csv", o.csv, "also write the per-op table as CSV", "FILE");
  flags.parse(argc, argv);
  if (o.shape.hidden % o.shape.heads != 0)
    flags.fail(fmt::format("--hidden {} is not a multiple of --heads {}", o.shape.hidden, o.shape.heads));
  if (o.shape.experts > 0 && o.shape.top_k > o.shape.experts)
    flags.fail(fmt::format("--top-k {} exceeds --experts {}", o.shape.top_k, o.shape.experts));
  return o;
}

// The model of a rank over the backend Timed (cost::OpTimed<B>).
template <class Timed>
using TimedModel = pd::Gpt<pd::AllStrategies<Timed>, Timed>;

// The steps on `ranks` (one rank) of TimedModel<Timed>; returns the exit status.
template <class Timed, class RanksT>
int run(const Options& o, const pd::cost::HardwareProfile& profile, RanksT& ranks) {
  using Strategies = pd::AllStrategies<Timed>;
  using Model = TimedModel<Timed>;
  const pd::GptConfig config =
      o.shape.experts > 0 ? pd::moe_gpt_config(o.shape) : pd::byte_gpt_config(o.shape);
  const pd::StackPlan plan(std::size_t(config.layers),
                           pd::SublayerChoice{.attention = Strategies::index_of(o.attention),
                                              .mlp = Strategies::index_of("MegatronTS"), .moe = 0});
  pd::Rng rng(7);
  std::vector<std::int32_t> ids(std::size_t(o.length + 1));
  for (std::int32_t& id : ids) id = std::int32_t(rng.next_u64() % 256);
  pd::cost::OpTimes times(profile);
  std::vector<double> untimed;
  ranks.run([&](auto&, int r) {
    ranks.models[std::size_t(r)] = std::make_unique<Model>(config, 1, r, 1);
    ranks.pools[std::size_t(r)] = std::make_unique<pd::BufferPool>();
  });
  pd::ops::AdamWConfig adamw;
  adamw.learning_rate = 1e-4f;
  for (int step = 0; step < o.steps; ++step) {
    for (const bool timed : {false, true}) {
      if (step == 0 && timed) continue;  // the warm-up step runs once, untimed
      const pd::Timer start;
      ranks.run([&](auto& comm, int r) {
        Model& model = *ranks.models[std::size_t(r)];
        pd::MemoryTracker host;  // the token ids are host memory on every backend
        pd::Tensor<std::int32_t> x, y;
        {
          const pd::ScopedTracker on_host(host);
          x = pd::Tensor<std::int32_t>(pd::Shape{1, o.length});
          y = pd::Tensor<std::int32_t>(pd::Shape{1, o.length});
          std::copy_n(ids.begin(), o.length, x.data());
          std::copy_n(ids.begin() + 1, o.length, y.data());
        }
        std::optional<pd::cost::ScopedOpTimes> on;
        if (timed) on.emplace(times);
        model.zero_gradients();
        (void)model.forward_backward(comm, *ranks.pools[std::size_t(r)], plan, o.length, x.view(), y.view());
        model.optimizer_step(adamw);
      });
      if (step > 0 && !timed) untimed.push_back(start.seconds());
    }
  }

  const int counted = o.steps - 1;
  std::vector<std::pair<std::string, pd::cost::OpTime>> rows(times.by_op().begin(), times.by_op().end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.measured_s > b.second.measured_s; });
  fmt::print("{} GPT, {} layers, h={}, {} heads{}, {} tokens, one rank on {}; attention {}, profile {}\n",
             o.shape.experts > 0 ? "MoE" : "dense", config.layers, o.shape.hidden, o.shape.heads,
             o.shape.experts > 0 ? fmt::format(", {} experts top-{}", o.shape.experts, o.shape.top_k) : std::string(),
             o.length, o.device, o.attention, o.profile);
  fmt::print("per step (the mean of {} timed steps), each op timed alone:\n\n", counted);
  fmt::print("| op | calls | measured ms | priced ms | priced / measured |\n|---|---:|---:|---:|---:|\n");
  pd::CsvTable csv(o.csv, {"op", "calls", "measured_s", "priced_s"});
  for (const auto& [op, t] : rows) {
    fmt::print("| {} | {} | {:.3f} | {:.3f} | {:.2f} |\n", op, t.calls / counted, 1e3 * t.measured_s / counted,
               1e3 * t.priced_s / counted, t.measured_s > 0 ? t.priced_s / t.measured_s : 0.0);
    csv.row(op, double(t.calls) / counted, t.measured_s / counted, t.priced_s / counted);
  }
  const pd::cost::OpTime total = times.total();
  if (total.calls == 0 || untimed.empty()) throw pd::Error("no op was timed: the timed backend did not run the step");
  fmt::print("| all ops | {} | {:.3f} | {:.3f} | {:.2f} |\n\n", total.calls / counted, 1e3 * total.measured_s / counted,
             1e3 * total.priced_s / counted, total.measured_s > 0 ? total.priced_s / total.measured_s : 0.0);
  const double wall = pd::median(untimed);
  fmt::print("untimed step: median {:.3f} ms (min {:.3f}, max {:.3f}); priced ops / untimed step {:.2f}\n", 1e3 * wall,
             1e3 * *std::min_element(untimed.begin(), untimed.end()),
             1e3 * *std::max_element(untimed.begin(), untimed.end()), total.priced_s / counted / wall);
  csv.close();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    pd::cost::HardwareProfile profile = pd::cost::named_profile(o.profile);
    pd::cost::use_gemm_engines(profile);  // a calibrated CPU profile's GEMM engines, as train_gpt runs them
    if (o.device == "cuda") {
#if PARADYSE_WITH_CUDA
      pd::check(pd::device::available(), "--device cuda: {}", pd::device::unavailable_reason());
      using Timed = pd::cost::OpTimed<pd::ops::Cuda>;
      pd::DeviceRanks<TimedModel<Timed>, pd::BufferPool> ranks(1, std::numeric_limits<std::size_t>::max());
      return run<Timed>(o, profile, ranks);
#else
      throw pd::Error("--device cuda: this step_ops was built without CUDA (no nvcc found by CMake)");
#endif
    }
    using Timed = pd::cost::OpTimed<pd::ops::Cpu>;
    pd::Ranks<TimedModel<Timed>, pd::BufferPool> ranks(pd::RankBackend::threads, 1,
                                                       std::numeric_limits<std::size_t>::max());
    return run<Timed>(o, profile, ranks);
  } catch (const std::exception& e) {
    fmt::print(stderr, "step_ops: {}\n", pd::bounded_message(e.what()));
    return 1;
  }
}
