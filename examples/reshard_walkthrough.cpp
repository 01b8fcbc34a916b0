// reshard_walkthrough: moves one tensor through a path of layouts on thread ranks and prints every rank's shard.
//
//   reshard_walkthrough                                   # 4 ranks, a [1, 10, 4] tensor: 10 tokens, uneven over 4
//   reshard_walkthrough --ranks 3 --shape 2,7,3
//   reshard_walkthrough --mesh dp=2,sp=2 --path "S0,R S0,S1 S0,Z1 S0,S2 R,R"
//   reshard_walkthrough --strategies                      # the layouts each strategy computes in, per rank
//   reshard_walkthrough --help                            # the flags (generated from parse())
//
// Element values are their global linear index, so each printed shard shows which part of the tensor it is. Each
// step prints the collectives the planner chose, the bytes every rank sent, and checks that every rank holds exactly
// the slice its layout names.
#include "paradyse/cli/flags.hpp"
#include "paradyse/cli/lists.hpp"
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/printable.hpp"
#include "paradyse/layout/reshard.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/strategy/strategies.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace pd = paradyse;

namespace {

std::vector<std::string> split(std::string_view text, char separator) {
  std::vector<std::string> parts;
  std::string current;
  for (char c : text) {
    if (c == separator) {
      if (!current.empty()) parts.push_back(current);
      current.clear();
    } else {
      current += c;
    }
  }
  if (!current.empty()) parts.push_back(current);
  return parts;
}

int parse_int(const std::string& text, std::string_view what) {
  char* end = nullptr;
  const long value = std::strtol(text.c_str(), &end, 10);
  pd::check(end != text.c_str() && *end == '\0' && value >= 0 && value < (1L << 30), "{} '{}' is not a count; expected an integer in [0, {}]", what,
            pd::printable(text), (1L << 30) - 1);
  return int(value);
}

pd::Placement parse_placement(const std::string& token) {
  if (token == "R") return pd::Placement::replicate();
  if (token == "P") return pd::Placement::partial();
  if (token.size() >= 2 && (token[0] == 'S' || token[0] == 'Z')) {
    const int dim = parse_int(token.substr(1), "shard dim");
    return token[0] == 'S' ? pd::Placement::shard(dim) : pd::Placement::zigzag(dim);
  }
  throw std::invalid_argument(fmt::format("--path: placement '{}' is not one of R, P, S<dim>, Z<dim>", pd::printable(token)));
}

pd::DynamicLayout parse_layout(const std::string& text, int mesh_ndim) {
  std::vector<pd::Placement> placements;
  for (const std::string& token : pd::cli::list_items("--path layout", text)) placements.push_back(parse_placement(token));
  pd::check(int(placements.size()) == mesh_ndim, "--path: layout '{}' places {} axes; the mesh has {}", text,
            placements.size(), mesh_ndim);
  return pd::DynamicLayout(std::span<const pd::Placement>(placements));
}

// A shard as text: its shape, the global ranges it holds per dim, and its values (the global linear indices).
std::string describe(const pd::Tensor<float>& shard, const pd::DynamicLayout& layout, const pd::Shape& global,
                     const pd::DeviceMesh& mesh, const pd::MeshCoordinate& coord) {
  std::string text = fmt::format("shape {}", shard.shape());
  for (int d = 0; d < global.rank(); ++d) {
    bool sharded = false;
    for (const pd::Placement& p : layout) sharded = sharded || p.is_shard(d);
    if (!sharded) continue;
    std::vector<std::string> ranges;
    for (const pd::ChunkRange& r : pd::local_ranges(layout, global, mesh, coord, d))
      ranges.push_back(fmt::format("[{}, {})", r.start, r.end()));
    text += fmt::format("  dim {}: {}", d, ranges.empty() ? "none" : fmt::format("{}", fmt::join(ranges, " + ")));
  }
  if (shard.numel() == 0) return text + "\n      (empty)";
  if (shard.numel() > 256) return text + fmt::format("\n      ({} values)", shard.numel());
  // One group per row of the last dim, packed into lines.
  const std::int64_t inner = shard.shape()[shard.shape().rank() - 1];
  std::string line;
  for (std::int64_t row = 0; row * inner < shard.numel(); ++row) {
    std::vector<std::string> values;
    for (std::int64_t i = 0; i < inner; ++i) values.push_back(fmt::format("{:g}", shard.data()[row * inner + i]));
    const std::string group = fmt::format("({})", fmt::join(values, " "));
    if (!line.empty() && line.size() + group.size() > 100) {
      text += "\n      " + line;
      line.clear();
    }
    line += (line.empty() ? "" : " ") + group;
  }
  return text + "\n      " + line;
}

pd::Shape shape_of(const std::vector<std::int64_t>& e) {
  switch (e.size()) {
    case 1: return {e[0]};
    case 2: return {e[0], e[1]};
    case 3: return {e[0], e[1], e[2]};
    case 4: return {e[0], e[1], e[2], e[3]};
    case 5: return {e[0], e[1], e[2], e[3], e[4]};
    default: return {e[0], e[1], e[2], e[3], e[4], e[5]};
  }
}

struct Options {
  int ranks = 4;
  pd::Shape shape{1, 10, 4};
  std::string mesh_text, path_text;
  std::vector<pd::MeshAxis> axes;  // --mesh, or one axis "sp" over every rank
  bool strategies = false;
};

Options parse(int argc, char** argv) {
  Options options;
  std::string shape_text = "1,10,4";
  pd::cli::Flags flags(
      "reshard_walkthrough",
      "Moves one tensor through a path of layouts on thread ranks and prints every rank's shard, or (--strategies) "
      "the layouts each strategy computes in.");
  // One thread per rank, each printing its shard: beyond 256 the walkthrough neither starts reliably nor reads.
  flags.integer("--ranks", options.ranks, 1, 256, "thread ranks; the default mesh is one axis sp=N");
  flags.text("--shape", shape_text, "the global tensor's shape ([batch, tokens, hidden])", "D0,D1,...");
  flags.text("--mesh", options.mesh_text, "named mesh axes, outermost first, e.g. dp=2,sp=2 (product = ranks)",
             "name=size,...").nonempty("axes such as dp=2,sp=2");
  flags.text("--path", options.path_text,
             "layouts to visit, separated by spaces; each lists one placement per mesh axis, comma-separated: R "
             "(replicate), S<d> (shard dim d), Z<d> (zigzag shard of dim d), P (partial sum). Default: \"R S1 Z1 S2 R "
             "P S1 R\" on the last mesh axis, the other axes replicating",
             "\"L1 L2 ...\"")
      .nonempty("layouts separated by spaces");
  flags.flag("--strategies", options.strategies,
             "print the layouts every strategy's sublayers compute in, for activations [B, S, H] on N ranks (a layer "
             "with N heads of H / N, f = 4H), with each rank's local shape; no data moves");
  flags.parse(argc, argv);
  // The lists, read strictly (cli/lists.hpp): an empty, unknown or repeated item is refused naming the flag.
  try {
    const std::vector<std::string> parts = pd::cli::list_items("--shape", shape_text);
    pd::check(parts.size() <= std::size_t(pd::kMaxRank), "--shape \"{}\" has {} extents; at most {}", shape_text,
              parts.size(), pd::kMaxRank);
    std::vector<std::int64_t> extents;
    for (const std::string& part : parts) extents.push_back(parse_int(part, "--shape extent"));
    options.shape = shape_of(extents);
    if (options.mesh_text.empty()) {
      options.axes.push_back({"sp", options.ranks});
    } else {
      std::vector<std::string> names;
      for (const std::string& item : pd::cli::list_items("--mesh", options.mesh_text)) {
        const auto eq = item.find('=');
        pd::check(eq != std::string::npos && eq > 0, "--mesh \"{}\": axis '{}' is not name=size", options.mesh_text,
                  item);
        names.push_back(item.substr(0, eq));
        options.axes.push_back({names.back(), parse_int(item.substr(eq + 1), "--mesh axis size")});
      }
      pd::cli::check_unique("--mesh", options.mesh_text, names);
      double product = 1;  // in double: never wraps
      for (const pd::MeshAxis& a : options.axes) product *= double(a.size);
      if (product != double(options.ranks))
        throw std::invalid_argument(fmt::format("--mesh \"{}\" holds {:.6g} ranks, but --ranks is {} (the product of the "
                                                "axis sizes must equal --ranks)", options.mesh_text, product,
                                                options.ranks));
    }
    if (!options.path_text.empty())
      for (const std::string& layout : split(options.path_text, ' ')) parse_layout(layout, int(options.axes.size()));
  } catch (const std::exception& e) {
    flags.fail(e.what());
  }
  return options;
}

// Every strategy's compute layouts for a small layer: what its reshard moves the unified activations into.
int print_strategy_layouts(const Options& options) {
  const pd::Shape& shape = options.shape;
  pd::check(shape.rank() == 3, "--strategies needs a shape B,S,H; got {}", shape);
  const int p = options.ranks;
  pd::check(shape[2] % p == 0, "--strategies: H = {} must be divisible by the {} ranks (one head per rank)", shape[2], p);
  const pd::LayerConfig layer = pd::LayerConfig::make(shape[2], p);
  pd::BufferPool pool;
  const pd::SublayerContext ctx(layer, p, shape[0], shape[1], pool);
  const pd::AllStrategies<> strategies;
  auto print = [&](std::string_view what, const pd::TensorLayout& layout) {
    std::vector<std::string> locals;
    for (int r = 0; r < p; ++r) locals.push_back(fmt::format("{}", layout.local_shape(p, r)));
    fmt::print("    {:<7} {:<36} ranks hold {}\n", what, layout.to_string(), fmt::join(locals, " "));
  };
  fmt::print("the unified layout of [b, s, h] = {} over {} ranks:\n", shape, p);
  print("", ctx.unified(ctx.hidden()));
  for (std::size_t i = 0; i < strategies.count; ++i) {
    const pd::Support support = strategies.supports(i, ctx);
    fmt::print("{}{}\n", strategies.name(i), support ? "" : fmt::format(" (cannot run: {})", support.reason));
    const pd::ComputeLayouts attention = strategies.attention_layouts(i, ctx), mlp = strategies.mlp_layouts(i, ctx);
    fmt::print("  attention computes in\n");
    print("reads", attention.input);
    print("writes", attention.output);
    fmt::print("  mlp computes in\n");
    print("reads", mlp.input);
    print("writes", mlp.output);
  }
  return 0;
}

int run(const Options& options) {
  if (options.strategies) return print_strategy_layouts(options);
  const pd::DeviceMesh mesh(options.axes, options.ranks);  // --mesh, or one axis "sp" over every rank
  const pd::Shape& global = options.shape;

  // The path: --path, or the default walk on the last axis (the other axes replicate).
  std::vector<pd::DynamicLayout> path;
  if (!options.path_text.empty()) {
    for (const std::string& layout : split(options.path_text, ' ')) path.push_back(parse_layout(layout, mesh.ndim()));
  } else {
    pd::check(global.rank() >= 3, "the default path shards dims 1 and 2; give --path for a rank-{} shape",
              global.rank());
    for (const char* last : {"R", "S1", "Z1", "S2", "R", "P", "S1", "R"}) {
      std::string text;
      for (int a = 0; a + 1 < mesh.ndim(); ++a) text += "R,";
      path.push_back(parse_layout(text + last, mesh.ndim()));
    }
  }
  pd::check(path.size() >= 1, "--path names no layout");

  pd::Tensor<float> tensor(global);
  for (std::int64_t i = 0; i < tensor.numel(); ++i) tensor.data()[i] = float(i);

  fmt::print("paradyse reshard walk-through: a {} tensor on mesh {} ({} thread ranks)\n", global, mesh, mesh.size());
  fmt::print("values are global linear indices; the chunking rule gives the first n % p chunks one extra element\n");

  const int ranks = mesh.size();
  const auto rank_count = static_cast<std::size_t>(ranks);
  std::vector<std::string> shards(rank_count);
  std::vector<std::uint64_t> bytes(rank_count);
  std::vector<int> wrong(rank_count);
  int failures = 0;
  pd::run_ranks(ranks, [&](pd::ThreadCommunicator& world) {
    pd::MeshCommunicator comm(mesh, world);
    const auto me = std::size_t(world.rank());
    // The shard carries its layout (and through it the global shape): reshard needs only the target.
    pd::ShardedTensor<float> shard{pd::distribute(tensor, path[0], mesh, comm.coordinate()), pd::TensorLayout(global, path[0])};
    for (std::size_t step = 0; step < path.size(); ++step) {
      pd::ReshardReport report;
      if (step > 0) shard = pd::reshard(comm, shard, path[step], &report);
      shards[me] = describe(shard.local, path[step], global, mesh, comm.coordinate());
      bytes[me] = report.bytes_sent;
      // The post-condition: my shard is the slice the layout names (on Partial axes, the terms sum to it).
      pd::DynamicLayout summed = path[step];
      std::vector<int> partial_axes;
      for (int a = 0; a < mesh.ndim(); ++a)
        if (summed[a].is_partial()) {
          summed = summed.with(a, pd::Placement::replicate());
          partial_axes.push_back(a);
        }
      pd::Tensor<float> total = pd::Tensor<float>::copy_of(shard.local.view());
      if (!partial_axes.empty()) {
        pd::ThreadCommunicator group = mesh.group(world, std::span<const int>(partial_axes));
        group.all_reduce(total.span(), total.span(), pd::ReduceOp::sum);
      }
      const pd::Tensor<float> want = pd::distribute(tensor, summed, mesh, comm.coordinate());
      wrong[me] = total.shape() != want.shape() ||
                  !std::equal(want.span().begin(), want.span().end(), total.span().begin());
      world.barrier();
      if (me == 0) {
        if (step == 0)
          fmt::print("\nstart: {}\n", path[0]);
        else
          fmt::print("\nstep {}: {}\n", step, report.plan.to_string(&mesh));
        std::uint64_t sent = 0;
        for (int r = 0; r < ranks; ++r) {
          const auto first = std::find(shards.begin(), shards.end(), shards[std::size_t(r)]) - shards.begin();
          if (first < r)
            fmt::print("  rank {} {}: the same as rank {}\n", r, mesh.coordinate(r), first);
          else
            fmt::print("  rank {} {}: {}\n", r, mesh.coordinate(r), shards[std::size_t(r)]);
          sent += bytes[std::size_t(r)];
          failures += wrong[std::size_t(r)];
        }
        int bad = 0;
        for (int w : wrong) bad += w;
        fmt::print("  bytes sent (all ranks): {}   every shard is the slice its layout names: {}\n", sent,
                   bad == 0 ? "yes" : "NO");
      }
      world.barrier();
    }
  });
  fmt::print("\n{}\n", failures == 0 ? "walk-through complete: every post-condition held"
                                      : "walk-through FAILED: some shard differs from its layout's slice");
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    fmt::print(stderr, "reshard_walkthrough: {}\n", paradyse::bounded_message(e.what()));  // a filesystem_error echoes paths whole
    return 2;
  }
}
