// Tests of ClusterProfile::cores_per_node (search/cluster.hpp, perf_model.hpp): devices that share a node's cores
// (thread ranks on a CPU) run their own work in turn, so a step stretches by devices per node / cores; a pipeline's
// bubble is filled by the other ranks' work; dedicated devices (0, or at least one core each) are unchanged; the JSON
// key round-trips and bad values are refused by name.
#include "ideal_cluster.hpp"
#include "paradyse/search/config_file.hpp"
#include "paradyse/search/search.hpp"

#include <doctest/doctest.h>

#include <string>

using namespace paradyse;
using namespace paradyse::search;
using paradyse::search::testing::ideal_cluster;

namespace {

TrainingModel shared_cores_model() {
  return {.name = "small", .layers = 8, .hidden = 512, .heads = 8, .kv_heads = 8, .head_dim = 64, .ffn = 2048,
          .vocab = 1024, .tied_embeddings = true};
}

// 8 devices on one level (the whole cluster one node), with links slow enough that communication shows.
ClusterProfile node_of_8(std::int64_t cores) {
  ClusterProfile c = ideal_cluster(1e11, {{"threads", 0, 2e-6, 5e9}}, 2e10);
  c.cores_per_node = cores;
  return c;
}

}  // namespace

TEST_CASE("shared cores: 8 ranks on 2 cores take 4x every term of their own work; 8 or more cores change nothing") {
  const TrainingSetup setup{.seq = 512, .global_batch = 16};
  const PerformanceModel own(shared_cores_model(), node_of_8(0), setup, 8);
  const PerformanceModel eight(shared_cores_model(), node_of_8(8), setup, 8);
  const PerformanceModel sixteen(shared_cores_model(), node_of_8(16), setup, 8);
  const PerformanceModel two(shared_cores_model(), node_of_8(2), setup, 8);
  const PerformanceModel three(shared_cores_model(), node_of_8(3), setup, 8);
  for (const ParallelConfig& c : {ParallelConfig{.dp = 8, .micro_batch = 2},
                                  ParallelConfig{.dp = 2, .tp_y = 4, .zero = 1, .micro_batch = 1},
                                  ParallelConfig{.dp = 4, .cp = 2, .zero = 3, .micro_batch = 2}}) {
    CAPTURE(to_string(c));
    const Estimate a = own.evaluate(c);
    REQUIRE(a.feasible);
    REQUIRE(a.bubble_s == 0);
    for (const PerformanceModel* same : {&eight, &sixteen}) {
      const Estimate b = same->evaluate(c);
      CHECK(b.step_s == a.step_s);
      CHECK(b.compute_s == a.compute_s);
    }
    const Estimate s = two.evaluate(c);
    CHECK(s.step_s == doctest::Approx(4 * a.step_s).epsilon(1e-12));
    CHECK(s.compute_s == doctest::Approx(4 * a.compute_s).epsilon(1e-12));
    CHECK(s.optimizer_s == doctest::Approx(4 * a.optimizer_s).epsilon(1e-12));
    for (CommDim d : kAllCommDims) CHECK(s.exposed(d) == doctest::Approx(4 * a.exposed(d)).epsilon(1e-12));
    CHECK(s.mfu == doctest::Approx(a.mfu / 4).epsilon(1e-12));
    CHECK(three.evaluate(c).step_s == doctest::Approx(8.0 / 3 * a.step_s).epsilon(1e-12));
  }
}

TEST_CASE("shared cores: a pipeline's bubble is filled by the other ranks' work, never below the dedicated step") {
  const TrainingSetup setup{.seq = 512, .global_batch = 16};
  const ParallelConfig c{.dp = 2, .pp = 4, .micro_batch = 1};
  const Estimate own = PerformanceModel(shared_cores_model(), node_of_8(0), setup, 8).evaluate(c);
  REQUIRE(own.feasible);
  REQUIRE(own.bubble_s > 0);
  const double busy = own.step_s - own.bubble_s;
  for (std::int64_t cores : {1, 2, 4, 7}) {
    CAPTURE(cores);
    const double f = 8.0 / double(cores);
    const Estimate s = PerformanceModel(shared_cores_model(), node_of_8(cores), setup, 8).evaluate(c);
    CHECK(s.step_s == doctest::Approx(std::max(own.step_s, f * busy)).epsilon(1e-12));
    CHECK(s.bubble_s == doctest::Approx(std::max(0.0, own.step_s - f * busy)).epsilon(1e-9));
    CHECK(s.step_s == doctest::Approx(s.compute_s + s.total_exposed_comm_s() + s.bubble_s + s.optimizer_s));
  }
}

TEST_CASE("shared cores: paced links (emulation) stretch compute and the optimizer; a collective's wait holds its "
          "ranks, a pipeline's bubble and sends are filled by other stages' work") {
  const TrainingSetup setup{.seq = 512, .global_batch = 16};
  ClusterProfile paced = node_of_8(2);
  paced.paced_links = true;
  // Without a pipeline every wait is a collective's: the stretched work, then every wait whole.
  const ParallelConfig c{.dp = 2, .tp_y = 4, .zero = 1, .micro_batch = 1};
  const Estimate own = PerformanceModel(shared_cores_model(), node_of_8(0), setup, 8).evaluate(c);
  const Estimate s = PerformanceModel(shared_cores_model(), paced, setup, 8).evaluate(c);
  REQUIRE(own.exposed(CommDim::tp) > 0);
  REQUIRE(own.exposed(CommDim::dp) > 0);
  CHECK(s.compute_s == doctest::Approx(4 * own.compute_s).epsilon(1e-12));
  CHECK(s.optimizer_s == doctest::Approx(4 * own.optimizer_s).epsilon(1e-12));
  for (CommDim d : kAllCommDims) CHECK(s.exposed(d) == doctest::Approx(own.exposed(d)).epsilon(1e-12));
  CHECK(s.step_s == doctest::Approx(4 * (own.compute_s + own.optimizer_s) + own.total_exposed_comm_s()).epsilon(1e-12));
  // A pipeline: its bubble and its sends are what other stages' work fills, the collectives' waits stay whole; the
  // step never below the dedicated one. Fast links (the stretched work outlasts the bubble) and slow ones.
  const ParallelConfig piped{.dp = 2, .pp = 4, .micro_batch = 1};
  for (const ClusterProfile& links : {node_of_8(0), ideal_cluster(1e11, {{"threads", 0, 2e-4, 5e7}}, 2e10)}) {
    ClusterProfile shared = links;
    shared.cores_per_node = 2;
    shared.paced_links = true;
    const Estimate a = PerformanceModel(shared_cores_model(), links, setup, 8).evaluate(piped);
    const Estimate b = PerformanceModel(shared_cores_model(), shared, setup, 8).evaluate(piped);
    REQUIRE(a.bubble_s > 0);
    REQUIRE(a.exposed(CommDim::pp) > 0);
    const double held = a.total_exposed_comm_s() - a.exposed(CommDim::pp);
    const double work = 4 * (a.compute_s + a.optimizer_s);
    CAPTURE(a.step_s);
    CAPTURE(work + held);
    CHECK(b.step_s == doctest::Approx(std::max(a.step_s, work + held)).epsilon(1e-12));
    const double kept = std::max(0.0, a.step_s - work - held) / (a.exposed(CommDim::pp) + a.bubble_s);
    CHECK(b.exposed(CommDim::pp) == doctest::Approx(kept * a.exposed(CommDim::pp)).epsilon(1e-12));
    CHECK(b.bubble_s == doctest::Approx(kept * a.bubble_s).epsilon(1e-12));
    for (CommDim d : {CommDim::tp, CommDim::cp, CommDim::ep, CommDim::dp})
      CHECK(b.exposed(d) == doctest::Approx(a.exposed(d)).epsilon(1e-12));
    CHECK(b.step_s == doctest::Approx(b.compute_s + b.total_exposed_comm_s() + b.bubble_s + b.optimizer_s));
  }
  CHECK(cluster_from_json(cluster_to_json(paced)).paced_links);
}

TEST_CASE("shared cores: only the devices of one node share its cores") {
  // Nodes of 4 devices with 2 cores each: 16 devices stretch by 2, not 8.
  ClusterProfile nodes = ideal_cluster(1e11, {{"node", 4, 2e-6, 5e9}, {"net", 0, 5e-6, 1e9}}, 2e10);
  CHECK(nodes.serialisation(16) == 1);
  nodes.cores_per_node = 2;
  CHECK(nodes.serialisation(16) == 2);
  CHECK(nodes.serialisation(2) == 1);  // 2 devices in use on a node of 2 cores
  const TrainingSetup setup{.seq = 512, .global_batch = 16};
  ClusterProfile own = nodes;
  own.cores_per_node = 0;
  const ParallelConfig c{.dp = 16, .micro_batch = 1};
  const double a = PerformanceModel(shared_cores_model(), own, setup, 16).evaluate(c).step_s;
  CHECK(PerformanceModel(shared_cores_model(), nodes, setup, 16).evaluate(c).step_s ==
        doctest::Approx(2 * a).epsilon(1e-12));
}

TEST_CASE("shared cores: cores_per_node round-trips through JSON; 0, negative and non-integers are refused by name") {
  ClusterProfile c = node_of_8(2);
  const ClusterProfile read = cluster_from_json(json::parse(json::dump(cluster_to_json(c))));
  CHECK(read.cores_per_node == 2);
  CHECK(cluster_from_json(cluster_to_json(node_of_8(0))).cores_per_node == 0);  // absent: dedicated devices
  for (const char* bad : {"0", "-2", "1.5", "\"2\""}) {
    CAPTURE(bad);
    json::Value v = cluster_to_json(c);
    v["cores_per_node"] = json::parse(bad);
    try {
      cluster_from_json(v);
      FAIL("cores_per_node = " << bad << " was accepted");
    } catch (const Error& e) {
      CHECK(std::string(e.what()).find("cores_per_node") != std::string::npos);
    }
  }
}
