// LayerConfig validation and ShardGeometry: clear errors for layers the unified layout cannot shard, and the
// shard sizes for MHA, GQA and replicated kv heads.
#include "paradyse/contract/layer_config.hpp"
#include "support/error_of.hpp"

#include <doctest/doctest.h>

#include <string>

using paradyse::testing::error_of;

using namespace paradyse;

TEST_CASE("LayerConfig: validation names the offending value") {
  LayerConfig c = LayerConfig::make(64, 8);
  CHECK_NOTHROW(c.validate());
  CHECK(c.head_dim == 8);
  CHECK(c.kv_heads == 8);
  CHECK(c.ffn == 256);

  LayerConfig bad = c;
  bad.kv_heads = 3;
  CHECK(error_of([&] { bad.validate(); }).find("kv_heads = 3 must divide heads = 8") != std::string::npos);
  bad = c;
  bad.hidden = 0;
  CHECK(error_of([&] { bad.validate(); }).find("hidden = 0") != std::string::npos);
  bad = c;
  bad.rope = true;
  bad.head_dim = 5;
  CHECK(error_of([&] { bad.validate(); }).find("head_dim = 5 must be even") != std::string::npos);
  bad = c;
  bad.norm_eps = 0.0;
  CHECK_THROWS_AS(bad.validate(), Error);
}

TEST_CASE("LayerConfig: the unified layout's requirements on p") {
  LayerConfig c = LayerConfig::make(48, 6);
  CHECK_NOTHROW(c.validate_for(3));
  CHECK(error_of([&] { c.validate_for(4); }).find("heads = 6 must be divisible by the group size p = 4") != std::string::npos);
  c.ffn = 50;
  CHECK(error_of([&] { c.validate_for(3); }).find("ffn = 50") != std::string::npos);
  c = LayerConfig::make(64, 8);
  c.kv_heads = 2;
  CHECK_NOTHROW(c.validate_for(4));  // replicated: p % kv == 0
  CHECK_NOTHROW(c.validate_for(2));
  c.heads = 12;
  c.kv_heads = 3;
  c.ffn = 48;
  CHECK(error_of([&] { c.validate_for(2); }).find("kv_heads = 3 must be a multiple of p = 2 or divide it") != std::string::npos);
}

TEST_CASE("ShardGeometry: MHA, GQA and replicated kv heads") {
  LayerConfig c = LayerConfig::make(64, 8);  // d = 8
  const ShardGeometry mha(c, 4);
  CHECK(mha.q_heads == 2);
  CHECK(mha.kv_heads == 2);
  CHECK(mha.group_size == 1);
  CHECK(mha.qkv_rows == 2 * 3 * 8);
  CHECK(mha.proj_rows == 16);
  CHECK(mha.ffn == 64);
  CHECK(mha.ffn_in_rows == 64);
  CHECK(mha.first_kv_head(3) == 6);

  c.kv_heads = 4;
  const ShardGeometry gqa(c, 2);
  CHECK(gqa.q_heads == 4);
  CHECK(gqa.kv_heads == 2);
  CHECK(gqa.group_size == 2);
  CHECK(!gqa.kv_replicated());
  CHECK(gqa.qkv_rows == (4 + 4) * 8);

  c.kv_heads = 2;
  c.activation = Activation::swiglu;
  const ShardGeometry replicated(c, 8);
  CHECK(replicated.q_heads == 1);
  CHECK(replicated.kv_heads == 1);
  CHECK(replicated.kv_replicas == 4);
  CHECK(replicated.group_size == 1);
  CHECK(replicated.first_kv_head(3) == 0);
  CHECK(replicated.first_kv_head(4) == 1);
  CHECK(replicated.ffn_in_rows == 2 * 32);
}
