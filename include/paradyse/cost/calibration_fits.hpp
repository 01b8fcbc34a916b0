// paradyse/cost/calibration_fits.hpp: the calibration's fits, pure functions of measurements (cost/calibrate.hpp
// measures; tests feed these synthetic samples): fresh memory, scalar math, the elementwise size classes, paged
// attention, the linear GEMM model, GEMMs as measured, an elementwise kernel family, a collective's size ranges.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/cost/calibration_options.hpp"
#include "paradyse/cost/least_squares.hpp"
#include "paradyse/cost/profile.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <span>
#include <vector>

namespace paradyse::cost {

// One allocation size and the seconds to make, zero and free a Tensor of it (the fastest of several runs), and the
// share of its bytes that came on new pages (its page faults times 4 KiB over its bytes, at most 1; 1 where the
// faults were not counted).
struct AllocationSample {
  double bytes = 0;
  double seconds = 0;
  double new_share = 1;
};

// Reused pages cost a memset, new pages a fault each on top (8x here). Where the size from which the C library hands
// out new pages is known (`new_pages_from` > 0: core/host_malloc.hpp's threshold once retain_freed_host_memory() set
// it), the samples below it are the reused ones and the others fresh, and fresh_min_bytes is that size. Else a sample
// is fresh when its seconds per byte exceed `fresh_factor` times the smallest sample's, and fresh_min_bytes is the
// smallest size from which every larger sample is fresh (none: the largest sample plus one, so that every allocation
// is priced at the zero rate); a known size that leaves either group empty is not used. Found from the rates alone,
// the size moved with this VM's page faults: a calibration timed its 32 MiB sample at 4.7 GB/s and the 64 MiB one
// at 2.4, another put the 32 MiB one under 3x the memset's time per byte and the size at 64 MiB, pricing ColossalZ's
// 32 MiB score matrices as reused memory (2,048 tokens predicted at 0.69 of the measured step). The zero rate is
// the median of the reused samples' rates: their bytes over their seconds was the largest sample's rate (16 MiB, four
// fifths of the bytes), and on an Intel Xeon VM one calibration timed it at 6.2 GB/s against 10.7-13.7 for 64 KiB to
// 4 MiB, the sizes a training step's activations have; train_gpt's steps at 1,024 tokens were then priced 8-15 ms of
// zeroing where perf measured 5-6 (stop 51). The fresh rate is the fresh samples' bytes over their seconds (a relative
// least-squares slope would follow its fastest sample), each fresh sample's part on reused pages (1 - new_share of
// its bytes, a heap's free top serving it: calibrate_fresh_memory) priced at the zero rate and taken off first. A
// fresh sample with under an eighth of its bytes on new pages (reused, or faulting in huge pages, which count one
// fault per 2 MiB) says little of a new page's cost and is left out; if all are, the samples are taken as timed
// (every byte new, as before the faults were counted). Samples must be ascending in bytes.
inline FreshMemoryModel fit_fresh_memory(std::span<const AllocationSample> samples, std::int64_t new_pages_from = 0,
                                         double fresh_factor = 3) {
  check(!samples.empty(), "fit_fresh_memory: no samples");
  double fastest = 1e300;
  for (std::size_t i = 0; i < samples.size(); ++i) {
    check(samples[i].bytes > 0 && samples[i].seconds > 0 && samples[i].new_share >= 0 && samples[i].new_share <= 1,
          "fit_fresh_memory: sample {} has bytes = {}, seconds = {}, new_share = {} (expected > 0, > 0, in [0, 1])", i,
          samples[i].bytes, samples[i].seconds, samples[i].new_share);
    check(i == 0 || samples[i].bytes > samples[i - 1].bytes, "fit_fresh_memory: samples must be ascending in bytes");
    fastest = std::min(fastest, samples[i].seconds / samples[i].bytes);
  }
  // The first fresh sample: the first from the known size, else the first of the trailing run of slow ones.
  const auto below_known = std::size_t(std::ranges::count_if(
      samples, [&](const AllocationSample& s) { return s.bytes < double(new_pages_from); }));
  const bool use_known = new_pages_from > 0 && below_known > 0 && below_known < samples.size();
  std::size_t first_fresh = use_known ? below_known : samples.size();
  const auto slow = [&](const AllocationSample& s) { return s.seconds / s.bytes > fresh_factor * fastest; };
  if (!use_known)
    while (first_fresh > 0 && slow(samples[first_fresh - 1])) --first_fresh;
  const auto median_rate = [&](std::size_t begin, std::size_t end) {
    std::vector<double> rates;
    for (std::size_t i = begin; i < end; ++i) rates.push_back(samples[i].bytes / samples[i].seconds);
    return median(std::move(rates));
  };
  FreshMemoryModel model;
  model.zero_bytes_per_s = median_rate(0, std::max<std::size_t>(first_fresh, 1));
  // The fresh samples' new bytes over their seconds on new pages (as_timed: every byte new, as before the faults
  // were counted).
  const auto fresh_rate = [&](bool as_timed) {
    double bytes = 0, seconds = 0;
    for (std::size_t i = first_fresh; i < samples.size(); ++i) {
      const AllocationSample& s = samples[i];
      const double share = as_timed ? 1.0 : s.new_share;
      if (share < 0.125) continue;
      bytes += share * s.bytes;
      seconds += std::max(s.seconds - (1 - share) * s.bytes / model.zero_bytes_per_s, 0.0);
    }
    return bytes > 0 && seconds > 0 ? bytes / seconds : 0.0;
  };
  double fresh = first_fresh < samples.size() ? fresh_rate(false) : model.zero_bytes_per_s;
  if (fresh <= 0) fresh = fresh_rate(true);
  model.fresh_bytes_per_s = fresh > 0 ? fresh : model.zero_bytes_per_s;
  model.fresh_min_bytes = use_known                      ? new_pages_from
                          : first_fresh < samples.size() ? std::int64_t(samples[first_fresh].bytes)
                                                         : std::int64_t(samples.back().bytes) + 1;
  return model;
}

// A kernel that makes `calls` scalar math-library calls, measured at `seconds`, of which `other_s` are its other
// work as the profile prices it (memory traffic, activation elements).
struct ScalarSample {
  double calls = 0;
  double seconds = 0;
  double other_s = 0;
};

// Calls per second: the calls over the kernels' seconds beyond their other work (0, unpriced, when the kernels take
// no longer than their other work).
inline double fit_scalar_rate(std::span<const ScalarSample> samples) {
  double calls = 0, seconds = 0;
  for (const ScalarSample& s : samples) {
    check(s.calls > 0 && s.seconds > 0 && s.other_s >= 0, "fit_scalar_rate: calls = {}, seconds = {}, other = {}",
          s.calls, s.seconds, s.other_s);
    calls += s.calls;
    seconds += std::max(0.0, s.seconds - s.other_s);
  }
  return seconds > 0 ? calls / seconds : 0;
}

// The materialised softmax forward at one visible share: its scores, the exps it calls (one per visible score), its
// seconds, and the other work in them (a refill of the scores) priced by the profile.
struct SoftmaxSample {
  double scores = 0;
  double exps = 0;
  double seconds = 0;
  double other_s = 0;
};
// The softmax's own loop per score and its exp per call, non-negative least squares over samples of different visible
// shares: t - other = scores / softmax_scores_per_s + exps / exp_per_s. A term fitted at 0 comes back as rate 0
// (unpriced); two samples of one share cannot tell the terms apart (refused).
inline ScalarMathModel fit_softmax_rates(std::span<const SoftmaxSample> samples) {
  check(samples.size() >= 2, "fit_softmax_rates: {} samples, expected two or more of different visible shares",
        samples.size());
  std::vector<std::vector<double>> rows;
  std::vector<double> y;
  for (const SoftmaxSample& s : samples) {
    check(s.scores > 0 && s.exps > 0 && s.exps <= s.scores && s.seconds > s.other_s && s.other_s >= 0,
          "fit_softmax_rates: scores = {}, exps = {}, seconds = {}, other = {} (expected 0 < exps <= scores, "
          "0 <= other < seconds)", s.scores, s.exps, s.seconds, s.other_s);
    rows.push_back({s.scores, s.exps});
    y.push_back(s.seconds - s.other_s);
  }
  const auto share = [](const SoftmaxSample& s) { return s.exps / s.scores; };
  check(std::ranges::any_of(samples, [&](const SoftmaxSample& s) { return share(s) != share(samples[0]); }),
        "fit_softmax_rates: every sample sees {} of its scores; the fit needs two visible shares", share(samples[0]));
  const Fit fit = fit_non_negative(rows, y);
  ScalarMathModel rates;
  rates.softmax_scores_per_s = rate_of(fit.coefficients[0]);
  rates.exp_per_s = rate_of(fit.coefficients[1]);
  return rates;
}

// An elementwise kernel mix at one size: the bytes its calls record in a dry run per call, and its seconds per call.
struct ElementwiseSample {
  double bytes = 0;
  double seconds = 0;
};

// Size classes from samples ascending in bytes: sample i's rate (bytes / seconds) holds the calls up to the
// geometric mean of its bytes and the next sample's, the last sample's up to its own bytes (larger calls take the
// last class's rate, cost/profile.hpp).
inline std::vector<ElementwiseClass> fit_elementwise_classes(std::span<const ElementwiseSample> samples) {
  check(!samples.empty(), "fit_elementwise_classes: no samples");
  std::vector<ElementwiseClass> classes;
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const ElementwiseSample& s = samples[i];
    check(s.bytes >= 1 && s.seconds > 0, "fit_elementwise_classes: sample {} has bytes = {}, seconds = {}", i,
          s.bytes, s.seconds);
    check(i == 0 || s.bytes > samples[i - 1].bytes, "fit_elementwise_classes: samples must be ascending in bytes");
    const double bound = i + 1 < samples.size() ? std::sqrt(s.bytes * samples[i + 1].bytes) : s.bytes;
    classes.push_back({std::round(bound), s.bytes / s.seconds});
  }
  return classes;
}

// Serving's paged attention kernel (serve/paged_attention.hpp, which measures it): `visits` (query-key pair, head)
// visits of head dim `head_dim` measured at `seconds`.
struct PagedAttentionSample {
  double visits = 0;
  double head_dim = 0;
  double seconds = 0;
};

// The PagedAttentionModel of the samples (t = visits / visits_per_s + 4 d visits / flops_per_s, least relative error,
// non-negative; a coefficient fitted to 0 leaves its rate 0, that term unpriced) into `model`; the fit's errors back.
inline Fit fit_paged_attention(std::span<const PagedAttentionSample> samples, PagedAttentionModel& model) {
  check(!samples.empty(), "fit_paged_attention: no samples");
  std::vector<std::vector<double>> rows;
  std::vector<double> y;
  for (const PagedAttentionSample& s : samples) {
    check(s.visits > 0 && s.head_dim > 0 && s.seconds > 0,
          "fit_paged_attention: a sample of {} visits, head dim {}, {} s (all must be positive)", s.visits,
          s.head_dim, s.seconds);
    rows.push_back({s.visits, 4 * s.head_dim * s.visits});
    y.push_back(s.seconds);
  }
  Fit fit = fit_non_negative(rows, y);
  const std::vector<double>& c = fit.coefficients;
  model = {rate_of(c[0]), rate_of(c[1])};
  return fit;
}

// MLA's latent attention (serve/mla_attention.hpp; serve/paged_attention_calibration.hpp measures it): `pairs` visible
// query-key pairs of `heads` query heads at width `width` (r_kv + d_r / 2) measured at `seconds`.
struct LatentAttentionSample {
  double pairs = 0;
  double heads = 0;
  double width = 0;
  double seconds = 0;
};

// The LatentAttentionModel of the samples (t = visits / visits_per_s + 4 d visits / flops_per_s + d pairs /
// shared_per_s, least relative error, non-negative; a coefficient fitted to 0 leaves its term unpriced).
inline Fit fit_latent_attention(std::span<const LatentAttentionSample> samples, LatentAttentionModel& model) {
  check(!samples.empty(), "fit_latent_attention: no samples");
  std::vector<std::vector<double>> rows;
  std::vector<double> y;
  for (const LatentAttentionSample& s : samples) {
    check(s.pairs > 0 && s.heads > 0 && s.width > 0 && s.seconds > 0,
          "fit_latent_attention: a sample of {} pairs, {} heads, width {}, {} s (all must be positive)", s.pairs,
          s.heads, s.width, s.seconds);
    const double visits = s.pairs * s.heads;
    rows.push_back({visits, 4 * s.width * visits, s.width * s.pairs});
    y.push_back(s.seconds);
  }
  Fit fit = fit_non_negative(rows, y);
  const std::vector<double>& c = fit.coefficients;
  model = {rate_of(c[0]), rate_of(c[1]), rate_of(c[2])};
  return fit;
}

// t = overhead + flops / rate + operand bytes / bandwidth (cost/profile.hpp linear_gemm_time) fitted to float32 GEMM
// samples (shapes[i] took seconds[i]): the fit, and its terms as {overhead, rate, bandwidth} (1e30 and 0 for a
// coefficient fitted to 0: no term).
struct LinearGemmFit {
  Fit fit;
  double overhead_s = 0, flops_per_s = 1e30, bytes_per_s = 0;
};
inline LinearGemmFit fit_linear_gemm(const std::vector<std::array<std::int64_t, 3>>& shapes,
                                     const std::vector<double>& seconds) {
  std::vector<std::vector<double>> rows;
  for (const auto& [m, n, k] : shapes)
    rows.push_back({1.0, 2.0 * double(m) * double(n) * double(k), double(m * k + k * n + m * n) * sizeof(float)});
  LinearGemmFit r{fit_non_negative(rows, seconds)};
  const auto& c = r.fit.coefficients;
  r.overhead_s = c[0];
  r.flops_per_s = rate_of(c[1], 1e30);
  r.bytes_per_s = rate_of(c[2]);
  return r;
}

// The samples as measured shapes (GemmModel::measured, GemmThinClass::timed): per weight shape (n, k), its rows
// ascending, a row measured more than once at the median of its times.
inline GemmMeasured measured_gemms(const std::vector<GemmSample>& samples, int dtype_bytes) {
  check(dtype_bytes >= 1, "measured_gemms: dtype_bytes = {} must be at least 1", dtype_bytes);
  std::map<std::pair<std::int64_t, std::int64_t>, std::map<std::int64_t, std::vector<double>>> by_shape;
  for (const GemmSample& x : samples) {
    check(x.m > 0 && x.n > 0 && x.k > 0 && x.seconds > 0 && std::isfinite(x.seconds),
          "measured_gemms: sample {}x{}x{} took {} s", x.m, x.n, x.k, x.seconds);
    by_shape[{x.n, x.k}][x.m].push_back(x.seconds);
  }
  GemmMeasured out{dtype_bytes, {}};
  for (const auto& [nk, rows] : by_shape) {
    GemmMeasuredShape shape{double(nk.first), double(nk.second), {}, {}};
    for (const auto& [m, times] : rows) shape.rows.push_back(double(m)), shape.seconds.push_back(median(times));
    out.shapes.push_back(std::move(shape));
  }
  return out;
}

// One elementwise family's calls at one size: how many kernels, their bytes, their time.
struct FamilySample {
  double kernels, bytes, seconds;
};
// t = kernels x overhead + bytes / rate, least squares over the samples (non-negative terms; 0 bytes/s: no rate).
inline ElementwiseFamilyRate fit_elementwise_family(const std::vector<FamilySample>& samples) {
  std::vector<std::vector<double>> rows;
  std::vector<double> y;
  for (const FamilySample& s : samples) rows.push_back({s.kernels, s.bytes}), y.push_back(s.seconds);
  const Fit fit = fit_non_negative(rows, y);
  ElementwiseFamilyRate rate;
  rate.overhead_s = fit.coefficients[0];
  rate.bytes_per_s = rate_of(fit.coefficients[1]);
  return rate;
}

// The sizes (bytes) from which a collective's alpha-beta lines start, ascending, the first 0: `large` (messages
// below it fit in the cores' own caches), and where p ranks' buffers leave a shared last-level cache of `cache`
// bytes, cache / (p + 1) (an all-gather's p inputs and p outputs), if at least two of the sampled `sizes` lie beyond
// it and two between `large` and it (cache 0: none).
inline std::vector<std::int64_t> message_ranges(std::int64_t large, std::int64_t cache, int p,
                                                std::span<const std::int64_t> sizes) {
  std::vector<std::int64_t> from = {0, large};
  const std::int64_t beyond = cache / (p + 1);
  const auto in = [&](std::int64_t lo, std::int64_t hi) {
    return std::ranges::count_if(sizes, [&](std::int64_t b) { return b >= lo && b < hi; });
  };
  if (beyond > large && in(beyond, std::numeric_limits<std::int64_t>::max()) >= 2 && in(large, beyond) >= 2)
    from.push_back(beyond);
  return from;
}

// One collective's lines t = alpha + beta * bytes, one per range of `from` (message_ranges), each fitted on the
// samples in its range (rows[i] = {1, bytes}, y[i] seconds); a range of fewer than two samples on all of them.
inline std::vector<Fit> fit_message_ranges(const std::vector<std::vector<double>>& rows, std::span<const double> y,
                                           std::span<const std::int64_t> from) {
  std::vector<Fit> fits;
  for (std::size_t r = 0; r < from.size(); ++r) {
    const double lo = double(from[r]), hi = r + 1 < from.size() ? double(from[r + 1]) : HUGE_VAL;
    std::vector<std::vector<double>> range_rows;
    std::vector<double> range_y;
    for (std::size_t i = 0; i < y.size(); ++i)
      if (rows[i][1] >= lo && rows[i][1] < hi) range_rows.push_back(rows[i]), range_y.push_back(y[i]);
    if (range_y.size() < 2) range_rows = rows, range_y.assign(y.begin(), y.end());
    fits.push_back(fit_non_negative(range_rows, range_y));
  }
  return fits;
}

}  // namespace paradyse::cost
