// ZeRO-3's prefetch schedule (model/zero3_prefetch.hpp; MeshGptStage::set_zero3_prefetch; train_gpt --zero3-prefetch).
// 1. The schedule alone, on 2 and 3 thread ranks (uneven chunks) and its own layers of known values: every gathered
//    layer holds the full tensor when its use begins, every reduced chunk the sum over the ranks; the memory
//    tracker's bytes in use at each layer's use are at most two layers' parameters with prefetch (exactly one
//    without) in the forward, and two layers' parameters and two layers' full gradients in the backward.
// 2. On the mesh, two steps on fresh random rows with prefetch on and off: the loss of each step, every gradient and
//    every updated weight bit-identical (the same collectives on the same data); and the first step's loss and
//    gradients equal the single group's within float rounding. Meshes: dp = 2; dp = 3 (uneven chunks) with
//    micro-batches; dp = 2 x pp = 2; dp = 2 x cp = 2; dp = 2 x pp = 2 with 2 interleaved chunks per stage.
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/model/mesh_optimizer.hpp"
#include "paradyse/model/mesh_stage.hpp"
#include "paradyse/model/zero3_prefetch.hpp"
#include "paradyse/strategy/strategies.hpp"
#include "mesh_harness.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace {

using namespace paradyse;
using PrefetchStage = MeshGptStage<AllStrategies<>, ThreadCommunicator>;

// ---- 1. the schedule alone -------------------------------------------------------------------------------------
struct ScheduleUse {
  std::size_t most_forward = 0, most_backward = 0;  // bytes in use above the start, at the most
  bool values_right = true;
};

// L layers of one [rows, 8] tensor each (element i of layer l: l * 1000 + i) sharded over `comm`, a forward and a
// backward pass of hooks (each layer's gradient: rank + 1 everywhere) as a stack calls them.
ScheduleUse schedule_use(ThreadCommunicator& comm, int layers, std::int64_t rows, bool prefetch) {
  std::vector<Tensor<float>> values, gradients;
  values.reserve(std::size_t(layers));
  gradients.reserve(std::size_t(layers));
  for (int l = 0; l < layers; ++l) {
    Tensor<float>& v = values.emplace_back(Shape{rows, 8});
    for (std::int64_t i = 0; i < v.numel(); ++i) v.span()[std::size_t(i)] = float(l * 1000 + i);
    gradients.emplace_back(Shape{rows, 8});
  }
  std::vector<Zero3Tensor> shards;
  shards.reserve(std::size_t(layers));
  for (int l = 0; l < layers; ++l)
    shards.emplace_back(&values[std::size_t(l)], &gradients[std::size_t(l)], 0, int(comm.size()), int(comm.rank()));
  std::vector<Zero3Schedule<ThreadCommunicator>::Layer> members;
  for (Zero3Tensor& t : shards) members.push_back({{&t, &comm, true}});
  Zero3Schedule<ThreadCommunicator> schedule(std::move(members), prefetch);
  MemoryTracker& tracker = MemoryTracker::current();
  const std::size_t start = tracker.in_use();
  ScheduleUse use;
  const auto layer_in_full = [&](int l) {
    const Tensor<float>& v = values[std::size_t(l)];
    if (v.numel() != rows * 8) return false;
    for (std::int64_t i = 0; i < v.numel(); ++i)
      if (v.span()[std::size_t(i)] != float(l * 1000 + i)) return false;
    return true;
  };
  for (int l = 0; l < layers; ++l) {
    schedule.on_layer(l, false, true);
    use.values_right = use.values_right && layer_in_full(l);
    use.most_forward = std::max(use.most_forward, tracker.in_use() - start);
    schedule.on_layer(l, false, false);
  }
  for (int l = layers; l-- > 0;) {
    schedule.on_layer(l, true, true);
    use.values_right = use.values_right && layer_in_full(l);
    ops::Cpu::fill(gradients[std::size_t(l)].view(), float(comm.rank() + 1));
    use.most_backward = std::max(use.most_backward, tracker.in_use() - start);
    schedule.on_layer(l, true, false);
  }
  use.values_right = use.values_right && schedule.idle();
  const float sum = float(comm.size() * (comm.size() + 1) / 2);  // 1 + 2 + ... + size
  for (Zero3Tensor& t : shards)
    for (float g : t.gradient().span()) use.values_right = use.values_right && g == sum;
  return use;
}

// ---- 2. on the mesh ----------------------------------------------------------------------------------------------
struct PrefetchMesh {
  int dp, pp, cp, v, layers;
  std::int64_t rows, micro_batch;  // rows per step; rows per micro-batch (0: the default)
};

struct PrefetchRun {
  std::vector<double> losses;      // per step
  testing::StepTensors tensors;    // every rank's gathered gradients and updated weights after each step
  testing::RankGradients first;    // replica 0's gradients of step 0 by (stage rank, name), as the single group's
};

PrefetchRun prefetch_run(const GptConfig& config, const PrefetchMesh& m, bool prefetch, const StackPlan& plan,
                         std::int64_t seq, const std::vector<testing::RandomRows>& batches) {
  const DeviceMesh mesh({{"dp", m.dp}, {"pp", m.pp}, {"cp", m.cp}, {"tp", 1}});
  const int steps = int(batches.size());
  PrefetchRun out;
  std::vector<std::vector<double>> rank_losses(std::size_t(mesh.size()), std::vector<double>(std::size_t(steps)));
  std::mutex lock;
  const double counted = double(m.rows * seq);
  const ops::AdamWConfig adamw{.learning_rate = 0.02f, .weight_decay = 0.1f};
  run_ranks(mesh.size(), [&](ThreadCommunicator& world) {
    testing::MeshRank place = testing::MeshRank::on(mesh, world);
    const int chunks_per_rank = m.v, stages = m.pp * m.v;
    const auto chunk_layers = [&](int c) { return chunk_range(config.layers, stages, c * m.pp + place.stage_index); };
    std::vector<PrefetchStage> chunks;
    chunks.reserve(std::size_t(chunks_per_rank));
    for (int c = 0; c < chunks_per_rank; ++c)
      chunks.emplace_back(config, c * m.pp + place.stage_index, stages, chunk_layers(c), m.cp, place.stage_rank, m.cp,
                          place.stage_rank, 7);
    std::vector<MeshOptimizer> optimizers;
    for (PrefetchStage& chunk : chunks) {
      chunk.set_zero3_prefetch(prefetch);
      chunk.shard_over_dp(place.dp_group);
      optimizers.emplace_back(chunk, ZeroStage::three, m.dp, place.replica, adamw);
    }
    BufferPool pool;
    const ChunkRange mine = chunk_range(m.rows, m.dp, place.replica);
    for (int k = 0; k < steps; ++k) {
      for (int c = 0; c < chunks_per_rank; ++c) {
        const ChunkRange layers = chunk_layers(c);
        chunks[std::size_t(c)].begin_step(place.stage_group, place.stage_group, pool,
                                          StackPlan(plan.begin() + layers.start, plan.begin() + layers.end()), seq);
      }
      const double loss = mesh_forward_backward(std::span(chunks), place.pp_group, place.stage_group, mine, seq,
                                                batches[std::size_t(k)].inputs, batches[std::size_t(k)].targets,
                                                float(1.0 / counted), m.micro_batch);
      for (int c = 0; c < chunks_per_rank; ++c) {
        std::vector<std::vector<float>> g = testing::gathered_zero3(chunks[std::size_t(c)], place.dp_group, true);
        if (k == 0 && place.replica == 0) {  // by the single group's names: per layer attention, MLP, norms; the ends
          const std::lock_guard guard(lock);
          const std::int64_t first = chunk_layers(c).start;
          std::size_t i = 0;
          for (std::int64_t l = 0; l < chunk_layers(c).length; ++l)
            for (const char* part : {"attention", "mlp", "norms"})
              out.first[{place.stage_rank, fmt::format("layer {} {}", first + l, part)}] = g[i++];
          if (chunks[std::size_t(c)].first()) out.first[{place.stage_rank, "embedding"}] = g[i++];
          if (chunks[std::size_t(c)].last()) out.first[{place.stage_rank, "head"}] = g[i++];
        }
        testing::store_step_tensors(out.tensors, lock, world.rank(), k * chunks_per_rank + c, true, std::move(g));
      }
      for (MeshOptimizer& optimizer : optimizers) optimizer.step(place.dp_group, adamw.learning_rate, k + 1);
      for (int c = 0; c < chunks_per_rank; ++c)
        testing::store_step_tensors(out.tensors, lock, world.rank(), k * chunks_per_rank + c, false,
                                    testing::gathered_zero3(chunks[std::size_t(c)], place.dp_group, false));
      rank_losses[std::size_t(world.rank())][std::size_t(k)] = loss / counted;
    }
  });
  out.losses.assign(std::size_t(steps), 0.0);
  for (const std::vector<double>& mine : rank_losses)  // in rank order: the same sum on every run
    for (int k = 0; k < steps; ++k) out.losses[std::size_t(k)] += mine[std::size_t(k)];
  return out;
}

}  // namespace

TEST_CASE("Zero3Schedule: gathers posted a layer ahead and reduce-scatters finished a layer later give every layer "
          "in full at its use and every gradient chunk summed, holding at most two layers' parameters (one without "
          "prefetch); 2 and 3 ranks, uneven chunks") {
  const int layers = 5;
  const std::int64_t rows = 25;  // 200 elements: chunks of 67, 67, 66 over 3 ranks
  const auto tracked_bytes = [](std::int64_t elements) {  // what the tracker counts for a tensor (padded storage)
    const std::size_t before = MemoryTracker::current().in_use();
    const Tensor<float> t(Shape{elements});
    return MemoryTracker::current().in_use() - before;
  };
  const std::size_t layer_bytes = tracked_bytes(rows * 8);
  for (int ranks : {2, 3}) {
    CAPTURE(ranks);
    const std::size_t chunk_bytes = tracked_bytes(chunk_range(rows * 8, ranks, 0).length);
    for (bool prefetch : {true, false}) {
      CAPTURE(prefetch);
      std::vector<ScheduleUse> uses(static_cast<std::size_t>(ranks));
      run_ranks(ranks, [&](ThreadCommunicator& comm) {
        uses[std::size_t(comm.rank())] = schedule_use(comm, layers, rows, prefetch);
      });
      for (const ScheduleUse& u : uses) {
        CHECK(u.values_right);
        // Forward: the running layer's parameters and, with prefetch, the next one's.
        CHECK(u.most_forward == (prefetch ? 2 : 1) * layer_bytes);
        // Backward: as many parameters, the running layer's full gradient and, with prefetch, the one being
        // reduce-scattered (its full gradient and the chunk it lands in).
        CHECK(u.most_backward <= (prefetch ? 2 : 1) * (2 * layer_bytes) + (prefetch ? chunk_bytes : 0));
        CHECK(u.most_backward >= (prefetch ? 2 : 1) * (2 * layer_bytes));
      }
    }
  }
}

TEST_CASE("ZeRO-3 prefetch on the mesh trains bit-identically to prefetch off (losses, every gradient, every "
          "updated weight over two steps) and as the single group (the first step's loss and gradients): dp = 2; "
          "dp = 3 (uneven) with micro-batches; dp = 2 x pp = 2; dp = 2 x cp = 2; dp = 2 x pp = 2 interleaved") {
  GptConfig config = testing::uneven_zero3_config();
  const std::int64_t seq = 12;
  for (const PrefetchMesh& m : {PrefetchMesh{2, 1, 1, 1, 3, 2, 0}, PrefetchMesh{3, 1, 1, 1, 3, 6, 1},
                                PrefetchMesh{2, 2, 1, 1, 3, 4, 0}, PrefetchMesh{2, 1, 2, 1, 3, 4, 1},
                                PrefetchMesh{2, 2, 1, 2, 4, 4, 0}}) {
    CAPTURE(m.dp);
    CAPTURE(m.pp);
    CAPTURE(m.cp);
    CAPTURE(m.v);
    config.layers = m.layers;
    const std::size_t strategy = AllStrategies<>::index_of(m.cp == 1 ? "MegatronTS" : "UlyssesZ");
    const StackPlan plan(std::size_t(config.layers), SublayerChoice{strategy, strategy, 0});
    Rng rng(900 + std::uint64_t(m.dp * 1000 + m.pp * 100 + m.cp * 10 + m.v));
    std::vector<testing::RandomRows> batches;
    for (int k = 0; k < 2; ++k) batches.push_back(testing::random_rows(rng, m.rows * seq, config.vocab));
    const PrefetchRun off = prefetch_run(config, m, false, plan, seq, batches);
    const PrefetchRun on = prefetch_run(config, m, true, plan, seq, batches);
    for (std::size_t k = 0; k < on.losses.size(); ++k) CHECK(on.losses[k] == off.losses[k]);
    CHECK(on.losses[1] != on.losses[0]);  // the second step runs on updated weights
    REQUIRE(on.tensors.size() == off.tensors.size());
    for (const auto& [name, values] : off.tensors) {
      CAPTURE(name);
      REQUIRE(on.tensors.count(name) == 1);
      CHECK(on.tensors.at(name) == values);
    }
    const testing::SingleGroupStep single =
        testing::single_group_step<AllStrategies<>>(config, m.cp, 7, plan, batches[0], m.rows, seq);
    CHECK(on.losses[0] == doctest::Approx(single.loss).epsilon(1e-6));
    testing::check_same_gradients(on.first, single.gradients);
  }
}
