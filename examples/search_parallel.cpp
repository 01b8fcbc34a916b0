// examples/search_parallel.cpp: Hypertron's search of the N-D parallel training space for a model on a cluster.
//
// Prints the best configurations of the chosen space (MFU, step time, memory per device, and the breakdown:
// compute, exposed communication per dimension, pipeline bubble), then the best of each smaller space beside it, so
// that the gain of the high-dimensional space shows. --validate prints the performance model against Megatron-LM's
// published runs (SC'21, Table 1) and what the search picks in their 3-D space and in the full space.
//
//   search_parallel --help    (the flags and their defaults, generated from main's statement of them)
#include "paradyse/cli/flags.hpp"
#include "paradyse/search/search.hpp"
#include "paradyse/search/validation.hpp"

#include <fmt/core.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace pd = paradyse;
namespace search = paradyse::search;

namespace {

struct Options {
  std::string model = "mixtral-8x22b";
  std::string cluster = "ascend-supernode";
  std::int64_t devices = 2048;
  std::int64_t seq = 4096;
  std::int64_t global_batch = 1024;
  std::string space = "7d";
  int top = 5;
  bool validate = false;
};

bool is_json_file(const std::string& name) { return name.size() > 5 && name.substr(name.size() - 5) == ".json"; }

search::TrainingModel load_model(const std::string& name) {
  if (!is_json_file(name)) return search::model_preset(name);
  return search::model_from_json(pd::json::load_file(name), std::filesystem::path(name).stem().string());
}
search::ClusterProfile load_cluster(const std::string& name) {
  if (!is_json_file(name)) return search::cluster_preset(name);
  return search::cluster_from_json(pd::json::load_file(name));
}

constexpr double kGiB = double(1 << 30);

void print_header() {
  fmt::print("{:>3}  {:<62} {:>8} {:>6} {:>7} {:>8} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7}\n", "#", "configuration",
             "step s", "MFU", "mem GiB", "compute", "tp", "cp", "ep", "pp", "dp", "bubble");
}
void print_candidate(int rank, const search::Candidate& c) {
  const search::Estimate& e = c.estimate;
  using search::CommDim;
  fmt::print("{:>3}  {:<62} {:>8.3f} {:>5.1f}% {:>7.1f} {:>8.3f} {:>7.3f} {:>7.3f} {:>7.3f} {:>7.3f} {:>7.3f} {:>7.3f}\n",
             rank, search::to_string(c.config), e.step_s, 100 * e.mfu, e.memory.total() / kGiB, e.compute_s,
             e.exposed(CommDim::tp), e.exposed(CommDim::cp), e.exposed(CommDim::ep), e.exposed(CommDim::pp),
             e.exposed(CommDim::dp), e.bubble_s);
}
void print_statistics(const search::SearchResult& r) {
  fmt::print("     searched in {:.3f} s: {} meshes ({} skipped by the time bound, {} by memory), {} evaluations, {} "
             "fitting\n",
             r.seconds, r.meshes, r.meshes_bounded, r.meshes_out_of_memory, r.evaluated, r.feasible);
}

// The best of each space up to `largest`, side by side.
std::vector<search::SearchResult> search_spaces(const search::PerformanceModel& model, const std::string& largest,
                                                int top) {
  std::vector<search::SearchResult> results;
  for (const char* name : {"3d", "4d", "7d"}) {
    search::SearchOptions options{.space = search::space_by_name(name), .top_k = top};
    results.push_back(search::search(model, options));
    if (largest == name) break;
  }
  return results;
}

void print_gains(const std::vector<search::SearchResult>& results) {
  const char* names[] = {"3d", "4d", "7d"};
  for (std::size_t i = 0; i < results.size(); ++i) {
    const search::SearchResult& r = results[i];
    if (r.top.empty()) {
      fmt::print("  best in {}: nothing fits\n", names[i]);
      continue;
    }
    const search::Candidate& best = r.top.front();
    std::string gain;
    if (i > 0 && !results[0].top.empty())
      gain = fmt::format("  gain over 3d {:.2f}x", results[0].top.front().estimate.step_s / best.estimate.step_s);
    fmt::print("  best in {}: {:<62} step {:.3f} s  MFU {:.1f}%  {:.1f} GiB  ({:.3f} s search){}\n", names[i],
               search::to_string(best.config), best.estimate.step_s, 100 * best.estimate.mfu,
               best.estimate.memory.total() / kGiB, r.seconds, gain);
  }
}

void validate_against_megatron() {
  fmt::print("Megatron-LM, Narayanan et al. SC'21 Table 1 (A100-80GB, s = 2048, full recomputation), by prediction:\n");
  fmt::print("{:<11} {:>5} {:>4} {:>5} {:>6}  {:<44} {:>10} {:>10} {:>7}\n", "model", "tp", "pp", "gpus", "batch",
             "predicted with (mb, v chosen by the model)", "published", "predicted", "error");
  std::vector<search::Prediction> predictions;
  for (const search::PublishedRun& run : search::megatron_sc21_runs()) {
    const search::Prediction p = search::predict_published(run);
    predictions.push_back(p);
    fmt::print("{:<11} {:>5} {:>4} {:>5} {:>6}  {:<44} {:>10.0f} {:>10.1f} {:>+6.1f}%\n", run.name, run.tp, run.pp,
               run.gpus, run.global_batch,
               fmt::format("mb={} v={} step {:.2f} s", p.config.micro_batch, p.config.virtual_stages, p.estimate.step_s),
               run.tflops_per_gpu, p.tflops_per_gpu, 100 * p.error());
  }
  fmt::print("\nThe search with the same software (no flash attention, no overlap), in their 3-D space and in the full "
             "space:\n");
  for (const search::Prediction& p : predictions) {
    const search::PerformanceModel model(search::megatron_model(p.run), search::dgx_a100(),
                                         search::megatron_sc21_setup(p.run), p.run.gpus);
    fmt::print("{} on {} GPUs: published configuration {:.2f} s per step\n", p.run.name, p.run.gpus,
               p.estimate.step_s);
    for (const char* name : {"3d", "7d"}) {
      const search::SearchResult r = search::search(model, {.space = search::space_by_name(name), .top_k = 1});
      if (r.top.empty()) {
        fmt::print("  {}: nothing fits\n", name);
        continue;
      }
      const search::Candidate& best = r.top.front();
      fmt::print("  {}: {:<62} step {:.2f} s  MFU {:.1f}%  gain {:.2f}x  ({:.3f} s search)\n", name,
                 search::to_string(best.config), best.estimate.step_s, 100 * best.estimate.mfu,
                 p.estimate.step_s / best.estimate.step_s, r.seconds);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  pd::cli::Flags flags(
      "search_parallel",
      "Hypertron's search of the N-D parallel training space for a model on a cluster. A model file has the keys of "
      "a Hugging Face config.json; a cluster file is {name, peak_flops_per_s, device: <hardware profile>, levels: "
      "[{name, domain_devices, alpha_s, bytes_per_s}]}.");
  flags.text("--model", o.model, "model preset or config.json file", "gpt-175b|llama3-405b|mixtral-8x22b|deepseek-v3|FILE.json");
  flags.integer("--devices", o.devices, std::int64_t(1), std::int64_t(1) << 24, "devices");
  flags.text("--cluster", o.cluster, "cluster preset or file", "dgx-a100|dgx-h100|ascend-supernode|FILE.json");
  flags.integer("--seq", o.seq, std::int64_t(1), std::int64_t(1) << 24, "sequence length");
  flags.integer("--global-batch", o.global_batch, std::int64_t(1), std::int64_t(1) << 24, "sequences per step");
  flags.choice("--space", o.space, {"3d", "4d", "7d"}, "the largest space searched");
  flags.integer("--top", o.top, 1, 1000, "configurations printed");
  flags.flag("--validate", o.validate,
             "the performance model against Megatron-LM's SC'21 Table 1, and the search in their space");
  flags.parse(argc, argv);
  try {
    if (o.validate) {
      validate_against_megatron();
      return 0;
    }
    search::TrainingSetup setup;
    setup.seq = o.seq;
    setup.global_batch = o.global_batch;
    const search::PerformanceModel model(load_model(o.model), load_cluster(o.cluster), setup, o.devices);
    fmt::print("{}\n", search::describe(model.model()));
    fmt::print("cluster {} ({}), {} devices, {:.0f} GiB usable each; seq {}, global batch {}\n", model.cluster().name,
               model.cluster().source, o.devices, model.capacity_bytes() / kGiB, o.seq, o.global_batch);
    const std::vector<search::SearchResult> results = search_spaces(model, o.space, o.top);
    const search::SearchResult& chosen = results.back();
    fmt::print("\nbest {} configurations in the {} space (seconds per step; tp..dp: exposed communication):\n",
               chosen.top.size(), o.space);
    if (chosen.top.empty()) {
      fmt::print("  no configuration fits in memory\n");
    } else {
      print_header();
      for (std::size_t i = 0; i < chosen.top.size(); ++i) print_candidate(int(i) + 1, chosen.top[i]);
    }
    print_statistics(chosen);
    fmt::print("\n");
    print_gains(results);
  } catch (const pd::Error& e) {
    fmt::print(stderr, "search_parallel: {}\n", e.what());
    return 1;
  }
  return 0;
}
