// paradyse/search/search.hpp: the exhaustive search of a parallel training space, top-K by step time.
//
// Every factorisation of the device count into the mesh dimensions the space allows (dp, pp, cp, tp_x, tp_y), and
// per mesh every ep, etp, micro-batch size, virtual stage count, ZeRO stage and recomputation policy. Nothing is
// skipped without a proof that it cannot enter the top K:
// - bound: meshes are visited in increasing order of mesh_lower_bound; once the K-th best step time
//   is below a mesh's bound, that mesh and every later one are skipped; within a mesh, a (ep, etp, mb, recompute)
//   whose per-micro-batch time alone (m x slowest stage, v = 1: the least pipeline traffic, no bubble, no data-
//   parallel term) is above the K-th best skips its ZeRO stages and virtual stages.
// - memory: memory only grows with the micro-batch size and is smallest at v = 1 (interleaving holds pp + (pp - 1)
//   / v micro-batches, 1F1B pp); a mesh whose smallest memory over ep, etp, ZeRO and recomputation at mb = 1, v = 1
//   exceeds the device is skipped, and so is every micro-batch above the first that does not fit that way.
// Ties in step time are broken by the configuration's fields, so the result does not depend on the visiting order.
#pragma once

#include "paradyse/core/timer.hpp"
#include "paradyse/search/parallel_config.hpp"
#include "paradyse/search/perf_model.hpp"

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace paradyse::search {

struct SearchOptions {
  SearchSpace space = space_7d();
  int top_k = 5;
  bool prune = true;  // false: evaluate every configuration (the brute force the tests compare against)
};

struct Candidate {
  ParallelConfig config;
  Estimate estimate;
};

struct SearchResult {
  std::vector<Candidate> top;           // best first
  std::int64_t meshes = 0;              // structurally valid meshes
  std::int64_t meshes_bounded = 0;      // skipped by the time bound
  std::int64_t meshes_out_of_memory = 0;
  std::int64_t evaluated = 0;           // configurations evaluated in full
  std::int64_t feasible = 0;            // of those, fitting in memory
  double seconds = 0;
};

// The order among configurations of equal step time: the simpler first (no cp, 1D tp, no ep, no pipeline, ...).
inline auto config_key(const ParallelConfig& c) {
  return std::make_tuple(c.cp, c.tp_x, c.ep, c.etp, c.pp, c.tp_y, c.virtual_stages, c.zero, int(c.recompute),
                         c.micro_batch, c.dp, !c.sequence_parallel, int(c.cp_scheme));
}
// Strict order: faster first, then by config_key.
inline bool better(const Candidate& a, const Candidate& b) {
  if (a.estimate.step_s != b.estimate.step_s) return a.estimate.step_s < b.estimate.step_s;
  return config_key(a.config) < config_key(b.config);
}

// The divisors of n in increasing order, in O(sqrt n) (a global batch of 2^24 has 25).
inline std::vector<int> divisors(std::int64_t n) {
  std::vector<int> low, high;
  for (std::int64_t i = 1; i * i <= n; ++i)
    if (n % i == 0) {
      low.push_back(int(i));
      if (i * i != n) high.push_back(int(n / i));
    }
  low.insert(low.end(), high.rbegin(), high.rend());
  return low;
}

// Every mesh (dp, pp, cp, tp_x, tp_y) of the space whose product is `devices` and that the model can be sharded on
// (the structural checks at mb = 1, v = 1, ep = etp = 1).
inline std::vector<ParallelConfig> meshes(const PerformanceModel& model, const SearchSpace& space) {
  const std::int64_t n = model.devices();
  std::vector<ParallelConfig> out;
  for (int tp_y : divisors(n))
    for (int tp_x : divisors(n / tp_y)) {
      if (tp_x > 1 && !space.tensor_2d) continue;
      for (int cp : divisors(n / tp_y / tp_x)) {
        if (cp > 1 && !space.context_parallel) continue;
        for (int pp : divisors(n / tp_y / tp_x / cp)) {
          ParallelConfig c{.dp = int(n / tp_y / tp_x / cp / pp), .pp = pp, .cp = cp, .tp_x = tp_x, .tp_y = tp_y};
          if (structural_problem(model.model(), model.setup(), c, n).empty()) out.push_back(c);
        }
      }
    }
  return out;
}

// The (ep, etp) pairs of a mesh in the space: ep divides the experts and dp x cp; etp divides tp (or is tp when the
// space does not separate expert tensor parallelism).
inline std::vector<std::pair<int, int>> expert_layouts(const TrainingModel& m, const SearchSpace& space,
                                                       const ParallelConfig& mesh) {
  if (!m.is_moe()) return {{1, 1}};
  std::vector<std::pair<int, int>> out;
  for (int ep : divisors(mesh.dp * mesh.cp)) {
    if (m.experts % ep != 0 || (ep > 1 && !space.expert_parallel)) continue;
    for (int etp : divisors(mesh.tp())) {
      if (!space.expert_tensor && etp != mesh.tp()) continue;
      if (m.expert_ffn % etp == 0) out.emplace_back(ep, etp);
    }
  }
  return out;
}

// The context-parallel schemes of a mesh in the space: the space's when cp > 1, the ring (no cp traffic) otherwise.
inline std::vector<CpScheme> cp_schemes_of(const SearchSpace& space, const ParallelConfig& mesh) {
  if (mesh.cp == 1 || space.cp_schemes.empty()) return {CpScheme::ring};
  return space.cp_schemes;
}

// The largest micro-batch size of a mesh in the space: a divisor of B / dp.
inline int largest_micro_batch(const TrainingSetup& setup, const SearchSpace& space, const ParallelConfig& mesh) {
  int largest = 1;
  for (int mb : divisors(setup.global_batch / mesh.dp))
    if (mb <= space.max_micro_batch) largest = mb;
  return largest;
}

// A lower bound on the step time of every configuration of the space on this mesh, whatever its ep, etp, ZeRO
// stage, micro-batch, virtual stages and recomputation: the compute and the tensor- and expert-parallel
// communication of m micro-batches through the stage that is slowest, at the largest micro-batch and without
// recomputation. Every term of it, per token, only falls as the micro-batch grows (GEMM time is overhead +
// FLOPs / rate + operand bytes / bandwidth with m growing with the micro-batch; collectives alpha + beta * bytes;
// elementwise work linear), recomputation only adds, and the terms left out (cp's exposed ring, pipeline sends,
// bubble, data parallelism, optimizer) are non-negative.
inline double mesh_lower_bound(const PerformanceModel& model, const SearchSpace& space, const ParallelConfig& mesh) {
  double least = 1e300;
  for (auto [ep, etp] : expert_layouts(model.model(), space, mesh))
    for (CpScheme scheme : cp_schemes_of(space, mesh)) {
      ParallelConfig c = mesh;
      c.ep = ep, c.etp = etp, c.micro_batch = largest_micro_batch(model.setup(), space, mesh);
      c.recompute = Recompute::none, c.cp_scheme = scheme;
      const Estimate e = model.evaluate(c);
      if (!e.valid) continue;
      least = std::min(least, e.compute_s + e.exposed(CommDim::tp) + e.exposed(CommDim::ep));
    }
  return least;
}

inline SearchResult search(const PerformanceModel& model, const SearchOptions& options) {
  check(options.top_k >= 1, "top_k = {} must be at least 1", options.top_k);
  const Timer timer;
  const TrainingModel& m = model.model();
  const TrainingSetup& setup = model.setup();
  const double capacity = model.capacity_bytes();
  SearchResult result;

  const std::vector<ParallelConfig> all_meshes = meshes(model, options.space);
  if (all_meshes.empty())
    throw Error(fmt::format("no factorisation of {} devices into the {} space fits model {} (heads = {}, layers = {}, "
                            "hidden = {}) with seq = {} and global batch = {}",
                            model.devices(), options.space.name, m.name, m.heads, m.layers, m.hidden, setup.seq,
                            setup.global_batch));
  std::vector<std::pair<double, ParallelConfig>> ordered;
  for (const ParallelConfig& mesh : all_meshes) ordered.emplace_back(mesh_lower_bound(model, options.space, mesh), mesh);
  result.meshes = std::int64_t(ordered.size());
  std::sort(ordered.begin(), ordered.end(),
            [](const auto& a, const auto& b) { return a.first != b.first ? a.first < b.first : config_key(a.second) < config_key(b.second); });

  std::vector<Candidate>& top = result.top;
  auto worst = [&] { return top.size() < std::size_t(options.top_k) ? 1e300 : top.back().estimate.step_s; };
  auto offer = [&](Candidate c) {
    if (top.size() == std::size_t(options.top_k) && !better(c, top.back())) return;
    top.insert(std::upper_bound(top.begin(), top.end(), c, better), std::move(c));
    if (top.size() > std::size_t(options.top_k)) top.pop_back();
  };

  for (std::size_t i = 0; i < ordered.size(); ++i) {
    const auto& [bound, mesh] = ordered[i];
    if (options.prune && bound > worst()) {
      result.meshes_bounded += std::int64_t(ordered.size() - i);
      break;
    }
    const std::vector<std::pair<int, int>> layouts = expert_layouts(m, options.space, mesh);
    // Smallest memory of the mesh at a micro-batch size, over expert layouts, ZeRO stages and recomputation (v = 1).
    auto smallest_memory = [&](int micro_batch) {
      double least = 1e300;
      for (auto [ep, etp] : layouts)
        for (int zero = 0; zero <= 3; ++zero)
          for (Recompute r : kAllRecompute) {
            ParallelConfig c = mesh;
            c.ep = ep, c.etp = etp, c.zero = zero, c.micro_batch = micro_batch, c.recompute = r;
            least = std::min(least, estimate_memory(m, setup, c).total());
          }
      return least;
    };
    if (options.prune && smallest_memory(1) > capacity) {
      ++result.meshes_out_of_memory;
      continue;
    }
    for (int mb : divisors(setup.global_batch / mesh.dp)) {
      if (mb > options.space.max_micro_batch) break;
      if (options.prune && mb > 1 && smallest_memory(mb) > capacity) break;
      for (auto [ep, etp] : layouts)
        for (Recompute r : kAllRecompute) {
          ParallelConfig base = mesh;
          base.ep = ep, base.etp = etp, base.micro_batch = mb, base.recompute = r;
          if (options.prune) {  // m x slowest stage at v = 1 bounds every ZeRO stage and v of this point
            double least = 1e300;
            for (CpScheme scheme : cp_schemes_of(options.space, mesh)) {
              ParallelConfig c = base;
              c.cp_scheme = scheme;
              const Estimate e = model.evaluate(c);
              ++result.evaluated;
              least = std::min(least, e.compute_s + e.total_exposed_comm_s() - e.exposed(CommDim::dp));
            }
            if (least > worst()) continue;
          }
          for (int v = 1; v <= options.space.max_virtual_stages; ++v) {
            if (v > 1 && (mesh.pp == 1 || stage_layout(m.layers, mesh.pp).fewest() < v)) continue;
            for (int zero = 0; zero <= 3; ++zero)
              for (CpScheme scheme : cp_schemes_of(options.space, mesh)) {
                ParallelConfig c = base;
                c.virtual_stages = v, c.zero = zero, c.cp_scheme = scheme;
                Estimate e = model.evaluate(c);
                ++result.evaluated;
                if (!e.feasible) continue;  // invalid (v, mb) or out of memory
                ++result.feasible;
                offer({c, std::move(e)});
              }
          }
        }
    }
  }
  result.seconds = timer.seconds();
  return result;
}

}  // namespace paradyse::search
