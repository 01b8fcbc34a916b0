// Tests of paradyse/cost/memory_model.hpp: properties of the per-strategy memory model and the whole-model peak.
// (The model is checked against the memory tracker of the CPU strategies in tests/cost/memory_validation.cpp.)
#include "paradyse/cost/memory_model.hpp"

#include <doctest/doctest.h>

#include <string_view>
#include <vector>

using namespace paradyse;
using namespace paradyse::cost;

namespace {
ModelShape shape(std::int64_t s) { return ModelShape::mha(1024, 16, s, 4); }
int id(std::string_view name) { return default_catalog().index_of(name); }
}  // namespace

TEST_CASE("memory_model: saved and transient bytes never shrink as sequences grow") {
  for (int s : default_catalog().all())
    for (Sublayer part : kAllSublayers) {
      SublayerMemory previous{};
      for (std::int64_t len : {512, 1024, 4096, 16384, 32768}) {
        const SublayerMemory m = sublayer_memory(s, part, shape(len), 8);
        CHECK(m.saved_bytes >= previous.saved_bytes);
        CHECK(m.transient_bytes() >= previous.transient_bytes());
        CHECK(m.saved_bytes > 0);
        previous = m;
      }
    }
}

TEST_CASE("memory_model: the strategies' known memory traits") {
  const ModelShape m = shape(32768);
  const int p = 8;
  const auto saved = [&](int s) {
    return sublayer_memory(s, Sublayer::attention, m, p).saved_bytes + sublayer_memory(s, Sublayer::mlp, m, p).saved_bytes;
  };
  // METP keeps the least for backward; ColossalZ keeps the s x s/p scores.
  for (int s : {id("MegatronTS"), id("MegatronCZ"), id("UlyssesZ"), id("ColossalZ")})
    CHECK(saved(id("METP")) < saved(s));
  const double scores = double(m.batch) * m.heads * (m.seq / p) * m.seq * m.dtype_bytes;
  CHECK(sublayer_memory(id("ColossalZ"), Sublayer::attention, m, p).saved_bytes > scores);
  // MegatronTS gathers the whole sequence: its transient holds at least one b x s x h tensor.
  CHECK(sublayer_memory(id("MegatronTS"), Sublayer::mlp, m, p).transient_bytes() >=
        m.batch * m.seq * m.hidden * m.dtype_bytes);
  // The ZeRO MLP gathers the whole W_out (f x h).
  CHECK(sublayer_memory(id("MegatronCZ"), Sublayer::mlp, m, p).transient_bytes() >=
        m.ffn * m.hidden * m.dtype_bytes);
}

TEST_CASE("memory_model: model states are the unified shards, the same for every strategy") {
  const ModelShape m = shape(4096);
  const int p = 4;
  // Per rank: 1/p of W_qkv, W_proj, W_in, W_out, plus replicated norm parameters; 16 bytes per parameter.
  const std::int64_t per_layer = (4 * m.hidden * m.hidden + 2 * m.hidden * m.ffn) / p + 4 * m.hidden;
  CHECK(model_state_bytes(m, p) == m.layers * per_layer * 16);
  CHECK(model_state_bytes(m, p, {.parameter_bytes = 4, .gradient_bytes = 4, .optimizer_bytes = 8}) ==
        m.layers * per_layer * 16);
  CHECK(model_state_bytes(m, p, {.parameter_bytes = 4, .gradient_bytes = 4, .optimizer_bytes = 0}) ==
        m.layers * per_layer * 8);
}

TEST_CASE("memory_model: the whole-model bound is all saved activations plus the largest transients, once") {
  const ModelShape m = shape(16384);
  const std::vector<LayerStrategies> layers{{id("MegatronTS"), id("MegatronTS")},
                                            {id("UlyssesZ"), id("METP")},
                                            {id("METP"), id("MegatronCZ")},
                                            {id("METP"), id("METP")}};
  const MemoryEstimate e = estimate_memory(m, 8, layers);
  std::int64_t saved = 0, pool = 0, plain = 0;
  for (const LayerStrategies& l : layers) {
    for (const SublayerMemory& s :
         {sublayer_memory(l.attention, Sublayer::attention, m, 8), sublayer_memory(l.mlp, Sublayer::mlp, m, 8)}) {
      saved += s.saved_bytes;
      pool = std::max({pool, s.forward_pool_bytes, s.backward_pool_bytes});
      plain = std::max({plain, s.forward_plain_bytes, s.backward_plain_bytes});
    }
  }
  // The stack's own buffers: two activations and the norm gradient sums [L, 4, h].
  const std::int64_t activation = round_allocation(double(m.batch * (m.seq / 8) * m.hidden * m.dtype_bytes));
  const std::int64_t stack = 2 * activation + round_allocation(double(m.layers * 4 * m.hidden * 4));
  CHECK(e.saved_activations == saved);
  CHECK(e.largest_transient == pool + plain);
  CHECK(e.model_states == model_state_bytes(m, 8) + stack);
  CHECK(e.peak() == model_state_bytes(m, 8) + stack + saved + pool + plain);
  // The ordered peak never exceeds the bound, and is at least everything saved.
  CHECK(e.ordered_peak() <= e.peak());
  CHECK(e.ordered_activations >= saved);
  CHECK_THROWS_WITH_AS(estimate_memory(m, 8, std::vector<LayerStrategies>(3)),
                       doctest::Contains("3 layer strategies for a model of 4 layers"), Error);
}

TEST_CASE("memory_model: the ordered replay follows the buffer pool's rule") {
  // One layer whose forward lends two buffers (both kept by the pool), then a backward that needs a third size:
  // the pool evicts the larger cached buffer to stay under its high-water mark.
  SublayerMemory attention, mlp;
  attention.forward_events = {{MemoryEvent::plain, 1000}, {MemoryEvent::acquire, 4096}, {MemoryEvent::acquire, 2048},
                              {MemoryEvent::give_back, 4096}, {MemoryEvent::give_back, 2048}};
  attention.backward_events = {{MemoryEvent::acquire, 3072}, {MemoryEvent::give_back, 3072},
                               {MemoryEvent::release, -1000}};
  mlp.forward_events = {{MemoryEvent::plain, 500}};
  mlp.backward_events = {{MemoryEvent::plain, 64}, {MemoryEvent::plain, -64}, {MemoryEvent::release, -500}};
  const std::vector<SublayerMemory> layer{attention, mlp};
  // Forward: 1500 plain (both saves) with 6144 pooled, kept after the give-backs. Backward runs the MLP first (64
  // more plain with the pool still holding 6144), then attention: a miss for 3072 under a high-water mark of 6144
  // evicts the cached 4096 and holds 2048 + 3072.
  CHECK(ordered_activation_peak(layer) == 1500 + 64 + 6144);
  // A large request late in backward, after 3000 plain bytes: the peak is just before it (6144 still cached); the
  // miss evicts both cached buffers, so the 5000 do not add to them (that would make 15644).
  SublayerMemory late = attention;
  late.backward_events = {{MemoryEvent::plain, 3000}, {MemoryEvent::acquire, 5000}, {MemoryEvent::give_back, 5000},
                          {MemoryEvent::plain, -3000}, {MemoryEvent::release, -1000}};
  const std::vector<SublayerMemory> evicting{late, mlp};
  CHECK(ordered_activation_peak(evicting) == 1500 + 3000 + 6144);
  // The layer's saved bytes stay until both sublayers' backward is done.
  SublayerMemory big = attention;
  big.backward_events = {{MemoryEvent::release, -1000}, {MemoryEvent::acquire, 8192}, {MemoryEvent::give_back, 8192}};
  const std::vector<SublayerMemory> deferred{big, mlp};
  CHECK(ordered_activation_peak(deferred) == 1500 + 8192);
}

TEST_CASE("memory_model: uneven shards are sized by the rank holding the most tokens") {
  ModelShape even = shape(1024), uneven = shape(1021);
  for (int s : {id("MegatronCZ"), id("METP")}) {
    // ceil(1021 / 4) = 256 = 1024 / 4 tokens on the fullest rank.
    CHECK(sublayer_memory(s, Sublayer::mlp, uneven, 4).saved_bytes ==
          sublayer_memory(s, Sublayer::mlp, even, 4).saved_bytes);
  }
}
