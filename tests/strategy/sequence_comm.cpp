// The sequence collectives on thread ranks: gather in both token orders, reduce-scatter back, and the Ulysses
// all-to-alls between sequence and head sharding, for uneven lengths, zigzag and b = 2. Values encode (batch,
// position, column), so every element's destination is checked.
#include "paradyse/strategy/sequence_comm.hpp"

#include "paradyse/comm/threads.hpp"
#include "strategy/harness.hpp"

#include <doctest/doctest.h>

using namespace paradyse;
using namespace paradyse::testing;

namespace {
float code(std::int64_t b, std::int64_t position, std::int64_t column) { return float(b * 100000 + position * 100 + column); }
}  // namespace

TEST_CASE("sequence_comm: gather, reduce-scatter and the Ulysses all-to-alls") {
  for (int p : {1, 2, 3, 4})
    for (bool zigzag : {false, true})
      for (std::int64_t batch : {1, 2}) {
        const std::int64_t s = 4 * p + 3, width = 5;
        LayerConfig c = small_config(2 * p, 2 * p, 4 * p);
        c.zigzag = zigzag;
        Findings findings;
        run_ranks(p, [&](ThreadCommunicator& comm) {
          const int r = comm.rank();
          BufferPool pool;
          const SublayerContext ctx(c, p, batch, s, pool);
          const std::int64_t n = ctx.local_tokens(r);
          Tensor<float> local(Shape{batch, n, width});
          for (std::int64_t b = 0; b < batch; ++b)
            for (std::int64_t t = 0; t < n; ++t)
              for (std::int64_t k = 0; k < width; ++k) local(b, t, k) = code(b, ctx.sequence.position(r, t), k);
          // natural gather: element (b, position, k) at [b, position, k]
          Tensor<float> full(Shape{batch * s, width}), want(Shape{batch * s, width});
          for (std::int64_t b = 0; b < batch; ++b)
            for (std::int64_t t = 0; t < s; ++t)
              for (std::int64_t k = 0; k < width; ++k) want(b * s + t, k) = code(b, t, k);
          gather_sequence(comm, ctx, local.view(), full.view(), TokenOrder::natural);
          findings.compare(full.span(), std::span<const float>(want.span()), fmt::format("rank {} natural gather", r), kFloat64);
          // rank-major gather then reduce-scatter: every rank contributes the same full tensor, so each gets p x its own
          Tensor<float> rank_major(Shape{batch * s, width});
          gather_sequence(comm, ctx, local.view(), rank_major.view(), TokenOrder::rank_major);
          Tensor<float> back(local.shape());
          reduce_scatter_sequence(comm, ctx, rank_major.view(), TokenOrder::rank_major, back.view());
          std::vector<float> times_p(local.span().begin(), local.span().end());
          for (float& v : times_p) v *= float(p);
          findings.compare(back.span(), times_p, fmt::format("rank {} rank-major round trip", r), kFloat64);
          reduce_scatter_sequence(comm, ctx, full.view(), TokenOrder::natural, back.view());
          findings.compare(back.span(), times_p, fmt::format("rank {} natural round trip", r), kFloat64);
          // Ulysses: chunk j of the send buffer = this rank's tokens for head group j (column offset 1000 j)
          Tensor<float> send(Shape{p * batch * n, width});
          for (int j = 0; j < p; ++j)
            for (std::int64_t i = 0; i < batch * n; ++i)
              for (std::int64_t k = 0; k < width; ++k)
                send(j * batch * n + i, k) = local.span()[std::size_t(i * width + k)] + float(1000 * j);
          Tensor<float> heads(Shape{batch, s, width});
          sequence_to_heads(comm, ctx, send.view(), width, heads.view());
          std::vector<float> mine(want.span().begin(), want.span().end());
          for (float& v : mine) v += float(1000 * r);
          findings.compare(heads.span(), mine, fmt::format("rank {} sequence_to_heads", r), kFloat64);
          Tensor<float> recv(send.shape());
          heads_to_sequence(comm, ctx, heads.view(), width, recv.view());
          findings.compare(recv.span(), std::span<const float>(send.span()), fmt::format("rank {} heads_to_sequence", r), kFloat64);
        });
        findings.check_all(fmt::format("p={} zigzag={} b={}", p, zigzag, batch));
      }
}
