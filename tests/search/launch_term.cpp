// Tests of the links' launch term and point-to-point bandwidth (search/cluster.hpp) and of the operations train_gpt's
// step posts besides the model's (TrainingSetup::trainer, search/perf_model.hpp). On an idealised cluster every
// exposed term is written out by hand: each collective over g members pays launch + alpha x steps + bus factor x
// bytes / bus bandwidth, each pipeline send launch + alpha + bytes / p2p bandwidth. Also: cluster.json's launch_s and
// p2p_bytes_per_s read, written back and refused when bad, and links replaced by an emulated device's
// (with_paced_links) priced as the thread communicator's pacing charges them (comm/threads_member.hpp paced_seconds:
// launch + alpha x steps + the operation's bytes x seconds per byte, steps 2 (g - 1) for an all-reduce, g - 1 for
// the other collectives, 1 for a send).
#include "ideal_cluster.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/emulation.hpp"
#include "paradyse/search/config_file.hpp"
#include "paradyse/search/search.hpp"
#include "support/error_of.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <string>

using paradyse::testing::error_of;

using namespace paradyse;
using namespace paradyse::search;
using paradyse::search::testing::ideal_cluster;

namespace launch_term_test {

TrainingModel small_model() {
  return {.name = "small", .layers = 4, .hidden = 512, .heads = 8, .kv_heads = 8, .head_dim = 64, .ffn = 2048,
          .vocab = 1024, .tied_embeddings = true};
}

constexpr double kLaunch = 40e-6, kAlpha = 3e-6, kBus = 5e9, kP2p = 8e9;

// A collective over g members of `bytes` (nccl-tests size) with `steps` ring steps and `factor` of it on the wire.
double collective(double steps, double factor, double bytes) { return kLaunch + kAlpha * steps + factor * bytes / kBus; }
double gather(int g, double bytes) { return collective(g - 1, double(g - 1) / g, bytes); }
double all_reduce(int g, double bytes) { return collective(2 * (g - 1), 2.0 * (g - 1) / g, bytes); }
double send(double bytes, double bandwidth = kP2p) { return kLaunch + kAlpha + bytes / bandwidth; }

ClusterProfile cluster(double p2p = kP2p) {
  return ideal_cluster(1e11, {{"node", 0, kAlpha, kBus, kLaunch, p2p}}, 2e10);
}

}  // namespace launch_term_test

using namespace launch_term_test;

TEST_CASE("launch term: every collective and send pays its level's launch once, exact alpha-beta-launch formula") {
  const TrainingModel model = small_model();
  TrainingSetup setup{.seq = 512, .global_batch = 8};
  setup.overlap_grad_reduce = false;  // every reduction exposed
  const PerformanceModel perf(model, cluster(), setup, 8);
  const double w = setup.activation_bytes, h = double(model.hidden), L = double(model.layers);

  SUBCASE("tp: per layer and pass, the attention block's and the MLP's all-gather and reduce-scatter") {
    const ParallelConfig c{.dp = 2, .tp_y = 4, .micro_batch = 2};
    const Estimate e = perf.evaluate(c);
    REQUIRE(e.valid);
    const double T = double(c.micro_batch) * double(setup.seq), m = double(micro_batches(setup, c));
    CHECK(e.exposed(CommDim::tp) == doctest::Approx(m * L * 2 * 4 * gather(4, T * h * w)).epsilon(1e-12));
    // dp, ZeRO-0 bucketed: one all-reduce per layer of its share of the stage's parameters.
    const double dense = stage_parameters(model, c, 0, model.layers, true, true).dense;
    CHECK(e.exposed(CommDim::dp) ==
          doctest::Approx(L * all_reduce(2, dense * setup.gradient_reduce_bytes / L)).epsilon(1e-12));
  }
  SUBCASE("pp: one send per micro-batch and direction, at the point-to-point bandwidth") {
    const ParallelConfig c{.dp = 2, .pp = 4, .micro_batch = 1};
    const Estimate e = perf.evaluate(c);
    REQUIRE(e.valid);
    const double T = double(c.micro_batch) * double(setup.seq), m = double(micro_batches(setup, c));
    CHECK(e.exposed(CommDim::pp) == doctest::Approx(m * 2 * send(T * h * w)).epsilon(1e-12));
    // Without a p2p bandwidth the send takes the level's bus bandwidth.
    const PerformanceModel bus(model, cluster(0), setup, 8);
    CHECK(bus.evaluate(c).exposed(CommDim::pp) == doctest::Approx(m * 2 * send(T * h * w, kBus)).epsilon(1e-12));
  }
  SUBCASE("cp all-gather scheme: K and V gathered in forward, gathered and reduce-scattered in backward") {
    const ParallelConfig c{.dp = 2, .cp = 4, .micro_batch = 1, .cp_scheme = CpScheme::all_gather};
    const Estimate e = perf.evaluate(c);
    REQUIRE(e.valid);
    const double T = double(c.micro_batch) * double(setup.seq) / c.cp, m = double(micro_batches(setup, c));
    const double kv = 2.0 * double(model.kv_heads) * double(model.head_dim);
    CHECK(e.exposed(CommDim::cp) == doctest::Approx(m * L * 3 * gather(4, c.cp * T * kv * w)).epsilon(1e-12));
  }
}

TEST_CASE("trainer train_gpt: one collective per packed tensor after the backward, the step's world all-reduces") {
  const TrainingModel model = small_model();
  TrainingSetup setup{.seq = 512, .global_batch = 8};
  setup.trainer = Trainer::train_gpt;  // overlap_grad_reduce stays on: train_gpt's reduction never overlaps
  const PerformanceModel perf(model, cluster(), setup, 8);
  const double g = setup.gradient_reduce_bytes, wb = setup.precision.parameter_bytes, L = double(model.layers);
  for (int zero : {0, 1, 2}) {
    CAPTURE(zero);
    const ParallelConfig c{.dp = 8, .zero = zero, .micro_batch = 1};
    const Estimate e = perf.evaluate(c);
    REQUIRE(e.valid);
    const double dense = stage_parameters(model, c, 0, model.layers, true, true).dense;
    // 3 tensors per layer (attention, MLP, norms), the embedding, the head matrix and the final norm: 3 L + 3.
    const double ops = 3 * L + 3;
    double expected = ops * all_reduce(8, dense * g / ops);  // ZeRO 0 and 1 all-reduce
    if (zero == 2) expected = ops * gather(8, dense * g / ops);  // reduce-scatter, once per step
    if (zero >= 1) expected += ops * gather(8, dense * wb / ops);  // the updated weights all-gathered
    expected += 2 * all_reduce(8, 8);  // the step's loss and peak memory over every rank
    CHECK(e.exposed(CommDim::dp) == doctest::Approx(expected).epsilon(1e-12));
  }
  // With pp stages the stage with most holds 3 per layer and 2 more (the last: head matrix, final norm).
  const ParallelConfig c{.dp = 4, .pp = 2, .micro_batch = 1};
  const Estimate e = perf.evaluate(c);
  REQUIRE(e.valid);
  double dense = 0;
  for (int stage : {0, 1})
    dense = std::max(dense, stage_parameters(model, c, 2 * stage, 2, stage == 0, stage == 1).dense);
  CHECK(e.exposed(CommDim::dp) == doctest::Approx(8 * all_reduce(4, dense * g / 8) + 2 * all_reduce(8, 8)).epsilon(1e-12));
  // With a dense group of cp x tp ranks (the vocabulary sharded over tp), in each micro-batch the stage group's own
  // communication in each layer, the embedding's and the head's collectives over tp (stage_group.hpp) and after the
  // backward the layers' norm gradients [L, 4, h] all-reduced over the group; once per step the embedding's and the
  // head's gradients, V / tp rows each, all-reduced over the cp ranks holding the same rows (cp's term).
  const ParallelConfig grouped{.dp = 2, .cp = 2, .tp_y = 2, .micro_batch = 1};
  const StageGroupPrice price = price_stage_group(model, setup, cluster(), grouped);
  double layer_comm = 0;
  for (const SublayerPrice& s : price.sublayers) layer_comm += s.forward_comm_s + s.backward_comm_s;
  CHECK(price.embedding_comm_s > 0);
  CHECK(price.head_comm_s > 0);
  const double V = double(model.vocab) * double(model.hidden), per_mb = L * layer_comm + price.embedding_comm_s +
                   price.head_comm_s + all_reduce(4, L * 4 * double(model.hidden) * g);
  CHECK(perf.evaluate(grouped).exposed(CommDim::cp) ==
        doctest::Approx(4 * per_mb + 2 * all_reduce(2, V / 2 * g)).epsilon(1e-9));
  // And each of its tensors one all-reduce over dp alone (train_gpt's MeshOptimizer over the dp group): the layers'
  // 1 / cp shards (1 / tp already in stage_parameters) and the replicated embedding, head and norms alike.
  for (const ParallelConfig& mesh : {grouped, ParallelConfig{.dp = 2, .cp = 4, .micro_batch = 1},
                                     ParallelConfig{.dp = 2, .pp = 2, .cp = 2, .micro_batch = 1}}) {
    CAPTURE(to_string(mesh));
    const std::int64_t layers = model.layers / mesh.pp;
    double whole = 0;  // the stage with most (the last, with pp)
    for (int stage = 0; stage < mesh.pp; ++stage)
      whole = std::max(whole, stage_parameters(model, mesh, stage * layers, layers, stage == 0, stage == mesh.pp - 1).dense);
    const double sharded = cp_sharded_parameters(model, setup, mesh, 0, layers);
    const double ops = 3.0 * double(layers) + (mesh.pp == 1 ? 3 : 2);
    CHECK(perf.evaluate(mesh).exposed(CommDim::dp) ==
          doctest::Approx(ops * all_reduce(2, (whole - sharded + sharded / mesh.cp) * g / ops) + 2 * all_reduce(8, 8))
              .epsilon(1e-12));
  }
}

TEST_CASE("trainer train_gpt, ZeRO-3: the collectives its stages post, with zero3_prefetch each layer's gather "
          "hidden behind the layer before it and each reduce-scatter behind the next backward, the first gather of "
          "each pass and the last reduce-scatter exposed; without, every one exposed") {
  const TrainingModel model = small_model();
  const double g = 4, wb = 2;
  const LinkLevel node{"node", 0, kAlpha, kBus, kLaunch, kP2p};
  // The dp term of a config under a device of `rate` FLOP/s (and bytes/s of elementwise work), prefetch on or off.
  const auto dp_term = [&](const ParallelConfig& c, double rate, bool prefetch) {
    TrainingSetup setup{.seq = 512, .global_batch = 8};
    setup.trainer = Trainer::train_gpt;
    setup.zero3_prefetch = prefetch;
    const Estimate e = PerformanceModel(model, ideal_cluster(rate, {node}, rate), setup, 8).evaluate(c);
    REQUIRE(e.valid);
    return e.exposed(CommDim::dp) - 2 * all_reduce(8, 8);  // less the step's loss and peak memory all-reduces
  };
  struct Case {
    ParallelConfig c;
    int stage_layers, micro_batches, forward_passes;  // passes: the forward, and full recomputation's
  };
  for (const Case& k : {Case{{.dp = 8, .zero = 3, .micro_batch = 1}, 4, 1, 1},
                        Case{{.dp = 4, .pp = 2, .zero = 3, .micro_batch = 1, .recompute = Recompute::full}, 2, 2, 2},
                        Case{{.dp = 4, .cp = 2, .zero = 3, .micro_batch = 1}, 4, 2, 1}}) {
    CAPTURE(to_string(k.c));
    TrainingSetup setup{.seq = 512, .global_batch = 8};
    setup.trainer = Trainer::train_gpt;
    // The stage's parameters on a device: under a stage group of cp ranks the layers' 1 / cp shards, whose ZeRO
    // group is dp alone (train_gpt's MeshOptimizer), as every other tensor's.
    double dense = 0;
    for (int stage = 0; stage < k.c.pp; ++stage) {
      const double sharded = cp_sharded_parameters(model, setup, k.c, stage * k.stage_layers, k.stage_layers);
      dense = std::max(dense, stage_parameters(model, k.c, stage * k.stage_layers, k.stage_layers, stage == 0,
                                               stage == k.c.pp - 1).dense - sharded + sharded / k.c.cp);
    }
    // What a stage posts (model/mesh_stage.hpp, model/zero3_prefetch.hpp), per micro-batch: per layer and forward
    // pass, and before its backward, one all-gather of its three tensors (attention, MLP, norms, posted together);
    // after its backward one reduce-scatter of its attention's and MLP's gradients, and after the whole backward one
    // of its norms'; the stage's end (tied embeddings: the embedding or the head, one per stage) gathered and its
    // gradient reduce-scattered.
    const int d = k.c.dp;
    const double end = double(model.vocab) * double(model.hidden), norms = 2.0 * double(model.hidden);
    const double layer = (dense - end) / k.stage_layers;
    const double gathers = gather(d, layer * wb), scatters = gather(d, (layer - norms) * g);
    const double both = gather(d, layer * wb + (layer - norms) * g);  // a gather beside a reduce-scatter
    // Per micro-batch, and on the pipeline's fill and drain ((pp - 1) micro-batches' stage time) as well.
    const double L = k.stage_layers, m = k.micro_batches + (k.c.pp - 1), passes = k.forward_passes;
    const double waited = L * gather(d, norms * g) + gather(d, end * wb) + gather(d, end * g);
    // Off: every collective of every layer exposed, in every pass.
    const double off = m * (L * ((passes + 1) * gathers + scatters) + waited);
    CHECK(dp_term(k.c, 1e3, false) == doctest::Approx(off).epsilon(1e-12));
    // On, compute far slower than the links: only the first gather of each pass and the last reduce-scatter.
    const double floor = m * ((passes + 1) * gathers + scatters + waited);
    CHECK(dp_term(k.c, 1e3, true) == doctest::Approx(floor).epsilon(1e-12));
    // On, compute far faster: nothing to hide behind, each backward gather in flight beside a reduce-scatter; with
    // pp stages the layers' pipeline sends remain (the stage's time), and some of the gathers hide behind them.
    const double fast = dp_term(k.c, 1e30, true);
    const double exposed_all = m * (passes * L * gathers + gathers + scatters + (L - 1) * both + waited);
    // (A stage group's own communication is time a gather hides behind, as a pipeline's sends are.)
    if (k.c.pp == 1 && k.c.cp == 1) CHECK(fast == doctest::Approx(exposed_all).epsilon(1e-12));
    else CHECK((fast > floor && fast <= exposed_all * (1 + 1e-12)));
  }
  // The configuration file's key (search_parallel --emit writes it, train_gpt --mesh-file reads it).
  json::Value file = {{"dp", 8}, {"zero", 3}, {"zero3_prefetch", false}};
  const ConfigFile read = config_file_from_json(file);
  const TrainingSetup setup = setup_of(read, TrainingSetup{});
  CHECK_FALSE(setup.zero3_prefetch);
  CHECK(config_file_to_json(read.config, model, "", cluster(), "", setup)["zero3_prefetch"] == false);
  file["zero3_prefetch"] = "yes";
  CHECK_THROWS_WITH_AS(config_file_from_json(file), doctest::Contains("zero3_prefetch"), Error);
}

TEST_CASE("cluster.json: launch_s and p2p_bytes_per_s read and written back; bad values refused by name") {
  const ClusterProfile c = cluster();
  const ClusterProfile back = cluster_from_json(cluster_to_json(c));
  REQUIRE(back.levels.size() == 1);
  CHECK(back.levels[0].launch_s == kLaunch);
  CHECK(back.levels[0].p2p_bytes_per_s == kP2p);
  // Optional: a level without them has no launch cost and sends at its bus bandwidth.
  json::Value v = cluster_to_json(c);
  v["levels"][0].erase("launch_s");
  v["levels"][0].erase("p2p_bytes_per_s");
  const ClusterProfile plain = cluster_from_json(v);
  CHECK(plain.levels[0].launch_s == 0);
  CHECK(plain.levels[0].send_bytes_per_s() == kBus);

  auto with = [&](const char* key, json::Value value) {
    json::Value bad = cluster_to_json(c);
    bad["levels"][0][key] = std::move(value);
    return error_of([&] { cluster_from_json(bad); });
  };
  const std::string negative = with("launch_s", -1e-6);
  CHECK(negative.find("\"launch_s\" = -1e-06 must not be negative") != std::string::npos);
  CHECK(negative.find("levels[0].launch_s") != std::string::npos);
  CHECK(with("launch_s", 2.0).find("\"launch_s\" = 2 is outside the accepted range [0, 1] seconds") != std::string::npos);
  CHECK(with("launch_s", "fast").find("expected a number") != std::string::npos);
  CHECK(with("p2p_bytes_per_s", 0).find("\"p2p_bytes_per_s\" = 0 must be positive") != std::string::npos);
  const std::string unknown = with("launch", 1e-6);
  CHECK(unknown.find("\"launch\"") != std::string::npos);
  CHECK(unknown.find("launch_s") != std::string::npos);  // the keys expected are listed
}

TEST_CASE("emulated links (with_paced_links) priced as the pacing charges each operation") {
  // This machine's stand-in: the idealised device (GEMM 1e11 FLOP/s); H100's NVLink stretched by 989e12 x 0.7 / 1e11.
  const ClusterProfile machine = cluster();
  const cost::Emulation e = cost::emulate(cost::builtin_profile("h100"), machine.device);
  const ClusterProfile paced = with_paced_links(machine, e.profile.intra_node);
  CHECK(paced.paced_links);
  const auto& p = e.pacing;  // the thread communicator's LinkPacing
  REQUIRE(p.launch_s > 0);
  for (int g : {2, 3, 8}) {
    const GroupSpan group{g, g};
    const double bytes = 1 << 20, wire = double(g - 1) / g * bytes;  // what count_bytes records of a gather's output
    CAPTURE(g);
    CHECK(paced.collective_time(Collective::send_recv, group, bytes) ==
          doctest::Approx(p.launch_s + p.alpha_s + bytes * p.p2p_s_per_byte).epsilon(1e-12));
    CHECK(paced.collective_time(Collective::all_gather, group, bytes) ==
          doctest::Approx(p.launch_s + p.alpha_s * (g - 1) + wire * p.collective_s_per_byte).epsilon(1e-12));
    CHECK(paced.collective_time(Collective::reduce_scatter, group, bytes) ==
          doctest::Approx(p.launch_s + p.alpha_s * (g - 1) + wire * p.collective_s_per_byte).epsilon(1e-12));
    CHECK(paced.collective_time(Collective::all_reduce, group, bytes) ==
          doctest::Approx(p.launch_s + p.alpha_s * 2 * (g - 1) + 2 * wire * p.collective_s_per_byte).epsilon(1e-12));
    CHECK(paced.collective_time(Collective::all_to_all, group, bytes) ==
          doctest::Approx(p.launch_s + p.alpha_s * (g - 1) + wire * p.collective_s_per_byte).epsilon(1e-12));
  }
  // The published clusters keep no launch term: their alpha is the published per-step latency.
  for (std::string_view name : kClusterPresets)
    for (const LinkLevel& level : cluster_preset(name).levels) CHECK(level.launch_s == 0);
}
