// The memory model against the memory tracker: the model's layer stack (model/stack.hpp) run on thread ranks with
// every strategy, over lengths, group sizes (uneven shards included), batch, causal zigzag, GQA with replicated kv
// heads, SwiGLU and RoPE. The tracker is deterministic and the model comes from a dry run of the same code, so the
// ordered estimate must equal the measured peak to the byte, and the planner's bound must never be below it.
#include "paradyse/cost/stack_measurement.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <string>

using namespace paradyse;
using namespace paradyse::cost;

namespace {

// The small kernel allocations the planner allows for beside its bound (plan/cost_table.hpp).
std::int64_t plan_kernel_allowance() { return 4096; }

void check_stack(const std::string& name, const LayerConfig& config, int p, std::int64_t batch, std::int64_t seq,
                 int layers, int s) {
  CAPTURE(name);
  CAPTURE(default_catalog().name(s));
  CAPTURE(seq);
  const StackMeasurement measured = measure_stack(s, config, p, batch, seq, layers);
  const std::int64_t predicted = predicted_activation_peak(s, config, p, batch, seq, layers);
  const std::int64_t bound = bounded_activation_peak(s, config, p, batch, seq, layers);
  const double error = double(predicted - measured.activation_peak_bytes) / double(measured.activation_peak_bytes);
  CHECK_MESSAGE(predicted == measured.activation_peak_bytes, fmt::format("predicted {} B, measured {} B ({:+.2f}%)", predicted,
                                                     measured.activation_peak_bytes, 100 * error));
  CHECK_MESSAGE(bound + plan_kernel_allowance() >= measured.activation_peak_bytes,
                fmt::format("the planner's bound {} B is below the measured {} B", bound, measured.activation_peak_bytes));
}

LayerConfig small(std::int64_t heads = 4) { return LayerConfig::make(64, heads); }

}  // namespace

TEST_CASE("memory validation: every strategy over lengths, on 4 ranks") {
  for (std::int64_t seq : {512, 1024, 2048})
    for (int s : default_catalog().all()) check_stack("lengths", small(), 4, 1, seq, 2, s);
}

TEST_CASE("memory validation: uneven shards, batches, causal zigzag, GQA, SwiGLU, RoPE, other group sizes") {
  LayerConfig causal = small();
  causal.causal = true;
  causal.zigzag = true;
  LayerConfig gqa = small();
  gqa.kv_heads = 2;  // replicated over 4 ranks
  LayerConfig swiglu = LayerConfig::make(64, 6);
  swiglu.head_dim = 16;
  swiglu.activation = Activation::swiglu;
  swiglu.ffn = 96;
  LayerConfig rope = small();
  rope.rope = true;
  for (int s : default_catalog().all()) {
    check_stack("uneven", small(), 4, 1, 1001, 2, s);
    check_stack("batch", small(), 4, 2, 512, 2, s);
    check_stack("causal zigzag", causal, 4, 1, 1024, 2, s);
    check_stack("gqa", gqa, 4, 1, 512, 2, s);
    check_stack("swiglu p=3", swiglu, 3, 1, 600, 3, s);
    check_stack("rope p=2", rope, 2, 1, 512, 1, s);
  }
}
