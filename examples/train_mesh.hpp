// examples/train_mesh.hpp: train_gpt --mesh dp=D,pp=P,cp=C: the dense GPT trained on a D x P x C mesh of ranks
// (mesh/device_mesh.hpp; cp innermost, so a cp group holds consecutive ranks).
//
//   cp  every stage of every replica is a cp group of C ranks: the sequence is sharded over it in the unified layout
//       and the ParaDySe strategies switch per layer inside it, as in the single-group run (the exact planner picks
//       each layer's attention and MLP strategy for the cp group and the micro-batch shape, under the memory cap);
//   pp  the L layers are cut into P stages (uneven allowed); the stages run the 1F1B schedule of model/pipeline.hpp
//       over the micro-batches (one row each), activations [1, n_r, h] passed point to point between the cp ranks
//       of the same cp index. Stage 0 holds the embedding, stage P-1 the final norm, the LM head and the loss;
//   dp  the rows of each step's batch are dealt to the D replicas in contiguous chunks (uneven allowed, an empty
//       replica contributes nothing); gradients are summed over the dp group by model/data_parallel.hpp's
//       DataParallelOptimizer, tensor by tensor, with ZeRO stage 0, 1 or 2 (--zero);
//   ep  with --experts (the MoE GPT of examples/train_moe.hpp), dimension fusion: the MoE layers run over an expert
//       group folded over the D x C devices of a stage (ep = D * C, mesh.group({"dp", "cp"})) while attention keeps
//       its cp group on the same devices. Each rank brings its own tokens (its replica's rows, its cp shard of them)
//       to the MoE (ExpertParallel or ExpertTensorParallel, planned per layer); rank (d, c) owns the experts of ep
//       rank d * C + c, and the router and shared experts are replicated over the group. Their gradients are fully
//       reduced over the group by the MoE layer itself, so they take a plain AdamW step (no dp reduction, no ZeRO).
//       Every replica must hold at least one row of every step (checked); pp with experts is refused for now.
//
// Packed documents (--pack-documents B, as train_gpt's single group): a packed sequence holds several documents back
// to back (examples/corpus.hpp's pack_sequences); every stage's stack masks attention to each document and restarts
// RoPE positions at each (TransformerStack::set_documents), across cp and pp alike, and the planner plans a sequence
// from its documents' lengths. A mesh step holds D packed sequences, one per dp replica (MeshStep, mesh_steps: grouped
// by the planner's predicted time so that a step's replicas finish together; the last step may leave replicas idle),
// each with its own length and document starts, weighted by real tokens as rows are. Each replica's cp group plans
// its own sequence: strategies must agree only within a cp group and along its pp stages, and the replicas meet only
// in the gradient reduction, so the step's time is its slowest replica's and planning each for its own sequence
// minimises each. With --experts the MoE layers span the replicas, so every replica runs the plan of the step's most
// expensive sequence (the largest predicted time), and every replica must hold a sequence in every step (checked).
//
// The loss and every gradient are those of the whole step's batch: each token's loss gradient is scaled by
// 1 / (counted tokens of the whole batch) and the dp reduction sums, so the losses equal those of the single cp group
// training on the same batch (`train_gpt --ranks C` with the same --pack-tokens; with --experts, `--mesh cp=C`) within
// float rounding; the ctest train_gpt_mesh checks it (packed sequences over dp > 1, which no single group trains
// together: tests/examples/packing.cpp against the documents alone, and the ctest between two meshes). The AdamW step is the single-group model's (weight decay on
// matrices, none on norms; the same warm-up), elementwise, so ZeRO's chunking changes no value.
//
// Pipeline activations: a stage keeps only each in-flight micro-batch's input and recomputes its layers' forward
// before the backward (full recomputation at stage granularity, as Megatron-LM's runs do), unless the micro-batch is
// the one its last forward ran (always so on the last stage and without pp), whose saved activations it still holds.
//
// The whole run is one collective call over the world's ranks (thread ranks, or MPI processes under mpirun): the
// mesh groups are split once, every step's plan is computed before training (it depends on the step's shape
// only), and world rank 0 prints the table. Memory: planned under the cap (--cap-mib, or the single-group default);
// the trackers measure the peak but do not enforce the cap.
#pragma once

#include "corpus.hpp"
#include "csv_table.hpp"
#include "model_flops.hpp"
#include "plan_names.hpp"
#include "train_moe.hpp"
#include "train_ranks.hpp"
#include "training_data.hpp"
#include "training_options.hpp"

#include "paradyse/core/error.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/model/data_parallel.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/pipeline.hpp"
#include "paradyse/moe/moe_weights.hpp"
#include "paradyse/plan/gpt_costs.hpp"
#include "paradyse/plan/moe_plan.hpp"
#include "paradyse/plan/planner.hpp"
#include "paradyse/plan/stack_plan.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace paradyse::examples {

// "dp=2,pp=2,cp=2" (any order, each axis at most once, missing axes of size 1) as the mesh {dp, pp, cp}, cp
// innermost. Throws an Error naming the bad part.
inline DeviceMesh parse_mesh(std::string_view text) {
  int sizes[3] = {0, 0, 0};
  constexpr std::string_view names[3] = {"dp", "pp", "cp"};
  std::size_t from = 0;
  check(!text.empty(), "--mesh: empty; expected axes such as dp=2,cp=2 (axes dp, pp, cp)");
  while (from <= text.size()) {
    const std::size_t comma = std::min(text.find(',', from), text.size());
    const std::string_view part = text.substr(from, comma - from);
    const std::size_t eq = part.find('=');
    check(eq != std::string_view::npos, "--mesh {}: \"{}\" is not AXIS=SIZE (axes dp, pp, cp)", text, part);
    const std::string_view name = part.substr(0, eq), value = part.substr(eq + 1);
    const auto axis = std::find(std::begin(names), std::end(names), name) - std::begin(names);
    check(axis < 3, "--mesh {}: unknown axis \"{}\"; train_gpt trains on the axes dp, pp and cp (tensor and expert "
          "axes are search_parallel's)", text, name);
    check(sizes[axis] == 0, "--mesh {}: axis {} is given twice", text, name);
    int size = 0;
    for (char ch : value) {
      check(std::isdigit(static_cast<unsigned char>(ch)) && size < 100000, "--mesh {}: the size of {} is \"{}\", "
            "expected a positive integer", text, name, value);
      size = size * 10 + (ch - '0');
    }
    check(!value.empty() && size >= 1, "--mesh {}: the size of {} is \"{}\", expected a positive integer", text, name,
          value);
    sizes[axis] = size;
    from = comma + 1;
  }
  return DeviceMesh({{"dp", std::max(sizes[0], 1)}, {"pp", std::max(sizes[1], 1)}, {"cp", std::max(sizes[2], 1)}});
}

// One rank's part of the GPT on the mesh: the layers of its pp stage sharded over its cp group, plus the embedding
// (first stage) or the final norm and LM head (last stage), their gradients, and an optimizer per tensor over dp.
// A PipelineStage (model/pipeline.hpp) over the cp group `C`.
template <class Strategies, Communicator C>
class MeshGptStage {
public:
  using Stack = TransformerStack<Strategies>;
  struct Saved {
    Tensor<float> input;  // [b, n_r, h]: the stage's input, to recompute its forward
  };

  // Stage `stage` of `stages` holds layers `layers` (global indices) of `config`, sharded over cp rank `cp_rank`
  // of `cp_size` (the MoE layers' experts over ep rank `ep_rank` of `ep_size`), drawn from `seed` as
  // Gpt(config, cp_size, cp_rank, seed) draws them.
  MeshGptStage(const GptConfig& config, int stage, int stages, ChunkRange layers, int cp_size, int cp_rank,
               int ep_size, int ep_rank, std::uint64_t seed)
      : config_(config), first_(stage == 0), last_(stage == stages - 1), layers_(layers),
        stack_(make_stack(config, layers, cp_size, cp_rank, ep_size, ep_rank, seed)) {
    const std::int64_t v = config.vocab, h = config.layer.hidden;
    check(!config.tied_head, "--mesh: the GPT's head is untied");
    // Stages without the embedding or the head hold them empty ([0, h]; a default Tensor is a scalar).
    embedding_ = Tensor<float>(Shape{0, h});
    embedding_grad_ = Tensor<float>(Shape{0, h});
    head_ = Tensor<float>(Shape{0, h});
    head_grad_ = Tensor<float>(Shape{0, h});
    if (first_) {
      embedding_ = Tensor<float>(Shape{v, h});
      embedding_grad_ = Tensor<float>(Shape{v, h});
      for (std::int64_t i = 0; i < v; ++i)
        gpt_detail::init_row(config, seed, gpt_detail::Part::embedding, i, gpt_detail::row_span(embedding_, i));
    }
    if (last_) {  // rows: head [v], final gamma, final beta
      head_ = Tensor<float>(Shape{v + 2, h});
      head_grad_ = Tensor<float>(Shape{v + 2, h});
      for (std::int64_t i = 0; i < v; ++i)
        gpt_detail::init_row(config, seed, gpt_detail::Part::head, i, gpt_detail::row_span(head_, i));
      std::ranges::fill(gpt_detail::row_span(head_, v), 1.0f);
    }
  }

  bool first() const noexcept { return first_; }
  bool last() const noexcept { return last_; }
  const GptConfig& config() const noexcept { return config_; }
  Stack& stack() noexcept { return stack_; }

  // The step's context: the cp group, the expert group (the cp group itself without experts), the pool, the
  // stage's slice of the plan, the sequence length and its packed documents (global starts; empty: one document).
  void begin_step(C& cp, C& ep, BufferPool& pool, StackPlan plan, std::int64_t seq_len,
                  std::span<const std::int64_t> document_starts = {}) {
    stack_.set_documents(document_starts);
    cp_ = &cp;
    ep_ = &ep;
    pool_ = &pool;
    plan_ = std::move(plan);
    seq_len_ = seq_len;
    held_ = -1;
    stack_.zero_gradients();
    if (first_) Backend::fill(embedding_grad_.view(), 0.0f);
    if (last_) Backend::fill(head_grad_.view(), 0.0f);
  }

  Saved forward(int micro_batch, TensorView<const float> x, TensorView<float> y) {
    stack_.forward(*cp_, *ep_, *pool_, plan_, seq_len_, x, y);
    held_ = micro_batch;
    return Saved{Tensor<float>::copy_of(x)};
  }
  void backward(int micro_batch, Saved& saved, TensorView<const float> dy, TensorView<float> dx) {
    if (held_ != micro_batch) {  // recompute the forward of this micro-batch
      PooledBuffer<float> y = pool_->acquire<float>(saved.input.shape());
      stack_.forward(*cp_, *ep_, *pool_, plan_, seq_len_, saved.input.view(), y.view());
    }
    stack_.backward(*cp_, *ep_, *pool_, dy, dx);
    held_ = -1;
    saved.input = Tensor<float>();
  }

  // First stage: x [b, n_r, h] <- the embedding of tokens [b, n_r]; and its backward (accumulates).
  void embed(TensorView<const std::int32_t> tokens, TensorView<float> x) {
    Backend::embedding_forward(tokens, TensorView<const float>(embedding_.view()), x);
  }
  void embed_backward(TensorView<const std::int32_t> tokens, TensorView<const float> dx) {
    Backend::embedding_backward(tokens, dx, embedding_grad_.view());
  }

  // Last stage: the final norm, the LM head and the cross-entropy of y [b, n_r, h] against targets [b, n_r]; dy
  // (zeroed by the caller) <- the loss gradient, each token's scaled by grad_scale. Returns the loss sum.
  double head_loss(TensorView<const float> y, TensorView<const std::int32_t> targets, TensorView<float> dy,
                   float grad_scale) {
    const LayerConfig& c = config_.layer;
    const std::int64_t v = config_.vocab, h = c.hidden, rows = y.numel() / h;
    Tensor<float> normed(y.shape()), dnormed(y.shape()), stats(Shape{2, rows});
    const TensorView<float> mean = stats.view().slice(0, 0, 1).reshape(Shape{rows});
    const TensorView<float> rstd = stats.view().slice(0, 1, 1).reshape(Shape{rows});
    norm_forward<Backend>(c, y, gpt_detail::row_span(head_, v), gpt_detail::row_span(head_, v + 1), normed.view(),
                          mean, rstd);
    const TensorView<const float> x = TensorView<const float>(normed.view()).reshape(Shape{rows, h});
    const TensorView<float> dx = dnormed.view().reshape(Shape{rows, h});
    const TensorView<const std::int32_t> t = targets.reshape(Shape{rows});
    const TensorView<const float> weights = TensorView<const float>(head_.view()).slice(0, 0, v);
    const TensorView<float> weights_grad = head_grad_.view().slice(0, 0, v);
    const std::int64_t chunk_rows = Gpt<Strategies>::kHeadChunkRows;
    Tensor<float> logits(Shape{std::min(rows, chunk_rows), v});
    double loss = 0.0;
    using ops::Transpose;
    for (std::int64_t start = 0; start < rows; start += chunk_rows) {
      const std::int64_t count = std::min(chunk_rows, rows - start);
      const TensorView<float> chunk = logits.view().slice(0, 0, count);
      Backend::matmul(x.slice(0, start, count), Transpose::no, weights, Transpose::yes, chunk);
      loss += Backend::cross_entropy_forward_backward(chunk, t.slice(0, start, count), chunk, grad_scale).loss_sum;
      const TensorView<const float> dlogits = chunk;
      Backend::matmul(dlogits, Transpose::yes, x.slice(0, start, count), Transpose::no, weights_grad, 1.0f, 1.0f);
      Backend::matmul(dlogits, Transpose::no, weights, Transpose::no, dx.slice(0, start, count));
    }
    norm_backward<Backend>(c, y, gpt_detail::row_span(head_, v), mean, rstd, dnormed.view(), dy,
                           gpt_detail::row_span(head_grad_, v), gpt_detail::row_span(head_grad_, v + 1));
    return loss;
  }

  // After the step's micro-batches: the replicated gradients summed over the cp group (they are partial sums over
  // the rank's tokens; the layers' norm gradients the stack reduced already).
  void reduce_replicated(C& cp) {
    for (Tensor<float>* g : {&embedding_grad_, &head_grad_})
      if (g->numel() > 0) cp.all_reduce(std::span<const float>(g->span()), g->span(), ReduceOp::sum);
  }

  // Every (parameter, gradient, decays, replicated over dp) of this rank, in a fixed order (the same on every dp
  // replica for those replicated over dp; the MoE layers' expert shards, router and shared experts are not: their
  // gradients are already reduced over the expert group, which spans dp).
  struct Parameter {
    Tensor<float>* value;
    Tensor<float>* gradient;
    bool decays;
    bool over_dp = true;
  };
  std::vector<Parameter> parameters() {
    std::vector<Parameter> out;
    for (std::size_t l = 0; l < stack_.weights().size(); ++l) {
      LayerWeights& w = stack_.weights()[l];
      LayerWeights& g = stack_.gradients()[l];
      out.push_back({&w.attention.packed, &g.attention.packed, true});
      out.push_back({&w.mlp.packed, &g.mlp.packed, true});
      out.push_back({&w.norms.packed, &g.norms.packed, false});
    }
    for (std::size_t l = 0; l < stack_.weights().size(); ++l) {
      if (!stack_.is_moe_layer(int(l))) continue;
      MoeShard& w = stack_.moe_weights()[l];
      MoeShard& g = stack_.moe_gradients()[l];
      for (auto member : {&MoeShard::router, &MoeShard::expert_in, &MoeShard::expert_out, &MoeShard::shared_in,
                          &MoeShard::shared_out, &MoeShard::shared_gate})
        out.push_back({&(w.*member), &(g.*member), true, false});
    }
    if (first_) out.push_back({&embedding_, &embedding_grad_, true});
    if (last_) out.push_back({&head_, &head_grad_, true});  // the norm rows are split off by the caller
    return out;
  }
  std::int64_t head_matrix_elements() const { return config_.vocab * config_.layer.hidden; }

private:
  using Backend = ops::Cpu;
  // This stage's slice of the layers; with MoE layers, dense shards over cp and expert shards over ep, each drawn
  // from seed + global layer index as Gpt's stack draws them.
  static Stack make_stack(const GptConfig& config, ChunkRange layers, int cp_size, int cp_rank, int ep_size,
                          int ep_rank, std::uint64_t seed) {
    const int count = int(layers.length);
    const std::uint64_t first = seed + std::uint64_t(layers.start);
    if (!config.moe || config.moe->first_k_dense >= layers.end()) return Stack(config.layer, count, cp_size, cp_rank, first);
    const MoeLayers moe{config.moe->moe, int(std::max<std::int64_t>(0, config.moe->first_k_dense - layers.start))};
    std::vector<LayerWeights> dense;
    std::vector<MoeShard> experts;
    for (int l = 0; l < count; ++l) {
      dense.push_back(init_shard(config.layer, cp_size, cp_rank, first + std::uint64_t(l)));
      experts.push_back(moe.is_moe(l) ? init_moe_shard(moe.moe, ep_size, ep_rank, first + std::uint64_t(l)) : MoeShard{});
    }
    return Stack(config.layer, std::move(dense), std::move(experts), moe, cp_size);
  }
  GptConfig config_;
  bool first_, last_;
  ChunkRange layers_;
  Stack stack_;
  Tensor<float> embedding_, embedding_grad_;  // first stage: [V, h]
  Tensor<float> head_, head_grad_;            // last stage: [V + 2, h]: the head, the final gamma and beta
  C* cp_ = nullptr;
  C* ep_ = nullptr;
  BufferPool* pool_ = nullptr;
  StackPlan plan_;
  std::int64_t seq_len_ = 0;
  int held_ = -1;  // the micro-batch whose activations the stack holds (-1: none)
};

// AdamW for every parameter of a stage, the single-group model's rule: one DataParallelOptimizer over dp per tensor
// replicated over dp (the gradients summed over the replicas; the last stage's head pack in two: the head matrix
// with weight decay, the final norm without), a plain AdamW step for the MoE tensors (reduced over the expert group).
class MeshOptimizer {
public:
  template <class Stage>
  MeshOptimizer(Stage& stage, ZeroStage zero, int replicas, int replica, const ops::AdamWConfig& adamw) {
    const auto parameters = stage.parameters();
    for (const auto& p : parameters) {
      const std::int64_t n = p.value->numel();
      if (n == 0) continue;
      if (!p.over_dp) {
        local_.push_back({p.value->span(), p.gradient->span(), p.decays ? adamw : no_decay(adamw),
                          Tensor<float>(Shape{n}), Tensor<float>(Shape{n})});
        ops::Cpu::fill(local_.back().m.view(), 0.0f);
        ops::Cpu::fill(local_.back().v.view(), 0.0f);
        continue;
      }
      const bool head = stage.last() && p.value == parameters.back().value;
      const std::int64_t decayed = head ? stage.head_matrix_elements() : (p.decays ? n : 0);
      if (decayed > 0) add(p.value->span().subspan(0, std::size_t(decayed)), p.gradient->span().subspan(0, std::size_t(decayed)), true, zero, replicas, replica, adamw);
      if (n > decayed) add(p.value->span().subspan(std::size_t(decayed)), p.gradient->span().subspan(std::size_t(decayed)), false, zero, replicas, replica, adamw);
    }
  }
  // One AdamW step (step >= 1) at learning rate lr; collective over the dp group.
  template <Communicator C>
  void step(C& dp, float learning_rate, std::int64_t step) {
    for (Entry& e : entries_) {
      e.config.learning_rate = learning_rate;
      e.optimizer.set_config(e.config);
      e.optimizer.step(dp, e.params, e.grads, step);
    }
    for (Local& e : local_) {
      e.config.learning_rate = learning_rate;
      const auto view = [](std::span<float> s) { return TensorView<float>(s.data(), Shape{std::int64_t(s.size())}); };
      ops::Cpu::adamw_step(view(e.params), TensorView<const float>(view(e.grads)), e.m.view(), e.v.view(), e.config,
                           step);
    }
  }
  // Bytes of AdamW state this rank holds.
  std::int64_t state_bytes() const {
    std::int64_t n = 0;
    for (const Entry& e : entries_) n += e.optimizer.state_bytes();
    for (const Local& e : local_) n += 2 * e.m.numel() * std::int64_t(sizeof(float));
    return n;
  }

private:
  struct Entry {
    std::span<float> params, grads;
    ops::AdamWConfig config;
    DataParallelOptimizer<> optimizer;
  };
  struct Local {
    std::span<float> params, grads;
    ops::AdamWConfig config;
    Tensor<float> m, v;
  };
  static ops::AdamWConfig no_decay(ops::AdamWConfig adamw) {
    adamw.weight_decay = 0.0f;
    return adamw;
  }
  void add(std::span<float> params, std::span<float> grads, bool decays, ZeroStage zero, int replicas, int replica,
           ops::AdamWConfig adamw) {
    if (!decays) adamw = no_decay(adamw);
    entries_.push_back({params, grads, adamw, DataParallelOptimizer<>(zero, replicas, replica, std::int64_t(params.size()), adamw)});
    entries_.back().optimizer.set_reduce_op(ReduceOp::sum);  // each replica's gradient is scaled to the whole batch
  }
  std::vector<Entry> entries_;
  std::vector<Local> local_;
};

// The forward and backward of one step on this rank: `stage` (begun with begin_step) runs this replica's rows `mine`
// of the step's sequences (inputs, targets: the whole step's [rows, s] tokens), in micro-batches of one row with pp
// stages (pp_group's size) and all at once without, through the 1F1B schedule; each token's loss gradient is scaled by
// grad_scale (1 / the step's counted tokens); then the replicated gradients are summed over cp_group. Returns this
// rank's loss sum (the last stage's tokens; 0 on the others and on a replica without rows).
template <class Strategies, Communicator C>
double mesh_forward_backward(MeshGptStage<Strategies, C>& stage, C& pp_group, C& cp_group, ChunkRange mine,
                             std::int64_t s, std::span<const std::int32_t> inputs,
                             std::span<const std::int32_t> targets, float grad_scale) {
  const bool pipelined = pp_group.size() > 1;
  const int cp_rank = int(cp_group.rank());
  // Micro-batches of the rows: [b, n_r] tokens and targets of this cp rank.
  const std::int64_t per_micro = pipelined ? 1 : std::max<std::int64_t>(mine.length, 1);
  const int micro_batches = int((mine.length + per_micro - 1) / per_micro);
  const SequenceLayout layout(s, int(cp_group.size()), stage.config().layer.zigzag);
  const std::int64_t n = layout.local_length(cp_rank), h = stage.config().layer.hidden;
  std::vector<Tensor<std::int32_t>> x_tokens, y_tokens;
  for (int i = 0; i < micro_batches; ++i) {
    const std::int64_t first_row = mine.start + i * per_micro, b = std::min(per_micro, mine.end() - first_row);
    const auto slice = [&](std::span<const std::int32_t> all) { return all.subspan(std::size_t(first_row * s), std::size_t(b * s)); };
    x_tokens.push_back(shard_tokens(slice(inputs), b, layout, cp_rank));
    y_tokens.push_back(shard_tokens(slice(targets), b, layout, cp_rank));
  }
  double loss_sum = 0.0;
  if (micro_batches > 0) {
    Tensor<float> embedded(Shape{per_micro, n, h});
    PipelineIo io;
    io.input = [&](int i) {
      stage.embed(x_tokens[std::size_t(i)].view(), embedded.view());
      return TensorView<const float>(embedded.view());
    };
    io.loss_gradient = [&](int i, TensorView<const float> y, TensorView<float> dy) {
      loss_sum += stage.head_loss(y, y_tokens[std::size_t(i)].view(), dy, grad_scale);
    };
    io.input_gradient = [&](int i, TensorView<const float> dx) { stage.embed_backward(x_tokens[std::size_t(i)].view(), dx); };
    run_pipeline(pp_group, stage, micro_batches, Shape{per_micro, n, h}, io);
  }
  stage.reduce_replicated(cp_group);
  return loss_sum;
}

// One step of the mesh: what each dp replica trains.
//   rows (one window per step, or --pack-tokens): ONE corpus::Step whose rows are dealt to the D replicas in
//     contiguous chunks (uneven allowed; a replica past the rows trains nothing that step);
//   packed sequences (--pack-documents): up to D corpus::Steps, each ONE sequence of packed documents, replica d
//     training the d-th with its own length and document starts (a replica past the last trains nothing).
// The loss and every gradient are those of the whole step: each token's loss gradient is scaled by 1 / real_tokens()
// and the dp reduction sums, so the replicas are weighted by their real tokens.
struct MeshStep {
  std::vector<corpus::Step> parts;  // rows: one step; packed: one sequence per replica, at most D
  bool per_replica = false;         // packed: parts[d] is replica d's

  // The part replica `replica` of `dp` trains (nullptr: none) and its rows of that part.
  std::pair<const corpus::Step*, ChunkRange> work(int replica, int dp) const {
    if (!per_replica) return {&parts.at(0), chunk_range(parts.at(0).sequences(), dp, replica)};
    if (std::size_t(replica) >= parts.size()) return {nullptr, ChunkRange{0, 0}};
    return {&parts[std::size_t(replica)], ChunkRange{0, 1}};
  }
  // The counted tokens of the whole step (every real token has a target; padding has none).
  std::int64_t real_tokens() const {
    std::int64_t n = 0;
    for (const corpus::Step& p : parts) n += p.real_tokens();
    return n;
  }
  std::int64_t documents() const {
    std::int64_t n = 0;
    for (const corpus::Step& p : parts) n += std::int64_t(p.rows.size());
    return n;
  }
  std::int64_t longest() const {
    std::int64_t n = 0;
    for (const corpus::Step& p : parts) n = std::max(n, p.length);
    return n;
  }
  // Rows of the whole step: sequences over every part.
  std::int64_t sequences() const {
    std::int64_t n = 0;
    for (const corpus::Step& p : parts) n += p.sequences();
    return n;
  }
};

// The mesh's steps: each of `steps` alone, its rows dealt over the dp replicas; or, when the steps are packed
// sequences (corpus::pack_sequences), dp of them per mesh step, one per replica (the last step may hold fewer). With
// `cost` (one per step, e.g. the planner's predicted time) the sequences are grouped by cost: sorted by it, the most
// expensive first, and cut into groups of dp, so that a step's replicas take about as long as each other (the step
// waits for its slowest); the steps then come in the order of their first sequence in `steps` (the shuffle or the
// curriculum), each step's parts in that order too. Without costs, dp consecutive sequences make a step.
inline std::vector<MeshStep> mesh_steps(const std::vector<corpus::Step>& steps, int dp,
                                        std::span<const double> cost = {}) {
  check(dp >= 1, "mesh_steps: dp = {}, expected at least 1", dp);
  check(cost.empty() || cost.size() == steps.size(), "mesh_steps: {} costs for {} steps", cost.size(), steps.size());
  std::vector<MeshStep> out;
  std::vector<std::size_t> packed;  // the packed sequences, by index
  for (std::size_t k = 0; k < steps.size(); ++k) {
    if (steps[k].packed) packed.push_back(k);
    else out.push_back({{steps[k]}, false});
  }
  if (!cost.empty() && dp > 1)
    std::stable_sort(packed.begin(), packed.end(), [&](std::size_t a, std::size_t b) { return cost[a] > cost[b]; });
  std::vector<std::vector<std::size_t>> groups;
  for (std::size_t i = 0; i < packed.size(); i += std::size_t(dp)) {
    groups.emplace_back(packed.begin() + std::ptrdiff_t(i),
                        packed.begin() + std::ptrdiff_t(std::min(packed.size(), i + std::size_t(dp))));
    std::sort(groups.back().begin(), groups.back().end());
  }
  std::sort(groups.begin(), groups.end());  // by their first sequence
  for (const std::vector<std::size_t>& group : groups) {
    out.push_back({{}, true});
    for (const std::size_t k : group) out.back().parts.push_back(steps[k]);
  }
  return out;
}

namespace mesh_detail {

// A step's plan for the stack, and its compact name for the table.
struct StepPlan {
  StackPlan stack;
  std::string name;
  double time_s = 0;  // the planner's predicted time
};

}  // namespace mesh_detail

// Trains the dense GPT on `ranks` (threads or MPI processes, as many as the mesh holds). Returns the exit code.
template <class Strategies, class RanksT>
int train_mesh(const TrainingOptions& o, const cost::HardwareProfile& hardware, RanksT& ranks) {
  using Model = Gpt<Strategies>;
  const DeviceMesh mesh = parse_mesh(o.mesh);
  mesh.check_world_size(ranks.size());
  const int dp = mesh.axis_size("dp"), pp = mesh.axis_size("pp"), cp = mesh.axis_size("cp");
  check(o.layers >= pp, "--mesh {}: {} pipeline stages need at least as many layers (--layers {})", o.mesh, pp,
        o.layers);
  const bool experts = o.experts > 0;
  check(!experts || pp == 1, "--mesh {} --experts {}: pipeline stages with MoE layers are not supported yet (pp must "
        "be 1)", o.mesh, o.experts);
  GptConfig config;
  if (experts) {  // the MoE GPT of train_gpt --experts (examples/train_moe.hpp)
    config = moe_gpt_config(o);
  } else {
    config.layer = LayerConfig::make(o.hidden, o.heads);
    config.layer.causal = config.layer.zigzag = config.layer.rope = true;
    config.layers = o.layers;
    config.vocab = 256;
  }
  config.validate_for(cp);
  check(!experts || o.strategy.empty(), "--mesh --experts: the planner picks every sublayer (no --strategy)");
  check(o.pack_documents == 0 || o.pack_tokens == 0, "--mesh {}: --pack-tokens {} (documents as rows) and "
        "--pack-documents {} (documents in one sequence) exclude each other", o.mesh, o.pack_tokens, o.pack_documents);

  // The data: the single-group run's (examples/train_gpt.cpp with --ranks C; examples/training_data.hpp).
  const TrainingData data = training_data(o, {cp, config.layer.zigzag}, o.pack_tokens);
  const std::vector<corpus::Document>& docs = data.docs;
  const std::vector<corpus::Step>& steps = data.steps;

  // Micro-batches: without pp a replica's rows are one micro-batch; with pp each row is one.
  const auto micro_rows = [&](const corpus::Step& step) {
    const std::int64_t rows = step.sequences();
    return pp > 1 ? std::int64_t(1) : (rows + dp - 1) / dp;
  };
  // Every step's plan for a cp group running one micro-batch, computed before training.
  const plan::GptCosts<Model> costs{config, cp, &hardware};
  const plan::MoeGptCosts<Model> moe_costs{config, cp, &hardware};
  std::int64_t cap = 0;
  if (o.cap_mib > 0) cap = std::int64_t(o.cap_mib * 1024 * 1024);
  else if (experts) cap = hardware.usable_memory_bytes();  // as train_gpt --experts
  else {
    const std::int64_t metp = costs.uniform_peak(o.max_len, cost::default_catalog().index_of("METP"));
    const std::int64_t ts = costs.uniform_peak(o.max_len, cost::default_catalog().index_of("MegatronTS"));
    cap = (metp + (ts - metp) / 4 + (1 << 20) - 1) / (1 << 20) * (1 << 20);
  }
  const auto plan_start = std::chrono::steady_clock::now();
  // With experts the MoE FFN's row models the expert group as the cp group (the planner's view of train_gpt
  // --experts); the choice between ExpertParallel and ExpertTensorParallel is exact either way, its cost approximate.
  //
  // Packed sequences over dp > 1: each replica's cp group plans its own sequence (the strategies must agree within
  // a cp group and along its pp stages only; the replicas meet only in the gradient reduction, so the step takes as
  // long as its slowest replica, and planning each for its own sequence minimises each). With experts the MoE layers
  // span the replicas (ep = dp x cp), so every sublayer's strategy must agree over the whole mesh: the step runs
  // every replica on the plan of its most expensive sequence (the largest predicted time).
  // plans[k][d]: replica d's plan in step k (std::nullopt: no plan fits the cap, and the step is skipped).
  // Keyed by a part's shape: its length, or its packed documents' lengths, and the micro-batch's rows.
  std::map<std::pair<std::vector<std::int64_t>, std::int64_t>, std::optional<mesh_detail::StepPlan>> planned;
  const auto plan_of = [&](const corpus::Step& step) {
    const bool packed = step.document_starts().size() > 1;
    const std::int64_t length = step.length;
    const std::pair key{packed ? step.document_lengths() : std::vector<std::int64_t>{length}, micro_rows(step)};
    if (!planned.count(key)) {
      try {
        if (experts) {
          const plan::MoePlan plan = plan::plan_moe_exact(
              packed ? moe_costs.packed_table(key.first)
                     : plan::build_moe_cost_table(config, hardware, cp, plan::Batch::single(length, key.second),
                                                  {4, 4, 8}, moe_costs.extra_bytes(length)),
              cap);
          planned[key] = mesh_detail::StepPlan{plan.stack_plan<Strategies>(), compact_plan(plan),
                                               plan.time_s};
        } else {
          const plan::CostTable table = packed ? costs.packed_table(key.first) : costs.table(length, key.second);
          const plan::Plan plan = o.strategy.empty()
              ? plan::plan_exact(table, cap)
              : plan::plan_of(table, plan::uniform_layers(table, cost::default_catalog().index_of(o.strategy)), cap);
          planned[key] = mesh_detail::StepPlan{plan::stack_plan<Strategies>(plan), compact_plan(plan),
                                               plan.time_s};
        }
      } catch (const plan::NoFeasiblePlan&) {
        planned[key] = std::nullopt;
      }
    }
    return planned[key];
  };
  // Rows are dealt over dp; packed sequences go one per replica, D per mesh step, grouped by their predicted time
  // (the planner's, for the cp group) so that a step's replicas wait little for each other.
  std::vector<double> predicted;
  for (const corpus::Step& step : steps) {
    const std::optional<mesh_detail::StepPlan>& plan = plan_of(step);
    predicted.push_back(plan ? plan->time_s : std::numeric_limits<double>::infinity());
  }
  const std::vector<MeshStep> mesh_steps_ = mesh_steps(steps, dp, predicted);
  const int n_steps = int(mesh_steps_.size());
  if (experts && dp > 1) {  // the expert group spans the replicas: each must bring tokens to every MoE layer
    check(o.pack_documents == 0 || steps.size() % std::size_t(dp) == 0, "--mesh {} --experts --pack-documents {}: "
          "the {} documents make {} packed sequences, not a multiple of the {} dp replicas (each replica must bring a "
          "sequence to every step's MoE layers): change --steps or --pack-documents", o.mesh, o.pack_documents,
          o.steps, steps.size(), dp);
    for (int k = 0; k < n_steps; ++k)
      check(mesh_steps_[std::size_t(k)].sequences() >= dp, "--mesh {} --experts: step {} holds {} row(s), "
            "fewer than the {} dp replicas (each must hold a row: raise --pack-tokens or lower --max-len)", o.mesh, k,
            mesh_steps_[std::size_t(k)].sequences(), dp);
  }
  std::vector<std::vector<std::optional<mesh_detail::StepPlan>>> plans(mesh_steps_.size());
  for (std::size_t k = 0; k < mesh_steps_.size(); ++k) {
    const MeshStep& step = mesh_steps_[k];
    for (const corpus::Step& part : step.parts) plans[k].push_back(plan_of(part));
    const bool all_fit = std::all_of(plans[k].begin(), plans[k].end(), [](const auto& p) { return p.has_value(); });
    if (!all_fit) plans[k].assign(1, std::nullopt);
    else if (experts && plans[k].size() > 1)  // one plan over the expert group: the most expensive part's
      plans[k].assign(1, *std::max_element(plans[k].begin(), plans[k].end(),
                                           [](const auto& a, const auto& b) { return a->time_s < b->time_s; }));
  }
  // Replica d's plan in step k (a replica without a part runs none: any plan of the step).
  const auto replica_plan = [&](std::size_t k, int d) -> const std::optional<mesh_detail::StepPlan>& {
    return plans[k][std::min(std::size_t(d), plans[k].size() - 1)];
  };
  const double planning_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - plan_start).count();

  fmt::print("model: GPT, {} layers, h={}, {} heads, ffn={}, vocab {} (bytes), causal + RoPE, zigzag tokens; {:.2f} M "
             "parameters\n", o.layers, o.hidden, o.heads, config.layer.ffn, config.vocab,
             double(config.parameter_count()) / 1e6);
  if (experts)
    fmt::print("experts: {} MoE layers of {} experts (top-{}, ffn {}), {} dense first; ep = dp x cp = {} ranks "
               "(attention in cp groups of {}, the MoE layers over the {} devices of dp x cp)\n",
               o.layers - o.first_dense, o.experts, o.top_k, config.moe->moe.expert_ffn, o.first_dense, dp * cp, cp,
               dp * cp);
  fmt::print("mesh: {} on {} {} (dp outermost, cp innermost); {} stage{} of {} layers; {}; activations of pp "
             "stages recomputed for the backward\n", mesh.to_string(), mesh.size(),
             o.backend == RankBackend::mpi ? "MPI processes" : "threads", pp, pp > 1 ? "s" : "",
             fmt::join([&] {
               std::vector<std::int64_t> n;
               for (int s = 0; s < pp; ++s) n.push_back(chunk_range(o.layers, pp, s).length);
               return n;
             }(), "+"), name_of(o.zero));
  fmt::print("data: {} documents, {} steps (lengths {}..{}, {}), {}, {} per micro-batch; plans "
             "for a cp group of {} under a cap of {:.0f} MiB ({:.1f} ms of planning)\n",
             docs.size(), n_steps, o.min_len, o.max_len,
             o.pack_tokens > 0      ? fmt::format("packed up to {} tokens", o.pack_tokens)
             : o.pack_documents > 0 ? fmt::format("sequences of documents packed up to {} tokens, attention "
                                                  "within each", o.pack_documents)
                                    : std::string("one window each"),
             o.pack_documents > 0 ? fmt::format("one sequence per dp replica ({} per step, each replica's cp group "
                                                "planning its own{})", dp, experts && dp > 1 ? ": with experts the "
                                                "most expensive's plan for all" : "")
                                  : std::string("rows dealt over dp"),
             pp > 1 ? "one row" : "a replica's rows", cp, double(cap) / (1024 * 1024), planning_s * 1e3);
  fmt::print("{:>4}  {:>6}  {:>4}  {:<{}}  {:>7}  {:>7}  {:>9}\n", "step", "len", "docs", "plan", 8 * o.layers, "loss",
             "time s", "peak MiB");

  CsvTable csv(ranks.reports() ? o.csv : std::string(), {"step", "length", "rows", "plan", "loss", "seconds", "peak_mib"});
  ops::AdamWConfig adamw;
  adamw.learning_rate = float(o.lr);
  adamw.weight_decay = 0.01f;
  const int warmup = std::max(1, std::min(8, n_steps / 8));
  std::vector<double> losses;
  for (int r = 0; r < ranks.size(); ++r) ranks.tracker(r).set_cap(std::numeric_limits<std::size_t>::max());
  const auto run_start = std::chrono::steady_clock::now();

  ranks.run([&](auto& world, int rank) {
    using Comm = std::remove_reference_t<decltype(world)>;
    Comm dp_group = mesh.group(world, {"dp"});
    Comm pp_group = mesh.group(world, {"pp"});
    Comm cp_group = mesh.group(world, {"cp"});
    std::optional<Comm> ep_group;  // experts: dp x cp, rank replica * cp + cp_rank
    if (experts) ep_group.emplace(mesh.group(world, {"dp", "cp"}));
    const MeshCoordinate at = mesh.coordinate(rank);
    const int replica = at[0], stage_index = at[1], cp_rank = at[2];
    MeshGptStage<Strategies, Comm> stage(config, stage_index, pp, chunk_range(o.layers, pp, stage_index), cp,
                                         cp_rank, experts ? dp * cp : cp, experts ? replica * cp + cp_rank : cp_rank,
                                         o.seed);
    MeshOptimizer optimizer(stage, o.zero, dp, replica, adamw);
    BufferPool pool;
    for (int k = 0; k < n_steps; ++k) {
      const MeshStep& step = mesh_steps_[std::size_t(k)];
      const std::int64_t s = step.longest(), rows = step.sequences(), documents = step.documents();
      if (!plans[std::size_t(k)][0]) {
        if (rank == 0) fmt::print("{:>4}  {:>6}  {:>4}  no plan fits the cap\n", k, s, documents);
        continue;
      }
      const auto start = std::chrono::steady_clock::now();
      // This replica's part of the step (rows: the one step, of which it trains `mine`; packed: its own sequence).
      const auto [part, mine] = step.work(replica, dp);
      const corpus::Step& tokens_of = part ? *part : step.parts[0];
      std::vector<std::int32_t> inputs, targets;
      corpus::step_tokens(tokens_of, docs, ops::cpu::kIgnoreIndex, inputs, targets);
      const double counted = double(step.real_tokens());  // the whole step's: every replica's tokens
      const float grad_scale = float(1.0 / counted);
      const StackPlan& full = replica_plan(std::size_t(k), replica)->stack;
      const ChunkRange layers = chunk_range(o.layers, pp, stage_index);
      const std::vector<std::int64_t> document_starts = tokens_of.document_starts();  // empty: one document per row
      stage.begin_step(cp_group, ep_group ? *ep_group : cp_group, pool,
                       StackPlan(full.begin() + layers.start, full.begin() + layers.end()), tokens_of.length,
                       document_starts);
      pool.trim();
      ranks.tracker(rank).reset_peak();
      // This replica's rows, run through the stages.
      const double loss_sum = mesh_forward_backward(stage, pp_group, cp_group, mine, tokens_of.length, inputs, targets,
                                                    grad_scale);
      adamw.learning_rate = float(o.lr * std::min(1.0, double(k + 1) / warmup));
      optimizer.step(dp_group, adamw.learning_rate, k + 1);
      double sums[2] = {loss_sum, double(ranks.tracker(rank).peak())}, total[2] = {0, 0};
      world.all_reduce(std::span<const double>(&sums[0], 1), std::span<double>(&total[0], 1), ReduceOp::sum);
      world.all_reduce(std::span<const double>(&sums[1], 1), std::span<double>(&total[1], 1), ReduceOp::max);
      if (rank != 0) continue;
      const double loss = total[0] / counted;
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      losses.push_back(loss);
      // The plan, or with packed sequences over dp each replica's, "|" between them where they differ.
      std::vector<std::string> names;
      for (const auto& p : plans[std::size_t(k)]) names.push_back(p->name);
      const bool one_plan = std::all_of(names.begin(), names.end(), [&](const std::string& n) { return n == names[0]; });
      const std::string plan_name = one_plan ? names[0] : fmt::format("{}", fmt::join(names, " | "));
      fmt::print("{:>4}  {:>6}  {:>4}  {:<{}}  {:>7.4f}  {:>7.2f}  {:>9.1f}\n", k, s, documents, plan_name, 8 * o.layers,
                 loss, seconds, total[1] / (1024 * 1024));
      std::fflush(stdout);
      csv.row(k, s, rows, plan_name, fmt::format("{:.17g}", loss), seconds, total[1] / (1024 * 1024));
    }
  });
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
  const std::size_t k = std::min<std::size_t>(10, losses.size());
  const auto mean = [&](std::size_t from, std::size_t to) {
    double sum = 0;
    for (std::size_t i = from; i < to; ++i) sum += losses[i];
    return to > from ? sum / double(to - from) : 0.0;
  };
  fmt::print("\nsummary\n  steps                      {} run on the mesh {}\n", losses.size(), mesh.to_string());
  fmt::print("  mean loss, first {:>2} steps  {:.4f}\n  mean loss, last {:>2} steps   {:.4f}\n", k, mean(0, k), k,
             mean(losses.size() - k, losses.size()));
  fmt::print("  total time                 {:.1f} s\n", total);
  return 0;
}

}  // namespace paradyse::examples
