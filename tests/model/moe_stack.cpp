// tests/model/moe_stack.cpp: MoE layers in the layer stack (model/moe_half.hpp, model/stack.hpp) and the MoE GPT
// (model/gpt.hpp), against a float64 single-rank reference built from the dense layer's reference
// (tests/model/reference_transformer.hpp) and the MoE reference (tests/moe/reference_moe.hpp): the output, the input
// gradient and every gradient each rank holds (attention, norms, the dense MLP of the first_k_dense layers, router,
// each owned expert, shared experts and gate), on p in {1, 2, 3, 4} thread ranks with E = 5 (uneven expert counts,
// p = 4 leaves... every rank one or two experts), under mixed plans (ExpertParallel and ExpertTensorParallel per
// layer, different attention strategies), first_k_dense 0 and 1, shared experts off and on (gated), aux and z losses;
// a per-layer top-k override; bad plans refused by name. The MoE GPT: the same global model on p = 1 and p = 2
// gives the same loss and the same update; its parameter count is the sum of its tensors. The Hugging Face export
// (model/hf_checkpoint.hpp), saved from 2 and 4 ranks, read back by the inference engine's loader (serve/): Mixtral
// and Qwen2-MoE names, shapes and values, config.json's shape; what the formats cannot express is refused.
#include "model/reference_transformer.hpp"
#include "moe/reference_moe.hpp"
#include "strategy/harness.hpp"
#include "support/tolerance.hpp"

#include "paradyse/comm/threads.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/hf_checkpoint.hpp"
#include "paradyse/model/stack.hpp"
#include "paradyse/moe/moe_weights.hpp"
#include "paradyse/serve/decoder_weights.hpp"
#include "paradyse/serve/hf_checkpoint.hpp"
#include "paradyse/serve/hf_config.hpp"

#include <filesystem>
#include <unistd.h>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::testing;

namespace {

using Strategies = AllStrategies<>;
using Matrix = Tensor<double>;

struct MoeStackCase {
  std::string name;
  int ranks = 1;
  int layers = 2;
  int first_k_dense = 0;
  MoeConfig moe;
  std::int64_t batch = 2, length = 8;
  std::vector<std::int64_t> top_k;  // per-layer override (empty: the config's)
};

MoeConfig moe_config(bool shared) {
  MoeConfig m;
  m.hidden = 16;
  m.experts = 5;
  m.top_k = 2;
  m.expert_ffn = 6;
  m.norm_topk_prob = true;
  if (shared) {
    m.shared_experts = 2;
    m.shared_ffn = 3;
    m.shared_gate = true;
    m.aux_loss_coef = 0.2;
    m.z_loss_coef = 0.05;
  }
  return m;
}

LayerConfig layer_config(int p) {
  LayerConfig c = small_config(2 * p, p, 4 * p);
  c.activation = Activation::swiglu;
  c.causal = true;
  c.norm = NormKind::rms_norm;
  return c;
}

std::vector<double> flat(const Matrix& m) { return {m.span().begin(), m.span().end()}; }
Matrix matrix_of(const std::vector<double>& v, Shape shape) {
  Matrix m(shape);
  std::copy(v.begin(), v.end(), m.span().begin());
  return m;
}

GlobalMoeWeights<double> global_of(const ReferenceMoe& r) {
  GlobalMoeWeights<double> g(r.config);
  std::copy(r.router.begin(), r.router.end(), g.router.span().begin());
  std::copy(r.expert_in.begin(), r.expert_in.end(), g.expert_in.span().begin());
  std::copy(r.expert_out.begin(), r.expert_out.end(), g.expert_out.span().begin());
  std::copy(r.shared_in.begin(), r.shared_in.end(), g.shared_in.span().begin());
  std::copy(r.shared_out.begin(), r.shared_out.end(), g.shared_out.span().begin());
  std::copy(r.shared_gate.begin(), r.shared_gate.end(), g.shared_gate.span().begin());
  return g;
}

// The float64 stack: dense layers by ref::layer_*, MoE layers as the attention half then norm2 + MoE + residual.
struct ReferenceStack {
  LayerConfig config;
  MoeLayers moe;
  std::vector<GlobalLayerWeights<double>> dense;  // every layer's attention and norms; the dense layers' MLP
  std::vector<ReferenceMoe> experts;              // per layer (unused for dense layers)
  std::vector<std::int64_t> top_k;                // per layer
  std::vector<std::vector<std::int64_t>> groups;  // each rank's token ids (the capacity's groups; dropless here)

  std::vector<std::int64_t> ks(int l, std::int64_t tokens) const {
    return std::vector<std::int64_t>(std::size_t(tokens), top_k[std::size_t(l)]);
  }
  Matrix forward_layer(int l, const Matrix& x) const {
    const GlobalLayerWeights<double>& w = dense[std::size_t(l)];
    if (!moe.is_moe(l)) return ref::layer_forward(config, w, x);
    const Matrix y = ref::add(x, ref::attention_forward(config, w, ref::norm_forward(config, x, w.norm1_gamma, w.norm1_beta)));
    const Matrix n2 = ref::norm_forward(config, y, w.norm2_gamma, w.norm2_beta);
    const ReferenceResult r = reference_moe(experts[std::size_t(l)], flat(n2), {}, ks(l, n2.numel() / config.hidden), groups);
    return ref::add(y, matrix_of(r.y, y.shape()));
  }
  // dx; gradients accumulate into dw (dense) and are returned per MoE layer in moe_grads.
  Matrix backward(const Matrix& x, const Matrix& dz, std::vector<GlobalLayerWeights<double>>& dw,
                  std::vector<ReferenceResult>& moe_grads) const {
    std::vector<Matrix> inputs;
    inputs.push_back(Matrix::copy_of(x.view()));
    for (int l = 0; l + 1 < int(dense.size()); ++l) inputs.push_back(forward_layer(l, inputs.back()));
    moe_grads.assign(dense.size(), {});
    Matrix grad = Matrix::copy_of(dz.view());
    for (int l = int(dense.size()); l-- > 0;) {
      const GlobalLayerWeights<double>& w = dense[std::size_t(l)];
      const Matrix& in = inputs[std::size_t(l)];
      if (!moe.is_moe(l)) {
        grad = ref::layer_backward(config, w, in, grad, dw[std::size_t(l)]);
        continue;
      }
      GlobalLayerWeights<double>& g = dw[std::size_t(l)];
      const Matrix n1 = ref::norm_forward(config, in, w.norm1_gamma, w.norm1_beta);
      const Matrix y = ref::add(in, ref::attention_forward(config, w, n1));
      const Matrix n2 = ref::norm_forward(config, y, w.norm2_gamma, w.norm2_beta);
      ReferenceResult& r = moe_grads[std::size_t(l)];
      r = reference_moe(experts[std::size_t(l)], flat(n2), flat(grad), ks(l, n2.numel() / config.hidden), groups);
      const Matrix dy = ref::add(grad, ref::norm_backward(config, y, w.norm2_gamma, matrix_of(r.dx, y.shape()),
                                                          g.norm2_gamma, g.norm2_beta));
      const Matrix dn1 = ref::attention_backward(config, w, n1, dy, g);
      grad = ref::add(dy, ref::norm_backward(config, in, w.norm1_gamma, dn1, g.norm1_gamma, g.norm1_beta));
    }
    return grad;
  }
};

std::string plan_name(const StackPlan& plan, const MoeLayers& moe) {
  std::string name;
  for (std::size_t l = 0; l < plan.size(); ++l)
    name += fmt::format("[{} | {}] ", Strategies::name(plan[l].attention),
                        moe.is_moe(int(l)) ? MoeStrategies<>::name(plan[l].moe) : Strategies::name(plan[l].mlp));
  return name;
}

void check_moe_stack(const MoeStackCase& test, const std::vector<StackPlan>& plans, std::uint64_t seed) {
  const int p = test.ranks, layers = test.layers;
  const LayerConfig c = layer_config(p);
  ReferenceStack ref_stack{c, MoeLayers{test.moe, test.first_k_dense}, {}, {}, {}, {}};
  Matrix x, dz;
  for (int l = 0; l < layers; ++l) {
    Problem one = make_problem(c, test.batch, test.length, seed + std::uint64_t(l));
    if (l == 0) {
      x = std::move(one.x);
      dz = std::move(one.dy);
    }
    ref_stack.dense.push_back(std::move(one.weights));
    ref_stack.experts.push_back(random_problem(test.moe, 1, 1, seed + 50 + std::uint64_t(l)).model);
    ref_stack.top_k.push_back(test.top_k.empty() || test.top_k[std::size_t(l)] == 0 ? test.moe.top_k
                                                                                   : test.top_k[std::size_t(l)]);
  }
  {
    MoeProblem shape = random_problem(test.moe, test.batch, test.length, 0);
    ref_stack.groups = rank_groups(shape, p);
  }
  const Matrix z_ref = [&] {
    Matrix h = Matrix::copy_of(x.view());
    for (int l = 0; l < layers; ++l) h = ref_stack.forward_layer(l, h);
    return h;
  }();
  std::vector<GlobalLayerWeights<double>> dw;
  for (int l = 0; l < layers; ++l) dw.emplace_back(c);
  std::vector<ReferenceResult> moe_grads;
  const Matrix dx_ref = ref_stack.backward(x, dz, dw, moe_grads);

  Findings findings;
  run_ranks(p, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    BufferPool pool;
    std::vector<LayerWeights> shards;
    std::vector<MoeShard> experts;
    for (int l = 0; l < layers; ++l) {
      shards.push_back(shard_of(ref_stack.dense[std::size_t(l)], c, p, r));
      experts.push_back(ref_stack.moe.is_moe(l) ? moe_shard_of(global_of(ref_stack.experts[std::size_t(l)]), test.moe, p, r)
                                                : MoeShard{});
    }
    TransformerStack<Strategies> stack(c, std::move(shards), std::move(experts), ref_stack.moe, p);
    if (!test.top_k.empty()) stack.set_moe_top_k(test.top_k);
    const SequenceLayout layout(test.length, p, c.zigzag);
    const Tensor<float> xl = local_tokens(x, layout, r), dzl = local_tokens(dz, layout, r);
    const ChunkRange mine = owned_experts(test.moe, p, r);
    const std::int64_t h = test.moe.hidden, f = test.moe.expert_ffn;
    for (const StackPlan& plan : plans) {
      const std::string where = fmt::format("plan {}rank {}", plan_name(plan, ref_stack.moe), r);
      Tensor<float> z(xl.shape()), dx(xl.shape());
      stack.zero_gradients();
      stack.forward(comm, pool, plan, test.length, xl.view(), z.view());
      stack.backward(comm, pool, dzl.view(), dx.view());
      findings.compare(z, z_ref, layout, r, where + " output");
      findings.compare(dx, dx_ref, layout, r, where + " input gradient");
      int moe_index = 0;
      for (int l = 0; l < layers; ++l) {
        const LayerWeights want = shard_of(dw[std::size_t(l)], c, p, r);
        const LayerWeights& got = stack.gradients()[std::size_t(l)];
        const std::string at = fmt::format("{} layer {}", where, l);
        findings.compare(got.attention.packed.span(), want.attention.packed.span(), at + " attention gradient");
        findings.compare(got.norms.packed.span(), want.norms.packed.span(), at + " norm gradients");
        if (!ref_stack.moe.is_moe(l)) {
          findings.compare(got.mlp.packed.span(), want.mlp.packed.span(), at + " mlp gradient");
          continue;
        }
        if (got.mlp.packed.numel() != 0) findings.fail(at + ": an MoE layer holds a dense MLP gradient");
        const ReferenceResult& g = moe_grads[std::size_t(l)];
        const MoeShard& mg = stack.moe_gradients()[std::size_t(l)];
        findings.compare(mg.router.span(), g.drouter, at + " router gradient");
        findings.compare(mg.expert_in.span(), owned_slice(test.moe, g.dexpert_in, 2 * f * h, p, r), at + " expert_in gradient");
        findings.compare(mg.expert_out.span(), owned_slice(test.moe, g.dexpert_out, f * h, p, r), at + " expert_out gradient");
        findings.compare(mg.shared_in.span(), g.dshared_in, at + " shared_in gradient");
        findings.compare(mg.shared_out.span(), g.dshared_out, at + " shared_out gradient");
        findings.compare(mg.shared_gate.span(), g.dshared_gate, at + " shared gate gradient");
        // The recorded statistics are the group's.
        const auto& stats = stack.moe_stats();
        if (moe_index >= int(stats.size()) || stats[std::size_t(moe_index)].layer != l) {
          findings.fail(fmt::format("{}: no statistics recorded", at));
        } else {
          const MoeLayerStats& s = stats[std::size_t(moe_index)];
          findings.compare(std::vector<double>{s.aux, s.z}, std::vector<double>{g.aux, g.z}, at + " aux and z losses");
          if (s.routed != g.routed) findings.fail(fmt::format("{}: routed {} expected {}", at, fmt::join(s.routed, " "), fmt::join(g.routed, " ")));
        }
        ++moe_index;
        (void)mine;
      }
    }
  });
  findings.check_all(fmt::format("{} on p = {} ({} plans)", test.name, p, plans.size()));
}

// Plans over `layers` layers: every MoE strategy mix, with the attention strategies rotating through the list.
std::vector<StackPlan> mixed_plans(int layers, int p) {
  std::vector<StackPlan> plans;
  const int mixes = 1 << layers;
  for (int mix = 0; mix < mixes; ++mix) {
    StackPlan plan;
    for (int l = 0; l < layers; ++l) {
      const std::size_t attention = std::size_t(mix + l) % Strategies::count;
      const std::size_t mlp = std::size_t(mix + 2 * l + 1) % Strategies::count;
      plan.push_back({attention, mlp, std::size_t((mix >> l) & 1)});
    }
    plans.push_back(plan);
  }
  (void)p;
  return plans;
}

}  // namespace

TEST_CASE("moe stack: mixed ExpertParallel / ExpertTensorParallel plans against the float64 reference") {
  for (int p : {1, 2, 3, 4}) {
    const std::int64_t length = 3 * p + 2;
    check_moe_stack({"2 MoE layers, no shared experts", p, 2, 0, moe_config(false), 2, length, {}}, mixed_plans(2, p),
                    11 * std::uint64_t(p));
    check_moe_stack({"first_k_dense 1 then 2 MoE layers, gated shared experts, aux and z", p, 3, 1, moe_config(true), 1,
                     length + 1, {}},
                    mixed_plans(3, p), 13 * std::uint64_t(p));
  }
}

TEST_CASE("moe stack: a per-layer top-k override (Alloc-MoE) on every rank count") {
  for (int p : {1, 3}) {
    check_moe_stack({"per-layer k 1 then 4", p, 2, 0, moe_config(true), 2, 3 * p + 1, {1, 4}}, mixed_plans(2, p),
                    17 * std::uint64_t(p));
  }
}

// Dimension fusion (issue 13): the MoE layers run over an expert group folded over dp x cp (ep = dp * cp) while
// attention runs in each replica's cp group, on the same ranks. Replica d holds rows chunk d of the batch (uneven);
// against the float64 reference over the whole batch: every rank's output and input gradient, the dense gradients
// summed over dp, and the expert group's gradients (router, the ep rank's own experts, shared experts and gate) as
// they are, already reduced over every replica's tokens, with the aux and z losses of the whole batch.
TEST_CASE("moe stack: experts folded over dp x cp (the expert group spans the replicas) against the float64 reference") {
  for (auto [dp, cp] : std::vector<std::pair<int, int>>{{2, 1}, {2, 2}, {3, 2}}) {
    CAPTURE(dp);
    CAPTURE(cp);
    const int ep = dp * cp, layers = 2;
    MoeConfig m = moe_config(true);
    m.experts = 7;  // uneven over ep = 2, 4 and 6
    const LayerConfig c = layer_config(cp);
    const std::int64_t batch = dp + 1, length = 3 * cp + 2;
    const std::uint64_t seed = 29 * std::uint64_t(ep + cp);
    ReferenceStack ref_stack{c, MoeLayers{m, 1}, {}, {}, {}, {}};
    Matrix x, dz;
    for (int l = 0; l < layers; ++l) {
      Problem one = make_problem(c, batch, length, seed + std::uint64_t(l));
      if (l == 0) {
        x = std::move(one.x);
        dz = std::move(one.dy);
      }
      ref_stack.dense.push_back(std::move(one.weights));
      ref_stack.experts.push_back(random_problem(m, 1, 1, seed + 50 + std::uint64_t(l)).model);
      ref_stack.top_k.push_back(m.top_k);
    }
    ref_stack.groups = rank_groups(random_problem(m, batch, length, 0), ep);
    Matrix z_ref = Matrix::copy_of(x.view());
    for (int l = 0; l < layers; ++l) z_ref = ref_stack.forward_layer(l, z_ref);
    std::vector<GlobalLayerWeights<double>> dw;
    for (int l = 0; l < layers; ++l) dw.emplace_back(c);
    std::vector<ReferenceResult> moe_grads;
    const Matrix dx_ref = ref_stack.backward(x, dz, dw, moe_grads);
    // Rows `rows` of a [batch, length, h] matrix.
    const auto rows_of = [&](const Matrix& t, ChunkRange rows) {
      Matrix out(Shape{rows.length, t.extent(1), t.extent(2)});
      const std::int64_t row = t.extent(1) * t.extent(2);
      std::copy(t.data() + rows.start * row, t.data() + rows.end() * row, out.data());
      return out;
    };

    const DeviceMesh mesh({{"dp", dp}, {"cp", cp}});
    Findings findings;
    run_ranks(ep, [&](ThreadCommunicator& world) {
      ThreadCommunicator cp_group = mesh.group(world, {"cp"});
      ThreadCommunicator dp_group = mesh.group(world, {"dp"});
      ThreadCommunicator ep_group = mesh.group(world, {"dp", "cp"});
      const int d = mesh.coordinate(world.rank(), "dp"), r = mesh.coordinate(world.rank(), "cp");
      const int e = int(ep_group.rank());
      if (e != d * cp + r) findings.fail(fmt::format("ep rank {} of (dp {}, cp {}), expected {}", e, d, r, d * cp + r));
      std::vector<LayerWeights> shards;
      std::vector<MoeShard> experts;
      for (int l = 0; l < layers; ++l) {
        shards.push_back(shard_of(ref_stack.dense[std::size_t(l)], c, cp, r));
        experts.push_back(ref_stack.moe.is_moe(l) ? moe_shard_of(global_of(ref_stack.experts[std::size_t(l)]), m, ep, e)
                                                  : MoeShard{});
      }
      TransformerStack<Strategies> stack(c, std::move(shards), std::move(experts), ref_stack.moe, cp);
      BufferPool pool;
      const ChunkRange mine = chunk_range(batch, dp, d);
      const Matrix x_d = rows_of(x, mine), dz_d = rows_of(dz, mine), z_d = rows_of(z_ref, mine), dx_d = rows_of(dx_ref, mine);
      const SequenceLayout layout(length, cp, c.zigzag);
      const Tensor<float> xl = local_tokens(x_d, layout, r), dzl = local_tokens(dz_d, layout, r);
      const std::int64_t h = m.hidden, f = m.expert_ffn;
      for (const StackPlan& plan : mixed_plans(layers, cp)) {
        const std::string where = fmt::format("plan {}rank (dp {}, cp {})", plan_name(plan, ref_stack.moe), d, r);
        Tensor<float> z(xl.shape()), dx(xl.shape());
        stack.zero_gradients();
        stack.forward(cp_group, ep_group, pool, plan, length, xl.view(), z.view());
        stack.backward(cp_group, ep_group, pool, dzl.view(), dx.view());
        findings.compare(z, z_d, layout, r, where + " output");
        findings.compare(dx, dx_d, layout, r, where + " input gradient");
        for (int l = 0; l < layers; ++l) {
          const std::string at = fmt::format("{} layer {}", where, l);
          const LayerWeights want = shard_of(dw[std::size_t(l)], c, cp, r);
          LayerWeights& got = stack.gradients()[std::size_t(l)];
          for (Tensor<float>* g : {&got.attention.packed, &got.mlp.packed, &got.norms.packed})
            dp_group.all_reduce(std::span<const float>(g->span()), g->span(), ReduceOp::sum);
          findings.compare(got.attention.packed.span(), want.attention.packed.span(), at + " attention gradient (dp sum)");
          findings.compare(got.norms.packed.span(), want.norms.packed.span(), at + " norm gradients (dp sum)");
          if (!ref_stack.moe.is_moe(l)) {
            findings.compare(got.mlp.packed.span(), want.mlp.packed.span(), at + " mlp gradient (dp sum)");
            continue;
          }
          const ReferenceResult& g = moe_grads[std::size_t(l)];
          const MoeShard& mg = stack.moe_gradients()[std::size_t(l)];
          findings.compare(mg.router.span(), g.drouter, at + " router gradient");
          findings.compare(mg.expert_in.span(), owned_slice(m, g.dexpert_in, 2 * f * h, ep, e), at + " expert_in gradient");
          findings.compare(mg.expert_out.span(), owned_slice(m, g.dexpert_out, f * h, ep, e), at + " expert_out gradient");
          findings.compare(mg.shared_in.span(), g.dshared_in, at + " shared_in gradient");
          findings.compare(mg.shared_out.span(), g.dshared_out, at + " shared_out gradient");
          findings.compare(mg.shared_gate.span(), g.dshared_gate, at + " shared gate gradient");
          const MoeLayerStats& stats = stack.moe_stats().at(0);
          findings.compare(std::vector<double>{stats.aux, stats.z}, std::vector<double>{g.aux, g.z},
                           at + " aux and z losses of the whole batch");
          if (stats.routed != g.routed)
            findings.fail(fmt::format("{}: routed {} expected {}", at, fmt::join(stats.routed, " "), fmt::join(g.routed, " ")));
        }
      }
    });
    findings.check_all(fmt::format("experts over dp {} x cp {}", dp, cp));
  }
}

TEST_CASE("moe stack: bad plans and overrides are refused by name") {
  const LayerConfig c = layer_config(2);
  BufferPool pool;
  TransformerStack<Strategies> stack(c, 2, 1, 0, 3, MoeLayers{moe_config(false), 1});
  CHECK(stack.is_moe_layer(1));
  CHECK_FALSE(stack.is_moe_layer(0));
  CHECK(stack.weights()[1].mlp.packed.numel() == 0);
  CHECK_THROWS_WITH_AS(stack.set_moe_top_k({0, 9}), doctest::Contains("layer 1 asks for k = 9"), Error);
  CHECK_THROWS_WITH_AS(stack.set_moe_top_k({1}), doctest::Contains("1 entries for 2 layers"), Error);
  CHECK_THROWS_WITH_AS(TransformerStack<Strategies>(c, 2, 1, 0, 3, MoeLayers{moe_config(false), 2}),
                       doctest::Contains("first_k_dense = 2"), Error);
  Tensor<float> x(Shape{1, 4, c.hidden}), z(x.shape());
  run_ranks(1, [&](ThreadCommunicator& comm) {
    const StackPlan bad{{0, 0, 0}, {0, 0, 7}};
    CHECK_THROWS_WITH_AS(stack.forward(comm, pool, bad, 4, x.view(), z.view()),
                         doctest::Contains("MoE strategy index 7 is out of range"), Error);
  });
}

TEST_CASE("moe gpt: the same global model on 1 and 2 ranks gives the same loss, gradients and update") {
  GptConfig config;
  config.layer = layer_config(2);
  config.layers = 2;
  config.vocab = 40;
  config.moe = MoeLayers{moe_config(true), 1};
  const std::int64_t s = 9;
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(s)), targets(static_cast<std::size_t>(s));
  Rng rng(5);
  for (std::int64_t i = 0; i < s; ++i) {
    tokens[std::size_t(i)] = std::int32_t(rng.below(40));
    targets[std::size_t(i)] = std::int32_t(rng.below(40));
  }
  // Parameters: the sum of every tensor of the global model.
  const GlobalGptWeights<float> global = init_global_gpt<float>(config, 21);
  std::int64_t count = global.embedding.numel() + global.head.numel() + 2 * config.layer.hidden;
  for (int l = 0; l < config.layers; ++l) {
    const GlobalLayerWeights<float>& w = global.layers[std::size_t(l)];
    count += w.w_q.numel() + w.w_k.numel() + w.w_v.numel() + w.w_proj.numel() + 4 * config.layer.hidden;
    if (!config.is_moe_layer(l)) count += w.w_in.numel() + w.w_up.numel() + w.w_out.numel();
    const GlobalMoeWeights<float>& m = global.moe_layers[std::size_t(l)];
    count += m.router.numel() + m.expert_in.numel() + m.expert_out.numel() + m.shared_in.numel() +
             m.shared_out.numel() + m.shared_gate.numel();
  }
  CHECK(config.parameter_count() == count);

  std::vector<double> losses(3, 0.0);
  std::vector<std::vector<float>> routers(3);
  for (int p : {1, 2}) {
    run_ranks(p, [&](ThreadCommunicator& comm) {
      Gpt<Strategies> model(config, global, p, comm.rank());
      BufferPool pool;
      const SequenceLayout layout(s, p, config.layer.zigzag);
      const Tensor<std::int32_t> t = shard_tokens(tokens, 1, layout, comm.rank());
      const Tensor<std::int32_t> y = shard_tokens(targets, 1, layout, comm.rank());
      const StackPlan plan{{0, 0, 0}, {1, 1, std::size_t(p - 1)}};
      // Forward only gives forward_backward's loss and touches no gradient; a per-layer k changes it.
      const GptStepResult evaluated = model.evaluate(comm, pool, plan, s, t.view(), y.view());
      model.stack().set_moe_top_k({0, 4});
      const GptStepResult more_experts = model.evaluate(comm, pool, plan, s, t.view(), y.view());
      model.stack().set_moe_top_k({});
      model.zero_gradients();
      const GptStepResult step = model.forward_backward(comm, pool, plan, s, t.view(), y.view());
      CHECK(evaluated.loss == doctest::Approx(step.loss).epsilon(1e-6));
      CHECK(evaluated.counted == step.counted);
      CHECK(more_experts.loss != doctest::Approx(step.loss).epsilon(1e-6));
      model.optimizer_step(ops::AdamWConfig{});
      if (comm.rank() == 0) {
        losses[std::size_t(p)] = step.loss;
        const Tensor<float>& router = model.stack().moe_weights()[1].router;
        routers[std::size_t(p)].assign(router.span().begin(), router.span().end());
        CHECK(model.stack().moe_stats().size() == 1);
      }
    });
  }
  CHECK(losses[1] == doctest::Approx(losses[2]).epsilon(1e-5));
  CHECK_CLOSE(routers[2], routers[1], kFloat32);
  // The update moved the router (its gradient reached the optimizer).
  const GlobalMoeWeights<float>& before = global.moe_layers[1];
  double moved = 0;
  for (std::size_t i = 0; i < routers[1].size(); ++i) moved += std::abs(routers[1][i] - before.router.span()[i]);
  CHECK(moved > 0);
}

namespace {

GptConfig hf_test_config(bool qwen) {
  GptConfig config;
  config.layer = layer_config(1);
  config.layer.heads = 4;
  config.layer.kv_heads = 2;
  config.layer.ffn = 12;
  config.layer.rope = true;
  config.layers = 3;
  config.vocab = 30;
  MoeConfig m = moe_config(qwen);
  m.norm_topk_prob = true;
  config.moe = MoeLayers{m, qwen ? 1 : 0};
  return config;
}

void check_same(const Tensor<float>& got, const Tensor<float>& want, const std::string& what) {
  INFO(what);
  REQUIRE(got.shape() == want.shape());
  CHECK_CLOSE(got.span(), want.span(), kFloat64);
}

}  // namespace

TEST_CASE("moe gpt: the Hugging Face export reads back through the inference engine's loader") {
  for (const bool qwen : {false, true}) {
    const GptConfig config = hf_test_config(qwen);
    const int p = qwen ? 4 : 2;
    const std::string folder =
        (std::filesystem::temp_directory_path() / fmt::format("paradyse_hf_{}_{}", ::getpid(), qwen ? "qwen" : "mixtral")).string();
    std::filesystem::remove_all(folder);
    run_ranks(p, [&](ThreadCommunicator& comm) {
      Gpt<Strategies> model(config, p, comm.rank(), 33);
      save_hf_checkpoint(comm, model, folder, 256);
    });
    const serve::DecoderConfig d = serve::read_decoder_config(folder);
    CHECK(d.family == (qwen ? serve::Family::qwen2_moe : serve::Family::mixtral));
    CHECK(d.vocab == config.vocab);
    CHECK(d.layers == config.layers);
    CHECK(d.heads == config.layer.heads);
    CHECK(d.kv_heads == config.layer.kv_heads);
    CHECK(d.head_dim == config.layer.head_dim);
    CHECK(d.moe.experts == config.moe->moe.experts);
    CHECK(d.moe.top_k == config.moe->moe.top_k);
    CHECK(d.moe.expert_ffn == config.moe->moe.expert_ffn);
    CHECK(d.moe.shared_width() == config.moe->moe.shared_width());
    CHECK(d.moe.shared_gate == config.moe->moe.shared_gate);
    for (int l = 0; l < config.layers; ++l) CHECK(d.is_moe(l) == config.is_moe_layer(l));
    const serve::HfCheckpoint ck(folder);
    const serve::DecoderWeights w = serve::load_decoder_weights(d, ck);
    const GlobalGptWeights<float> g = init_global_gpt<float>(config, 33);  // what every rank's shards assemble to
    check_same(w.embed, g.embedding, "embedding");
    check_same(w.lm_head, g.head, "lm head");
    for (int l = 0; l < config.layers; ++l) {
      const serve::DecoderLayerWeights& got = w.layers[std::size_t(l)];
      const GlobalLayerWeights<float>& want = g.layers[std::size_t(l)];
      const std::string at = fmt::format("{} layer {}", qwen ? "qwen2_moe" : "mixtral", l);
      check_same(got.wq, want.w_q, at + " q");
      check_same(got.wk, want.w_k, at + " k");
      check_same(got.wv, want.w_v, at + " v");
      check_same(got.wo_t, want.w_proj, at + " o");
      check_same(got.attn_norm, want.norm1_gamma, at + " input norm");
      check_same(got.ffn_norm, want.norm2_gamma, at + " post-attention norm");
      if (!config.is_moe_layer(l)) {
        const std::int64_t f = config.layer.ffn, h = config.layer.hidden;
        REQUIRE(got.dense_in.numel() == 2 * f * h);
        CHECK_CLOSE(got.dense_in.span().first(std::size_t(f * h)), want.w_in.span(), kFloat64);
        CHECK_CLOSE(got.dense_in.span().subspan(std::size_t(f * h)), want.w_up.span(), kFloat64);
        CHECK_CLOSE(got.dense_out.span(), want.w_out.span(), kFloat64);
        continue;
      }
      const GlobalMoeWeights<float>& e = g.moe_layers[std::size_t(l)];
      check_same(got.moe.router, e.router, at + " router");
      check_same(got.moe.expert_in, e.expert_in, at + " experts in");
      check_same(got.moe.expert_out, e.expert_out, at + " experts out");
      if (qwen) {
        check_same(got.moe.shared_in, e.shared_in, at + " shared in");
        check_same(got.moe.shared_out, e.shared_out, at + " shared out");
        check_same(got.moe.shared_gate, e.shared_gate, at + " shared gate");
      }
    }
    std::filesystem::remove_all(folder);
  }
  GptConfig layer_norm = hf_test_config(false);
  layer_norm.layer.norm = NormKind::layer_norm;
  CHECK_THROWS_WITH_AS(check_hf_exportable(layer_norm), doctest::Contains("LayerNorm"), Error);
  GptConfig ungated = hf_test_config(true);
  ungated.moe->moe.shared_gate = false;
  CHECK_THROWS_WITH_AS(check_hf_exportable(ungated), doctest::Contains("without the sigmoid gate"), Error);
}
