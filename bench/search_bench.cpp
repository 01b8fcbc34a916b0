// bench/search_bench.cpp: the time of Hypertron's search (search/search.hpp) on one core, pruned (the time bound and
// memory pruning) against brute force (every configuration evaluated) measured in the same run, per model, cluster
// and space. Prints medians of the repeats, the configurations evaluated by each, and whether both found the same
// best configuration (they must). Issue 13's target: the 7-D space of Mixtral 8x22B on 2,048 devices under 10 s.
//
//   search_bench [--repeats N] [--quick]
#include "paradyse/cli/flags.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/search/search.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace search = paradyse::search;
using paradyse::median;

int main(int argc, char** argv) {
  int repeats = 3;
  bool quick = false;
  paradyse::cli::Flags flags(
      "search_bench", "Times the pruned search against brute force for GPT-175B, Llama-3 405B, Mixtral 8x22B and "
                      "DeepSeek-V3 on 2,048 devices of DGX H100 and the Ascend supernode, 3-D and 7-D spaces.");
  flags.integer("--repeats", repeats, 1, 100, "repeats (the median is printed)");
  flags.flag("--quick", quick, "Mixtral 8x22B on the Ascend supernode only, one repeat");
  flags.parse(argc, argv);
  if (quick) repeats = 1;
  std::vector<std::string> models{"gpt-175b", "llama3-405b", "mixtral-8x22b", "deepseek-v3"};
  std::vector<std::string> clusters{"dgx-h100", "ascend-supernode"};
  if (quick) models = {"mixtral-8x22b"}, clusters = {"ascend-supernode"};
  search::TrainingSetup setup;
  setup.seq = 4096;
  setup.global_batch = 1024;
  fmt::print("2,048 devices, seq 4096, global batch 1024, top 5; seconds are medians of {} runs on one core\n", repeats);
  fmt::print("{:<14} {:<17} {:>5} {:>7} {:>11} {:>11} {:>12} {:>12} {:>8} {:>6}\n", "model", "cluster", "space",
             "meshes", "pruned s", "brute s", "evals pruned", "evals brute", "speedup", "same");
  for (const std::string& model_name : models)
    for (const std::string& cluster_name : clusters) {
      const search::PerformanceModel model(search::model_preset(model_name), search::cluster_preset(cluster_name),
                                           setup, 2048);
      for (const char* space : {"3d", "7d"}) {
        std::vector<double> pruned_s, brute_s;
        search::SearchResult pruned, brute;
        for (int r = 0; r < repeats; ++r) {
          pruned = search::search(model, {.space = search::space_by_name(space), .top_k = 5});
          brute = search::search(model, {.space = search::space_by_name(space), .top_k = 5, .prune = false});
          pruned_s.push_back(pruned.seconds);
          brute_s.push_back(brute.seconds);
        }
        const bool same = !pruned.top.empty() && !brute.top.empty() &&
                          pruned.top.front().config == brute.top.front().config;
        fmt::print("{:<14} {:<17} {:>5} {:>7} {:>11.4f} {:>11.4f} {:>12} {:>12} {:>7.1f}x {:>6}\n", model_name,
                   cluster_name, space, pruned.meshes, median(pruned_s), median(brute_s), pruned.evaluated,
                   brute.evaluated, median(brute_s) / median(pruned_s), same ? "yes" : "NO");
      }
    }
  return 0;
}
