// paradyse/ops/cpu/embedding.hpp: token embedding lookup, forward and backward.
//
// Tokens are int32 ids in [0, vocab). Backward scatters the output gradient into the table's rows in token order
// (deterministic), accumulating (+=) like every ops::cpu backward.
#pragma once

#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/cpu/rows.hpp"

#include <algorithm>
#include <cstdint>

namespace paradyse::ops::cpu {

namespace detail {
// The shapes only (tokens may live in device memory: ops::cuda checks their range on the device).
inline void check_embedding_shapes(const char* op, const TensorView<const std::int32_t>& tokens,
                                   const TensorView<const float>& table, const TensorView<const float>& rows_view) {
  check(tokens.is_contiguous(), "{}: tokens must be contiguous; shape {} has strides {}", op, tokens.shape(),
        tokens.strides());
  check(table.rank() == 2, "{}: the table must be [vocab, h]; got {}", op, table.shape());
  check_rows(op, "table", table);
  check_rows(op, "out", rows_view);
  check(rows_view.rank() == tokens.rank() + 1, "{}: out must be tokens' shape {} plus [h]; got {}", op, tokens.shape(),
        rows_view.shape());
  for (int d = 0; d < tokens.rank(); ++d)
    check(rows_view.extent(d) == tokens.extent(d), "{}: out {} does not match tokens {}", op, rows_view.shape(),
          tokens.shape());
  check(rows_view.extent(-1) == table.extent(1), "{}: out has width {}, the table has h = {}", op,
        rows_view.extent(-1), table.extent(1));
}

inline void check_embedding(const char* op, const TensorView<const std::int32_t>& tokens,
                            const TensorView<const float>& table, const TensorView<const float>& rows_view) {
  check_embedding_shapes(op, tokens, table, rows_view);
  const std::int64_t vocab = table.extent(0);
  for (std::int64_t i = 0; i < tokens.numel(); ++i) {
    const std::int32_t t = tokens.data()[i];
    check(t >= 0 && t < vocab, "{}: token {} at index {} is outside the vocabulary [0, {})", op, t, i, vocab);
  }
}
}  // namespace detail

// tokens: [...] int32; table: [vocab, h]; out: [..., h] (overwritten). out[i] = table[tokens[i]].
inline void embedding_forward(TensorView<const std::int32_t> tokens, TensorView<const float> table,
                              TensorView<float> out) {
  detail::check_embedding("embedding_forward", tokens, table, out);
  const std::int64_t h = table.extent(1);
  const std::int64_t ld = table.extent(0) <= 1 ? h : table.strides()[0];
  for (std::int64_t i = 0; i < tokens.numel(); ++i) {
    const float* row = table.data() + std::int64_t(tokens.data()[i]) * ld;
    std::copy(row, row + h, detail::row_pointer(out, i));
  }
}

// tokens: [...]; dout: [..., h]; dtable: [vocab, h]. dtable[tokens[i]] += dout[i].
inline void embedding_backward(TensorView<const std::int32_t> tokens, TensorView<const float> dout,
                               TensorView<float> dtable) {
  detail::check_embedding("embedding_backward", tokens, dtable, dout);
  const std::int64_t h = dtable.extent(1);
  const std::int64_t ld = dtable.extent(0) <= 1 ? h : dtable.strides()[0];
  for (std::int64_t i = 0; i < tokens.numel(); ++i) {
    float* row = dtable.data() + std::int64_t(tokens.data()[i]) * ld;
    const float* g = detail::row_pointer(dout, i);
    for (std::int64_t c = 0; c < h; ++c) row[c] += g[c];
  }
}

}  // namespace paradyse::ops::cpu
