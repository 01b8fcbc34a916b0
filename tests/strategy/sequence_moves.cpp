// The moves strategies make between the unified layout and the layouts they compute in, through layout/'s engine
// (reshard_into over the group, staging in the call's pool), on thread ranks: the sequence all-gather, the
// reduce-scatter of partial sums, and Ulysses's all-to-alls between sequence and head sharding, for uneven lengths,
// zigzag and b = 2. Values encode (batch, position, column), so every element's destination is checked.
#include "paradyse/layout/reshard.hpp"
#include "paradyse/strategy/policy.hpp"

#include "paradyse/comm/threads.hpp"
#include "strategy/harness.hpp"

#include <doctest/doctest.h>

using namespace paradyse;
using namespace paradyse::testing;

namespace {
float code(std::int64_t b, std::int64_t position, std::int64_t column) { return float(b * 100000 + position * 100 + column); }
}  // namespace

TEST_CASE("sequence moves: gather, reduce-scatter and the Ulysses all-to-alls through the reshard engine") {
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
          const TensorLayout unified = ctx.unified(width);
          reshard_into(comm, ShardedView<const float>{local.view(), unified},
                       ShardedView<float>{full.view().reshape(Shape{batch, s, width}), ctx.replicated(width)}, pool);
          findings.compare(full.span(), std::span<const float>(want.span()), fmt::format("rank {} gather", r), kFloat64);
          // reduce-scatter: every rank contributes the same full tensor, so each gets p x its own tokens
          Tensor<float> back(local.shape());
          reshard_into(comm, ShardedView<const float>{full.view().reshape(Shape{batch, s, width}), ctx.partial_sums(width)},
                       ShardedView<float>{back.view(), unified}, pool);
          std::vector<float> times_p(local.span().begin(), local.span().end());
          for (float& v : times_p) v *= float(p);
          findings.compare(back.span(), times_p, fmt::format("rank {} reduce-scatter", r), kFloat64);
          // Ulysses on [p, b, s, width]: chunk j = this rank's tokens for head group j (value offset 1000 j)
          Tensor<float> send(Shape{p, batch, n, width});
          for (int j = 0; j < p; ++j)
            for (std::int64_t i = 0; i < batch * n * width; ++i)
              send.span()[std::size_t(j * batch * n * width + i)] = local.span()[std::size_t(i)] + float(1000 * j);
          const Shape groups{p, batch, s, width};
          const TensorLayout by_tokens(groups, DynamicLayout{ctx.sequence_placement(2)});
          const TensorLayout by_heads(groups, DynamicLayout{Placement::shard(0)});
          Tensor<float> heads(Shape{1, batch, s, width});
          reshard_into(comm, ShardedView<const float>{send.view(), by_tokens}, ShardedView<float>{heads.view(), by_heads}, pool);
          std::vector<float> mine(want.span().begin(), want.span().end());
          for (float& v : mine) v += float(1000 * r);
          findings.compare(heads.span(), mine, fmt::format("rank {} sequence -> heads", r), kFloat64);
          Tensor<float> recv(send.shape());
          reshard_into(comm, ShardedView<const float>{heads.view(), by_heads}, ShardedView<float>{recv.view(), by_tokens}, pool);
          findings.compare(recv.span(), std::span<const float>(send.span()), fmt::format("rank {} heads -> sequence", r), kFloat64);
          // a shard that does not match its layout is refused with both shapes named
          if (p > 1) {
            Tensor<float> wrong(Shape{batch, n + 1, width});
            const std::string want_message = fmt::format("holds a source shard of shape {}", wrong.shape());
            try {
              reshard_into(comm, ShardedView<const float>{wrong.view(), unified},
                           ShardedView<float>{full.view().reshape(Shape{batch, s, width}), ctx.replicated(width)}, pool);
              findings.fail(fmt::format("rank {}: a wrong shard shape was accepted", r));
            } catch (const Error& e) {
              if (std::string(e.what()).find(want_message) == std::string::npos)
                findings.fail(fmt::format("rank {}: unexpected message: {}", r, e.what()));
            }
          }
        });
        findings.check_all(fmt::format("p={} zigzag={} b={}", p, zigzag, batch));
      }
}
