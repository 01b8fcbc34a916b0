// paradyse/serve/step_cost.hpp: the time of one engine step on a cluster, from the step's trace (serve/step_trace.hpp)
// and a hardware profile (cost/profile.hpp), in closed form.
//
// The ANALYTIC model. The simulated clock advances by the cost of the step's dry run (serve/step_dry_run.hpp:
// decoder_step itself on meta tensors, ops::Counting and the symbolic communicator); this function is what the switcher
// forecasts with by default (serve/switch_policy.hpp: each candidate layout's step time, a few microseconds a call
// where a dry run of p ranks takes milliseconds). It sums, from the quantities the step computes on (n = the batch's
// tokens, each chunk's new tokens and cached positions, the layout and the routing), the kernels decoder_step runs,
// each with the bytes, rows and flops its counting rule records (ops/counting.hpp) and at the same price
// (cost/trace_cost.hpp event_seconds: the call's fixed cost, a family's rate or the size classes), so it is the dry
// run's cost to rounding on any profile (tests/serve/step_dry_run.cpp: Mixtral-8x7B and 8x22B, Qwen2-57B,
// DeepSeek-V2-Lite and the OLMoE, Qwen3-MoE, Qwen2-MoE and DeepSeek-V3 (YaRN) fixtures' configs; TP, EP and EP with
// replicas on 1-8 ranks, as is and switching) but for the GEMMs' weight reuse, which the simulated clock keeps across
// steps (cost/gemm_reuse.hpp; a calibrated CPU profile's measured shapes), and a routing budget's own kernels
// (Alloc-T's scoring pass; Alloc-L's K_l is in the step's routed loads). A kernel added to decoder_step needs its term
// here, or that test fails. Stop 58's model (before the terms below matched) priced prompt steps up to 3.9% under the
// dry run. Its terms, on rank r of p, per layer (d head width, hq_r / hk_r the rank's query / key-value heads, f the
// expert width, b the dtype's bytes, every GEMM through the profile's GemmModel: overhead + 2mnk / rate + (mk + kn +
// mn) b / HBM bandwidth, so a small batch pays its weight reads: the memory-bandwidth roofline that makes TP win
// there):
//   attention (attention_time): the RMSNorm over [n, h]; GEMMs q, k, v [n, h] x [h, (hq_r | hk_r | hk_r) d] (Qwen2:
//     their biases) and o [n, hq_r d] x [hq_r d, h]; OLMoE's and Qwen3's q/k norms; per chunk RoPE over its q and k
//     and the KV append; the paged attention kernel over the step's query-key pairs and hq_r heads (HardwareProfile::
//     paged_attention_time: per visit where the profile calibrated it, else 4 d hq_r pairs flops at the
//     AttentionModel's rate) plus reading each chunk's keys and values (2 (cached + tokens) hk_r d b bytes); DeepSeek's
//     latent attention instead as serve/mla_attention.hpp runs it (mla_attention_time); then all-reduce [n, h] (b bytes
//     per element).
//   FFN: the attention's residual add, the RMSNorm, the output's fill, then
//     dense: GEMMs [n, h] x [h, 2 F_r] and [n, F_r] x [F_r, h], F_r = chunk_range(F, p, r); SwiGLU n F_r outputs.
//     MoE: router GEMM [n, h] x [h, E] and its scores and top-k on every rank; per expert e with rows m_e on the
//     rank (TP: every pair, a slice of f_r = chunk_range(f, p, r) columns; EP: the rank's share, rows_per_rank's
//     rule, whole f columns): GEMMs [m_e, h] x [h, 2 f_r] and [m_e, f_r] x [f_r, h] and SwiGLU m_e f_r outputs (the
//     rank's experts' GEMMs of each projection one grouped call: bank_gemms; the SwiGLU one call over their rows); the
//     rows' gather and weighted scatter-add (moe_experts_time); the shared expert as a dense FFN of its width, gated
//     or added; then all-reduce [n, h] (EP: plus the p row counts), the FFN's residual add. OLMoE's q/k norm: an
//     all-reduce of 2n floats.
// Outside the layers: the embedding's rows before them; after them the final RMSNorm, each chunk's last row gathered,
// the lm_head GEMM [chunks, h] x [h, V], each chunk's logits copied out. Each layer's compute time is its slowest
// rank's (the all-reduces synchronise the ranks), and each synchronised half (attention, FFN) and the parts before
// and after the layers wait besides for the ranks' spread about their price (HardwareProfile::straggle_s,
// communication time); the code waits on every collective, so nothing overlaps there.
// Layout changes (a TP<->EP switch or an EPLB placement): layer l's pieces (redistribution_plan, 3 columns h b bytes
// each) leave after layer l computed, once its ranks made their new banks and copied the pieces they keep
// (layer_switch), and travel one layer after another on the links (an exchange: the link's launch plus (p - 1) step
// latencies plus the busiest rank's bytes in or out at the point-to-point bandwidth, or copied from memory to memory
// where that is slower); the exposed time is the ranks' own work, what is still in flight when the step's compute ends,
// and the share of the flight under the compute that the profile's overlap does not hide. Unpipelined, the whole change
// stalls before the step. Not counted (by either model): the plan and sampled-token broadcasts (a few hundred bytes;
// simulated_step_cost adds them), sampling, token sorting's and on-demand loading's fetches (costed as the plain EP
// split).
#pragma once

#include "paradyse/cost/profile.hpp"
#include "paradyse/serve/hf_config.hpp"
#include "paradyse/serve/paged_attention.hpp"  // chunk_pairs
#include "paradyse/serve/rank_shard.hpp"
#include "paradyse/serve/step_trace.hpp"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace paradyse::serve {

// A named cluster: a device and link profile, the ranks it runs on and the bytes of the weights' and activations'
// dtype there (2 for bf16 on GPUs; 4 for this library's float CPU ranks).
struct SimulatedCluster {
  cost::HardwareProfile profile;
  int dtype_bytes = 2;
};

struct StepCost {
  double compute_s = 0;         // GEMMs, attention, elementwise (the slowest rank per layer)
  double communication_s = 0;   // the all-reduces (exposed: the code waits on each)
  double switch_s = 0;          // the layout change's exposed time
  double host_s = 0;            // the engine's host work on the step's critical path (its bookkeeping, the dynamic
                                // policy's forecast)
  double total_s() const { return compute_s + communication_s + switch_s + host_s; }
  // Every term times f (a slower machine, a step's jitter).
  StepCost& operator*=(double f) {
    compute_s *= f, communication_s *= f, switch_s *= f, host_s *= f;
    return *this;
  }
  StepCost& operator+=(const StepCost& o) {
    compute_s += o.compute_s, communication_s += o.communication_s, switch_s += o.switch_s, host_s += o.host_s;
    return *this;
  }
};

// The GEMMs of a bank of SwiGLU experts of width w over blocks of `rows` rows, as experts_forward runs them
// (moe/experts.hpp): each projection (in [m, h] x [h, 2w], out [m, w] x [w, h]) one grouped GEMM, an item per
// non-empty block, the first item a call and the others priced as riding on it (cost::GemmModel::grouped_item_time).
// With `reuse_bytes` each GEMM is priced with its weight read that many weight bytes ago (GemmModel::time_at_reuse:
// a calibrated CPU profile's tables at other cycles; bench/serve_experts cycles its weights through a known size).
inline double bank_gemms(const cost::HardwareProfile& hw, std::span<const double> rows, double w, double h, int b,
                         std::optional<double> reuse_bytes = std::nullopt) {
  const auto time = [&](double m, double n, double k) {
    return reuse_bytes ? hw.gemm.time_at_reuse(m, n, k, b, *reuse_bytes) : hw.gemm.time(m, n, k, b);
  };
  double t = 0;
  bool first = true;
  for (const double m : rows) {
    if (m <= 0 || w <= 0) continue;
    const double in = time(m, 2 * w, h), out = time(m, h, w);
    t += first ? in + out
               : hw.gemm.grouped_item_time(in, m, 2 * w, h, b) + hw.gemm.grouped_item_time(out, m, h, w, b);
    first = false;
  }
  return t;
}

namespace step_cost_detail {

inline double gemm(const cost::HardwareProfile& hw, double m, double n, double k, int b) {
  return hw.gemm.time(m, n, k, b);
}

// One gemm_batched call of `count` items of one size with disjoint outputs (ops/counting.hpp): the first a call, the
// others priced as riding on its launch (cost::GemmModel::grouped_item_time).
inline double batched_gemms(const cost::HardwareProfile& hw, double count, double m, double n, double k, int b) {
  if (count <= 0) return 0;
  const double one = gemm(hw, m, n, k, b);
  return one + (count - 1) * hw.gemm.grouped_item_time(one, m, n, k, b);
}

// `calls` memory-bound kernels of `bytes` each, as the dry run prices a kernel (cost/trace_cost.hpp event_seconds:
// its call's fixed cost, its bytes at its family's rate).
inline double streams(const cost::HardwareProfile& hw, double bytes,
                      ElementwiseFamily family = ElementwiseFamily::other, double calls = 1) {
  return calls > 0 ? calls * (hw.call_overhead.kernel_call_s + hw.elementwise_time(bytes, family)) : 0;
}

// The bank as experts_forward runs it: its GEMMs (bank_gemms), the activation one call over every row.
inline double swiglu_bank(const cost::HardwareProfile& hw, std::span<const double> rows, double w, double h, int b) {
  double all = 0;
  for (const double m : rows) all += std::max(0.0, m);
  if (w <= 0 || all == 0) return 0;
  return bank_gemms(hw, rows, w, h, b) + hw.call_overhead.kernel_call_s +
         hw.activation_time(all * w, 3 * all * w * b, /*swiglu_forward=*/true);
}
// One SwiGLU bank of width w over m rows.
inline double swiglu(const cost::HardwareProfile& hw, double m, double w, double h, int b) {
  return swiglu_bank(hw, std::span<const double>(&m, 1), w, h, b);
}

// Seconds of one all-to-all-v of expert banks whose busiest rank moves `bytes` (in or out) among p ranks: the link's,
// or the banks' copy from memory to memory where that is slower (thread ranks: each piece is one memcpy between
// banks the caches no longer hold; a GPU's links are slower than its HBM).
inline double exchange_time(const cost::HardwareProfile& hw, int p, double bytes) {
  if (p <= 1 || bytes <= 0) return 0;
  const cost::LinkModel& l = hw.link(hw.level_of(p));
  const double transfer = std::max(bytes / l.p2p_bytes_per_s, hw.memory_copy_time(2 * bytes));
  return l.launch_s + l.step_latency_s * (p - 1) + transfer;
}

}  // namespace step_cost_detail

// Seconds rank r of p spends on one MoE layer's routed experts in layout L for the routing `routed` [E] ((token,
// expert) pairs per expert): the SwiGLU banks of its rows (TP: every pair over a slice of f_r columns; EP: its slots'
// share of the pairs over whole f columns), each one grouped GEMM per projection, and the moves of its rows, as
// moe_partial makes them (serve/decoder_step.hpp): TP gathers every pair's row [rows, h] and gate once and scatter-adds
// the outputs weighted by the gates; EP does the same over its tasks' rows (an expert's rows on this rank each) as one
// batch, its gates read one by one (on-demand loading's fetched tasks, a batch each, are priced as held ones). The
// switcher (serve/switch_policy.hpp) and step_cost share it.
inline double moe_experts_time(const cost::HardwareProfile& hw, const MoeConfig& m, const ExpertLayout& L,
                               const std::vector<std::int64_t>& routed, int p, int r, int b) {
  using namespace step_cost_detail;
  const double h = double(m.hidden);
  // A gather of x rows of [., h] in (read, written) and their scatter-add (the output read and written, the rows and
  // their gates read).
  const auto moves = [&](double x) {
    return streams(hw, 2 * x * h * b, ElementwiseFamily::rows) +
           streams(hw, (3 * x * h + x) * b, ElementwiseFamily::rows);
  };
  double t = 0;
  if (L.mode == MoeMode::tp) {
    const double fr = double(chunk_range(m.expert_ffn, p, r).length);
    const std::vector<double> blocks(routed.begin(), routed.end());
    double rows = 0;
    for (const double x : blocks) rows += x;
    t += swiglu_bank(hw, blocks, fr, h, b) + moves(rows) +
         streams(hw, 2 * rows * b, ElementwiseFamily::rows);  // and the gates' gather
  } else {
    std::vector<std::int64_t> holders(routed.size(), 0), seen(routed.size(), 0);
    for (const auto& slots : L.placement)
      for (const std::int64_t e : slots) ++holders[std::size_t(e)];
    std::vector<double> blocks;  // the rank's tasks' rows, one batch (serve/decoder_step.hpp moe_partial)
    double rows = 0;
    for (int q = 0; q <= r; ++q)
      for (const std::int64_t e : L.placement[std::size_t(q)]) {
        const std::size_t i = std::size_t(e);
        const double x = double(chunk_range(routed[i], holders[i], seen[i]++).length);
        if (q == r && x > 0) blocks.push_back(x), rows += x;
      }
    if (rows > 0) t += swiglu_bank(hw, blocks, double(m.expert_ffn), h, b) + moves(rows) + streams(hw, 2 * rows * b);
  }
  return t;
}

// One MoE layer's change from `from` to `to` on p ranks, from one walk of its plan (serve/redistribute.hpp):
//   bytes:  the busiest rank's on the links, sent or received; exchange_s their exchange (exchange_time);
//   host_s: the ranks' own work, at the slowest rank, on the compute stream before its transfers are posted: its new
//           banks (unzeroed: only their new pages cost, cost::FreshMemoryModel) and the copy of the pieces it keeps (a
//           read and a write from memory: HardwareProfile::memory_copy_time). The other pieces travel straight from
//           bank to bank.
struct LayerSwitch {
  double bytes = 0, exchange_s = 0, host_s = 0;
};
inline LayerSwitch layer_switch(const DecoderConfig& c, const ExpertLayout& from, const ExpertLayout& to, int p,
                                const cost::HardwareProfile& hw, int b) {
  const std::int64_t h = c.hidden;
  LayerSwitch out;
  const std::vector<RankMoveBytes> moved =
      move_bytes(redistribution_plan(from, to, c.moe.experts, c.moe.expert_ffn, p), h, p, b);
  for (int r = 0; r < p; ++r) {
    const RankMoveBytes& m = moved[std::size_t(r)];
    out.bytes = std::max({out.bytes, m.sent, m.received});
    const BankShape bank = bank_shape(to, c.moe.experts, c.moe.expert_ffn, p, r);
    const double floats = double(bank.slots) * double(bank.width) * double(h);  // of the output bank; the input's 2x
    const double banks = hw.fresh_memory.time(2 * floats * b, false) + hw.fresh_memory.time(floats * b, false);
    out.host_s = std::max(out.host_s, banks + hw.memory_copy_time(2 * m.kept));
  }
  out.exchange_s = step_cost_detail::exchange_time(hw, p, out.bytes);
  return out;
}

// The exposed seconds of the step's layout change, its compute having ended each layer at layer_end[l] seconds and
// the step at `step_end`. Pipelined, as the engine runs it: after layer l computed, the ranks' own work (layer_switch's
// host_s, delaying the layers after it), then its transfers, one exchange after another on the links; what is still
// in flight when the step's compute ends is exposed, and so is the share of the rest the profile's `overlap`
// does not hide (a CPU rank's thread copies overlap nothing). Unpipelined, the whole change stalls before the step.
// Shared with the dry run's cost (serve/step_dry_run.hpp).
inline double switch_exposed_s(const DecoderConfig& c, const StepTrace& t, const SimulatedCluster& cluster,
                               const std::vector<double>& layer_end, double step_end) {
  const cost::HardwareProfile& hw = cluster.profile;
  const int p = t.ranks, b = cluster.dtype_bytes;
  check(std::int64_t(layer_end.size()) == c.layers, "switch_exposed_s: {} layer end times for {} layers",
        layer_end.size(), c.layers);
  double host = 0, stall = 0;                     // the ranks' own work; the unpipelined change's whole
  std::vector<std::pair<double, double>> flight;  // pipelined: each exchange's start and end
  double link_free = 0;
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const std::size_t li = std::size_t(l);
    if (!t.next[li] || !c.is_moe(l)) continue;
    const LayerSwitch change = layer_switch(c, t.layout[li], *t.next[li], p, hw, b);
    const double x = change.exchange_s, own = change.host_s;
    host += own;
    if (t.pipelined_switch) {
      const double start = std::max(link_free, layer_end[li] + host);
      link_free = start + x;
      flight.emplace_back(start, link_free);
    } else {
      stall += own + x;
    }
  }
  if (!t.pipelined_switch) return stall;
  const double end = step_end + host;  // the compute, delayed by the ranks' own work
  double under = 0;                    // exchange time that ran under the compute
  for (const auto& [start, finish] : flight) under += std::max(0.0, std::min(finish, end) - start);
  return host + std::max(0.0, link_free - end) + (1 - hw.overlap) * under;
}

// Seconds of rank r's key/value traffic in one layer, as decoder_step records it beside the paged kernel: each
// chunk's append (its rows of the w floats a position holds on the rank, read and written into the cache: GQA's k and
// v, 2 hk d, or MLA's latent, r_kv + d_r), a call each, and one stream that reads every position's w floats.
inline double kv_traffic_time(const DecoderConfig& c, const StepTrace& t, const cost::HardwareProfile& hw, int r,
                              int b) {
  using namespace step_cost_detail;
  const double w = double(c.kv_cache_floats(kv_heads_of(c, t.ranks, r).length));
  double a = 0, positions = 0;
  for (const ChunkShape& ch : t.chunks)
    a += streams(hw, 2 * double(ch.tokens) * w * b), positions += double(ch.cached + ch.tokens);
  return a + streams(hw, positions * w * b);
}

// Seconds of rank r's latent attention (DeepSeek) in one layer after its norm, as serve/mla_attention.hpp runs it (hq
// the rank's heads, r_q = q_lora_rank, r_kv = kv_lora_rank, d_n, d_r, d_v the head's widths): q's projection (through
// r_q with its norm, or direct) and the latent's [n, h] x [h, r_kv + d_r]; c_kv's norm between two copies; q_pe's and
// k_pe's copies out, per chunk their RoPE, k_pe's copy back; the absorption's batched GEMMs, hq items of [n, d_n] x
// [d_n, r_kv] and of [n, r_kv] x [r_kv, d_v] (batched_gemms); the latents' append and reads (kv_traffic_time); the
// paged kernel over the step's pairs at width r_kv + d_r / 2; the output projection [n, hq d_v] x [hq d_v, h].
inline double mla_attention_time(const DecoderConfig& c, const StepTrace& t, const cost::HardwareProfile& hw, int r,
                                 int b) {
  using namespace step_cost_detail;
  const MlaShape& m = c.mla;
  const double n = double(t.tokens()), h = double(c.hidden), hq = double(query_heads(c, t.ranks, r).length);
  const double rq = double(m.q_lora_rank), rkv = double(m.kv_lora_rank), dn = double(m.nope), dr = double(m.rope),
               dv = double(m.v), qk = dn + dr;
  const auto copy = [&](double floats) { return streams(hw, 2 * floats * b, ElementwiseFamily::copy); };
  const auto norm = [&](double floats) { return streams(hw, 2 * floats * b, ElementwiseFamily::norm); };
  double a = m.q_lora_rank > 0 ? gemm(hw, n, rq, h, b) + norm(n * rq) + gemm(hw, n, hq * qk, rq, b)
                               : gemm(hw, n, hq * qk, h, b);
  a += gemm(hw, n, rkv + dr, h, b) + 2 * copy(n * rkv) + norm(n * rkv);
  a += copy(n * hq * dr) + 2 * copy(n * dr);  // q_pe and k_pe out, k_pe back
  double pairs = 0;
  for (const ChunkShape& ch : t.chunks) {  // RoPE of its q_pe and k_pe (a cos and a sin per token and frequency)
    const double len = double(ch.tokens);
    pairs += chunk_pairs(ch.tokens, ch.cached);
    for (const double heads : {hq, 1.0})
      a += streams(hw, 2 * len * heads * dr * b, ElementwiseFamily::rope) +
           hw.scalar_math.time(cost::ScalarFunction::sincos, len * dr);
  }
  a += m.nope > 0 ? batched_gemms(hw, hq, n, rkv, dn, b) : streams(hw, n * hq * rkv * b, ElementwiseFamily::fill);
  a += hw.latent_attention_time(pairs, hq, rkv + dr / 2) + hw.call_overhead.kernel_call_s +
       kv_traffic_time(c, t, hw, r, b);
  return a + batched_gemms(hw, hq, n, dv, rkv, b) + gemm(hw, n, h, hq * dv, b);
}

// Seconds of rank r's attention sublayer in one layer (every layer's is the same), as decoder_step runs it: the
// norm, the projections (with Qwen2's biases), OLMoE's or Qwen3's q/k norms, per chunk RoPE of q and k and the KV
// append, the paged kernel with its key and value reads, the output projection; or the norm and MLA's.
inline double attention_time(const DecoderConfig& c, const StepTrace& t, const cost::HardwareProfile& hw, int r,
                             int b) {
  using namespace step_cost_detail;
  const int p = t.ranks;
  const double n = double(t.tokens()), h = double(c.hidden), d = double(c.head_dim);
  double a = streams(hw, 2 * n * h * b, ElementwiseFamily::norm);
  if (c.is_mla()) return a + mla_attention_time(c, t, hw, r, b);
  const double hq = double(query_heads(c, p, r).length), hk = double(kv_heads_of(c, p, r).length);
  double pairs = 0;  // query-key pairs of the step's chunks
  for (const ChunkShape& ch : t.chunks) pairs += chunk_pairs(ch.tokens, ch.cached);
  a += gemm(hw, n, hq * d, h, b) + 2 * gemm(hw, n, hk * d, h, b) + gemm(hw, n, h, hq * d, b);
  if (c.qkv_bias) a += streams(hw, (2 * n + 1) * hq * d * b) + 2 * streams(hw, (2 * n + 1) * hk * d * b);
  if (c.qk_norm)  // the sums of squares, then each row scaled
    a += streams(hw, n * (hq + hk) * d * b) + streams(hw, (2 * n + 1) * hq * d * b) +
         streams(hw, (2 * n + 1) * hk * d * b);
  if (c.head_qk_norm)
    a += streams(hw, 2 * n * hq * d * b, ElementwiseFamily::norm) +
         streams(hw, 2 * n * hk * d * b, ElementwiseFamily::norm);
  for (const ChunkShape& ch : t.chunks) {  // RoPE of the chunk's q and k (a cos and a sin per token and frequency)
    const double len = double(ch.tokens);
    for (const double heads : {hq, hk})
      a += streams(hw, 2 * len * heads * d * b, ElementwiseFamily::rope) +
           hw.scalar_math.time(cost::ScalarFunction::sincos, len * d);
  }
  return a + hw.paged_attention_time(pairs, hq, d) + hw.call_overhead.kernel_call_s + kv_traffic_time(c, t, hw, r, b);
}

// Seconds of each layer of the step on the cluster (compute, then its collectives), and the totals.
inline StepCost step_cost(const DecoderConfig& c, const StepTrace& t, const SimulatedCluster& cluster) {
  using namespace step_cost_detail;
  const cost::HardwareProfile& hw = cluster.profile;
  const int p = t.ranks, b = cluster.dtype_bytes;
  check(p >= 1 && std::int64_t(t.layout.size()) == c.layers && std::int64_t(t.routed.size()) == c.layers &&
            std::int64_t(t.next.size()) == c.layers,
        "step_cost: a trace of {} ranks with {} layouts, {} routings, {} next layouts for {} layers", p,
        t.layout.size(), t.routed.size(), t.next.size(), c.layers);
  const double n = double(t.tokens()), h = double(c.hidden), chunks = double(t.chunks.size());
  StepCost out;
  if (n <= 0) return out;
  const double reduce_s = hw.collective_time(cost::Collective::all_reduce, p, n * h * b);
  const double add = streams(hw, 3 * n * h * b, ElementwiseFamily::add);
  const double fill = streams(hw, n * h * b, ElementwiseFamily::fill);
  double attention = 0;  // every layer's, at its slowest rank
  for (int r = 0; r < p; ++r) attention = std::max(attention, attention_time(c, t, hw, r, b));
  // The embedding's rows, before the first layer (the dry run's first piece holds it).
  const double embedding = streams(hw, 2 * n * h * b, ElementwiseFamily::rows);
  out.compute_s += embedding;
  out.communication_s += hw.straggle_s(embedding, p);
  std::vector<double> layer_end;  // seconds from the step's start to the end of each layer
  double clock = embedding + hw.straggle_s(embedding, p);
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const std::size_t li = std::size_t(l);
    double ffn = 0;
    // The layout the layer computed in: unpipelined, the change was installed before the step.
    const ExpertLayout& L = (!t.pipelined_switch && t.next[li]) ? *t.next[li] : t.layout[li];
    // The attention's residual add, the norm, the output's fill and its residual add; an MoE layer's router (its
    // GEMM, the scores and the top-k of moe/router.hpp), the same on every rank.
    double every_rank = 2 * add + streams(hw, 2 * n * h * b, ElementwiseFamily::norm) + fill;
    if (c.is_moe(l)) {
      double pairs = 0;
      for (const std::int64_t x : t.routed[li]) pairs += double(x);
      const double e = double(c.moe.experts);
      every_rank += gemm(hw, n, e, h, b) + streams(hw, (2 * n * e + n + 3 * pairs) * b);
    }
    for (int r = 0; r < p; ++r) {
      double f = every_rank;
      if (!c.is_moe(l)) {
        f += swiglu(hw, n, double(chunk_range(c.dense_ffn, p, r).length), h, b);
      } else {
        const MoeConfig& m = c.moe;
        f += moe_experts_time(hw, m, L, t.routed[li], p, r, b);
        if (m.has_shared()) {  // a dense FFN of its width into its own output, then gated (a sigmoid) or added
          f += fill + swiglu(hw, n, double(chunk_range(m.shared_width(), p, r).length), h, b);
          const double gate = gemm(hw, n, 1, h, b) + hw.activation_time(n, 2 * n * b) + hw.call_overhead.kernel_call_s;
          f += m.shared_gate ? gate + streams(hw, (3 * n * h + n) * b, ElementwiseFamily::rows) : add;
        }
      }
      ffn = std::max(ffn, f);
    }
    double comm = 2 * reduce_s + hw.straggle_s(attention, p) + hw.straggle_s(ffn, p);  // the wait for the slowest rank
    // OLMoE's q/k sums of squares (2n floats; the dry run's transfers, recorded in float, scale to the cluster's
    // dtype).
    if (c.qk_norm) comm += hw.collective_time(cost::Collective::all_reduce, p, 2 * n * b);
    if (c.is_moe(l) && L.mode == MoeMode::ep)
      comm += hw.collective_time(cost::Collective::all_reduce, p, (n * h + p) * b) - reduce_s;
    out.compute_s += attention + ffn;
    out.communication_s += comm;
    clock += attention + ffn + comm;
    layer_end.push_back(clock);
  }
  // The final norm; the chunks' last rows gathered, their logits, each chunk's copied out.
  const double v = double(c.vocab);
  const double logits = streams(hw, 2 * n * h * b, ElementwiseFamily::norm) +
                        streams(hw, 2 * chunks * h * b, ElementwiseFamily::rows) + gemm(hw, chunks, v, h, b) +
                        streams(hw, 2 * v * b, ElementwiseFamily::copy, chunks);
  out.compute_s += logits;
  out.communication_s += hw.straggle_s(logits, p);  // the dry run waits for the slowest rank after it too
  clock += logits + hw.straggle_s(logits, p);
  out.switch_s = switch_exposed_s(c, t, cluster, layer_end, clock);
  return out;
}

}  // namespace paradyse::serve
