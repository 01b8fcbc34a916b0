// paradyse/strategy/sequence_comm.hpp: the collectives that move activations between the unified layout
// (rank r holds its tokens [b, n_r, C]) and the layouts strategies compute in:
//   - the full sequence on every rank (Megatron's sequence-parallel all-gather / reduce-scatter), in natural token
//     order [b, s, C] (what attention needs) or rank-major [rank][b][n_r][C] (enough for token-wise work);
//   - the full sequence for one rank's head group (Ulysses's all-to-all), natural order.
// Uneven token counts (s % p != 0, zigzag) use the _v collectives; the natural-order permutation is a local copy,
// skipped when b == 1 and the layout is contiguous (then the two orders coincide).
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/buffer_pool.hpp"
#include "paradyse/strategy/policy.hpp"
#include "paradyse/strategy/sequence_layout.hpp"

#include <cstdint>
#include <vector>

namespace paradyse {

enum class TokenOrder : bool { rank_major, natural };

namespace sequence_comm_detail {
inline void check_rows(const char* who, const char* what, const Shape& got, std::int64_t rows, std::int64_t width) {
  check(got.numel() == rows * width, "{}: {} has shape {} ({} elements), expected {} rows of {}", who, what, got,
        got.numel(), rows, width);
}
}  // namespace sequence_comm_detail

// full: [b*s, C] (in `order`) <- every rank's local: [b, n_r, C]. All-gather.
template <class Backend = ops::Cpu, Communicator Comm>
void gather_sequence(Comm& comm, const SublayerContext& ctx, TensorView<const float> local, TensorView<float> full,
                     TokenOrder order) {
  const std::int64_t width = local.numel() / std::max<std::int64_t>(ctx.local_rows(comm.rank()), 1);
  sequence_comm_detail::check_rows("gather_sequence", "local", local.shape(), ctx.local_rows(comm.rank()), width);
  sequence_comm_detail::check_rows("gather_sequence", "full", full.shape(), ctx.global_rows(), width);
  const std::vector<std::int64_t> counts = ctx.sequence.counts(ctx.batch * width);
  if (order == TokenOrder::rank_major || ctx.sequence.natural_is_rank_major(ctx.batch)) {
    comm.all_gather_v(local.span(), full.span(), std::span<const std::int64_t>(counts));
    return;
  }
  PooledBuffer<float> staged = ctx.pool->acquire<float>(Shape{ctx.global_rows(), width});
  comm.all_gather_v(local.span(), staged.span(), std::span<const std::int64_t>(counts));
  rank_major_to_natural<Backend>(ctx.sequence, ctx.batch, width, staged.data(), full.data());
}

// local: [b, n_r, C] <- the sum over ranks of full: [b*s, C] (in `order`), rank r's tokens. Reduce-scatter.
template <class Backend = ops::Cpu, Communicator Comm>
void reduce_scatter_sequence(Comm& comm, const SublayerContext& ctx, TensorView<const float> full, TokenOrder order,
                             TensorView<float> local) {
  const std::int64_t width = local.numel() / std::max<std::int64_t>(ctx.local_rows(comm.rank()), 1);
  sequence_comm_detail::check_rows("reduce_scatter_sequence", "local", local.shape(), ctx.local_rows(comm.rank()), width);
  sequence_comm_detail::check_rows("reduce_scatter_sequence", "full", full.shape(), ctx.global_rows(), width);
  const std::vector<std::int64_t> counts = ctx.sequence.counts(ctx.batch * width);
  if (order == TokenOrder::rank_major || ctx.sequence.natural_is_rank_major(ctx.batch)) {
    comm.reduce_scatter_v(full.span(), local.span(), std::span<const std::int64_t>(counts), ReduceOp::sum);
    return;
  }
  PooledBuffer<float> staged = ctx.pool->acquire<float>(Shape{ctx.global_rows(), width});
  natural_to_rank_major<Backend>(ctx.sequence, ctx.batch, width, full.data(), staged.data());
  comm.reduce_scatter_v(read_span(staged), local.span(), std::span<const std::int64_t>(counts), ReduceOp::sum);
}

// Ulysses, sequence -> heads. send: [p][b*n_r, W], chunk j holding this rank's tokens of rank j's head group;
// natural: [b, s, W], every token of this rank's head group. All-to-all.
template <class Backend = ops::Cpu, Communicator Comm>
void sequence_to_heads(Comm& comm, const SublayerContext& ctx, TensorView<const float> send, std::int64_t width,
                       TensorView<float> natural) {
  const int p = ctx.ranks(), r = comm.rank();
  sequence_comm_detail::check_rows("sequence_to_heads", "send", send.shape(), p * ctx.local_rows(r), width);
  sequence_comm_detail::check_rows("sequence_to_heads", "natural", natural.shape(), ctx.global_rows(), width);
  const std::vector<std::int64_t> send_counts(std::size_t(p), ctx.local_rows(r) * width);
  const std::vector<std::int64_t> recv_counts = ctx.sequence.counts(ctx.batch * width);
  if (ctx.sequence.natural_is_rank_major(ctx.batch)) {
    comm.all_to_all_v(send.span(), std::span<const std::int64_t>(send_counts), natural.span(),
                      std::span<const std::int64_t>(recv_counts));
    return;
  }
  PooledBuffer<float> staged = ctx.pool->acquire<float>(Shape{ctx.global_rows(), width});
  comm.all_to_all_v(send.span(), std::span<const std::int64_t>(send_counts), staged.span(),
                    std::span<const std::int64_t>(recv_counts));
  rank_major_to_natural<Backend>(ctx.sequence, ctx.batch, width, staged.data(), natural.data());
}

// Ulysses, heads -> sequence: the inverse. natural: [b, s, W] of this rank's head group; recv: [p][b*n_r, W], chunk
// j holding rank j's head group for this rank's tokens.
template <class Backend = ops::Cpu, Communicator Comm>
void heads_to_sequence(Comm& comm, const SublayerContext& ctx, TensorView<const float> natural, std::int64_t width,
                       TensorView<float> recv) {
  const int p = ctx.ranks(), r = comm.rank();
  sequence_comm_detail::check_rows("heads_to_sequence", "natural", natural.shape(), ctx.global_rows(), width);
  sequence_comm_detail::check_rows("heads_to_sequence", "recv", recv.shape(), p * ctx.local_rows(r), width);
  const std::vector<std::int64_t> send_counts = ctx.sequence.counts(ctx.batch * width);
  const std::vector<std::int64_t> recv_counts(std::size_t(p), ctx.local_rows(r) * width);
  if (ctx.sequence.natural_is_rank_major(ctx.batch)) {
    comm.all_to_all_v(natural.span(), std::span<const std::int64_t>(send_counts), recv.span(),
                      std::span<const std::int64_t>(recv_counts));
    return;
  }
  PooledBuffer<float> staged = ctx.pool->acquire<float>(Shape{ctx.global_rows(), width});
  natural_to_rank_major<Backend>(ctx.sequence, ctx.batch, width, natural.data(), staged.data());
  comm.all_to_all_v(read_span(staged), std::span<const std::int64_t>(send_counts), recv.span(),
                    std::span<const std::int64_t>(recv_counts));
}

}  // namespace paradyse
