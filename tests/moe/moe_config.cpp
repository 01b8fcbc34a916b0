// tests/moe/moe_config.cpp: MoeConfig::validate names each bad value and what is expected; the expert layout (the
// chunking rule, uneven counts) and the shard shapes.
#include "paradyse/moe/moe_config.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

using namespace paradyse;

namespace {
MoeConfig good() {
  MoeConfig c;
  c.hidden = 16;
  c.experts = 8;
  c.top_k = 2;
  c.expert_ffn = 32;
  return c;
}
}  // namespace

TEST_CASE("MoeConfig: a good config validates; each bad value is an Error naming it and what is expected") {
  CHECK_NOTHROW(good().validate());
  MoeConfig shared = good();
  shared.shared_experts = 2;
  shared.shared_ffn = 8;
  shared.shared_gate = true;
  shared.capacity_factor = 1.25;
  shared.aux_loss_coef = 0.01;
  shared.z_loss_coef = 0.001;
  CHECK_NOTHROW(shared.validate());
  CHECK(shared.shared_width() == 16);

  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<std::pair<std::function<void(MoeConfig&)>, std::string>> bad = {
      {[](MoeConfig& c) { c.hidden = 0; }, "hidden = 0 must be at least 1"},
      {[](MoeConfig& c) { c.experts = -3; }, "experts = -3 must be at least 1"},
      {[](MoeConfig& c) { c.top_k = 0; }, "top_k = 0 must be in [1, experts = 8]"},
      {[](MoeConfig& c) { c.top_k = 9; }, "top_k = 9 must be in [1, experts = 8]"},
      {[](MoeConfig& c) { c.expert_ffn = 0; }, "expert_ffn = 0 must be at least 1"},
      {[](MoeConfig& c) { c.scoring = RouterScoring(7); }, "scoring = 7 must be softmax or sigmoid"},
      {[](MoeConfig& c) { c.routed_scaling_factor = 0; }, "routed_scaling_factor = 0 must be finite and positive"},
      {[&](MoeConfig& c) { c.routed_scaling_factor = nan; }, "routed_scaling_factor = nan"},
      {[](MoeConfig& c) { c.shared_experts = -1; }, "shared_experts = -1 must be non-negative"},
      {[](MoeConfig& c) { c.shared_experts = 2; }, "shared_ffn = 0 must be at least 1 with 2 shared experts"},
      {[](MoeConfig& c) { c.shared_gate = true; }, "shared_gate needs shared experts"},
      {[](MoeConfig& c) { c.capacity_factor = -0.5; }, "capacity_factor = -0.5 must be 0 (dropless) or finite and positive"},
      {[](MoeConfig& c) { c.capacity_factor = std::numeric_limits<double>::infinity(); }, "capacity_factor = inf"},
      {[](MoeConfig& c) { c.aux_loss_coef = -1; }, "aux_loss_coef = -1 must be finite and non-negative"},
      {[&](MoeConfig& c) { c.z_loss_coef = nan; }, "z_loss_coef = nan must be finite and non-negative"},
  };
  for (const auto& [spoil, message] : bad) {
    MoeConfig c = good();
    spoil(c);
    CAPTURE(message);
    CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains(message.c_str()), Error);
  }
}

TEST_CASE("owned_experts: whole experts per rank, the first E % p ranks own one more, contiguous and complete") {
  MoeConfig c = good();
  c.experts = 6;
  const std::int64_t want_start[] = {0, 2, 4, 5}, want_length[] = {2, 2, 1, 1};
  for (int r = 0; r < 4; ++r) {
    CHECK(owned_experts(c, 4, r).start == want_start[r]);
    CHECK(owned_experts(c, 4, r).length == want_length[r]);
  }
  for (std::int64_t e : {1, 3, 5, 8, 16})
    for (int p = 1; p <= 8; ++p) {
      c.experts = e;
      std::int64_t next = 0;
      for (int r = 0; r < p; ++r) {
        const ChunkRange mine = owned_experts(c, p, r);
        CHECK(mine.start == next);
        CHECK(mine.length >= e / p);
        CHECK(mine.length <= e / p + 1);
        next = mine.end();
      }
      CHECK(next == e);
    }
}

TEST_CASE("MoeShard::zeros: rank r's shapes") {
  MoeConfig c = good();
  c.experts = 5;
  c.shared_experts = 2;
  c.shared_ffn = 4;
  c.shared_gate = true;
  const MoeShard s = MoeShard::zeros(c, 3, 2);  // owns expert 4 only
  CHECK(s.router.shape() == Shape{5, 16});
  CHECK(s.expert_in.shape() == Shape{1, 64, 16});
  CHECK(s.expert_out.shape() == Shape{1, 32, 16});
  CHECK(s.shared_in.shape() == Shape{16, 16});
  CHECK(s.shared_out.shape() == Shape{8, 16});
  CHECK(s.shared_gate.shape() == Shape{1, 16});
  c.shared_gate = false;
  c.shared_experts = 0;
  const MoeShard plain = MoeShard::zeros(c, 1, 0);
  CHECK(plain.expert_in.shape() == Shape{5, 64, 16});
  CHECK(plain.shared_in.numel() == 0);
  CHECK(plain.shared_gate.numel() == 0);
}
