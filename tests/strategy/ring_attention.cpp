// tests/strategy/ring_attention.cpp: ring attention on thread ranks against a plain float64 full-attention reference.
#include "paradyse/strategy/ring_attention.hpp"

#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "support/tolerance.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using namespace paradyse;
using paradyse::testing::kFloat32;

struct Case {
  int ranks = 1;
  std::int64_t batch = 1, length = 8, q_heads = 2, kv_heads = 2, head_dim = 8;
  bool causal = false, zigzag = false;
  std::vector<std::int64_t> document_starts = {};
};

// Row-major [b, s, heads, d] index.
struct Index4 {
  std::int64_t s, heads, d;
  std::int64_t operator()(std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t c) const {
    return ((b * s + t) * heads + h) * d + c;
  }
};

struct Reference {
  std::vector<double> out, lse, dq, dk, dv;  // out, dq: [b, s, hq, d]; lse: [b, hq, s]; dk, dv: [b, s, hkv, d]
};

std::int64_t document_of(const std::vector<std::int64_t>& starts, std::int64_t position) {
  std::int64_t doc = 0;
  for (std::size_t i = 0; i < starts.size(); ++i)
    if (starts[i] <= position) doc = std::int64_t(i);
  return doc;
}

bool visible(const Case& c, std::int64_t query, std::int64_t key) {
  if (c.causal && key > query) return false;
  return c.document_starts.empty() || document_of(c.document_starts, query) == document_of(c.document_starts, key);
}

// Full softmax attention over the whole sequence, then its gradients, in float64, one query row at a time.
Reference reference_attention(const Case& c, const std::vector<double>& q, const std::vector<double>& k,
                              const std::vector<double>& v, const std::vector<double>& dout) {
  const std::int64_t b_n = c.batch, s = c.length, hq = c.q_heads, hkv = c.kv_heads, d = c.head_dim;
  const Index4 qi{s, hq, d}, ki{s, hkv, d};
  const double scale = 1.0 / std::sqrt(double(d));
  Reference r;
  r.out.assign(std::size_t(b_n * s * hq * d), 0.0);
  r.dq.assign(r.out.size(), 0.0);
  r.lse.assign(std::size_t(b_n * hq * s), -std::numeric_limits<double>::infinity());
  r.dk.assign(std::size_t(b_n * s * hkv * d), 0.0);
  r.dv.assign(r.dk.size(), 0.0);
  std::vector<double> score(static_cast<std::size_t>(s)), prob(score), dprob(score);
  for (std::int64_t b = 0; b < b_n; ++b)
    for (std::int64_t h = 0; h < hq; ++h) {
      const std::int64_t g = h / (hq / hkv);
      for (std::int64_t i = 0; i < s; ++i) {
        double top = -std::numeric_limits<double>::infinity();
        for (std::int64_t j = 0; j < s; ++j) {
          double dot = 0.0;
          for (std::int64_t x = 0; x < d; ++x) dot += q[qi(b, i, h, x)] * k[ki(b, j, g, x)];
          score[j] = scale * dot;
          if (visible(c, i, j)) top = std::max(top, score[j]);
        }
        double sum = 0.0;
        for (std::int64_t j = 0; j < s; ++j) sum += visible(c, i, j) ? std::exp(score[j] - top) : 0.0;
        const double lse = top + std::log(sum);
        r.lse[std::size_t((b * hq + h) * s + i)] = lse;
        for (std::int64_t j = 0; j < s; ++j) prob[j] = visible(c, i, j) ? std::exp(score[j] - lse) : 0.0;
        for (std::int64_t x = 0; x < d; ++x) {
          double o = 0.0;
          for (std::int64_t j = 0; j < s; ++j) o += prob[j] * v[ki(b, j, g, x)];
          r.out[qi(b, i, h, x)] = o;
        }
        // dP_j = dout . v_j; dS_j = P_j (dP_j - sum_l P_l dP_l); dq = scale sum dS_j k_j; dk_j += scale dS_j q.
        double delta = 0.0;
        for (std::int64_t j = 0; j < s; ++j) {
          double dot = 0.0;
          for (std::int64_t x = 0; x < d; ++x) dot += dout[qi(b, i, h, x)] * v[ki(b, j, g, x)];
          dprob[j] = dot;
          delta += prob[j] * dot;
        }
        for (std::int64_t j = 0; j < s; ++j) {
          const double ds = prob[j] * (dprob[j] - delta);
          for (std::int64_t x = 0; x < d; ++x) {
            r.dq[qi(b, i, h, x)] += scale * ds * k[ki(b, j, g, x)];
            r.dk[ki(b, j, g, x)] += scale * ds * q[qi(b, i, h, x)];
            r.dv[ki(b, j, g, x)] += prob[j] * dout[qi(b, i, h, x)];
          }
        }
      }
    }
  return r;
}

std::vector<double> random_values(std::size_t count, Rng& rng) {
  std::vector<double> x(count);
  for (double& e : x) e = double(float(rng.uniform(-1.0, 1.0)));  // exactly representable in float
  return x;
}

// What one run measured besides the tensors.
struct RunResult {
  Reference got;
  std::vector<std::size_t> peak_bytes;
};

constexpr float kGradientSeed = 0.5f;  // dq, dk, dv start here: the backward must add, not overwrite

RunResult run_ring(const Case& c, const std::vector<double>& q, const std::vector<double>& k,
                   const std::vector<double>& v, const std::vector<double>& dout) {
  const std::int64_t b_n = c.batch, s = c.length, hq = c.q_heads, hkv = c.kv_heads, d = c.head_dim;
  const Index4 qi{s, hq, d}, ki{s, hkv, d};
  RunResult result;
  Reference& got = result.got;
  got.out.assign(q.size(), 0.0);
  got.dq.assign(q.size(), 0.0);
  got.lse.assign(std::size_t(b_n * hq * s), 0.0);
  got.dk.assign(k.size(), 0.0);
  got.dv.assign(k.size(), 0.0);
  const SequenceLayout layout(s, c.ranks, c.zigzag);
  const RunReport report = run_ranks(c.ranks, [&](ThreadCommunicator& comm) {
    const int rank = comm.rank();
    const std::int64_t n = layout.local_length(rank);
    // q, k, v as slices of one packed [b, n, hq + 2 hkv, d] tensor: strided views, as a strategy passes them.
    Tensor<float> qkv(Shape{b_n, n, hq + 2 * hkv, d});
    Tensor<float> dout_local(Shape{b_n, n, hq, d});
    for (std::int64_t b = 0; b < b_n; ++b)
      for (std::int64_t t = 0; t < n; ++t) {
        const std::int64_t pos = layout.position(rank, t);
        for (std::int64_t x = 0; x < d; ++x) {
          for (std::int64_t h = 0; h < hq; ++h) {
            qkv(b, t, h, x) = float(q[qi(b, pos, h, x)]);
            dout_local(b, t, h, x) = float(dout[qi(b, pos, h, x)]);
          }
          for (std::int64_t h = 0; h < hkv; ++h) {
            qkv(b, t, hq + h, x) = float(k[ki(b, pos, h, x)]);
            qkv(b, t, hq + hkv + h, x) = float(v[ki(b, pos, h, x)]);
          }
        }
      }
    const TensorView<const float> all = qkv.view();
    const auto q_local = all.slice(2, 0, hq), k_local = all.slice(2, hq, hkv), v_local = all.slice(2, hq + hkv, hkv);
    const RingAttentionSpec spec{layout, c.causal, 0.0f, c.document_starts};
    BufferPool pool;
    const CommStats before = comm.stats();
    RingAttentionOutput fwd = ring_attention_forward(comm, spec, pool, q_local, k_local, v_local);
    Tensor<float> dq(Shape{b_n, n, hq, d}), dk(Shape{b_n, n, hkv, d}), dv(Shape{b_n, n, hkv, d});
    dq.fill(kGradientSeed);
    dk.fill(kGradientSeed);
    dv.fill(kGradientSeed);
    ring_attention_backward(comm, spec, pool, q_local, k_local, v_local, fwd.out.view(), fwd.lse.view(),
                            dout_local.view(), dq.view(), dk.view(), dv.view());
    // Volume: forward sends every block but the next rank's once (p - 1 hops), backward sends them again and
    // every dK/dV sum once more (p hops).
    const CommStats after = comm.stats();
    const std::int64_t next_tokens = layout.local_length((rank + 1) % c.ranks);
    const std::uint64_t per_token = std::uint64_t(2 * b_n * hkv * d) * sizeof(float);
    const std::uint64_t want = c.ranks == 1 ? 0 : per_token * std::uint64_t(2 * (s - next_tokens) + s);
    CHECK(after.bytes_sent - before.bytes_sent == want);
    for (std::int64_t b = 0; b < b_n; ++b)
      for (std::int64_t t = 0; t < n; ++t) {
        const std::int64_t pos = layout.position(rank, t);
        for (std::int64_t x = 0; x < d; ++x) {
          for (std::int64_t h = 0; h < hq; ++h) {
            got.out[qi(b, pos, h, x)] = fwd.out(b, t, h, x);
            got.dq[qi(b, pos, h, x)] = double(dq(b, t, h, x)) - kGradientSeed;
          }
          for (std::int64_t h = 0; h < hkv; ++h) {
            got.dk[ki(b, pos, h, x)] = double(dk(b, t, h, x)) - kGradientSeed;
            got.dv[ki(b, pos, h, x)] = double(dv(b, t, h, x)) - kGradientSeed;
          }
        }
        for (std::int64_t h = 0; h < hq; ++h) got.lse[std::size_t((b * hq + h) * s + pos)] = fwd.lse(b, h, t);
      }
  });
  result.peak_bytes = report.peak_bytes;
  return result;
}

void check_case(const Case& c, std::uint64_t seed) {
  CAPTURE(c.ranks);
  CAPTURE(c.length);
  CAPTURE(c.q_heads);
  CAPTURE(c.kv_heads);
  CAPTURE(c.causal);
  CAPTURE(c.zigzag);
  CAPTURE(c.document_starts.size());
  Rng rng(seed);
  const std::size_t q_count = std::size_t(c.batch * c.length * c.q_heads * c.head_dim);
  const std::size_t kv_count = std::size_t(c.batch * c.length * c.kv_heads * c.head_dim);
  const auto q = random_values(q_count, rng), k = random_values(kv_count, rng), v = random_values(kv_count, rng);
  const auto dout = random_values(q_count, rng);
  const Reference want = reference_attention(c, q, k, v, dout);
  const RunResult run = run_ring(c, q, k, v, dout);
  CHECK_CLOSE(run.got.out, want.out, kFloat32);
  CHECK_CLOSE(run.got.lse, want.lse, kFloat32);
  CHECK_CLOSE(run.got.dq, want.dq, kFloat32);
  CHECK_CLOSE(run.got.dk, want.dk, kFloat32);
  CHECK_CLOSE(run.got.dv, want.dv, kFloat32);
}

}  // namespace

TEST_CASE("ring attention matches full attention: p = 1..4, causal or not, contiguous or zigzag, MHA and GQA") {
  std::uint64_t seed = 100;
  for (int p : {1, 2, 3, 4})
    for (std::int64_t kv_heads : {4, 2, 1})
      for (bool causal : {false, true})
        for (bool zigzag : {false, true}) {
          Case c;
          c.ranks = p;
          c.batch = 2;
          c.length = 23;  // uneven over every p > 1, and over the 2p zigzag chunks
          c.q_heads = 4;
          c.kv_heads = kv_heads;
          c.head_dim = 8;
          c.causal = causal;
          c.zigzag = zigzag;
          check_case(c, ++seed);
        }
}

TEST_CASE("ring attention on 8 ranks (tiny shapes, uneven)") {
  for (bool causal : {false, true})
    for (bool zigzag : {false, true}) {
      Case c;
      c.ranks = 8;
      c.length = 19;
      c.q_heads = 2;
      c.kv_heads = 1;
      c.head_dim = 4;
      c.causal = causal;
      c.zigzag = zigzag;
      check_case(c, 7 + std::uint64_t(causal) * 2 + std::uint64_t(zigzag));
    }
}

TEST_CASE("ring attention over packed documents (varlen): blocks of other documents are skipped") {
  for (bool causal : {false, true})
    for (bool zigzag : {false, true}) {
      Case c;
      c.ranks = 3;
      c.batch = 1;
      c.length = 26;
      c.q_heads = 2;
      c.kv_heads = 2;
      c.head_dim = 8;
      c.causal = causal;
      c.zigzag = zigzag;
      c.document_starts = {0, 5, 13, 14};  // one document of a single token
      check_case(c, 40 + std::uint64_t(causal) * 2 + std::uint64_t(zigzag));
    }
}

TEST_CASE("ring attention: a longer block stresses the flash tiles (several q and kv tiles per block)") {
  Case c;
  c.ranks = 2;
  c.length = 301;
  c.q_heads = 2;
  c.kv_heads = 1;
  c.head_dim = 16;
  c.causal = true;
  c.zigzag = true;
  check_case(c, 77);
}

TEST_CASE("ring attention: per-rank memory is the local tensors plus five K/V blocks, never the whole sequence") {
  // Causal zigzag on 4 ranks. Measured above a smaller run of the same shape whose blocks already fill the kernels'
  // tiles (128 x 256), so the fixed tile scratch and the built-in GEMM's packing workspace (sized to the tile, up to
  // the full tile) cancel; what is left must be the test's own local tensors (16 units of n_r * d floats: qkv 6, dout, out, dq, dk,
  // dv 2 each) plus the ring's pooled buffers (backward: 5 blocks of 4 units, size classes add at most 1/8) plus
  // one partial output. Gathering the whole sequence's K/V and dK/dV instead would add 32 units more.
  auto peak_of = [](std::int64_t length) {
    Case c;
    c.ranks = 4;
    c.length = length;
    c.q_heads = 2;
    c.kv_heads = 2;
    c.head_dim = 8;
    c.causal = true;
    c.zigzag = true;
    Rng rng(5);
    const std::size_t count = std::size_t(c.length * c.q_heads * c.head_dim);
    const auto q = random_values(count, rng), k = random_values(count, rng), v = random_values(count, rng);
    const auto dout = random_values(count, rng);
    const RunResult run = run_ring(c, q, k, v, dout);
    return *std::max_element(run.peak_bytes.begin(), run.peak_bytes.end());
  };
  const std::size_t small = peak_of(2048), large = peak_of(4096);
  const double unit = double(4096 / 4 * 8 * sizeof(float)), small_unit = double(2048 / 4 * 8 * sizeof(float));
  const double growth_units = (double(large) - double(small)) / (unit - small_unit);
  MESSAGE("peak per rank: " << small << " bytes at s = 2048, " << large << " bytes at s = 4096 (" << growth_units
                            << " units of n_r * d floats)");
  CHECK(growth_units <= 16 + 5 * 4 * 1.125 + 1);
  CHECK(growth_units >= 16 + 5 * 4);  // the backward's five blocks are all alive at once
}

TEST_CASE("ring attention rejects a layout over the wrong group size and mismatched token counts") {
  CHECK_THROWS_AS(run_ranks(2,
                            [](ThreadCommunicator& comm) {
                              const SequenceLayout layout(8, 3, false);  // 3 ranks, the group has 2
                              Tensor<float> q(Shape{1, 4, 1, 4}), lse(Shape{1, 1, 4});
                              BufferPool pool;
                              ring_attention_forward(comm, RingAttentionSpec{layout}, pool, q.view(), q.view(), q.view(),
                                                     q.view(), lse.view());
                            }),
                  Error);
  CHECK_THROWS_AS(run_ranks(2,
                            [](ThreadCommunicator& comm) {
                              const SequenceLayout layout(9, 2, false);  // rank 0 holds 5 tokens, not 4
                              Tensor<float> q(Shape{1, 4, 1, 4}), lse(Shape{1, 1, 4});
                              BufferPool pool;
                              ring_attention_forward(comm, RingAttentionSpec{layout}, pool, q.view(), q.view(), q.view(),
                                                     q.view(), lse.view());
                            }),
                  Error);
}
