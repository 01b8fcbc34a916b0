// paradyse/strategy/zero3_linear.hpp: ZeRO-3 linear layers over the unified shards. Weights are never stored
// whole: every rank keeps its shard, and a layer borrows the others' shards for the duration of one product.
//
// Column linear (W_qkv^T, W_in^T: shards are row blocks W_j: [R, h] of W^T, i.e. column blocks of the output):
//   the shards rotate around the ring (strategy/ring_schedule.hpp's rotate_blocks), so at most two shard buffers
//   are alive and the transfer of the next overlaps the product with the current. Forward: out_j = x * W_j^T for
//   every owner j. Backward (rotate_blocks_with_sums): the shards rotate again, each with the running sum of its
//   gradient; dW_j collects every rank's dy_j^T * x as it travels and one last hop returns it to its owner (a ring
//   reduce-scatter fused with the products); dx = sum_j dy_j * W_j.
// Row linear (W_proj, W_out: shards are row blocks W_j: [R, h] of W, i.e. of the input dimension):
//   all-gather the full weight [p*R, h], y = sum_j a_j * W_j. Backward: all-gather again, da_j = dy * W_j^T, the
//   full partial dW (block j = a_j^T dy) is reduce-scattered to the owners.
// Blocks are given by callbacks owner -> view, so a caller can place them anywhere: contiguous column blocks of
// one matrix, or the chunks of an all-to-all buffer (Ulysses). Activation rows m are any token count.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/buffer_pool.hpp"
#include "paradyse/strategy/policy.hpp"
#include "paradyse/strategy/ring_schedule.hpp"

#include <cstdint>
#include <span>

namespace paradyse {


// out_block(j): [m, R] (overwritten) = x: [m, h] * W_j^T for every owner j; shard: this rank's W_r: [R, h].
template <class Backend, Communicator Comm, class BlockOut>
void ring_column_linear_forward(Comm& comm, BufferPool& pool, TensorView<const float> x, TensorView<const float> shard,
                                BlockOut&& out_block) {
  const std::int64_t rows = shard.extent(0), h = shard.extent(1);
  check(x.rank() == 2 && x.extent(1) == h, "ring_column_linear_forward: x {} must be [m, h = {}]", x.shape(), h);
  rotate_blocks(
      comm, pool, [&](int) { return rows * h; }, [&](std::span<float> own) { Backend::copy(shard.span(), own); },
      [&](int owner, std::span<const float> block) {
        const TensorView<const float> w(block.data(), Shape{rows, h});
        Backend::matmul(x, ops::Transpose::no, w, ops::Transpose::yes, out_block(owner));
      });
}

// dx: [m, h] (overwritten) = sum_j dy_block(j) * W_j; grad_shard: [R, h] += sum over ranks of dy_block(j)^T * x
// for j = this rank. dy_block(j): [m, R].
template <class Backend, Communicator Comm, class BlockGrad>
void ring_column_linear_backward(Comm& comm, BufferPool& pool, TensorView<const float> x, TensorView<const float> shard,
                                 BlockGrad&& dy_block, TensorView<float> dx, TensorView<float> grad_shard) {
  const std::int64_t rows = shard.extent(0), h = shard.extent(1);
  check(x.rank() == 2 && x.extent(1) == h && dx.shape() == x.shape(),
        "ring_column_linear_backward: x {} and dx {} must be [m, h = {}]", x.shape(), dx.shape(), h);
  check(grad_shard.shape() == shard.shape(), "ring_column_linear_backward: grad {} must match the shard {}",
        grad_shard.shape(), shard.shape());
  bool first = true;
  rotate_blocks_with_sums<Backend>(
      comm, pool, [&](int) { return rows * h; }, [&](int) { return rows * h; },
      [&](std::span<float> own) { Backend::copy(shard.span(), own); },
      [&](int owner, std::span<const float> block, std::span<float> sum) {
        const TensorView<const float> w(block.data(), Shape{rows, h});
        const TensorView<const float> dy = dy_block(owner);
        Backend::matmul(dy, ops::Transpose::no, w, ops::Transpose::no, dx, 1.0f, first ? 0.0f : 1.0f);
        Backend::matmul(dy, ops::Transpose::yes, x, ops::Transpose::no, TensorView<float>(sum.data(), Shape{rows, h}),
                        1.0f, 1.0f);  // sum arrives zeroed
        first = false;
      },
      [&](std::span<const float> total) { Backend::add_into(grad_shard.span(), total); });
}

// y: [m, h] (overwritten) = sum_j a_block(j) * W_j, a_block(j): [m, R]; the full W: [p*R, h] is all-gathered.
template <class Backend, Communicator Comm, class BlockIn>
void gathered_row_linear_forward(Comm& comm, BufferPool& pool, TensorView<const float> shard, BlockIn&& a_block,
                                 TensorView<float> y) {
  const std::int64_t rows = shard.extent(0), h = shard.extent(1);
  const int p = comm.size();
  PooledBuffer<float> full = pool.acquire<float>(Shape{p * rows, h});
  comm.all_gather(shard.span(), full.span());
  for (int j = 0; j < p; ++j)
    Backend::matmul(a_block(j), ops::Transpose::no, TensorView<const float>(full.view()).slice(0, j * rows, rows),
                    ops::Transpose::no, y, 1.0f, j == 0 ? 0.0f : 1.0f);
}

// da_block(j): [m, R] (overwritten) = dy * W_j^T; grad_shard: [R, h] += sum over ranks of a_block(r)^T * dy.
template <class Backend, Communicator Comm, class BlockIn, class BlockOut>
void gathered_row_linear_backward(Comm& comm, BufferPool& pool, TensorView<const float> shard, BlockIn&& a_block,
                                  TensorView<const float> dy, BlockOut&& da_block, TensorView<float> grad_shard) {
  const std::int64_t rows = shard.extent(0), h = shard.extent(1);
  const int p = comm.size();
  PooledBuffer<float> full = pool.acquire<float>(Shape{p * rows, h});
  comm.all_gather(shard.span(), full.span());
  PooledBuffer<float> partial = pool.acquire<float>(Shape{p * rows, h});
  for (int j = 0; j < p; ++j) {
    const TensorView<const float> w = TensorView<const float>(full.view()).slice(0, j * rows, rows);
    Backend::matmul(dy, ops::Transpose::no, w, ops::Transpose::yes, da_block(j));
    Backend::matmul(a_block(j), ops::Transpose::yes, dy, ops::Transpose::no, partial.view().slice(0, j * rows, rows));
  }
  full = PooledBuffer<float>();  // free the gathered weight before the reduce-scatter's buffer
  PooledBuffer<float> mine = pool.acquire<float>(Shape{rows, h});
  comm.reduce_scatter(read_span(partial), mine.span(), ReduceOp::sum);
  Backend::add_into(grad_shard.span(), read_span(mine));
}

}  // namespace paradyse
