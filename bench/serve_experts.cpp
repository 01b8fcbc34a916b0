// bench/serve_experts.cpp: one MoE layer's routed experts on one rank of p, tensor-parallel against expert-parallel,
// measured and priced: the GEMM shapes the simulated TP/EP crossover rests on (issue 25).
//
// Dynamo-MoE's account of its crossover: TP reads a 1/p slice of every routed expert, which wins at a few tokens, and
// EP runs fuller GEMMs, which wins large batches. The simulation (docs/serving_simulation.md) prices every GEMM on the
// built-in GPU profiles at one flops rate and one byte rate (cost/profile.hpp linear_gemm_time), so whether "fuller"
// wins there is the profile's say, not the device's. This measures it. For each batch of n tokens, routed top-k over
// E experts by a Zipf skew (serve/routing_source.hpp, as moe_simulate routes them):
//   TP   rank 0's bank: every expert's rows over its 1/p slice of the width (w = f/p columns);
//   EP   the busiest rank's bank (the chunked placement, E/p experts a rank): its experts' rows over the whole width f;
// each bank's two projections (in: [m_e, h] x [h, 2w], out: [m_e, w] x [w, h]) run as one grouped GEMM each, as
// moe/experts.hpp runs them, and again as one GEMM per item (what the grouped call saves). Measured: the median (and
// min-max) of REPS passes, each over copies of the bank's weights that add up to --cold-mb (the weights come from
// memory, as in a step that reads every layer's). Priced: the same GEMMs on --profile as the simulated clock prices
// them (serve/step_cost.hpp bank_gemms: the first item a call, the others cost::GemmModel::grouped_item_time), and
// the singles each a call of its own, each weight at the reuse distance the passes give it (the bytes cycled: a
// calibrated CPU profile's tables at other cycles, cost::GemmModel::time_at_reuse; else its one price a shape). The
// SwiGLU between the projections and the rows' moves are left out (priced by their bytes, which are the same rows
// either way).
//
// On --device cuda the operands are bf16 with fp32 accumulation (the built-in profiles' dtype; the grouped call is
// cublasGemmGroupedBatchedEx, ops/cuda/gemm.hpp), on cpu fp32 (ops::cpu, priced at 4 bytes a value; on a calibrated CPU
// profile the dry run prices each GEMM at its weight's reuse distance, cost/gemm_reuse.hpp, as this does at its cycle).
// Also prints, per row, what the grouped call saved per item after the first against the singles, (singles - grouped) /
// (2 (items - 1)): a single call's fixed cost (a device's launch) that an item of the grouped call does not pay.
//
//   serve_experts [--model data/model_shapes/mixtral-8x7b.json] [--ranks 8] [--tokens 1,4,16,64,256,1024,4096]
//                 [--zipf 0.5] [--device cpu|cuda] [--profile h100] [--reps 7] [--cold-mb 256]
//                 [--shape HIDDEN,EXPERTS,TOP_K,FFN (instead of --model)] [--profile-out FILE.json]
//
// --profile-out writes --profile with the banks' weight shapes (n, k) timed alone at m = 1, 2, 4, ... rows (single
// calls, weights cycled as the banks') as its measured shapes, the median saving per item as their call_overhead_s
// (cost::GemmMeasured: an item of a grouped call costs its measured time less it) and grouped_item_s 0: moe_simulate
// --cluster FILE.json then prices the served experts by the device's own times.
#include "paradyse/cli/flags.hpp"
#include "paradyse/cli/lists.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/cost/profile_json.hpp"
#include "paradyse/ops/cpu/gemm_grouped.hpp"
#include "paradyse/serve/model_shape_hf.hpp"
#include "paradyse/serve/rank_shard.hpp"
#include "paradyse/serve/routing_source.hpp"
#include "paradyse/serve/step_cost.hpp"
#if PARADYSE_WITH_CUDA
#include "paradyse/device/runtime.hpp"
#include "paradyse/ops/cuda/gemm.hpp"
#endif

#include <fmt/core.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace {

namespace pd = paradyse;
using pd::ops::Transpose;

struct Options {
  std::string model = "data/model_shapes/mixtral-8x7b.json", shape, tokens = "1,4,16,64,256,1024,4096";
  std::string device = "cpu", profile = "h100", profile_out;
  int ranks = 8, reps = 7;
  double zipf = 0.5;
  std::int64_t cold_mb = 256;
  std::vector<std::int64_t> batches;  // --tokens, read
  std::vector<std::int64_t> sizes;    // --shape, read (empty: --model's)
};

// The MoE layer's sizes: h, E, top-k, f.
struct Experts {
  std::int64_t hidden = 0, experts = 0, top_k = 0, ffn = 0;
};

// ---- where the banks live: the host in fp32, or the GPU in bf16 ---------------------------------------------------

struct HostF32 {
  using T = float;
  static constexpr int dtype_bytes = 4;
  class Array {
  public:
    explicit Array(std::size_t count) : values_(count) {}
    T* get() { return values_.data(); }
    void fill(std::uint64_t seed) {
      pd::Rng rng(seed);
      for (T& v : values_) v = float(rng.uniform() - 0.5);
    }

  private:
    std::vector<T> values_;
  };
  static void grouped(const pd::ops::GroupedGemmOf<T>& g, std::int64_t lda, std::int64_t ldb, std::int64_t ldc) {
    pd::ops::cpu::gemm_grouped(Transpose::no, Transpose::yes, 1.0f, g, lda, ldb, 0.0f, ldc);
  }
  static void single(const pd::ops::GroupedGemmOf<T>& g, std::size_t i, std::int64_t lda, std::int64_t ldb,
                     std::int64_t ldc) {
    pd::ops::cpu::gemm(Transpose::no, Transpose::yes, g.m[i], g.n[i], g.k[i], 1.0f, g.a[i], lda, g.b[i], ldb, 0.0f,
                       g.c[i], ldc);
  }
  static void synchronize() {}
};

#if PARADYSE_WITH_CUDA
struct CudaBf16 {
  using T = pd::bf16;
  static constexpr int dtype_bytes = 2;
  class Array {
  public:
    explicit Array(std::size_t count) : count_(count) {
      PARADYSE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&data_), std::max<std::size_t>(count, 1) * sizeof(T)));
    }
    ~Array() { (void)cudaFree(data_); }
    Array(const Array&) = delete;
    Array& operator=(const Array&) = delete;
    T* get() { return data_; }
    // Every value 0x3c3c (about 0.0115): the timing does not depend on the values, and a bank of Mixtral's experts
    // (hundreds of MB) is set in microseconds rather than drawn on the host.
    void fill(std::uint64_t) { PARADYSE_CUDA_CHECK(cudaMemset(data_, 0x3c, count_ * sizeof(T))); }

  private:
    T* data_ = nullptr;
    std::size_t count_;
  };
  static void grouped(const pd::ops::GroupedGemmOf<T>& g, std::int64_t lda, std::int64_t ldb, std::int64_t ldc) {
    pd::ops::cuda::gemm_grouped(Transpose::no, Transpose::yes, 1.0f, g, lda, ldb, 0.0f, ldc);
  }
  static void single(const pd::ops::GroupedGemmOf<T>& g, std::size_t i, std::int64_t lda, std::int64_t ldb,
                     std::int64_t ldc) {
    pd::ops::cuda::gemm(Transpose::no, Transpose::yes, g.m[i], g.n[i], g.k[i], 1.0f, g.a[i], lda, g.b[i], ldb, 0.0f,
                        g.c[i], ldc);
  }
  static void synchronize() { pd::device::synchronize(); }
};
#endif

// One projection of a bank: items e of x_e [m_e, k] against weights [n, k] (y_e = x_e W_e^T: [m_e, n]), the empty
// blocks left out, with `copies` copies of the weights and one set of activations ([rows, k] in, [rows, n] out).
template <class Device>
class Projection {
public:
  using T = typename Device::T;
  Projection(const std::vector<std::int64_t>& rows, std::int64_t n, std::int64_t k, std::size_t copies)
      : n_(n), k_(k), x_(total(rows) * std::size_t(k)), y_(total(rows) * std::size_t(n)) {
    std::vector<std::int64_t> blocks = rows;
    blocks.erase(std::remove(blocks.begin(), blocks.end(), 0), blocks.end());
    const std::size_t weight = std::size_t(n * k);
    x_.fill(1);
    for (std::size_t c = 0; c < copies; ++c) {
      weights_.push_back(std::make_unique<typename Device::Array>(blocks.size() * weight));
      weights_.back()->fill(2 + c);
      pd::ops::GroupedGemmOf<T> items;
      std::int64_t row = 0;
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        items.add(blocks[i], n, k, x_.get() + row * k, weights_[c]->get() + i * weight, y_.get() + row * n);
        row += blocks[i];
      }
      items_.push_back(std::move(items));
    }
  }
  std::size_t items() const { return items_.front().size(); }
  std::size_t copies() const { return items_.size(); }
  // Enqueues copy c's GEMMs: one grouped call, or a call per item.
  void run(std::size_t c, bool grouped) {
    if (grouped) return Device::grouped(items_[c], k_, k_, n_);
    for (std::size_t i = 0; i < items_[c].size(); ++i) Device::single(items_[c], i, k_, k_, n_);
  }

private:
  static std::size_t total(const std::vector<std::int64_t>& rows) {
    std::int64_t all = 0;
    for (const std::int64_t m : rows) all += m;
    return std::size_t(all);
  }
  std::int64_t n_, k_;
  typename Device::Array x_, y_;
  std::vector<std::unique_ptr<typename Device::Array>> weights_;
  std::vector<pd::ops::GroupedGemmOf<T>> items_;
};

// Seconds of one pass over the projections' weight copies (copy c of each, in turn), over the copies.
template <class Device>
double pass(const std::vector<Projection<Device>*>& projections, bool grouped) {
  Device::synchronize();
  const pd::Timer clock;
  const std::size_t copies = projections.front()->copies();
  for (std::size_t c = 0; c < copies; ++c)
    for (Projection<Device>* p : projections) p->run(c, grouped);
  Device::synchronize();
  return clock.seconds() / double(copies);
}

// Copies of `weight_bytes` of weights that add up to --cold-mb (at least one).
std::size_t copies_for(const Options& o, double weight_bytes) {
  return std::size_t(std::max(1.0, std::ceil(double(o.cold_mb) * 1048576.0 / weight_bytes)));
}

// A bank's measurement: grouped and single calls, median and spread of the passes, and its prices.
struct BankResult {
  std::int64_t rows = 0, largest = 0;  // rows in all, in the largest block
  std::size_t items = 0;
  pd::Spread grouped, singles;
  double priced_grouped = 0, priced_singles = 0;
};

template <class Device>
BankResult measure_bank(const Options& o, const pd::cost::HardwareProfile& hw, const std::vector<std::int64_t>& rows,
                        std::int64_t w, std::int64_t h) {
  BankResult r;
  std::vector<double> blocks;
  for (const std::int64_t m : rows) r.rows += m, r.largest = std::max(r.largest, m), blocks.push_back(double(m));
  if (r.rows == 0) return r;
  const int b = Device::dtype_bytes;
  std::int64_t experts = 0;
  for (const std::int64_t m : rows) experts += m > 0;
  const double bank_bytes = double(experts) * 3 * double(w) * double(h) * b;
  const std::size_t copies = copies_for(o, bank_bytes);
  Projection<Device> in(rows, 2 * w, h, copies), out(rows, h, w, copies);  // up = x W_in^T, out = act W_out^T
  const std::vector<Projection<Device>*> bank = {&in, &out};
  r.items = in.items();
  std::vector<double> grouped, singles;
  (void)pass(bank, true), (void)pass(bank, false);  // warm up (the library's first calls, page faults)
  for (int i = 0; i < o.reps; ++i) grouped.push_back(pass(bank, true)), singles.push_back(pass(bank, false));
  r.grouped = pd::spread_of(grouped), r.singles = pd::spread_of(singles);
  // Each weight comes back after every copy's bank: its reuse distance.
  const double cycled = double(copies) * bank_bytes;
  r.priced_grouped = pd::serve::bank_gemms(hw, blocks, double(w), double(h), b, cycled);
  for (const double m : blocks)
    r.priced_singles += hw.gemm.time_at_reuse(m, 2.0 * double(w), double(h), b, cycled) +
                        hw.gemm.time_at_reuse(m, double(h), double(w), b, cycled);
  return r;
}

// Seconds the grouped call saved per item after the first against the same items as single calls (two projections).
double saved_per_item(const BankResult& r) {
  return r.items < 2 ? 0 : (r.singles.median - r.grouped.median) / (2.0 * double(r.items - 1));
}

// The banks' weight shapes (n, k) timed alone (single calls, weights cycled as the banks') at m = 1, 2, 4, ... up to
// `max_rows`: the table the simulation prices those shapes by (cost::GemmModel::measured).
template <class Device>
pd::cost::GemmMeasured measure_shapes(const Options& o, const std::vector<std::array<std::int64_t, 2>>& shapes,
                                      std::int64_t max_rows) {
  pd::cost::GemmMeasured table;
  table.dtype_bytes = Device::dtype_bytes;
  for (const auto& [n, k] : shapes) {
    pd::cost::GemmMeasuredShape shape{.n = double(n), .k = double(k)};
    for (std::int64_t m = 1;; m = std::min(2 * m, max_rows)) {
      Projection<Device> gemm({m}, n, k, copies_for(o, double(n * k * Device::dtype_bytes)));
      const std::vector<Projection<Device>*> one = {&gemm};
      (void)pass(one, false);
      std::vector<double> t;
      for (int i = 0; i < o.reps; ++i) t.push_back(pass(one, false));
      shape.rows.push_back(double(m)), shape.seconds.push_back(pd::median(t));
      if (m == max_rows) break;
    }
    table.shapes.push_back(std::move(shape));
  }
  return table;
}

template <class Device>
int run(const Options& o, const Experts& x) {
  const pd::cost::HardwareProfile hw = pd::cost::named_profile(o.profile);
  pd::check(o.profile_out.empty() || (hw.gemm.measured.shapes.empty() && hw.gemm.reuse.empty()),
            "--profile-out: --profile {} already prices GEMMs by measured shapes; give a built-in profile (a100, h100, "
            "h200) or one without them", o.profile);
  const int p = o.ranks, b = Device::dtype_bytes;
  const std::int64_t h = x.hidden, f = x.ffn, E = x.experts;
  const std::int64_t w_tp = pd::chunk_range(f, p, 0).length;
  const pd::serve::ExpertPlacement placement = pd::serve::ExpertPlacement::chunked(E, p);
  pd::serve::ZipfRouting routing(o.zipf, 1);

  fmt::print("one MoE layer's routed experts on one rank of {}: h = {}, {} experts top-{}, f = {} (TP slice {}); "
             "Zipf s = {:g}; {} ({} bytes a value); priced on {}; weights cycled through {} MB; {} passes\n\n",
             p, h, E, x.top_k, f, w_tp, o.zipf, o.device == "cuda" ? "cuda, bf16 with fp32 accumulation" : "cpu, fp32",
             b, hw.name, o.cold_mb, o.reps);
  fmt::print("| tokens | TP rows (items) | TP ms (min-max) | TP priced | EP rank: rows (items) | EP ms (min-max) | "
             "EP priced | TP / EP measured | TP / EP priced |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  struct Row {
    std::int64_t n;
    BankResult tp, ep;
  };
  std::vector<Row> rows;
  for (const std::int64_t n : o.batches) {
    const std::vector<std::int64_t> routed = routing.counts(0, 0, n, E, x.top_k);
    // EP: the busiest rank by price (the step waits for it).
    const auto rows_of = [&](int r) {  // rank r's rows per expert it holds
      std::vector<std::int64_t> held;
      for (const std::int64_t e : placement.experts_of_rank[std::size_t(r)]) held.push_back(routed[std::size_t(e)]);
      return held;
    };
    int busiest = 0;
    double most = -1;
    for (int r = 0; r < p; ++r) {
      const std::vector<std::int64_t> held = rows_of(r);
      const std::vector<double> blocks(held.begin(), held.end());
      const double t = pd::serve::bank_gemms(hw, blocks, double(f), double(h), b);
      if (t > most) most = t, busiest = r;
    }
    const std::vector<std::int64_t> ep_rows = rows_of(busiest);
    Row row{n, measure_bank<Device>(o, hw, routed, w_tp, h), measure_bank<Device>(o, hw, ep_rows, f, h)};
    const auto ms = [](const pd::Spread& s) {
      return fmt::format("{:.3f} ({:.3f}-{:.3f})", 1e3 * s.median, 1e3 * s.min, 1e3 * s.max);
    };
    fmt::print("| {} | {} ({}) | {} | {:.3f} | {}: {} ({}) | {} | {:.3f} | {:.2f} | {:.2f} |\n", n, row.tp.rows,
               row.tp.items, ms(row.tp.grouped), 1e3 * row.tp.priced_grouped, busiest, row.ep.rows, row.ep.items,
               ms(row.ep.grouped), 1e3 * row.ep.priced_grouped, row.tp.grouped.median / row.ep.grouped.median,
               row.tp.priced_grouped / row.ep.priced_grouped);
    rows.push_back(std::move(row));
  }
  fmt::print("\nthe same banks with each item a GEMM call of its own (singles) against the grouped call; measured "
             "ms (priced), and what the grouped call saved per item after the first (priced: the profile's GEMM fit's "
             "fixed cost for one row, {:.2f} us, less its grouped_item_s, {})\n\n",
             1e6 * hw.gemm.call_overhead(1, double(2 * w_tp), double(h), b),
             hw.gemm.grouped_item_s ? fmt::format("{:.2f} us", 1e6 * *hw.gemm.grouped_item_s) : std::string("unset"));
  fmt::print("| tokens | TP singles ms | TP grouped / singles | TP saved per item us | EP singles ms | "
             "EP grouped / singles | EP saved per item us |\n|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Row& r : rows) {
    const auto saved = [](const BankResult& x) {
      return x.items < 2 ? std::string("-") : fmt::format("{:.2f}", 1e6 * saved_per_item(x));
    };
    fmt::print("| {} | {:.3f} ({:.3f}) | {:.2f} ({:.2f}) | {} | {:.3f} ({:.3f}) | {:.2f} ({:.2f}) | {} |\n", r.n,
               1e3 * r.tp.singles.median, 1e3 * r.tp.priced_singles, r.tp.grouped.median / r.tp.singles.median,
               r.tp.priced_grouped / r.tp.priced_singles, saved(r.tp), 1e3 * r.ep.singles.median,
               1e3 * r.ep.priced_singles, r.ep.grouped.median / r.ep.singles.median,
               r.ep.priced_grouped / r.ep.priced_singles, saved(r.ep));
  }
  if (!o.profile_out.empty()) {
    // The profile the simulation can price these banks by (moe_simulate --cluster FILE.json): --profile with the four
    // weight shapes' measured times, what grouping saved per item as their call_overhead_s (the banks' median, at
    // least 0) and grouped_item_s 0 (an item of a grouped call pays its measured time less that).
    std::vector<double> saved;
    std::int64_t max_rows = 1;
    for (const Row& r : rows) {
      if (r.tp.items >= 2) saved.push_back(saved_per_item(r.tp));
      if (r.ep.items >= 2) saved.push_back(saved_per_item(r.ep));
      max_rows = std::max({max_rows, r.tp.largest, r.ep.largest});
    }
    std::vector<std::array<std::int64_t, 2>> shapes = {{2 * w_tp, h}, {h, w_tp}};
    if (w_tp != f) shapes.push_back({2 * f, h}), shapes.push_back({h, f});
    pd::cost::HardwareProfile out = hw;
    out.gemm.measured = measure_shapes<Device>(o, shapes, max_rows);
    if (!saved.empty()) out.gemm.measured.call_overhead_s = std::max(0.0, pd::median(saved));
    out.gemm.grouped_item_s = 0.0;
    out.name = hw.name + " + measured expert GEMMs";
    out.source = fmt::format("{}; the expert GEMMs of h = {}, f = {} on {} ranks measured by bench/serve_experts "
                             "({}, {} bytes a value)", hw.source, h, f, p, o.device, b);
    pd::cost::save_profile(out, o.profile_out);
    fmt::print("\nwrote {}: {} with {} weight shapes measured at 1 to {} rows{}\n", o.profile_out, hw.name,
               shapes.size(), max_rows,
               saved.empty() ? std::string(" (no bank of two items: no saving recorded)")
                             : fmt::format(", {:.2f} us saved per grouped item",
                                           1e6 * out.gemm.measured.call_overhead_s));
  }
  return 0;
}

Options parse(int argc, char** argv) {
  Options o;
  pd::cli::Flags flags("serve_experts", "One MoE layer's routed experts on one rank of p, TP against EP, each "
                                        "projection one grouped GEMM: measured against the simulation's price.");
  flags.text("--model", o.model, "the model's Hugging Face config.json (its MoE sizes)", "FILE");
  flags.text("--shape", o.shape, "the MoE sizes instead of --model", "HIDDEN,EXPERTS,TOP_K,FFN");
  flags.integer("--ranks", o.ranks, 1, 4096, "ranks the layer is split over (p)");
  flags.text("--tokens", o.tokens, "batches of tokens, one row each (comma-separated)", "LIST");
  flags.number("--zipf", o.zipf, {.min = 0, .max = 10}, "the routing's Zipf skew s");
  flags.choice("--device", o.device, {"cpu", "cuda"}, "where the bank runs (cuda: bf16 on one GPU)");
  flags.text("--profile", o.profile, "the hardware profile the banks are priced on", "FILE.json|a100|h100|h200")
      .nonempty("a profile .json or a built-in name");
  flags.integer("--reps", o.reps, 1, 1000, "passes a measurement takes the median of");
  flags.text("--profile-out", o.profile_out, "also write --profile with the banks' weight shapes as measured and the "
             "grouped call's saving per item (for moe_simulate --cluster)", "FILE.json");
  flags.integer("--cold-mb", o.cold_mb, std::int64_t(0), std::int64_t(1) << 20,
                "MB of weight copies a pass cycles through (0: one copy)");
  flags.parse(argc, argv);
  // A comma-separated list of integers in [1, max], or a message naming the flag, the value and the bad item.
  const auto integers = [&](const std::string& flag, const std::string& text, std::int64_t max) {
    std::vector<std::int64_t> values;
    try {
      for (const std::string& item : pd::cli::list_items(flag, text)) {
        std::int64_t v = 0;
        if (!pd::cli::parse_integer<std::int64_t>(item, 1, max, v))
          flags.fail(fmt::format("{} \"{}\": item \"{}\" is not an integer in [1, {}]", flag, text, item, max));
        values.push_back(v);
      }
    } catch (const std::invalid_argument& e) {
      flags.fail(e.what());
    }
    return values;
  };
  o.batches = integers("--tokens", o.tokens, std::int64_t(1) << 20);
  if (!o.profile_out.empty()) {
    const std::filesystem::path folder = std::filesystem::path(o.profile_out).parent_path();
    if (!folder.empty() && !std::filesystem::is_directory(folder))
      flags.fail(fmt::format("--profile-out {}: the folder {} does not exist", o.profile_out, folder.string()));
  }
  if (!o.shape.empty()) {
    o.sizes = integers("--shape", o.shape, std::int64_t(1) << 20);
    if (o.sizes.size() != 4 || o.sizes[2] > o.sizes[1])
      flags.fail(fmt::format("--shape \"{}\" expects HIDDEN,EXPERTS,TOP_K,FFN with TOP_K <= EXPERTS", o.shape));
  }
  return o;
}

Experts experts_of(const Options& o) {
  if (o.sizes.empty()) {
    const pd::serve::ModelShape shape = pd::serve::read_model_shape(o.model);
    const pd::MoeConfig& m = shape.config.moe;
    pd::check(m.experts > 0, "--model {}: not an MoE model (no routed experts)", o.model);
    return {m.hidden, m.experts, m.top_k, m.expert_ffn};
  }
  return {o.sizes[0], o.sizes[1], o.sizes[2], o.sizes[3]};
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    const Experts x = experts_of(o);
    pd::check(x.ffn >= o.ranks, "--ranks {} exceeds the expert width {}: TP would give a rank no columns", o.ranks,
              x.ffn);
    if (o.device == "cuda") {
#if PARADYSE_WITH_CUDA
      pd::check(pd::device::available(), "--device cuda: {}", pd::device::unavailable_reason());
      return run<CudaBf16>(o, x);
#else
      throw pd::Error("--device cuda: this serve_experts was built without CUDA (no nvcc found by CMake)");
#endif
    }
    return run<HostF32>(o, x);
  } catch (const std::exception& e) {
    fmt::print(stderr, "serve_experts: {}\n", pd::bounded_message(e.what()));
    return 1;
  }
}
