// tests/moe/layer_harness.hpp: the MoE sublayer's test cases and their checks against the float64 reference
// (tests/moe/reference_moe.hpp), shared by the host strategies' tests (tests/moe/moe_layer.cpp: thread ranks,
// ops::Cpu) and the device's (tests/cuda/moe_layer.cpp: cuda_local ranks, ops::Cuda), so that a difference between
// the two is a difference of the backend. A case: a router (softmax or sigmoid, top-k, renormalised, scaled), shared
// experts (gated or not), per-token or per-call k, capacity drops, skewed routing; what each rank computed
// (RankResult, host tensors) is checked for its output, losses, drops, input gradient and every owned gradient.
#pragma once

#include "moe/reference_moe.hpp"
#include "support/tolerance.hpp"

#include "paradyse/moe/moe_layer.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace paradyse::testing::moe_harness {

struct LayerCase {
  std::string name;
  MoeConfig config;
  std::int64_t batch = 2;
  std::int64_t length = 7;
  bool k_per_token = false;
  std::int64_t call_k = 0;  // a per-call k (0: the config's)
  bool skewed = false;      // every token prefers expert 1
};

inline MoeConfig base_config(std::int64_t experts, std::int64_t top_k) {
  MoeConfig c;
  c.hidden = 8;
  c.experts = experts;
  c.top_k = top_k;
  c.expert_ffn = 6;
  return c;
}

inline std::vector<LayerCase> layer_cases(int p) {
  std::vector<LayerCase> cases;
  const std::int64_t length = 3 * p + 2;
  {
    LayerCase lc{"Mixtral-like softmax top-2 norm E=6", base_config(6, 2), 2, length};
    lc.config.norm_topk_prob = true;
    cases.push_back(lc);
  }
  {
    LayerCase lc{"Qwen-like softmax top-2 shared x2 gated, aux and z losses E=5", base_config(5, 2), 2, length};
    lc.config.shared_experts = 2;
    lc.config.shared_ffn = 4;
    lc.config.shared_gate = true;
    lc.config.aux_loss_coef = 0.3;
    lc.config.z_loss_coef = 0.05;
    cases.push_back(lc);
  }
  {
    LayerCase lc{"DeepSeek-like sigmoid top-3 norm scale 2.5 shared x1, aux E=6", base_config(6, 3), 1, length + 3};
    lc.config.scoring = RouterScoring::sigmoid;
    lc.config.norm_topk_prob = true;
    lc.config.routed_scaling_factor = 2.5;
    lc.config.shared_experts = 1;
    lc.config.shared_ffn = 5;
    lc.config.aux_loss_coef = 0.2;
    cases.push_back(lc);
  }
  {
    LayerCase lc{"variable experts per token (0..E) softmax aux z E=5", base_config(5, 2), 2, length};
    lc.k_per_token = true;
    lc.config.aux_loss_coef = 0.1;
    lc.config.z_loss_coef = 0.02;
    cases.push_back(lc);
  }
  {
    LayerCase lc{"variable experts per token sigmoid norm E=4", base_config(4, 1), 1, length + 1};
    lc.k_per_token = true;
    lc.config.scoring = RouterScoring::sigmoid;
    lc.config.norm_topk_prob = true;
    cases.push_back(lc);
  }
  {
    LayerCase lc{"per-call k = 3 (config top_k 1) E=6", base_config(6, 1), 2, length};
    lc.call_k = 3;
    cases.push_back(lc);
  }
  {
    LayerCase lc{"capacity factor 1.0 top-2 E=4 (drops)", base_config(4, 2), 2, 2 * length};
    lc.config.capacity_factor = 1.0;
    lc.config.aux_loss_coef = 0.1;
    cases.push_back(lc);
  }
  {
    LayerCase lc{"skewed: every token to expert 1, top-1 E=4", base_config(4, 1), 2, length};
    lc.skewed = true;
    cases.push_back(lc);
  }
  {
    LayerCase lc{"E=3 top-1 (a rank may own no expert)", base_config(3, 1), 2, length};
    cases.push_back(lc);
  }
  {
    LayerCase lc{"E=16 top-4 softmax norm, shared x1, aux E=16", base_config(16, 4), 2, length};
    lc.config.norm_topk_prob = true;
    lc.config.shared_experts = 1;
    lc.config.shared_ffn = 4;
    lc.config.aux_loss_coef = 0.1;
    cases.push_back(lc);
  }
  {
    LayerCase lc{"E=8 capacity factor 1.25, variable experts per token", base_config(8, 1), 2, 2 * length};
    lc.config.capacity_factor = 1.25;
    lc.k_per_token = true;
    cases.push_back(lc);
  }
  return cases;
}

inline MoeProblem make_problem(const LayerCase& lc, std::uint64_t seed) {
  MoeProblem prob = random_problem(lc.config, lc.batch, lc.length, seed, lc.k_per_token);
  if (lc.call_k) prob.k.assign(prob.k.size(), lc.call_k);
  if (lc.skewed) {
    const std::int64_t h = lc.config.hidden;
    for (std::size_t t = 0; t * std::size_t(h) < prob.x.size(); ++t) prob.x[t * std::size_t(h)] = 2.0 + prob.x[t * std::size_t(h)];
    for (std::int64_t col = 0; col < h; ++col) prob.model.router[std::size_t(1 * h + col)] = col == 0 ? 6.0 : 0.1;
  }
  return prob;
}

// What one rank computed.
struct RankResult {
  std::vector<std::int64_t> ids;
  Tensor<float> y, dx;
  MoeShard grad;
  double aux = 0, z = 0;
  std::int64_t dropped = 0;
  std::vector<std::int64_t> routed;

  // What the rank's forward saved that the checks read: its losses and drops.
  void keep(const MoeSaved& saved) {
    aux = saved.losses.aux;
    z = saved.losses.z;
    dropped = saved.dropped;
    routed = saved.losses.routed;
  }
};

// A rank's k for its tokens `ids`: the problem's per-call k and each token's own (top_k() views them, held here).
struct RankK {
  std::int64_t call_k = 0;
  std::vector<std::int64_t> per_token;
  RankK(const MoeProblem& prob, std::span<const std::int64_t> ids) : call_k(prob.k.empty() ? 0 : prob.k[0]) {
    for (const std::int64_t id : ids) per_token.push_back(prob.k[std::size_t(id)]);
  }
  TopK top_k() const { return TopK{call_k, per_token}; }
};

// Rank r's accumulated gradients (which started from the weights themselves) against weights + reference gradient.
inline void check_gradients(const ReferenceMoe& m, const ReferenceResult& ref, int p, int r, const MoeShard& grad) {
  const MoeConfig& c = m.config;
  const std::int64_t h = c.hidden, f = c.expert_ffn;
  const auto plus = [](const std::vector<double>& a, std::span<const double> b) {
    std::vector<double> s(a);
    for (std::size_t i = 0; i < s.size(); ++i) s[i] += b[i];
    return s;
  };
  {
    INFO("router gradient");
    CHECK_CLOSE(grad.router.span(), plus(m.router, ref.drouter), kFloat32);
  }
  {
    INFO("owned experts' W_in^T gradient");
    CHECK_CLOSE(grad.expert_in.span(), owned_slice(c, plus(m.expert_in, ref.dexpert_in), 2 * f * h, p, r), kFloat32);
  }
  {
    INFO("owned experts' W_out gradient");
    CHECK_CLOSE(grad.expert_out.span(), owned_slice(c, plus(m.expert_out, ref.dexpert_out), f * h, p, r), kFloat32);
  }
  {
    INFO("shared experts' gradients");
    CHECK_CLOSE(grad.shared_in.span(), plus(m.shared_in, ref.dshared_in), kFloat32);
    CHECK_CLOSE(grad.shared_out.span(), plus(m.shared_out, ref.dshared_out), kFloat32);
    CHECK_CLOSE(grad.shared_gate.span(), plus(m.shared_gate, ref.dshared_gate), kFloat32);
  }
}

// Every rank's output, losses and gradients against the reference.
inline void check_against_reference(const MoeProblem& prob, int p, const std::vector<RankResult>& results) {
  const std::int64_t h = prob.model.config.hidden;
  const ReferenceResult ref = reference_moe(prob.model, prob.x, prob.dy, prob.k, rank_groups(prob, p));
  const std::vector<double> aux{ref.aux, ref.z};
  for (int r = 0; r < p; ++r) {
    const RankResult& got = results[std::size_t(r)];
    INFO("rank " << r << " of " << p);
    const ReferenceMoe& m = prob.model;
    const std::vector<double> losses{got.aux, got.z};
    CHECK_CLOSE(losses, aux, kFloat32);
    CHECK(got.dropped == ref.dropped);
    CHECK(got.routed == ref.routed);
    {
      INFO("y");
      CHECK_CLOSE(got.y.span(), double_rows(ref.y, h, got.ids), kFloat32);
    }
    {
      INFO("dx");
      CHECK_CLOSE(got.dx.span(), double_rows(ref.dx, h, got.ids), kFloat32);
    }
    check_gradients(m, ref, p, r, got.grad);
  }
}

// Every case of p ranks (seeds from `seed` on): run(problem, p) computes each rank's results, checked against the
// reference.
template <class Run>
void check_cases(int p, std::uint64_t seed, Run&& run) {
  for (const LayerCase& lc : layer_cases(p)) {
    CAPTURE(lc.name);
    CAPTURE(p);
    const MoeProblem prob = make_problem(lc, seed++);
    check_against_reference(prob, p, run(prob, p));
  }
}

// The layer's forward and backward as the tests call them, over communicator Comm on Backend (the host's tests:
// ThreadCommunicator and ops::Cpu; the device's: CudaLocalCommunicator and ops::Cuda): forward_of<S>() and
// backward_of<S>() for a strategy S (ExpertParallel<Backend>, ExpertTensorParallel<Backend>), single_forward() and
// single_backward() for the one-rank layer (the communicator unused).
template <class Comm, class Backend>
struct LayerCalls {
  using Forward = std::function<MoeSaved(Comm&, const MoeContext&, const MoeShard&, TensorView<const float>,
                                         TensorView<float>)>;
  using Backward = std::function<void(Comm&, const MoeContext&, const MoeShard&, MoeSaved&, TensorView<const float>,
                                      TensorView<float>, MoeShard&)>;

  template <class S>
  static Forward forward_of() {
    return [](Comm& comm, const MoeContext& ctx, const MoeShard& w, TensorView<const float> x, TensorView<float> y) {
      return S{}.forward(comm, ctx, w, x, y);
    };
  }
  template <class S>
  static Backward backward_of() {
    return [](Comm& comm, const MoeContext& ctx, const MoeShard& w, MoeSaved& s, TensorView<const float> dy,
              TensorView<float> dx, MoeShard& g) { S{}.backward(comm, ctx, w, s, dy, dx, g); };
  }
  static Forward single_forward() {
    return [](Comm&, const MoeContext& ctx, const MoeShard& w, TensorView<const float> x, TensorView<float> y) {
      return moe_forward<Backend>(ctx, w, x, y);
    };
  }
  static Backward single_backward() {
    return [](Comm&, const MoeContext& ctx, const MoeShard& w, MoeSaved& s, TensorView<const float> dy,
              TensorView<float> dx, MoeShard& g) { moe_backward<Backend>(ctx, w, s, dy, dx, g); };
  }
};

}  // namespace paradyse::testing::moe_harness
