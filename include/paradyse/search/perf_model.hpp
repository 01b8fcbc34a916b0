// paradyse/search/perf_model.hpp: step time, its breakdown, memory and MFU of one parallel configuration.
//
// Per micro-batch and layer, on one device (T = mb * s / cp tokens of the local sequence chunk, x = tp_x,
// y = tp_y, t = x * y):
// - compute: every GEMM at its local shape through the device's GEMM model (the planner's time model, cost/
//   profile.hpp): forward (m, n, k), backward dgrad (m, k, n) and wgrad (k, n, m); attention through the flash model
//   (or, without flash, two batched GEMMs and the softmax's memory traffic); norms, residuals, activations and
//   dropout as elementwise memory traffic over T / t tokens.
// - 2D tensor parallelism, layout X [T / y, h / x]: a linear all-gathers its input over tp_y, multiplies
//   [T, k / x] x [k / x, n / y] and reduce-scatters the partial sums over tp_x to [T / x, n / y]; the second linear
//   of a block swaps the axes and returns to X (MindSpore's "high dimension tensor parallel"). Attention
//   all-gathers K and V over tp_x. With x = 1 this is Megatron's tensor + sequence parallelism; without sequence
//   parallelism (the 2021 Megatron) each block all-reduces its output over tp, forward and backward, and norms,
//   residuals and dropout run on all T tokens of every tp rank. Not overlapped.
// - cp: K and V circulate in a ring over cp (cp - 1 sends forward, twice in backward), hidden under the attention
//   block's compute where it is shorter; or (Llama 3's scheme) K and V are all-gathered over cp before attention
//   (again in backward, whose K and V gradients are reduce-scattered), exposed, one attention kernel per block.
// - tp inside cp as train_gpt's MegatronRing runs it (setup.cp_gathers_weights, cp > 1 and tp > 1): each sublayer's
//   weights are sharded over cp x tp, so it all-gathers its cp sub-group's shards over cp (P / t elements gathered,
//   (cp - 1) / cp of them received) in forward and again in backward, and reduce-scatters their gradient back over
//   cp in backward. Exposed (the gathers precede the sublayer's compute). Megatron-LM keeps them replicated over cp.
//   Their data-parallel reduction then moves the device's 1 / cp of them over dp alone (memory_estimate.hpp's
//   cp_sharded_parameters).
// - under train_gpt's step (TrainingSetup::trainer) a dense layer of a stage group of cp x tp > 1 ranks is priced
//   instead as train_gpt's planner prices it, the cheapest strategy per sublayer by its dry run (stage_group.hpp);
//   the stack's norm gradients all-reduced over the group once per micro-batch; every tensor reduced over dp alone.
// - ep (folded over dp x cp) and etp (over tp): all-to-all dispatch and combine of k copies of each token, all-gather
//   and reduce-scatter over etp; balanced routing; the local experts in one grouped GEMM.
// - pp: one send of the stage's output per chunk and micro-batch, each direction, priced on the level the pipeline
//   group spans (its slowest hop). Stages hold ceil(L / pp) layers or one fewer (training_setup.hpp's StageLayout).
// - recomputation: selective re-runs attention's core (from q and k kept after RoPE) and the activation functions;
//   full re-runs the layer's forward (its communication included).
// Per step: (m + (pp - 1) / v) * (slowest stage's micro-batch time) [1F1B / interleaved bubble], plus the data-
// parallel reduction: ZeRO 0/1 reduce once per step, hidden under the last micro-batch's backward when overlap is
// on; ZeRO 2 reduce-scatters every micro-batch, hidden under that micro-batch's compute where shorter; ZeRO 3
// gathers each layer's parameters ahead of use (one layer ahead, as FSDP prefetches) and reduce-scatters its
// gradients after its backward: the first gather of each pass and the last reduce-scatter are exposed, every
// other gather (and reduce-scatter) hides under one layer's compute where shorter; ZeRO 1-2 all-gather updated
// parameters; plus the optimizer's memory traffic. Every collective and send pays its level's launch latency once
// (cluster.hpp): the model posts one operation per term above (per layer, micro-batch and direction).
// Devices on shared cores (ClusterProfile::cores_per_node, thread ranks on a CPU): every term above is a device's own
// work (a calibrated CPU profile times each rank's thread), and a node's devices beyond its cores run in turn, so
// the work stretches by serialisation() = devices per node / cores; a pipeline's idle bubble is then filled by other
// ranks' work, so the step is the longer of the dedicated step and the stretched work (the bubble what remains).
// With paced links (emulation) communication is a wait, not work (comm/threads_member.hpp sleeps until the
// operation's paced end, freeing the core). A collective's wait holds all its members until the last has arrived and
// the paced time has passed, while the other groups, in lockstep, wait in theirs: nothing fills it. A pipeline's
// bubble and its sends are filled by other stages' work, so the step is the longer of the dedicated step and the
// stretched compute and optimizer plus the collectives' waits; the bubble and the sends what remains.
// Work a calibrated CPU profile prices and a device profile leaves at 0 (cost/profile.hpp's ScalarMathModel and
// FreshMemoryModel): RoPE's cos and sin per (token, frequency) of q and of k in each pass (every model is taken to be
// rotary), the materialised softmax's exp per score, and the zeroing (or first touch) of each layer's fresh tensors:
// its stored activations in forward and as many gradients in backward, in tensors the size of one activation.
#pragma once

#include "paradyse/search/cluster.hpp"
#include "paradyse/search/memory_estimate.hpp"
#include "paradyse/search/mesh_groups.hpp"
#include "paradyse/search/parallel_config.hpp"
#include "paradyse/search/stage_group.hpp"
#include "paradyse/search/training_model.hpp"
#include "paradyse/search/training_setup.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

namespace paradyse::search {

enum class CommDim : std::uint8_t { tp, cp, ep, pp, dp };
inline constexpr std::array<CommDim, 5> kAllCommDims{CommDim::tp, CommDim::cp, CommDim::ep, CommDim::pp, CommDim::dp};
constexpr std::string_view name_of(CommDim d) {
  constexpr std::string_view names[] = {"tp", "cp", "ep", "pp", "dp"};
  return names[int(d)];
}

struct Estimate {
  bool valid = false;             // the model can be sharded this way (structural_problem is empty)
  bool feasible = false;          // valid and fits in memory
  std::string problem;            // why not, when not feasible
  double step_s = 0;
  double compute_s = 0;           // compute on the critical path (m micro-batches of the slowest stage)
  double recompute_s = 0;         // the part of compute_s that recomputes activations
  std::array<double, 5> exposed_comm_s{};  // per CommDim, on the critical path
  double bubble_s = 0;            // pipeline fill and drain
  double optimizer_s = 0;
  MemoryEstimate memory;
  double capacity_bytes = 0;
  double model_flops = 0;         // per step (3 x forward, attention counted by the setup's FlopConvention)
  double mfu = 0;                 // model_flops / (step_s * devices * peak)
  double exposed(CommDim d) const { return exposed_comm_s[std::size_t(d)]; }
  double total_exposed_comm_s() const {
    double t = 0;
    for (double x : exposed_comm_s) t += x;
    return t;
  }
};

class PerformanceModel {
public:
  PerformanceModel(TrainingModel model, ClusterProfile cluster, TrainingSetup setup, std::int64_t devices)
      : model_(std::move(model)), cluster_(std::move(cluster)), setup_(setup), devices_(devices) {
    validate(model_);
    validate(cluster_);
    validate(setup_);
    check(devices_ >= 1 && devices_ <= (std::int64_t(1) << 24), "devices = {} must be in [1, 2^24]", devices_);
  }

  const TrainingModel& model() const { return model_; }
  const ClusterProfile& cluster() const { return cluster_; }
  const TrainingSetup& setup() const { return setup_; }
  std::int64_t devices() const { return devices_; }
  double capacity_bytes() const { return double(cluster_.device.usable_memory_bytes()); }

  // Model FLOPs of one step (MFU's numerator), attention counted by the setup's FlopConvention.
  double model_flops_per_step() const {
    return 3.0 * model_.forward_flops_per_token(setup_.flop_context()) * double(setup_.seq) *
           double(setup_.global_batch);
  }

  Estimate evaluate(const ParallelConfig& c) const;

private:
  // Per micro-batch and device, one layer: compute and exposed communication, forward and backward.
  struct LayerTime {
    double forward_compute = 0, backward_compute = 0, recompute = 0;
    std::array<double, 5> forward_comm{}, backward_comm{};  // exposed, per CommDim
  };

  double gemm_forward(double m, double n, double k) const {
    return cluster_.device.gemm.time(m, n, k, setup_.activation_bytes);
  }
  double gemm_backward(double m, double n, double k) const {
    return cluster_.device.gemm.time(m, k, n, setup_.activation_bytes) +
           cluster_.device.gemm.time(k, n, m, setup_.activation_bytes);
  }

  LayerTime layer_time(const ParallelConfig& c, bool moe_layer) const;
  LayerTime stage_group_layer_time(const ParallelConfig& c) const;
  double stage_micro_batch_time(const ParallelConfig& c, const LayerTime& dense, const LayerTime& moe,
                                std::int64_t first, std::int64_t layers, bool last, Estimate& e, double& forward_s,
                                double& backward_s) const;

  TrainingModel model_;
  ClusterProfile cluster_;
  TrainingSetup setup_;
  std::int64_t devices_;
  std::shared_ptr<StageGroupPrices> stage_groups_ = std::make_shared<StageGroupPrices>();  // shared by copies
};

// A dense layer under train_gpt's planner (stage_group.hpp): its picks' forward and backward, the communication
// exposed on the group's axis (cp where the group has cp, else tp); full recomputation re-runs the forward with its
// communication. (Selective's re-run of attention's core is in the picks' backward: recompute_s leaves it out.)
inline PerformanceModel::LayerTime PerformanceModel::stage_group_layer_time(const ParallelConfig& c) const {
  const StageGroupPrice& price = (*stage_groups_)(model_, setup_, cluster_, c);
  const std::size_t dim = std::size_t(c.cp > 1 ? CommDim::cp : CommDim::tp);
  LayerTime r;
  for (const SublayerPrice& s : price.sublayers) {
    r.forward_compute += s.forward_compute_s;
    r.backward_compute += s.backward_compute_s;
    r.forward_comm[dim] += s.forward_comm_s;
    r.backward_comm[dim] += s.backward_comm_s;
  }
  if (c.recompute == Recompute::full) {
    r.recompute = r.forward_compute;
    r.backward_comm[dim] += r.forward_comm[dim];
  }
  return r;
}

inline PerformanceModel::LayerTime PerformanceModel::layer_time(const ParallelConfig& c, bool moe_layer) const {
  const TrainingModel& m = model_;
  if (!moe_layer && prices_stage_group(model_, setup_, c)) return stage_group_layer_time(c);
  const cost::HardwareProfile& d = cluster_.device;
  const double w = setup_.activation_bytes;
  const double T = double(c.micro_batch) * double(setup_.seq) / c.cp;  // tokens of the local chunk
  const double x = c.tp_x, y = c.tp_y, t = c.tp();
  const double h = double(m.hidden);
  LayerTime r;
  const MeshGroups groups = mesh_groups(c);
  const GroupSpan tp_y = groups.tp_y, tp_x = groups.tp_x;
  auto ag_y = [&](double bytes) { return cluster_.collective_time(Collective::all_gather, tp_y, bytes); };
  auto rs_x = [&](double bytes) { return cluster_.collective_time(Collective::reduce_scatter, tp_x, bytes); };
  auto ag_x = [&](double bytes) { return cluster_.collective_time(Collective::all_gather, tp_x, bytes); };
  auto rs_y = [&](double bytes) { return cluster_.collective_time(Collective::reduce_scatter, tp_y, bytes); };
  // Entering and leaving a block over tp_y: with sequence parallelism an all-gather of the input and a
  // reduce-scatter of the output; without, one all-reduce of the output (forward; the input's in backward).
  const bool sp = c.sequence_parallel;
  auto enter_leave_y = [&](double bytes) {
    return sp ? ag_y(bytes) + rs_y(bytes) : cluster_.collective_time(Collective::all_reduce, tp_y, bytes);
  };
  auto add_comm = [&](CommDim dim, double forward, double backward) {
    r.forward_comm[std::size_t(dim)] += forward;
    r.backward_comm[std::size_t(dim)] += backward;
  };
  double recompute_forward = 0;  // the part of the forward that selective recomputation re-runs
  // A sublayer of `parameters` weights under MegatronRing (see the header): gathered over cp in forward and in
  // backward, its gradient reduce-scattered over cp.
  const bool cp_gathers_weights = setup_.cp_gathers_weights && c.cp > 1 && t > 1;
  auto gather_weights_over_cp = [&](double parameters) {
    if (!cp_gathers_weights) return;
    const double bytes = parameters / t * w;
    const double gather = cluster_.collective_time(Collective::all_gather, groups.cp, bytes);
    add_comm(CommDim::cp, gather, gather + cluster_.collective_time(Collective::reduce_scatter, groups.cp, bytes));
  };

  // ---- attention block ------------------------------------------------------------------------------------------
  const double qkv_in = (m.attention_parameters() - m.context_width() * h) / h;  // input projections' width
  const double kv_width = m.qkv_width() - double(m.heads) * double(m.key_dim());
  double forward = gemm_forward(T, qkv_in / y, h / x) + gemm_forward(T, h / x, m.context_width() / y);
  double backward = gemm_backward(T, qkv_in / y, h / x) + gemm_backward(T, h / x, m.context_width() / y);
  {
    const double tp_comm = enter_leave_y(T * h / x * w) + rs_x(T * m.qkv_width() / y * w) +
                           ag_x(T * kv_width / y * w) + ag_x(T * m.context_width() / y * w);
    add_comm(CommDim::tp, tp_comm, tp_comm);
  }
  gather_weights_over_cp(m.attention_parameters());
  // Attention core: T / x queries of a / y heads against all s keys (the cp ring brings the other chunks).
  const double queries = T / x, heads = double(m.heads) / y;
  double core_forward = 0, core_backward = 0;
  if (setup_.flash_attention) {
    const double context = setup_.causal ? setup_.seq / 2.0 : double(setup_.seq);
    const double flops = 2.0 * queries * context * heads * double(m.key_dim() + m.value_dim());
    // With cp > 1 the ring runs one kernel per K/V block it receives, each paying the kernel overhead.
    const double blocks = c.cp_scheme == CpScheme::ring ? c.cp - 1 : 0;
    core_forward = d.attention.forward_time(flops) + blocks * d.attention.overhead_s;
    core_backward = d.attention.backward_time(flops) + blocks * d.attention.backward_overhead();
  } else {  // scores materialised: two batched GEMMs over the full s x s square and softmax/dropout traffic
    const double scores = queries * heads * double(setup_.seq);
    core_forward = gemm_forward(queries * heads, double(setup_.seq), double(m.key_dim())) +
                   gemm_forward(queries * heads, double(m.value_dim()), double(setup_.seq)) +
                   d.elementwise_time(scores * 9.0);  // per score: fused scale-mask-softmax reads and writes 2 B,
                                                      // dropout reads 2 B and writes 2 B and a 1 B mask
    core_backward = gemm_backward(queries * heads, double(setup_.seq), double(m.key_dim())) +
                    gemm_backward(queries * heads, double(m.value_dim()), double(setup_.seq)) +
                    d.elementwise_time(scores * 11.0);  // dropout backward (2 B + 1 B mask in, 2 B out),
                                                        // softmax backward (probabilities and gradient in, 2 B out)
    core_forward += d.scalar_math.time(cost::ScalarFunction::exp, scores);
  }
  forward += core_forward;
  backward += core_backward;
  recompute_forward += core_forward;
  if (c.cp > 1 && c.cp_scheme == CpScheme::ring) {  // K, V of the local chunk [T, kv_width / y] around the ring
    const GroupSpan cp_ring = groups.cp;
    const double step = cluster_.collective_time(Collective::send_recv, cp_ring, T * kv_width / y * w);
    add_comm(CommDim::cp, std::max(0.0, (c.cp - 1) * step - core_forward),
             std::max(0.0, 2.0 * (c.cp - 1) * step - core_backward));
  } else if (c.cp > 1) {  // all-gather K, V [cp T, kv_width / y]; backward gathers again, reduce-scatters dK, dV
    const double gathered = c.cp * T * kv_width / y * w;
    const double ag = cluster_.collective_time(Collective::all_gather, groups.cp, gathered);
    add_comm(CommDim::cp, ag, ag + cluster_.collective_time(Collective::reduce_scatter, groups.cp, gathered));
  }
  // Norms, residuals, dropout: ~26 h bytes per token read and written over the layer (two of each) in bf16, twice
  // that in fp32, on T / t tokens with sequence parallelism (or the 2D layout), on all T without.
  double elementwise = T / (sp ? t : 1.0) * 26.0 * h * w / 2;

  // ---- MLP block ------------------------------------------------------------------------------------------------
  if (!moe_layer) {
    const double f = double(m.ffn), f_in = m.swiglu ? 2 * f : f;
    forward += gemm_forward(T, f_in / y, h / x) + gemm_forward(T, h / x, f / y);
    backward += gemm_backward(T, f_in / y, h / x) + gemm_backward(T, h / x, f / y);
    // GELU or SwiGLU over T / t tokens: f outputs each, (4 or 6) * f bytes of bf16 traffic (more at fp32); compute-
    // bound on a CPU (the profile's activation rate), memory-bound on a GPU.
    const double activation = d.activation_time(T / t * f, T / t * (m.swiglu ? 6.0 : 4.0) * f * w / 2);
    forward += activation;
    backward += 2 * activation;
    recompute_forward += activation;
    const double tp_comm = enter_leave_y(T * h / x * w) + rs_x(T * f_in / y * w) + ag_x(T * f / y * w);
    add_comm(CommDim::tp, tp_comm, tp_comm);
    gather_weights_over_cp(m.dense_mlp_parameters());
  } else {
    // Tokens [T / y, h / x] -> full h on T / t tokens per device (all-gather over x), and back after the combine.
    const double tokens = T / t;
    const double layout = ag_x(T / y * h * w);
    add_comm(CommDim::tp, 2 * layout, 2 * layout);
    forward += gemm_forward(tokens, double(m.experts), h);  // router
    backward += gemm_backward(tokens, double(m.experts), h);
    // Experts: assignments per device (k copies per token, gathered over etp), spread over the local experts.
    const double local_experts = double(m.experts) / c.ep;
    const double assignments = tokens * double(m.top_k) * c.etp;
    const double per_expert = assignments / local_experts;
    const double fe = double(m.expert_ffn) / c.etp;
    // One grouped GEMM over the local experts (Megatron-Core's grouped GEMM): one launch, each expert's block at
    // its own shape.
    const double launch = d.gemm.overhead_s;
    auto grouped = [&](double single, int launches) { return local_experts * (single - launches * launch) + launches * launch; };
    forward += grouped(gemm_forward(per_expert, 2 * fe, h), 1) + grouped(gemm_forward(per_expert, h, fe), 1);
    backward += grouped(gemm_backward(per_expert, 2 * fe, h), 2) + grouped(gemm_backward(per_expert, h, fe), 2);
    const double activation = d.activation_time(assignments * fe, assignments * 6.0 * fe * w / 2) +
                              d.elementwise_time(tokens * double(m.top_k) * h * w * 4);  // permute, unpermute
    forward += activation;
    backward += 2 * activation;
    recompute_forward += d.activation_time(assignments * fe, assignments * 6.0 * fe * w / 2);
    if (m.shared_experts > 0) {  // a dense SwiGLU MLP over the 2D layout
      const double fs = double(m.shared_experts * m.shared_ffn);
      forward += gemm_forward(T, 2 * fs / y, h / x) + gemm_forward(T, h / x, fs / y);
      backward += gemm_backward(T, 2 * fs / y, h / x) + gemm_backward(T, h / x, fs / y);
      const double tp_comm = ag_y(T * h / x * w) + rs_x(T * 2 * fs / y * w) + ag_x(T * fs / y * w) + rs_y(T * h / x * w);
      add_comm(CommDim::tp, tp_comm, tp_comm);
    }
    // ep: all-to-all of k copies of the device's tokens, dispatch and combine; etp: gather and scatter them.
    const GroupSpan ep_group = groups.ep, etp_group = groups.etp;
    const double dispatched = tokens * double(m.top_k) * h * w;
    const double a2a = 2 * cluster_.collective_time(Collective::all_to_all, ep_group, dispatched);
    const double etp_comm = cluster_.collective_time(Collective::all_gather, etp_group, dispatched * c.etp) +
                            cluster_.collective_time(Collective::reduce_scatter, etp_group, dispatched * c.etp);
    add_comm(CommDim::ep, a2a + etp_comm, a2a + etp_comm);
  }
  forward += d.elementwise_time(elementwise);
  backward += 2 * d.elementwise_time(elementwise);
  {  // RoPE's scalar calls (per call: its tokens x key_dim, ops/cpu/rope.hpp), fresh tensors (see the header)
    const double rope = d.scalar_math.time(cost::ScalarFunction::sincos, 2.0 * double(setup_.seq) / c.cp * double(m.key_dim()));
    const double one = T / t * h * w;
    const double stored = stored_bytes_per_token(m, setup_, c, moe_layer, Recompute::none) * T / t;
    const double fresh = one > 0 ? stored / one * d.fresh_memory.time(one) : 0;
    forward += rope + fresh;
    backward += rope + fresh;  // selective keeps q and k after RoPE: its re-run of the core does not rotate them
  }

  r.forward_compute = forward;
  r.backward_compute = backward;
  if (c.recompute == Recompute::selective) r.recompute = recompute_forward;
  else if (c.recompute == Recompute::full) {
    r.recompute = forward;
    for (std::size_t i = 0; i < r.forward_comm.size(); ++i) r.backward_comm[i] += r.forward_comm[i];
  }
  return r;
}

// Forward + backward seconds of one micro-batch through `layers` layers from `first` (all chunks of one stage),
// with the stage's pipeline sends; accumulates the per-dimension exposed communication of one micro-batch into e.
inline double PerformanceModel::stage_micro_batch_time(const ParallelConfig& c, const LayerTime& dense,
                                                       const LayerTime& moe, std::int64_t first, std::int64_t layers,
                                                       bool last, Estimate& e, double& forward_s,
                                                       double& backward_s) const {
  std::array<double, 5> comm{};
  double compute = 0, recompute = 0;
  forward_s = backward_s = 0;
  // The stage's MoE layers are those at or after dense_layers; every layer of a kind costs the same.
  const std::int64_t moe_layers =
      model_.is_moe() ? std::clamp<std::int64_t>(first + layers - model_.dense_layers, 0, layers) : 0;
  for (const auto& [lt, count] : {std::pair{&dense, layers - moe_layers}, std::pair{&moe, moe_layers}}) {
    if (count == 0) continue;
    const double n = double(count);
    compute += n * (lt->forward_compute + lt->backward_compute + lt->recompute);
    recompute += n * lt->recompute;
    forward_s += n * lt->forward_compute;
    backward_s += n * (lt->backward_compute + lt->recompute);
    for (std::size_t i = 0; i < comm.size(); ++i) {
      comm[i] += n * (lt->forward_comm[i] + lt->backward_comm[i]);
      forward_s += n * lt->forward_comm[i];
      backward_s += n * lt->backward_comm[i];
    }
  }
  if (last) {  // logits [T, V / y] from [T, h / x] (2D-sharded output layer) and the cross-entropy
    const double T = double(c.micro_batch) * double(setup_.seq) / c.cp;
    const double V = double(model_.vocab), h = double(model_.hidden);
    const double w2 = setup_.activation_bytes / 2.0;  // the loss's traffic below is counted in bf16
    const double f = gemm_forward(T, V / c.tp_y, h / c.tp_x) + cluster_.device.elementwise_time(T * V / c.tp() * 12 * w2);
    const double b = gemm_backward(T, V / c.tp_y, h / c.tp_x) + cluster_.device.elementwise_time(T * V / c.tp() * 8 * w2);
    compute += f + b;
    forward_s += f;
    backward_s += b;
  }
  if (prices_stage_group(model_, setup_, c)) {
    // train_gpt's stack ends each backward by summing its layers' norm gradients [layers, 4, h] over the stage group
    // (model/layer.hpp reduce_norm_gradients): one all-reduce per micro-batch; with the vocabulary sharded over tp,
    // the embedding's and the head's collectives (stage_group.hpp).
    const GroupSpan group{c.cp * c.tp(), std::int64_t(c.cp) * c.tp()};
    const StageGroupPrice& price = (*stage_groups_)(model_, setup_, cluster_, c);
    const double norms = cluster_.collective_time(Collective::all_reduce, group,
                                                  double(layers) * 4 * double(model_.hidden) * setup_.gradient_reduce_bytes);
    const double ends = (first == 0 ? price.embedding_comm_s : 0.0) + (last ? price.head_comm_s : 0.0);
    comm[std::size_t(c.cp > 1 ? CommDim::cp : CommDim::tp)] += norms + ends;
    backward_s += norms + ends;
  }
  if (c.pp > 1) {  // one send per chunk and direction of the stage's output [T / t, h]
    const double T = double(c.micro_batch) * double(setup_.seq) / c.cp;
    const GroupSpan pp_group = mesh_groups(c).pp;
    const double send = cluster_.collective_time(Collective::send_recv, pp_group,
                                                 T / c.tp() * double(model_.hidden) * setup_.activation_bytes);
    comm[std::size_t(CommDim::pp)] += 2.0 * c.virtual_stages * send;
    forward_s += c.virtual_stages * send;
    backward_s += c.virtual_stages * send;
  }
  double total = compute;
  for (double x : comm) total += x;
  e.compute_s = compute;  // per micro-batch for now; scaled by the caller
  e.recompute_s = recompute;
  e.exposed_comm_s = comm;
  return total;
}

inline Estimate PerformanceModel::evaluate(const ParallelConfig& c) const {
  Estimate e;
  e.capacity_bytes = capacity_bytes();
  e.model_flops = model_flops_per_step();
  e.problem = structural_problem(model_, setup_, c, devices_);
  if (!e.problem.empty()) return e;
  e.valid = true;
  e.memory = estimate_memory(model_, setup_, c);
  const std::int64_t mbs = micro_batches(setup_, c);

  // The slowest stage sets the pace: the first (embedding, dense layers of MoE models), the last (logits) or,
  // when the ends hold a layer fewer, a full stage.
  const StageLayout layout = stage_layout(model_.layers, c.pp);
  LayerTime dense_layer;
  try {
    dense_layer = layer_time(c, false);
  } catch (const Error& x) {  // train_gpt's planner has no strategy for a sublayer of this stage group
    e.valid = false;
    e.problem = fmt::format("train_gpt's planner cannot price its stage group (cp = {}, tp = {}): {}", c.cp, c.tp(),
                            x.what());
    return e;
  }
  const LayerTime moe_layer = model_.is_moe() ? layer_time(c, true) : dense_layer;
  Estimate stage_e;
  double stage_s = -1, stage_forward = 0, stage_backward = 0;
  std::int64_t per_stage = 0;  // layers of the slowest stage
  double over_cp = 0;          // of p.dense, the largest stage's parameters sharded over cp too (MegatronRing)
  StageParameters p{};         // the largest parameters of a stage, dense and experts apart
  for (int stage : layout.candidates()) {
    Estimate candidate;
    double f = 0, b = 0;
    const std::int64_t first = layout.first_of(stage), layers = layout.layers_of(stage);
    const double t =
        stage_micro_batch_time(c, dense_layer, moe_layer, first, layers, stage == c.pp - 1, candidate, f, b);
    if (t > stage_s) stage_s = t, stage_e = candidate, stage_forward = f, stage_backward = b, per_stage = layers;
    const StageParameters q = stage_parameters(model_, c, first, layers, stage == 0, stage == c.pp - 1);
    p.dense = std::max(p.dense, q.dense), p.experts = std::max(p.experts, q.experts);
    over_cp = std::max(over_cp, cp_sharded_parameters(model_, setup_, c, first, layers));
  }
  const double m = double(mbs);
  e.compute_s = stage_e.compute_s * m;
  e.recompute_s = stage_e.recompute_s * m;
  for (std::size_t i = 0; i < e.exposed_comm_s.size(); ++i) e.exposed_comm_s[i] = stage_e.exposed_comm_s[i] * m;
  e.bubble_s = double(c.pp - 1) / c.virtual_stages * stage_s;

  // ---- data parallelism and the optimizer ---------------------------------------------------------------------
  // Dense weights are replicated over dp x cp, except those sharded over cp as well (MegatronRing): 1 / cp of them
  // per device, replicated over dp alone.
  const double dense = p.dense - over_cp, dense_dp = over_cp / c.cp, experts = p.experts;
  const MeshGroups groups = mesh_groups(c);
  const GroupSpan dp_group = groups.dp_cp;
  const GroupSpan dp_only{c.dp, std::int64_t(c.dp) * c.cp * c.tp()};
  const GroupSpan edp_group = groups.edp;  // experts are replicated over edp
  const double g = setup_.gradient_reduce_bytes, wb = setup_.precision.parameter_bytes;
  // The operations the reduction posts, each paying its level's launch and latency (TrainingSetup::trainer):
  // Megatron's, one collective per layer (the buckets of Megatron's and DeepSpeed's reducers, FSDP's units);
  // train_gpt's MeshOptimizer, one per packed tensor (a layer's attention, MLP and norms; the first stage's
  // embedding, the last stage's head matrix and final norm), after the last backward (never overlapped), a ZeRO-1
  // reduction an all-reduce, a ZeRO-2 one once per step (the micro-batches' gradients accumulated first).
  const bool per_tensor = setup_.trainer == Trainer::train_gpt;
  const double buckets = double(std::max<std::int64_t>(1, per_stage));
  const double operations = per_tensor ? 3.0 * double(per_stage) + (c.pp == 1 ? 3 : 2) : buckets;
  // `count` collectives of `bytes` per parameter in all, for each kind: dense over dp x cp, MegatronRing's over dp,
  // experts over edp. Under train_gpt's step every dense tensor is one collective over dp alone: the stage group's
  // 1 / (cp tp) shard of a layer, or a tensor replicated over the group (embedding, head, norms), summed over the
  // group first (`replicated` below; the norms per micro-batch, stage_micro_batch_time).
  auto reduce = [&](Collective op, double bytes, double count) {
    const double experts_s = cluster_.collective_time(op, edp_group, experts * bytes / count);
    if (per_tensor) return count * (cluster_.collective_time(op, dp_only, (dense + dense_dp) * bytes / count) + experts_s);
    return count * (cluster_.collective_time(op, dp_group, dense * bytes / count) +
                    cluster_.collective_time(op, dp_only, dense_dp * bytes / count) + experts_s);
  };
  const bool overlap = setup_.overlap_grad_reduce && !per_tensor;
  double dp_s = 0;
  if (c.zero <= 1) {
    const Collective op = c.zero == 0 || per_tensor ? Collective::all_reduce : Collective::reduce_scatter;
    const double grads = reduce(op, g, operations);
    dp_s += overlap ? std::max(0.0, grads - stage_backward) : grads;
  } else if (c.zero == 2 && per_tensor) {  // once per step
    dp_s += reduce(Collective::reduce_scatter, g, operations);
  } else if (c.zero == 2) {  // every micro-batch: reduce-scatter its gradients
    const double per_mb = reduce(Collective::reduce_scatter, g, operations);
    dp_s += m * (overlap ? std::max(0.0, per_mb - (stage_forward + stage_backward)) : per_mb);
  } else if (per_tensor) {
    // train_gpt's ZeRO-3, every micro-batch (model/mesh_stage.hpp, model/zero3_prefetch.hpp). Collectives posted
    // together run as one of their summed bytes (one launch; all-gather and reduce-scatter take the same steps and
    // bus factor): a layer's tensors (attention, MLP, norms) gathered before each pass; its attention's and MLP's
    // gradients reduce-scattered after its backward, beside the gather of the layer before it; its norms' gradients
    // reduce-scattered after the whole backward, each waited for; the embedding and the head gathered and their
    // gradients reduce-scattered around each use, each waited for.
    const double end = model_.embedding_parameters() / c.tp(), norms = model_.norm_parameters();
    const double ends = c.pp == 1 && !model_.tied_embeddings ? 2 : 1;  // the stage's embedding and head
    // A layer's shard (1 / (cp tp) of its weights under a stage group), its ZeRO group dp alone.
    const double layer = (dense + dense_dp - ends * end) / buckets;
    // One collective per layer: `bytes` of each of its parameters, `norm_bytes` of each of its norms' besides.
    auto per_layer = [&](double bytes, double norm_bytes) {
      return cluster_.collective_time(Collective::all_gather, dp_only, layer * bytes + norms * (norm_bytes - bytes)) +
             cluster_.collective_time(Collective::all_gather, edp_group, experts / buckets * bytes);
    };
    const double gather = per_layer(wb, wb), scatter = per_layer(g, 0), both = per_layer(wb + g, wb);
    const double waited = buckets * cluster_.collective_time(Collective::reduce_scatter, dp_only, norms * g) +
                          ends * (cluster_.collective_time(Collective::all_gather, dp_only, end * wb) +
                                  cluster_.collective_time(Collective::reduce_scatter, dp_only, end * g));
    const double passes = c.recompute == Recompute::full ? 2 : 1;  // forward passes: the forward, the recomputation's
    double exposed = buckets * ((passes + 1) * gather + scatter);
    if (setup_.zero3_prefetch) {
      // Each forward pass: a layer's gather behind the layer before it, the first exposed. The backward: a layer's
      // gather beside the reduce-scatter of the layer after it behind its backward (the recomputation's forward
      // counted apart), the first gather and the last reduce-scatter exposed.
      const double layer_forward = stage_forward / buckets;
      const double layer_back = std::max(0.0, stage_backward / buckets - (passes - 1) * layer_forward);
      exposed = passes * (gather + (buckets - 1) * std::max(0.0, gather - layer_forward)) + gather + scatter +
                (buckets - 1) * std::max(0.0, both - layer_back);
    }
    // Per micro-batch, on each stage's path: a pipeline's fill and drain ((pp - 1) / v micro-batches' stage time)
    // carry them too, as the idle stages wait on the gathering one.
    dp_s += (m + double(c.pp - 1) / c.virtual_stages) * (exposed + waited);
  } else {  // Megatron's ZeRO-3, every micro-batch: per layer a gather before the forward, one (two with full
            // recomputation) before the backward, a reduce-scatter after it; each hidden under one layer's compute
            // at most.
    const double gather = reduce(Collective::all_gather, wb, buckets) / buckets;
    const double scatter = reduce(Collective::reduce_scatter, g, buckets) / buckets;
    const double backward_gathers = c.recompute == Recompute::full ? 2 : 1;
    double exposed = buckets * ((1 + backward_gathers) * gather + scatter);
    const double layer_forward = stage_forward / buckets, layer_backward = stage_backward / buckets;
    if (overlap) {
      exposed = gather + (buckets - 1) * std::max(0.0, gather - layer_forward) +   // forward pass
                backward_gathers * gather + scatter +                               // backward's first and last
                (buckets - 1) * std::max(0.0, backward_gathers * gather + scatter - layer_backward);
    }
    dp_s += m * exposed;
  }
  if (c.zero >= 1 && c.zero <= 2) dp_s += reduce(Collective::all_gather, wb, operations);  // updated weights
  if (per_tensor) {
    // train_gpt's step: the loss and the peak memory all-reduced over every rank (one double each); the embedding's
    // and the head's gradients (partial sums over the dense group's tokens) all-reduced over the dense group, or with
    // the vocabulary sharded over tp each rank's ceil(V / tp) rows over the cp ranks holding the same rows.
    const GroupSpan world{int(devices_), devices_};
    dp_s += 2 * cluster_.collective_time(Collective::all_reduce, world, 8);
    const GroupSpan vocab_replicas{c.cp, std::int64_t(c.cp) * c.tp()};
    // The stage with both, or with one: train_gpt's GPT never ties its head to its embedding, so these are two
    // all-reduces even where the model ties them (the ZeRO-3 branch above counts the stage's parameters, as
    // stage_parameters does, with the tying).
    const double ends = c.pp == 1 ? 2 : 1;
    const double rows = double((model_.vocab + c.tp() - 1) / c.tp());
    const double replicated = ends * cluster_.collective_time(Collective::all_reduce, vocab_replicas,
                                                              rows * double(model_.hidden) * g);
    e.exposed_comm_s[std::size_t(c.cp > 1 ? CommDim::cp : CommDim::tp)] += replicated;
  }
  e.exposed_comm_s[std::size_t(CommDim::dp)] += dp_s;
  // Adam: read weights, gradient, master weights and two moments, write back all but the gradient (~36 B/param).
  const double shard_dense = c.zero >= 1 ? double(c.dp) * c.cp : 1.0, shard_experts = c.zero >= 1 ? c.expert_dp() : 1.0;
  const double shard_dp = c.zero >= 1 ? double(c.dp) : 1.0;
  e.optimizer_s = cluster_.device.elementwise_time(36.0 * (dense / shard_dense + dense_dp / shard_dp +
                                                           experts / shard_experts));

  if (const double f = cluster_.serialisation(devices_); f > 1) {
    const double dedicated = e.compute_s + e.total_exposed_comm_s() + e.bubble_s + e.optimizer_s;
    e.compute_s *= f;
    e.recompute_s *= f;
    e.optimizer_s *= f;
    if (cluster_.paced_links) {
      // Paced transfers are waits. A collective holds every member until its paced end, and the other groups, in
      // lockstep, wait in theirs: nothing fills it. A pipeline's bubble and its sends are filled by the other
      // stages' work.
      const double held = e.total_exposed_comm_s() - e.exposed(CommDim::pp);
      const double fillable = e.exposed(CommDim::pp) + e.bubble_s;
      const double kept =
          fillable > 0 ? std::max(0.0, dedicated - (e.compute_s + e.optimizer_s + held)) / fillable : 0;
      e.exposed_comm_s[std::size_t(CommDim::pp)] *= kept;
      e.bubble_s *= kept;
    } else {  // copies on the shared cores
      for (double& x : e.exposed_comm_s) x *= f;
      e.bubble_s = std::max(0.0, dedicated - (e.compute_s + e.total_exposed_comm_s() + e.optimizer_s));
    }
  }
  e.step_s = e.compute_s + e.total_exposed_comm_s() + e.bubble_s + e.optimizer_s;
  e.mfu = e.model_flops / (e.step_s * double(devices_) * cluster_.peak_flops_per_s);
  e.feasible = e.memory.total() <= e.capacity_bytes;
  if (!e.feasible)
    e.problem = fmt::format("needs {:.1f} GiB per device, {:.1f} GiB usable", e.memory.total() / (1 << 30),
                            e.capacity_bytes / (1 << 30));
  return e;
}

}  // namespace paradyse::search
