// tests/ops/attention_checks.hpp: what every attention test (CPU ops, CUDA kernels) needs beside the float64
// reference: the reference's mask as the ops' AttentionMask, and an lse check that allows -inf rows.
#pragma once

#include "ops/reference.hpp"
#include "support/tolerance.hpp"

#include "paradyse/ops/attention_mask.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>

namespace paradyse::testing {

inline ops::AttentionMask to_mask(const ReferenceMask& r) {
  ops::AttentionMask m;
  m.causal = r.causal;
  m.q_offset = r.q_offset;
  m.kv_offset = r.kv_offset;
  m.document_starts = r.document_starts;
  m.scale = float(r.scale);
  return m;
}

// lse may be -inf (a query without keys): require -inf exactly where the reference has it, compare the rest.
inline void check_lse(const Vec& got, const Vec& want, Tolerance tol = kFloat32) {
  REQUIRE(got.size() == want.size());
  Vec g = got, w = want;
  for (std::size_t i = 0; i < w.size(); ++i) {
    if (std::isinf(w[i]) && w[i] < 0) {
      CHECK_MESSAGE((std::isinf(g[i]) && g[i] < 0), "lse element ", i, " is ", g[i], ", want -inf");
      g[i] = w[i] = 0.0;
    }
  }
  CHECK_CLOSE(g, w, tol);
}

}  // namespace paradyse::testing
