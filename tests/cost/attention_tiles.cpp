// Tests of attention priced on whole tiles (issue 25): ops/counting.hpp's tiled_pairs counts the pairs of the tiles
// the CPU flash kernel computes (held against a brute-force walk of the kernel's own tile grid and rule, for lengths
// that are and are not multiples of a tile, causal and not, with offsets and documents (uneven, straddling tiles,
// several to a tile, empty; and 2^30 tokens of tile-aligned ones against one call per document), and per call of a
// zigzag ring); the counting backend records it in TraceEvent::tiled; the trace clock prices it when the profile's
// AttentionModel::whole_tiles is set (cost/trace_cost.hpp); profile JSON keeps the flag (cost/profile_json.hpp);
// the calibration fits it on causal calls when asked (cost/calibrate.hpp).
#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/dry_run.hpp"
#include "paradyse/cost/profile_json.hpp"
#include "paradyse/cost/trace_cost.hpp"
#include "paradyse/ops/counting.hpp"
#include "paradyse/strategy/ring_attention.hpp"

#include "support/fresh_seed.hpp"

#include <doctest/doctest.h>

#include <numeric>
#include <random>
#include <vector>

using namespace paradyse;
using namespace paradyse::cost;

namespace {

// Pairs of the tiles the CPU kernel computes, by brute force: every tile of its grid (ops/cpu/attention.hpp),
// classified by the kernel's own rule, counted whole unless no pair of it is visible.
double kernel_tile_pairs(const ops::AttentionMask& mask, std::int64_t q_len, std::int64_t kv_len, std::int64_t d) {
  const ops::cpu::AttentionTiling t = ops::cpu::attention_tiling(d);
  const Tensor<std::int64_t> ranges = ops::cpu::detail::visible_ranges(mask, q_len, kv_len);
  double pairs = 0;
  for (std::int64_t i0 = 0; i0 < q_len; i0 += t.q_block)
    for (std::int64_t j0 = 0; j0 < kv_len; j0 += t.kv_block) {
      const std::int64_t rows = std::min(t.q_block, q_len - i0), cols = std::min(t.kv_block, kv_len - j0);
      if (ops::cpu::detail::classify_tile(ranges.data() + 2 * i0, rows, j0, cols) !=
          ops::cpu::detail::TileVisibility::none)
        pairs += double(rows) * double(cols);
    }
  return pairs;
}

// Checks tiled_pairs against kernel_tile_pairs and visible_pairs against the kernel's own per-query ranges; returns
// whether the call computes masked pairs (tiled > visible).
bool check_against_kernel(const ops::AttentionMask& mask, std::int64_t q_len, std::int64_t kv_len, std::int64_t d) {
  CAPTURE(d);
  CAPTURE(mask.causal);
  CAPTURE(q_len);
  CAPTURE(kv_len);
  CAPTURE(mask.q_offset);
  CAPTURE(mask.kv_offset);
  const std::vector<std::int64_t> starts(mask.document_starts.begin(), mask.document_starts.end());
  CAPTURE(starts);
  const double tiled = ops::tiled_pairs(mask, q_len, kv_len, ops::cpu::attention_tiling(d));
  CHECK(tiled == kernel_tile_pairs(mask, q_len, kv_len, d));
  const Tensor<std::int64_t> ranges = ops::cpu::detail::visible_ranges(mask, q_len, kv_len);
  double visible = 0;
  for (std::int64_t i = 0; i < q_len; ++i) visible += double(ranges(i, 1) - ranges(i, 0));
  CHECK(ops::visible_pairs(mask, q_len, kv_len) == visible);
  CHECK(tiled >= visible);
  return tiled > visible;
}

// Sums of count * (visible pairs, tiled pairs) over the attention events of `kind`.
std::pair<double, double> attention_sums(std::span<const TraceEvent> events, TraceKind kind) {
  double visible = 0, tiled = 0;
  for (const TraceEvent& e : events)
    if (e.kind == kind) {
      visible += e.count * e.m;
      tiled += e.count * e.tiled;
    }
  return {visible, tiled};
}

}  // namespace

TEST_CASE("tiled pairs: a causal diagonal costs whole tiles (by hand)") {
  const ops::AttentionMask causal{.causal = true};
  const ops::cpu::AttentionTiling t = ops::cpu::attention_tiling(32);
  REQUIRE(t == ops::cpu::AttentionTiling{128, 256});
  // 1024 queries in 8 tiles of 128 rows: query tile i reaches key 128 (i + 1), i.e. up to that rounded up to 256.
  CHECK(ops::tiled_pairs(causal, 1024, 1024, t) == 128.0 * (256 + 256 + 512 + 512 + 768 + 768 + 1024 + 1024));
  CHECK(ops::visible_pairs(causal, 1024, 1024) == 1024.0 * 1025 / 2);
  CHECK(ops::tiled_pairs(ops::AttentionMask{}, 1000, 300, t) == 1000.0 * 300);  // not causal: every tile
  CHECK(ops::tiled_pairs(causal, 0, 300, t) == 0);
  // Keys all after the queries (a ring's hidden block): no tile.
  CHECK(ops::tiled_pairs(ops::AttentionMask{.causal = true, .q_offset = 0, .kv_offset = 512}, 256, 256, t) == 0);
}

TEST_CASE("tiled pairs: the kernel's tiles, brute force, over lengths, offsets, documents and head dims") {
  PARADYSE_FRESH_RNG(rng);
  const std::vector<std::int64_t> lengths = {1, 50, 127, 128, 129, 255, 256, 257, 300, 640, 1000, 1024, 1030};
  std::uniform_int_distribution<std::size_t> pick(0, lengths.size() - 1);
  std::uniform_int_distribution<std::int64_t> offset(0, 1500), cut(1, 1500);
  int cases = 0, larger = 0;
  for (const std::int64_t d : {32, 128, 200})  // tiles 128 x 256 up to d = 128, 64 x 128 above
    for (const bool causal : {false, true})
      for (const bool documents : {false, true})
        for (int trial = 0; trial < 12; ++trial) {
          const std::int64_t q_len = lengths[pick(rng)], kv_len = lengths[pick(rng)];
          std::vector<std::int64_t> starts;
          if (documents) {
            starts = {0, cut(rng), cut(rng), cut(rng)};
            std::sort(starts.begin(), starts.end());
          }
          // The first trials at offset 0 (a whole sequence), the rest anywhere (a chunk of one).
          const ops::AttentionMask mask{.causal = causal,
                                        .q_offset = trial < 3 ? 0 : offset(rng),
                                        .kv_offset = trial < 3 ? 0 : offset(rng),
                                        .document_starts = starts};
          larger += check_against_kernel(mask, q_len, kv_len, d);
          ++cases;
        }
  CHECK(larger > cases / 4);  // the cases do exercise partly visible tiles
}

TEST_CASE("tiled pairs: packed documents, uneven, straddling tiles, many in one tile, empty, with offsets") {
  PARADYSE_FRESH_RNG(rng);
  int cases = 0, larger = 0;
  for (const std::int64_t d : {32, 200})  // tiles 128 x 256, 64 x 128
    for (const bool causal : {false, true})
      for (int trial = 0; trial < 40; ++trial) {
        // Documents of uneven lengths: short ones (several in one tile), ones straddling tile boundaries, some
        // empty; the block anywhere in them (offsets up to past the last start).
        std::vector<std::int64_t> starts = {0};
        const std::int64_t documents = std::uniform_int_distribution<std::int64_t>(1, 30)(rng);
        for (std::int64_t i = 1; i < documents; ++i) {
          const int kind = std::uniform_int_distribution<int>(0, 3)(rng);
          const std::int64_t length = kind == 0   ? 0
                                      : kind == 1 ? std::uniform_int_distribution<std::int64_t>(1, 40)(rng)
                                                  : std::uniform_int_distribution<std::int64_t>(41, 700)(rng);
          starts.push_back(starts.back() + length);
        }
        std::uniform_int_distribution<std::int64_t> offset(0, starts.back() + 300), length(1, 2500);
        const ops::AttentionMask mask{.causal = causal,
                                      .q_offset = trial < 8 ? 0 : offset(rng),
                                      .kv_offset = trial < 8 ? 0 : offset(rng),
                                      .document_starts = starts};
        const std::int64_t q_len = length(rng), kv_len = trial < 8 ? q_len : length(rng);
        larger += check_against_kernel(mask, q_len, kv_len, d);
        ++cases;
      }
  CHECK(larger > cases / 2);
}

TEST_CASE("tiled pairs: 2^30 packed tokens in tile-aligned documents count as the documents apart") {
  // Documents that start on a multiple of both tile sides share no tile: the call costs the sum of one call per
  // document. At 2^30 tokens (~2^18 documents) the documents' closed form is held against the single sequence's.
  PARADYSE_FRESH_RNG(rng);
  const ops::cpu::AttentionTiling t = ops::cpu::attention_tiling(64);
  const std::int64_t align = std::lcm(t.q_block, t.kv_block), total = std::int64_t(1) << 30;
  for (const bool causal : {false, true}) {
    CAPTURE(causal);
    std::vector<std::int64_t> starts = {0};
    double tiled = 0, visible = 0;
    for (std::int64_t at = 0; at < total;) {
      const std::int64_t length = std::min(total - at, align * std::uniform_int_distribution<std::int64_t>(1, 32)(rng));
      const ops::AttentionMask alone{.causal = causal};
      tiled += ops::tiled_pairs(alone, length, length, t);
      visible += ops::visible_pairs(alone, length, length);
      at += length;
      if (at < total) starts.push_back(at);
    }
    const ops::AttentionMask packed{.causal = causal, .document_starts = starts};
    CHECK(ops::tiled_pairs(packed, total, total, t) == tiled);
    CHECK(ops::visible_pairs(packed, total, total) == visible);
  }
}

TEST_CASE("tiled pairs: the counting backend records them per call of a zigzag ring, every rank, p = 1..4") {
  PARADYSE_FRESH_RNG(rng);
  const std::int64_t batch = 2, heads = 3, d = 32;
  for (const int p : {1, 2, 3, 4})
    for (const bool zigzag : {false, true}) {
      // Lengths that split unevenly over the ranks and their chunks, and cut tiles.
      const std::int64_t length = std::uniform_int_distribution<std::int64_t>(300, 1400)(rng);
      const RingAttentionSpec spec{.layout = SequenceLayout(length, p, zigzag), .causal = true};
      for (int rank = 0; rank < p; ++rank) {
        CAPTURE(p);
        CAPTURE(zigzag);
        CAPTURE(length);
        CAPTURE(rank);
        // What the kernel computes: one call per visible (query segment, key segment) pair.
        double visible = 0, tiled = 0;
        int q_count = 0;
        const auto q_segments = ring_detail::segments(spec.layout, rank, q_count);
        for (int qi = 0; qi < q_count; ++qi)
          for (int owner = 0; owner < p; ++owner) {
            int kv_count = 0;
            const auto kv_segments = ring_detail::segments(spec.layout, owner, kv_count);
            for (int ki = 0; ki < kv_count; ++ki) {
              const TokenSegment &qs = q_segments[std::size_t(qi)], &ks = kv_segments[std::size_t(ki)];
              if (!ring_detail::block_visible(spec, qs, ks)) continue;
              const ops::AttentionMask mask = ring_detail::block_mask(spec, qs, ks);
              visible += batch * ops::visible_pairs(mask, qs.length, ks.length);
              tiled += batch * kernel_tile_pairs(mask, qs.length, ks.length, d);
            }
          }
        // What the dry run of the ring records.
        DryRun run(rank, p);
        run.record();
        const std::int64_t n = spec.layout.local_length(rank);
        Tensor<float> q(Shape{batch, n, heads, d}), k(Shape{batch, n, heads, d}), v(Shape{batch, n, heads, d});
        Tensor<float> out(Shape{batch, n, heads, d}), lse(Shape{batch, heads, n});
        ring_attention_forward<ops::Counting>(run.comm, spec, run.pool, q.view(), k.view(), v.view(), out.view(),
                                              lse.view());
        run.stop();
        const auto [recorded_visible, recorded_tiled] =
            attention_sums(run.trace().events(), TraceKind::attention_forward);
        CHECK(recorded_visible == visible);
        CHECK(recorded_tiled == tiled);
        CHECK(tiled > visible);
      }
    }
}

TEST_CASE("whole tiles: the trace clock prices the tiled pairs when the profile says so, the visible ones if not") {
  HardwareProfile hw = a100_sxm4_80gb_x8();
  hw.attention = {3e-6, 2e11, 1.5e11};
  const double d = 64, heads = 8, visible = 5000, tiled = 6144;
  SublayerTrace trace;
  trace.forward = {{.kind = TraceKind::attention_forward, .count = 3, .m = visible, .n = heads, .k = d, .tiled = tiled},
                   {.kind = TraceKind::attention_forward, .m = visible, .n = heads, .k = d}};  // built by hand
  trace.backward = {{.kind = TraceKind::attention_backward, .count = 2, .m = visible, .n = heads, .k = d,
                     .tiled = tiled}};
  const auto forward_s = [&](double pairs) { return 3e-6 + 4 * d * heads * pairs / 2e11; };
  const auto backward_s = [&](double pairs) { return 3e-6 + 2.5 * 4 * d * heads * pairs / 1.5e11; };
  for (const bool whole : {false, true}) {
    CAPTURE(whole);
    hw.attention.whole_tiles = whole;
    const SublayerCost c = cost_of(trace, &hw, 4);
    const double pairs = whole ? tiled : visible;
    CHECK(c.forward_s == doctest::Approx(3 * forward_s(pairs) + forward_s(visible)).epsilon(1e-12));
    CHECK(c.backward_s == doctest::Approx(2 * backward_s(pairs)).epsilon(1e-12));
  }
}

TEST_CASE("whole tiles: every strategy's dry run costs exactly its calls' extra tiled pairs more, p = 2, 3") {
  PARADYSE_FRESH_RNG(rng);
  HardwareProfile hw = a100_sxm4_80gb_x8();
  hw.attention = {2e-6, 3e11, 2e11};
  const StrategyCatalog& catalog = default_catalog();
  int flash_strategies = 0;
  for (const int p : {2, 3}) {
    ModelShape m = ModelShape::mha(96, 6, 2 * p * std::uniform_int_distribution<std::int64_t>(70, 200)(rng));
    m.causal = true;
    m.zigzag = true;
    for (const int s : catalog.all()) {
      CAPTURE(p);
      CAPTURE(m.seq);
      CAPTURE(catalog.name(s));
      if (!catalog.supports(s, m, p).ok()) continue;
      const SublayerTrace trace = catalog.trace(s, Sublayer::attention, m, p, p - 1);
      hw.attention.whole_tiles = false;
      const SublayerCost visible = cost_of(trace, &hw, 4);
      hw.attention.whole_tiles = true;
      const SublayerCost whole = cost_of(trace, &hw, 4);
      // The hand-priced difference: 4 d heads (tiled - visible) flops per call, forward and 2.5 x backward.
      double extra = 0;
      for (const auto& [events, factor] : {std::pair{std::span<const TraceEvent>(trace.forward), 1 / 3e11},
                                           std::pair{std::span<const TraceEvent>(trace.backward), 2.5 / 2e11}})
        for (const TraceEvent& e : events)
          if (e.kind == TraceKind::attention_forward || e.kind == TraceKind::attention_backward) {
            CHECK(e.tiled >= e.m);
            extra += e.count * 4 * e.k * e.n * (e.tiled - e.m) * factor;
          }
      const bool flash = attention_sums(trace.forward, TraceKind::attention_forward).second > 0;
      CHECK(whole.compute_s - visible.compute_s == doctest::Approx(extra).epsilon(1e-9));
      if (flash) CHECK(extra > 0);  // causal diagonals on every rank's flash calls
      flash_strategies += flash;
    }
  }
  CHECK(flash_strategies >= 6);  // MegatronTS, MegatronCZ, UlyssesZ, METP, ... at both group sizes
}

TEST_CASE("whole tiles: profile JSON keeps the flag; without the key it is off; a bad value is named") {
  HardwareProfile hw = a100_sxm4_80gb_x8();
  CHECK_FALSE(to_json(hw).contains("attention_whole_tiles"));
  CHECK_FALSE(profile_from_json(to_json(hw)).attention.whole_tiles);
  hw.attention.whole_tiles = true;
  const HardwareProfile back = profile_from_json(to_json(hw));
  CHECK(back.attention.whole_tiles);
  CHECK(back.attention.forward_flops_per_s == hw.attention.forward_flops_per_s);
  json::Value v = to_json(hw);
  v["attention_whole_tiles"] = false;
  CHECK_FALSE(profile_from_json(v).attention.whole_tiles);
  v["attention_whole_tiles"] = "yes";
  CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains("attention_whole_tiles"), Error);
  v["attention_whole_tiles"] = 1;
  CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains("attention_whole_tiles"), Error);
}

TEST_CASE("whole tiles: calibrated on causal calls priced by their tiles when asked, on full calls otherwise") {
  for (const int p : {1, 2}) {
    for (const bool asked : {false, true}) {
      CAPTURE(p);
      CAPTURE(asked);
      CalibrationOptions options;
      options.repetitions = 1;
      options.attention_lengths = {256, 300, 640};
      options.attention_whole_tiles = asked;
      options.attention_causal_only = asked && p == 2;  // ignored beside whole tiles (alone: the next test case)
      Calibration result;
      run_ranks(p, [&](ThreadCommunicator& comm) {
        Calibration mine;
        calibrate_detail::calibrate_attention<ops::Cpu>(comm, options, mine);
        if (comm.rank() == 0) result = mine;
      });
      CHECK(result.profile.attention.whole_tiles == asked);
      REQUIRE(result.samples.size() == (asked ? 12u : 6u));
      // Each sample's fitted time is the forward fit at 4 d heads x its pairs: the tiled ones where asked.
      const auto& f = result.attention_forward_fit.coefficients;
      const double per_pair = 4.0 * double(options.head_dim) * double(options.attention_heads);
      std::size_t i = 0;
      for (const std::int64_t len : options.attention_lengths)
        for (const bool causal : {false, true}) {
          if (causal && !asked) continue;
          const ops::AttentionMask mask{.causal = causal};
          const double pairs = asked ? kernel_tile_pairs(mask, len, len, options.head_dim)
                                     : ops::visible_pairs(mask, len, len);
          CAPTURE(result.samples[i].what);
          CHECK(result.samples[i].what.find(causal ? "causal" : "s=") != std::string::npos);
          CHECK(result.samples[i].fitted_s == doctest::Approx(f[0] + f[1] * per_pair * pairs).epsilon(1e-12));
          i += 2;  // forward, backward
        }
      CHECK(result.profile.attention.forward_flops_per_s < 1e30);  // a measured rate
    }
  }
}

TEST_CASE("whole tiles: attention_causal_only calibrates on causal calls alone, priced on their visible pairs") {
  for (const int p : {1, 3}) {
    CAPTURE(p);
    CalibrationOptions options;
    options.repetitions = 1;
    options.attention_lengths = {256, 300, 640};
    options.attention_causal_only = true;
    Calibration result;
    run_ranks(p, [&](ThreadCommunicator& comm) {
      Calibration mine;
      calibrate_detail::calibrate_attention<ops::Cpu>(comm, options, mine);
      if (comm.rank() == 0) result = mine;
    });
    CHECK(!result.profile.attention.whole_tiles);
    REQUIRE(result.samples.size() == 6u);  // one causal call a length, forward and backward
    const auto& f = result.attention_forward_fit.coefficients;
    const auto& b = result.attention_backward_fit.coefficients;
    const double per_pair = 4.0 * double(options.head_dim) * double(options.attention_heads);
    for (std::size_t i = 0; i < options.attention_lengths.size(); ++i) {
      const std::int64_t len = options.attention_lengths[i];
      const double pairs = ops::visible_pairs(ops::AttentionMask{.causal = true}, len, len);
      CAPTURE(result.samples[2 * i].what);
      CHECK(result.samples[2 * i].what == fmt::format("attention forward s={} causal", len));
      CHECK(result.samples[2 * i + 1].what == fmt::format("attention backward s={} causal", len));
      CHECK(result.samples[2 * i].fitted_s == doctest::Approx(f[0] + f[1] * per_pair * pairs).epsilon(1e-12));
      CHECK(result.samples[2 * i + 1].fitted_s ==
            doctest::Approx(b[0] + b[1] * 2.5 * per_pair * pairs).epsilon(1e-12));
      // The profile prices each direction as its fit: the forward's intercept and the backward's own.
      const AttentionModel& model = result.profile.attention;
      CHECK(model.forward_time(per_pair * pairs) == doctest::Approx(result.samples[2 * i].fitted_s).epsilon(1e-9));
      CHECK(model.backward_time(per_pair * pairs) ==
            doctest::Approx(result.samples[2 * i + 1].fitted_s).epsilon(1e-9));
    }
  }
}
