// tests/serve/mla_latent_attention.cpp: the attention over MLA's latent cache (serve/mla_attention.hpp
// mla_detail::latent_attention) against a float64 reference, on fresh random queries and latents, over head counts,
// cached lengths and chunk lengths; and every head of a query at once gives each head the bits it gets alone. Its
// calibration (serve/paged_attention_calibration.hpp calibrate_latent_attention) times every shape on every rank and
// describes each sample as the dry run's event for that chunk does.
#include "paradyse/comm/threads.hpp"
#include "paradyse/serve/mla_attention.hpp"
#include "paradyse/serve/paged_attention_calibration.hpp"

#include "support/fresh_seed.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;

namespace mla_latent_test {

// One request's latents [positions, r_kv + d_r] ([c_kv | k_pe] per position), as a cache hands them out.
struct LatentRows {
  std::vector<float> values;
  std::int64_t width = 0;
  const float* key(std::int64_t, std::int64_t, std::int64_t t, std::int64_t) const {
    return &values[std::size_t(t * width)];
  }
};

// out [len, hq, rkv] in float64: query i (position start + i) of head h scores latent t by
// (q_lat . c_kv_t + q_pe . k_pe_t) scale over t <= start + i, and sums the softmax-weighted c_kv_t.
std::vector<double> reference(const std::vector<float>& q_lat, const std::vector<float>& q_pe, const LatentRows& c,
                              std::int64_t len, std::int64_t start, std::int64_t hq, std::int64_t rkv,
                              std::int64_t dr, double scale) {
  std::vector<double> out(std::size_t(len * hq * rkv), 0.0);
  for (std::int64_t i = 0; i < len; ++i)
    for (std::int64_t h = 0; h < hq; ++h) {
      const std::int64_t visible = start + i + 1;
      std::vector<double> s(static_cast<std::size_t>(visible));
      double top = -1e300, total = 0;
      for (std::int64_t t = 0; t < visible; ++t) {
        const float* l = c.key(0, 0, t, 0);
        double dot = 0;
        for (std::int64_t r = 0; r < rkv; ++r) dot += double(q_lat[std::size_t((i * hq + h) * rkv + r)]) * l[r];
        for (std::int64_t e = 0; e < dr; ++e) dot += double(q_pe[std::size_t((i * hq + h) * dr + e)]) * l[rkv + e];
        s[std::size_t(t)] = dot * scale;
        top = std::max(top, s[std::size_t(t)]);
      }
      for (double& x : s) total += (x = std::exp(x - top));
      for (std::int64_t t = 0; t < visible; ++t)
        for (std::int64_t r = 0; r < rkv; ++r)
          out[std::size_t((i * hq + h) * rkv + r)] += s[std::size_t(t)] / total * c.key(0, 0, t, 0)[r];
    }
  return out;
}

std::vector<float> uniform_values(std::mt19937_64& rng, std::int64_t count) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(count));
  for (float& x : v) x = u(rng);
  return v;
}

}  // namespace mla_latent_test

TEST_CASE("MLA: the latent cache's attention matches a float64 reference, each head's bits as when it runs alone") {
  using namespace mla_latent_test;
  PARADYSE_FRESH_RNG(rng);
  const std::int64_t rkv = 24, dr = 6, latent = rkv + dr;
  const double scale = 1.0 / std::sqrt(20.0);
  for (const std::int64_t hq : {1, 3, 8})
    for (const std::int64_t start : {0, 5})
      for (const std::int64_t len : {1, 4}) {
        CAPTURE(hq);
        CAPTURE(start);
        CAPTURE(len);
        const LatentRows cache{uniform_values(rng, (start + len) * latent), latent};
        const std::vector<float> q_lat = uniform_values(rng, len * hq * rkv);
        const std::vector<float> q_pe = uniform_values(rng, len * hq * dr);
        // The chunk's rows sit after two other rows of the step's activations.
        const std::int64_t first = 2, rows = first + len;
        Tensor<float> ql(Shape{rows, hq, rkv}), qp(Shape{rows, hq, dr}), out(Shape{rows, hq, rkv});
        for (std::int64_t i = 0; i < len; ++i)
          for (std::int64_t h = 0; h < hq; ++h) {
            const std::size_t at = std::size_t(i * hq + h);
            for (std::int64_t r = 0; r < rkv; ++r) ql.view()(first + i, h, r) = q_lat[at * rkv + std::size_t(r)];
            for (std::int64_t e = 0; e < dr; ++e) qp.view()(first + i, h, e) = q_pe[at * dr + std::size_t(e)];
          }
        const AttentionChunk chunk{.request = 0, .first = first, .length = len};
        mla_detail::LatentScratch scratch;
        mla_detail::latent_attention(cache, 0, chunk, start, scale, ql.view(), qp.view(), out.view(), scratch);
        const std::vector<double> want = reference(q_lat, q_pe, cache, len, start, hq, rkv, dr, scale);
        for (std::int64_t i = 0; i < len; ++i)
          for (std::int64_t h = 0; h < hq; ++h)
            for (std::int64_t r = 0; r < rkv; ++r) {
              const double x = want[std::size_t((i * hq + h) * rkv + r)];
              CHECK(double(out.view()(first + i, h, r)) == doctest::Approx(x).epsilon(1e-6).scale(0));
            }
        // Each head alone (its own query slices, one head wide) gives the same bits.
        for (std::int64_t h = 0; h < hq; ++h) {
          Tensor<float> one_l(Shape{rows, 1, rkv}), one_p(Shape{rows, 1, dr}), one_out(Shape{rows, 1, rkv});
          for (std::int64_t i = first; i < rows; ++i) {
            for (std::int64_t r = 0; r < rkv; ++r) one_l.view()(i, 0, r) = ql.view()(i, h, r);
            for (std::int64_t e = 0; e < dr; ++e) one_p.view()(i, 0, e) = qp.view()(i, h, e);
          }
          mla_detail::latent_attention(cache, 0, chunk, start, scale, one_l.view(), one_p.view(), one_out.view(),
                                       scratch);
          for (std::int64_t i = first; i < rows; ++i)
            for (std::int64_t r = 0; r < rkv; ++r) CHECK(one_out.view()(i, 0, r) == out.view()(i, h, r));
        }
      }
}

TEST_CASE("MLA: the latent loop's calibration times each shape on every rank, its samples as the dry run's events") {
  PARADYSE_FRESH_RNG(rng);
  std::uniform_int_distribution<std::int64_t> rank_of(4, 40), heads_of(1, 6), rope_of(1, 5);
  LatentAttentionCalibrationOptions o;
  o.repetitions = 1;
  o.ranks = {rank_of(rng), rank_of(rng)};
  o.heads = {heads_of(rng), heads_of(rng) + 6};
  o.rope = 2 * rope_of(rng);
  o.chunks = {{6, 0}, {1, 30}, {3, 11}};
  for (const int p : {1, 2, 3}) {
    CAPTURE(p);
    std::vector<LatentAttentionCalibration> got(static_cast<std::size_t>(p));
    run_ranks(p, [&](ThreadCommunicator& comm) {
      got[std::size_t(comm.rank())] = calibrate_latent_attention(comm, o);
    });
    const std::vector<cost::LatentAttentionSample>& samples = got[0].samples;
    REQUIRE(samples.size() == o.ranks.size() * o.heads.size() * o.chunks.size());
    std::size_t i = 0;
    for (const std::int64_t rkv : o.ranks)
      for (const std::int64_t hq : o.heads)
        for (const auto& [tokens, cached] : o.chunks) {
          const TraceEvent e = mla_detail::latent_attention_event(chunk_pairs(tokens, cached), hq, rkv, o.rope);
          CHECK(samples[i].pairs == e.m);
          CHECK(samples[i].heads == double(hq));
          CHECK(samples[i].width == double(rkv + o.rope / 2));
          CHECK(e.k == double(rkv + o.rope / 2));
          CHECK(samples[i].seconds > 0);
          ++i;
        }
    for (const LatentAttentionCalibration& rank : got) {  // the slowest rank's time, the same fit on every rank
      CHECK(rank.model == got[0].model);
      for (std::size_t j = 0; j < samples.size(); ++j) CHECK(rank.samples[j].seconds == samples[j].seconds);
    }
    CHECK(got[0].model.calibrated());
  }
  LatentAttentionCalibrationOptions none = o, zero = o;
  none.heads.clear();
  zero.ranks = {0, 512};
  run_ranks(1, [&](ThreadCommunicator& comm) {
    CHECK_THROWS_WITH_AS(calibrate_latent_attention(comm, none), doctest::Contains("0 head counts"), Error);
    CHECK_THROWS_WITH_AS(calibrate_latent_attention(comm, zero), doctest::Contains("all positive"), Error);
  });
}
