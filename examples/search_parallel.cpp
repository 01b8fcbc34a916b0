// examples/search_parallel.cpp: Hypertron's search of the N-D parallel training space for a model on a cluster.
//
// Prints the best configurations of the chosen space (MFU, step time, memory per device, and the breakdown:
// compute, exposed communication per dimension, pipeline bubble), then the best of each smaller space beside it, so
// that the gain of the high-dimensional space shows. --emit FILE writes the best configuration as a configuration
// file (search/config_file.hpp); --score FILE (or --config dp=..,pp=..,tp=..) predicts that one configuration with
// its full breakdown instead of searching. --validate scores the published rows (Megatron-LM SC'21 Table 1, Llama 3
// 405B) as configuration files, beside the published throughput under both FLOP conventions, and shows what the
// search picks in Megatron's 3-D space and in the full space (--validate --emit DIR writes the rows' files).
//
//   search_parallel --help    (the flags and their defaults, generated from main's statement of them)
#include "paradyse/cli/flags.hpp"
#include "paradyse/core/printable.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/emulation.hpp"
#include "paradyse/plan/plan_names.hpp"
#include "paradyse/search/config_file.hpp"
#include "paradyse/search/search.hpp"
#include "paradyse/search/validation.hpp"

#include <fmt/core.h>

#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>
#include <system_error>
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
  std::string flops = "causal";
  std::string cp_scheme = "ring";
  std::string precision = "bf16";
  std::string emulate;  // price the cluster's links as train_gpt --emulate paces them
  bool cp_gathers_weights = false;  // tp inside cp as train_gpt's MegatronRing (TrainingSetup::cp_gathers_weights)
  std::string trainer = "megatron";
  std::string score;   // a configuration file to predict
  std::string config;  // or the configuration as key=value text
  std::string emit;    // where to write the best configuration (with --validate: a folder for the rows)
};

search::TrainingModel load_model(const std::string& name) { return search::load_training_model(name); }
// How an emitted file names a model or cluster: a preset by its name, anything else inline.
std::string spec_to_emit(const std::string& spec) { return search::is_json_file(spec) ? std::string() : spec; }
search::ClusterProfile load_cluster(const std::string& name) { return search::load_cluster(name); }

// --emulate NODE: the cluster's compute with NODE's intra-node link, stretched by NODE's GEMM rate over the cluster
// device's (cost/emulation.hpp, what train_gpt --emulate paces thread ranks at), on every link level
// (search::with_paced_links). Replaces the links (applying it twice gives the same cluster).
search::ClusterProfile emulated(search::ClusterProfile cluster, const std::string& node) {
  if (node.empty()) return cluster;
  const pd::cost::Emulation e = pd::cost::emulate(pd::cost::builtin_profile(node), cluster.device);
  cluster = search::with_paced_links(std::move(cluster), e.profile.intra_node);
  const std::string suffix = fmt::format(" (links of {} x {:.0f})", node, e.slowdown);
  if (!cluster.source.ends_with(suffix)) cluster.source += suffix;
  return cluster;
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
                                                int top, const std::string& cp_scheme) {
  std::vector<search::SearchResult> results;
  for (const char* name : {"3d", "4d", "7d"}) {
    search::SearchOptions options{.space = search::space_by_name(name), .top_k = top};
    if (cp_scheme == "all-gather") options.space.cp_schemes = {search::CpScheme::all_gather};
    if (cp_scheme == "both") options.space.cp_schemes = {search::CpScheme::ring, search::CpScheme::all_gather};
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

// Under train_gpt's step, what its planner picks per sublayer on the stage group (search/stage_group.hpp), named as
// train_gpt's table names a layer ("MTS/METP"), and each pick's time per layer and micro-batch.
void print_stage_group(const search::Scored& r) {
  if (!search::prices_stage_group(r.model, r.setup, r.config)) return;
  const search::StageGroupPrice price = search::price_stage_group(r.model, r.setup, r.cluster, r.config);
  fmt::print("  stage group     cp {} x tp {}: train_gpt's planner picks {}/{} in every dense layer (per layer and "
             "micro-batch, seconds):\n", r.config.cp, r.config.tp(), pd::plan::initials(price.sublayers[0].strategy),
             pd::plan::initials(price.sublayers[1].strategy));
  for (pd::cost::Sublayer part : pd::cost::kAllSublayers) {
    const search::SublayerPrice& s = price.sublayers[std::size_t(part)];
    fmt::print("    {:<9} {:<12} {:.4f}  (forward {:.4f} compute + {:.4f} exposed communication, backward {:.4f} + "
               "{:.4f})\n", pd::cost::name_of(part), s.strategy, s.time_s(), s.forward_compute_s, s.forward_comm_s,
               s.backward_compute_s, s.backward_comm_s);
  }
}

// One configuration's prediction with every term, and the published figure beside it when the file gives one.
void print_score(const search::Scored& r) {
  const search::Estimate& e = r.estimate;
  using search::CommDim;
  fmt::print("{}\n", search::describe(r.model));
  fmt::print("cluster {}, {} devices; seq {}, global batch {}; FLOPs counted {}{}\n", r.cluster.name,
             r.config.devices(), r.setup.seq, r.setup.global_batch, search::name_of(r.setup.flops),
             r.setup.cp_gathers_weights ? "; tp inside cp gathers weights over cp (MegatronRing)" : "");
  fmt::print("trainer {}\n", search::name_of(r.setup.trainer));
  fmt::print("configuration {}\n", search::to_string(r.config));
  if (!e.valid) {
    fmt::print("  cannot run: {}\n", e.problem);
    return;
  }
  fmt::print("  step            {:>10.4f} s   MFU {:.1f}%  ({:.1f} TFLOP/s per device, {} FLOPs)\n", e.step_s,
             100 * e.mfu, e.model_flops / (e.step_s * double(r.config.devices())) / 1e12,
             search::name_of(r.setup.flops));
  fmt::print("  compute         {:>10.4f} s   (of which recomputation {:.4f} s)\n", e.compute_s, e.recompute_s);
  for (CommDim d : search::kAllCommDims)
    fmt::print("  exposed {:<7} {:>10.4f} s\n", search::name_of(d), e.exposed(d));
  print_stage_group(r);
  fmt::print("  bubble          {:>10.4f} s\n", e.bubble_s);
  fmt::print("  optimizer       {:>10.4f} s\n", e.optimizer_s);
  const search::MemoryEstimate& m = e.memory;
  fmt::print("  memory per device {:.2f} GiB of {:.2f} GiB usable: {} (weights {:.2f}, gradients {:.2f}, optimizer "
             "{:.2f}, activations {:.2f} for {:.1f} micro-batches in flight, transient {:.2f})\n",
             m.total() / kGiB, e.capacity_bytes / kGiB, e.feasible ? "fits" : "DOES NOT FIT", m.weights / kGiB,
             m.gradients / kGiB, m.optimizer / kGiB, m.activations / kGiB, m.in_flight, m.transient / kGiB);
  if (r.published) {
    fmt::print("  published {:.0f} TFLOP/s per device ({} count{}); predicted {:.1f} (attention full square, "
               "{:+.1f}%), {:.1f} (causal half, {:+.1f}%)\n",
               r.published->tflops_per_gpu, search::name_of(r.published->counting),
               r.published->source.empty() ? "" : ", " + r.published->source,
               r.tflops_per_gpu(search::FlopConvention::full),
               100 * (r.tflops_per_gpu(search::FlopConvention::full) / r.published->tflops_per_gpu - 1),
               r.tflops_per_gpu(search::FlopConvention::causal),
               100 * (r.tflops_per_gpu(search::FlopConvention::causal) / r.published->tflops_per_gpu - 1));
  }
}

// The published rows scored as configuration files, one line each.
void print_published_rows(const std::string& emit_folder) {
  fmt::print("Published rows scored as fixed configurations (search_parallel --score; TFLOP/s per device counted as "
             "each paper counts, attention as the full square and as the causal half):\n");
  fmt::print("{:<27} {:<62} {:>8} {:>9} {:>10} {:>7} {:>10} {:>7}\n", "row", "configuration", "step s", "published",
             "full", "error", "causal", "error");
  for (const search::PublishedRow& row : search::published_rows()) {
    if (!emit_folder.empty())  // the folder was made (or refused) in main, before any work
      pd::json::save_file(row.file, (std::filesystem::path(emit_folder) / (row.name + ".json")).string(), "--emit");
    const search::Scored r = search::score(search::config_file_from_json(row.file, row.name), {}, {}, {});
    const double published = r.published->tflops_per_gpu;
    const double full = r.tflops_per_gpu(search::FlopConvention::full);
    const double causal = r.tflops_per_gpu(search::FlopConvention::causal);
    fmt::print("{:<27} {:<62} {:>8.2f} {:>9.0f} {:>10.1f} {:>+6.1f}% {:>10.1f} {:>+6.1f}%\n", row.name,
               search::to_string(r.config), r.estimate.step_s, published, full, 100 * (full / published - 1), causal,
               100 * (causal / published - 1));
  }
  if (!emit_folder.empty()) fmt::print("(the rows' configuration files are in {})\n", emit_folder);
  fmt::print("\n");
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
      "[{name, domain_devices, alpha_s, bytes_per_s, [launch_s], [p2p_bytes_per_s]}]}.");
  flags.text("--model", o.model, "model preset or config.json file", "gpt-175b|llama3-405b|mixtral-8x22b|deepseek-v3|FILE.json")
      .nonempty("a model preset or a .json file");
  flags.integer("--devices", o.devices, std::int64_t(1), std::int64_t(1) << 24, "devices");
  flags.text("--cluster", o.cluster, "cluster preset or file", "dgx-a100|dgx-h100|ascend-supernode|FILE.json")
      .nonempty("a cluster preset or a .json file");
  flags.integer("--seq", o.seq, std::int64_t(1), std::int64_t(1) << 24, "sequence length");
  flags.integer("--global-batch", o.global_batch, std::int64_t(1), std::int64_t(1) << 24, "sequences per step");
  flags.choice("--space", o.space, {"3d", "4d", "7d"}, "the largest space searched");
  flags.integer("--top", o.top, 1, 1000, "configurations printed");
  flags.flag("--validate", o.validate,
             "the performance model against Megatron-LM's SC'21 Table 1 and Llama 3 405B (the published rows as "
             "configuration files), and the search in Megatron's space");
  flags.choice("--flops", o.flops, {"causal", "full"},
               "how MFU counts causal attention: the half square (causal) or the full square");
  flags.choice("--precision", o.precision, {"bf16", "fp32"},
               "what the run trains in: bf16 (bf16 weights and activations, fp32 gradients, master weights and Adam "
               "moments, as Megatron-LM) or fp32 throughout (train_gpt on CPU thread ranks)");
  flags.choice("--emulate", o.emulate, {"a100", "h100", "h200"},
               "price the links as train_gpt --emulate paces them: that 8-GPU node's intra-node link, latency and "
               "bandwidth stretched by its GEMM rate over the cluster device's (the cluster's compute kept)")
      .without_default();
  flags.flag("--cp-gathers-weights", o.cp_gathers_weights,
             "tp inside cp as train_gpt's MegatronRing: each layer's weights sharded over cp x tp and all-gathered over "
             "cp around each sublayer's use (memory and the exposed gathers); off: replicated over cp, as Megatron-LM "
             "(a configuration file's cp_gathers_weights wins)");
  flags.choice("--trainer", o.trainer, {"megatron", "train_gpt"},
               "what the step posts besides the model's collectives: megatron (one gradient bucket per layer, "
               "overlapped with the backward, as Megatron-LM, DeepSpeed, FSDP) or train_gpt (one collective per "
               "packed tensor after the backward, the embedding's and head's gradients over the dense group, the "
               "loss and peak memory over every rank, each dense layer's cp x tp stage group priced as train_gpt's "
               "planner prices it, the cheapest strategy per sublayer by its dry run); a configuration file's trainer "
               "wins");
  flags.choice("--cp-scheme", o.cp_scheme, {"ring", "all-gather", "both"},
               "context parallelism searched as a ring, as Llama 3's all-gather, or both");
  flags.text("--score", o.score, "predict this configuration file instead of searching (the --emit schema)",
             "FILE.json")
      .nonempty("a configuration file (--emit wrote)");
  flags.text("--config", o.config, "predict this configuration instead of searching",
             "dp=N,pp=N,cp=N,tp=N|tp_x=N,tp_y=N,ep=N,etp=N,zero=N,virtual_stages=N,micro_batch=N,recompute=none|"
             "selective|full,sequence_parallel=true|false,cp_scheme=ring|all-gather")
      .nonempty("a configuration such as dp=2,tp=4");
  flags.text("--emit", o.emit, "write the best configuration to this file (with --validate: the rows to this folder)",
             "FILE.json|DIR")
      .nonempty("a file name (with --validate: a folder)");
  flags.parse(argc, argv);
  if (!o.score.empty() && !o.config.empty()) flags.fail("--score and --config both name a configuration; give one");
  if (o.validate && (!o.score.empty() || !o.config.empty()))
    flags.fail("--validate scores its own rows; drop --score/--config");
  if (o.validate && !o.emit.empty()) {  // --validate --emit DIR: the rows' folder, made here (it aborted the program)
    std::error_code error;
    std::filesystem::create_directories(o.emit, error);
    if (error || !std::filesystem::is_directory(o.emit))
      flags.fail(fmt::format("--emit {}: --validate writes its rows into this folder, but it cannot be made: {}",
                             pd::printable(o.emit), error ? error.message() : std::string("it is not a folder")));
  }
  try {
    if (o.validate) {
      print_published_rows(o.emit);
      validate_against_megatron();
      return 0;
    }
    search::TrainingSetup setup;
    setup.seq = o.seq;
    setup.global_batch = o.global_batch;
    setup.flops = o.flops == "causal" ? search::FlopConvention::causal : search::FlopConvention::full;
    setup.cp_gathers_weights = o.cp_gathers_weights;
    setup.trainer = o.trainer == "megatron" ? search::Trainer::megatron : search::Trainer::train_gpt;
    if (o.precision == "fp32") {  // fp32 weights, gradients and activations; Adam's two fp32 moments
      setup.activation_bytes = 4;
      setup.gradient_reduce_bytes = 4;
      setup.precision = {.parameter_bytes = 4, .gradient_bytes = 4, .optimizer_bytes = 8};
    }
    if (!o.score.empty() || !o.config.empty()) {
      search::ConfigFile file;
      if (!o.score.empty()) file = search::load_config_file(o.score);
      else file.config = search::config_from_text(o.config);
      const search::TrainingModel model = file.model ? *file.model : load_model(o.model);
      if (file.cluster) file.cluster = emulated(*file.cluster, o.emulate);  // the file's cluster is the one scored
      const search::ClusterProfile cluster = file.cluster ? *file.cluster : emulated(load_cluster(o.cluster), o.emulate);
      const search::Scored r = search::score(file, model, cluster, setup);
      print_score(r);
      if (!o.emit.empty()) {
        pd::json::save_file(search::config_file_to_json(r.config, r.model,
                                                        spec_to_emit(file.model ? file.model_spec : o.model), r.cluster,
                                                        spec_to_emit(file.cluster ? file.cluster_spec : o.cluster),
                                                        r.setup, r.published),
                            o.emit, "--emit");
        fmt::print("wrote {}\n", o.emit);
      }
      return r.estimate.feasible ? 0 : 1;
    }
    const search::PerformanceModel model(load_model(o.model), emulated(load_cluster(o.cluster), o.emulate), setup,
                                         o.devices);
    fmt::print("{}\n", search::describe(model.model()));
    fmt::print("cluster {} ({}), {} devices, {:.0f} GiB usable each; seq {}, global batch {}\n", model.cluster().name,
               model.cluster().source, o.devices, model.capacity_bytes() / kGiB, o.seq, o.global_batch);
    const std::vector<search::SearchResult> results = search_spaces(model, o.space, o.top, o.cp_scheme);
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
    if (!o.emit.empty()) {
      if (chosen.top.empty()) {
        fmt::print(stderr, "search_parallel: nothing fits, so nothing was written to {}\n", o.emit);
        return 1;
      }
      pd::json::save_file(search::config_file_to_json(chosen.top.front().config, model.model(), spec_to_emit(o.model),
                                                      model.cluster(), spec_to_emit(o.cluster), setup),
                          o.emit, "--emit");
      fmt::print("\nwrote the best configuration to {} (search_parallel --score {} predicts it again)\n", o.emit,
                 o.emit);
    }
  } catch (const std::exception& e) {  // pd::Error, and anything from the standard library (a filesystem error)
    fmt::print(stderr, "search_parallel: {}\n", paradyse::bounded_message(e.what()));  // a filesystem_error echoes paths whole
    return 1;
  }
  return 0;
}
