// paradyse/moe/moe_weights.hpp: the global (unsharded) weights of one MoE FFN sublayer, their deterministic
// initialisation, and the bridge to and from the per-rank shards (MoeShard, moe/moe_config.hpp).
//
// Initialisation draws every global row from its own Rng stream keyed by (seed, matrix, expert, row), so the global
// model is the same for any p and a rank draws only its own experts' rows. Standard deviations: 1/sqrt(fan_in) for
// the expert and shared matrices (W_out's fan-in is its ffn width), 1/sqrt(h) for the shared gate, and a small
// router (router_std, default 0.02 as in Mixtral's and Qwen's initialisers) so that routing starts near uniform.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/moe/moe_config.hpp"

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

namespace paradyse {

template <class T>
struct GlobalMoeWeights {
  Tensor<T> router;       // [E, h]
  Tensor<T> expert_in;    // [E, 2f, h]: per expert the gate rows, then the up rows (W_in^T)
  Tensor<T> expert_out;   // [E, f, h]: W_out
  Tensor<T> shared_in;    // [2 fs, h]
  Tensor<T> shared_out;   // [fs, h]
  Tensor<T> shared_gate;  // [1, h] with a shared gate, else [0, h]

  // No weights (every tensor [0]): a dense layer's entry in a list of per-layer MoE weights.
  GlobalMoeWeights()
      : router(Shape{0}), expert_in(Shape{0}), expert_out(Shape{0}), shared_in(Shape{0}), shared_out(Shape{0}),
        shared_gate(Shape{0}) {}
  explicit GlobalMoeWeights(const MoeConfig& c)
      : router(Shape{c.experts, c.hidden}), expert_in(Shape{c.experts, 2 * c.expert_ffn, c.hidden}),
        expert_out(Shape{c.experts, c.expert_ffn, c.hidden}), shared_in(Shape{2 * c.shared_width(), c.hidden}),
        shared_out(Shape{c.shared_width(), c.hidden}), shared_gate(Shape{c.shared_gate ? 1 : 0, c.hidden}) {}
};

namespace moe_weights_detail {

enum class Matrix : std::uint64_t { router = 0x61, expert_in, expert_out, shared_in, shared_out, shared_gate };

template <class T>
void init_row(std::uint64_t seed, Matrix m, std::int64_t expert, std::int64_t row, double std_dev, std::span<T> out) {
  Rng mix(seed ^ (std::uint64_t(m) * 0x9e3779b97f4a7c15ull) ^ (std::uint64_t(expert + 1) * 0xbf58476d1ce4e5b9ull));
  mix.next_u64();
  Rng rng(mix.next_u64() ^ (std::uint64_t(row) * 0xd1b54a32d192ed03ull));
  rng.fill_normal(out, std_dev);
}

// Fills rows [0, rows) of `t` viewed as [rows, h] from matrix m of expert `expert` (rows of that matrix).
template <class T>
void init_rows(std::uint64_t seed, Matrix m, std::int64_t expert, double std_dev, T* at, std::int64_t rows,
               std::int64_t h) {
  for (std::int64_t r = 0; r < rows; ++r) init_row(seed, m, expert, r, std_dev, std::span<T>(at + r * h, std::size_t(h)));
}

template <class T, class Weights>
void init_into(const MoeConfig& c, std::uint64_t seed, double router_std, std::int64_t first_expert,
               std::int64_t expert_count, Weights& w) {
  const std::int64_t h = c.hidden, f = c.expert_ffn, fs = c.shared_width();
  const double in_std = 1.0 / std::sqrt(double(h)), out_std = 1.0 / std::sqrt(double(f));
  init_rows(seed, Matrix::router, -1, router_std, w.router.data(), c.experts, h);
  for (std::int64_t e = 0; e < expert_count; ++e) {
    init_rows(seed, Matrix::expert_in, first_expert + e, in_std, w.expert_in.data() + e * 2 * f * h, 2 * f, h);
    init_rows(seed, Matrix::expert_out, first_expert + e, out_std, w.expert_out.data() + e * f * h, f, h);
  }
  if (fs > 0) {
    init_rows(seed, Matrix::shared_in, -1, in_std, w.shared_in.data(), 2 * fs, h);
    init_rows(seed, Matrix::shared_out, -1, 1.0 / std::sqrt(double(fs)), w.shared_out.data(), fs, h);
  }
  if (c.shared_gate) init_rows(seed, Matrix::shared_gate, -1, in_std, w.shared_gate.data(), 1, h);
}

template <class From, class To>
void convert(const From* from, To* to, std::int64_t count) {
  for (std::int64_t i = 0; i < count; ++i) to[i] = To(from[i]);
}

}  // namespace moe_weights_detail

inline constexpr double kDefaultRouterStd = 0.02;

// A shard with no weights at all (every tensor [0]): what a dense layer of a stack with MoE layers holds in the MoE
// slot. (A default-constructed Tensor is a scalar without storage, not empty.)
inline MoeShard empty_moe_shard() {
  MoeShard s;
  for (Tensor<float>* t : {&s.router, &s.expert_in, &s.expert_out, &s.shared_in, &s.shared_out, &s.shared_gate})
    *t = Tensor<float>(Shape{0});
  return s;
}

// The global MoE sublayer drawn from `seed` (what init_moe_shard's shards assemble to, for any p).
template <class T>
GlobalMoeWeights<T> init_global_moe(const MoeConfig& c, std::uint64_t seed, double router_std = kDefaultRouterStd) {
  c.validate();
  GlobalMoeWeights<T> g(c);
  moe_weights_detail::init_into<T>(c, seed, router_std, 0, c.experts, g);
  return g;
}

// Rank `rank`'s shard of the global sublayer drawn from `seed`: its own experts, the router and shared experts.
inline MoeShard init_moe_shard(const MoeConfig& c, int ranks, int rank, std::uint64_t seed,
                               double router_std = kDefaultRouterStd) {
  c.validate();
  check(ranks >= 1 && rank >= 0 && rank < ranks, "init_moe_shard: rank {} outside [0, {})", rank, ranks);
  MoeShard s = MoeShard::zeros(c, ranks, rank);
  const ChunkRange mine = owned_experts(c, ranks, rank);
  moe_weights_detail::init_into<float>(c, seed, router_std, mine.start, mine.length, s);
  return s;
}

// Rank `rank`'s float shard of global weights (any element type).
template <class T>
MoeShard moe_shard_of(const GlobalMoeWeights<T>& g, const MoeConfig& c, int ranks, int rank) {
  const GlobalMoeWeights<T> expected(c);
  check(g.router.shape() == expected.router.shape() && g.expert_in.shape() == expected.expert_in.shape() &&
            g.expert_out.shape() == expected.expert_out.shape() && g.shared_in.shape() == expected.shared_in.shape() &&
            g.shared_out.shape() == expected.shared_out.shape() &&
            g.shared_gate.shape() == expected.shared_gate.shape(),
        "moe_shard_of: the global weights (router {}, experts {} / {}, shared {} / {}, gate {}) do not match the "
        "config (router {}, experts {} / {}, shared {} / {}, gate {})",
        g.router.shape(), g.expert_in.shape(), g.expert_out.shape(), g.shared_in.shape(), g.shared_out.shape(),
        g.shared_gate.shape(), expected.router.shape(), expected.expert_in.shape(), expected.expert_out.shape(),
        expected.shared_in.shape(), expected.shared_out.shape(), expected.shared_gate.shape());
  using moe_weights_detail::convert;
  MoeShard s = MoeShard::zeros(c, ranks, rank);
  const ChunkRange mine = owned_experts(c, ranks, rank);
  const std::int64_t in_size = 2 * c.expert_ffn * c.hidden, out_size = c.expert_ffn * c.hidden;
  convert(g.router.data(), s.router.data(), g.router.numel());
  convert(g.expert_in.data() + mine.start * in_size, s.expert_in.data(), mine.length * in_size);
  convert(g.expert_out.data() + mine.start * out_size, s.expert_out.data(), mine.length * out_size);
  convert(g.shared_in.data(), s.shared_in.data(), g.shared_in.numel());
  convert(g.shared_out.data(), s.shared_out.data(), g.shared_out.numel());
  convert(g.shared_gate.data(), s.shared_gate.data(), g.shared_gate.numel());
  return s;
}

// The global weights from every rank's shard (shards[r] of rank r of shards.size(); the replicated weights are
// taken from rank 0).
template <class T>
GlobalMoeWeights<T> global_moe_of(std::span<const MoeShard> shards, const MoeConfig& c) {
  const int ranks = int(shards.size());
  check(ranks >= 1, "global_moe_of: no shards given");
  GlobalMoeWeights<T> g(c);
  using moe_weights_detail::convert;
  const std::int64_t in_size = 2 * c.expert_ffn * c.hidden, out_size = c.expert_ffn * c.hidden;
  const MoeShard& first = shards[0];
  check(first.router.numel() == g.router.numel() && first.shared_in.numel() == g.shared_in.numel() &&
            first.shared_gate.numel() == g.shared_gate.numel(),
        "global_moe_of: rank 0's router {} or shared experts {} do not match the config", first.router.shape(),
        first.shared_in.shape());
  convert(first.router.data(), g.router.data(), g.router.numel());
  convert(first.shared_in.data(), g.shared_in.data(), g.shared_in.numel());
  convert(first.shared_out.data(), g.shared_out.data(), g.shared_out.numel());
  convert(first.shared_gate.data(), g.shared_gate.data(), g.shared_gate.numel());
  for (int r = 0; r < ranks; ++r) {
    const ChunkRange mine = owned_experts(c, ranks, r);
    const MoeShard& s = shards[std::size_t(r)];
    check(s.expert_in.numel() == mine.length * in_size && s.expert_out.numel() == mine.length * out_size,
          "global_moe_of: rank {} of {} holds experts {} / {}, expected {} experts", r, ranks, s.expert_in.shape(),
          s.expert_out.shape(), mine.length);
    convert(s.expert_in.data(), g.expert_in.data() + mine.start * in_size, mine.length * in_size);
    convert(s.expert_out.data(), g.expert_out.data() + mine.start * out_size, mine.length * out_size);
  }
  return g;
}

}  // namespace paradyse
