// examples/train_gpt.cpp: trains a small byte-level GPT on the State of the Union corpus with ParaDySe's per-layer
// strategy switching, on p thread ranks with a per-rank memory cap.
//
// Each step takes one document window (data/corpus.hpp: a document drawn with the seed, its length scaled so
// that the longest speech gives --max-len), asks the exact planner for the fastest strategy of every layer and
// sublayer that fits the cap (cost models: memory exact per strategy, time from a hardware profile of this machine),
// and runs forward, backward and AdamW with that plan. It prints per step the length, the plan, the loss, the step
// time, and each rank's measured peak memory against the cap and against the memory model's prediction.
// `--strategy NAME` forces one strategy everywhere instead: long inputs then run out of memory under the cap
// (OutOfMemory is caught, reported and the step skipped; the model is left as it was).
//
// Hardware profile: --profile FILE.json, or else the one calibrated on this machine by cost/calibrate.hpp (a quick
// calibration on the first run, cached in build/train_gpt_profile_p<P>.json). Memory cap: --cap-mib, or else a
// default from the memory model, between what all-METP needs at --max-len and what all-MegatronTS needs there, so
// that the longest inputs do not fit with MegatronTS but do with METP.
//
//   train_gpt --help     (every flag with its range and default: generated from parse() below)
// --save writes a safetensors checkpoint of the global weights at the end (model/checkpoint.hpp); --load starts
// from one (saved on any number of ranks, same model configuration).
#include "command_line.hpp"
#include "csv_table.hpp"
#include "progress.hpp"
#include "train_gpt/train_mesh.hpp"
#include "train_gpt/train_moe.hpp"
#include "train_gpt/training_data.hpp"
#include "train_gpt/training_options.hpp"

#include "paradyse/comm/ranks.hpp"
#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/emulation.hpp"
#include "paradyse/cost/from_config.hpp"
#include "paradyse/cost/memory_model.hpp"
#include "paradyse/cost/model_flops.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/data/packing.hpp"
#include "paradyse/model/byte_gpt.hpp"
#include "paradyse/model/checkpoint.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/resume.hpp"
#include "paradyse/plan/gpt_costs.hpp"
#include "paradyse/plan/memory_cap.hpp"
#include "paradyse/plan/plan_names.hpp"
#include "paradyse/plan/planner.hpp"
#include "paradyse/plan/stack_plan.hpp"
#if PARADYSE_WITH_CUDA
#include "paradyse/ops/cuda_backend.hpp"
#endif

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace pd = paradyse;
using Model = pd::Gpt<pd::AllStrategies<>>;  // on the host (ops::Cpu)
#if PARADYSE_WITH_CUDA
using DeviceModel = pd::Gpt<pd::AllStrategies<pd::ops::Cuda>, pd::ops::Cuda>;  // --device cuda: on one GPU
#endif
template <class M>
struct StrategiesOf;
template <class S, class B>
struct StrategiesOf<pd::Gpt<S, B>> {
  using type = S;
  static constexpr bool on_device = pd::ops::memory_space_of<B> == pd::MemorySpace::device;
};

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

using pd::examples::TrainingOptions;  // examples/training_options.hpp: what the flags below parse into

// The usage, generated from the flags parse() states (usage() is also called for problems found after parsing).
std::string& usage_text() {
  static std::string text;
  return text;
}
[[noreturn]] void usage(const std::string& problem) {
  paradyse::examples::print_usage_and_exit("train_gpt", problem, usage_text());
}

TrainingOptions parse(int argc, char** argv) {
  TrainingOptions o;
  std::int64_t zero_stage = 0;
  std::string backend_name = "threads";  // --backend, read into o.backend
  paradyse::examples::Flags flags(
      "train_gpt",
      "Trains a byte-level GPT on the bundled State of the Union corpus (or --corpus DIR) on p ranks under a per-rank "
      "memory cap, the exact planner choosing a strategy for every attention and MLP sublayer of every layer and "
      "step (or --strategy NAME everywhere). Prints per step the length, the plan, the loss, the time, the model "
      "FLOPs utilisation and the measured peak memory against the model's prediction; a summary at the end.");
  flags.integer("--steps", o.steps, 1, 10'000'000,
                "documents (windows) drawn: one per step, or with --pack-tokens / --pack-documents packed into steps");
  flags.integer("--seed", o.seed, std::uint64_t(1), std::numeric_limits<std::uint64_t>::max(),
                "seed of the weights and the data");
  flags.integer("--ranks", o.ranks, 1, 256, "ranks (with --mesh: may be left out)");
  flags.integer("--layers", o.layers, 1, 4096, "transformer layers");
  flags.integer("--hidden", o.hidden, std::int64_t(1), std::int64_t(1) << 20, "hidden size");
  flags.integer("--heads", o.heads, std::int64_t(1), std::int64_t(1) << 16, "attention heads");
  flags.integer("--min-len", o.min_len, std::int64_t(1), std::int64_t(1) << 24, "shortest window (tokens)");
  flags.integer("--max-len", o.max_len, std::int64_t(1), std::int64_t(1) << 24,
                "longest window: the longest document is scaled to it");
  flags.number("--cap-mib", o.cap_mib, {.min = 0, .max = 1 << 30, .min_open = true},
               "memory cap per rank in MiB (default: from the memory model, between what all-METP and all-MegatronTS "
               "need at --max-len; with --experts: the planner's budget)")
      .without_default();
  flags.choice("--strategy", o.strategy, pd::cost::default_catalog().names(),
               "one strategy everywhere instead of the planner (long inputs may then run out of memory: the step is "
               "reported and skipped)")
      .without_default();
  flags.number("--lr", o.lr, {.min = 0, .max = 100, .min_open = true}, "peak learning rate (AdamW, linear warm-up)");
  flags.choice("--order", o.sorted, "sorted", "random", "document order: sorted by length (curriculum) or shuffled");
  flags.text("--save", o.save,
             "write the global weights at the end as safetensors (with --experts: a Hugging Face folder, Mixtral or "
             "Qwen2-MoE)", "PATH");
  flags.text("--load", o.load, "start from weights --save wrote (on any number of ranks, same model)", "PATH");
  flags.text("--profile", o.profile,
             "hardware profile: a JSON file or a built-in name (default: calibrated on this machine once, cached in "
             "build/train_gpt_profile_p<P>.json)", "A100-SXM4-80GB-x8|H100-SXM-80GB-x8|H200-SXM-141GB-x8|FILE.json");
  flags.text("--corpus", o.corpus, "a folder of text documents (default: the bundled data/corpus/sotu.tar.xz)", "DIR");
  flags.choice("--backend", backend_name, {"threads", "mpi"},
               "threads: P thread ranks; mpi: one rank per process, run as mpirun -np P train_gpt --backend mpi "
               "--ranks P ...");
  flags.integer("--checkpoint-every", o.checkpoint_every, 1, 10'000'000,
                "every N steps a training checkpoint (weights, AdamW moments, step, data position, options) "
                "DIR/step_<next step>.safetensors")
      .without_default();
  flags.integer("--keep", o.keep, 1, 1'000'000, "training checkpoints kept (the newest)");
  flags.text("--checkpoint-dir", o.checkpoint_dir, "the folder of the training checkpoints", "DIR");
  flags.text("--resume", o.resume,
             "continue the run a training checkpoint was saved in, with its options (options given here override "
             "them); on the same number of thread ranks the losses are bit for bit those of a run that never stopped",
             "PATH");
  flags.integer("--stop-after", o.stop_after, 1, 10'000'000,
                "stop after N steps of this run and write a training checkpoint there (the data schedule stays that "
                "of --steps; --resume continues)")
      .without_default();
  flags.text("--csv", o.csv, "the per-step table as CSV (scripts/plot.py draws it)", "FILE");
  flags.integer("--pack-tokens", o.pack_tokens, std::int64_t(1), std::int64_t(1) << 30,
                "documents packed into steps of up to B tokens: rows of similar length, one document per row, padded "
                "with masked tokens")
      .without_default();
  flags.integer("--pack-documents", o.pack_documents, std::int64_t(1), std::int64_t(1) << 30,
                "the documents back to back in ONE sequence of up to B tokens per step (first-fit decreasing), "
                "attention masked to each document, RoPE positions restarting at each, the loss never crossing "
                "documents; the planner plans each step from its documents (not with --pack-tokens)")
      .without_default();
  flags.choice("--pack-order", o.pack_balanced, "balanced", "as-packed",
               "--pack-documents: each sequence's documents ordered to even out the ranks' causal attention under the "
               "zigzag layout, or as packed (longest first)");
  flags.choice("--device", o.device, {"cpu", "cuda"},
               "cuda: the P ranks are threads on one GPU (cuda_local, ops::Cuda, fp32); default profile "
               "H200-SXM-141GB-x8; --save, --load, --resume and training checkpoints are host-only for now");
  flags.choice("--emulate", o.emulate, {"a100", "h100", "h200"},
               "thread ranks paced like that 8-GPU node's links (latency and bandwidth stretched by its GEMM rate over "
               "this machine's), planned with those links (see also bench/emulated_switching)")
      .without_default();
  flags.text("--mesh", o.mesh,
             "D x P x C ranks: dp replicas (ZeRO --zero over dp), P pipeline stages (1F1B, one row per micro-batch), "
             "cp groups in which the strategies switch per layer; the losses of the single group (--ranks C) on the "
             "same batches (use --pack-tokens to batch rows; with --pack-documents each dp replica trains a packed "
             "sequence of its own, planned by its cp group); with --experts the MoE layers run over dp x cp",
             "dp=D,pp=P,cp=C");
  flags.integer("--zero", zero_stage, std::int64_t(0), std::int64_t(2), "--mesh: the ZeRO stage over dp");
  flags.integer("--experts", o.experts, std::int64_t(1), std::int64_t(1) << 16,
                "an MoE GPT of E experts of width ffn/K, every sublayer planned (MoE: ExpertParallel or "
                "ExpertTensorParallel), expert load and router losses printed")
      .without_default();
  flags.integer("--top-k", o.top_k, std::int64_t(1), std::int64_t(1) << 16, "--experts: experts per token");
  flags.integer("--shared-experts", o.shared_experts, std::int64_t(0), std::int64_t(1) << 10,
                "--experts: shared experts");
  flags.integer("--first-dense", o.first_dense, 0, 4096, "--experts: the first N layers dense");
  usage_text() = flags.usage();
  flags.parse(argc, argv);
  o.zero = pd::ZeroStage(int(zero_stage));
  o.backend = backend_name == "mpi" ? pd::RankBackend::mpi : pd::RankBackend::threads;
  // The options as given, for training checkpoints, as "--flag value" pairs (every flag takes one value, given as
  // "--flag value" or "--flag=value"); --resume, --load and --stop-after are not saved (a resumed run starts from its
  // checkpoint and runs to the end).
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i], value;
    if (const std::size_t equals = flag.find('='); flag.starts_with("--") && equals != std::string::npos) {
      value = flag.substr(equals + 1);
      flag.resize(equals);
    } else if (i + 1 < argc) {
      value = argv[++i];
    }
    if (flag == "--resume" || flag == "--load" || flag == "--stop-after") continue;
    o.args.push_back(flag);
    o.args.push_back(value);
  }
  if (!o.resume.empty() && !o.load.empty()) usage("--resume and --load exclude each other (--resume loads the weights)");
  if (o.min_len > o.max_len) usage(fmt::format("--min-len {} exceeds --max-len {}", o.min_len, o.max_len));
  if (o.pack_documents > 0 && o.pack_tokens > 0)
    usage("--pack-tokens (documents as rows) and --pack-documents (documents in one sequence) exclude each other");
  if (o.experts > 0) {  // the MoE mode (examples/train_moe.hpp) plans every sublayer and saves a Hugging Face folder
    if (o.top_k > o.experts) usage(fmt::format("--top-k {} exceeds --experts {}", o.top_k, o.experts));
    if (o.first_dense >= o.layers)
      usage(fmt::format("--first-dense {} leaves no MoE layer of --layers {}", o.first_dense, o.layers));
    if (!o.strategy.empty() || !o.load.empty())
      usage("--experts: --strategy and --load are for the dense GPT (the MoE GPT resumes with --resume)");
  } else if (o.shared_experts > 0 || o.first_dense > 0) {
    usage("--shared-experts and --first-dense need --experts");
  }
  if (!o.mesh.empty()) {  // examples/train_mesh.hpp
    int mesh_ranks = 0;
    try { mesh_ranks = pd::examples::parse_mesh(o.mesh).size(); } catch (const pd::Error& e) { usage(e.what()); }
    const bool ranks_given = std::find(o.args.begin(), o.args.end(), "--ranks") != o.args.end();
    if (ranks_given && o.ranks != mesh_ranks)
      usage(fmt::format("--ranks {} but --mesh {} holds {} ranks", o.ranks, o.mesh, mesh_ranks));
    o.ranks = mesh_ranks;
    if (o.device != "cpu" || !o.emulate.empty() || !o.save.empty() || !o.load.empty() || !o.resume.empty() ||
        o.checkpoint_every > 0 || o.stop_after > 0)
      usage("--mesh trains on the host: --device cuda, --emulate and checkpoints are not available with it yet");
  }
  if (!o.save.empty()) {  // fail now, not after the whole run
    try { pd::check_writable_target(o.save); } catch (const pd::Error& e) { usage(e.what()); }
  }
  return o;
}

// With --resume PATH: the options the checkpoint's run was started with, then those given now (which win).
TrainingOptions parse_resuming(int argc, char** argv) {
  TrainingOptions given = parse(argc, argv);
  if (given.resume.empty()) return given;
  std::vector<std::pair<std::string, std::string>> metadata;
  try {
    metadata = pd::read_checkpoint_metadata(given.resume);
  } catch (const pd::Error& e) {
    usage(fmt::format("--resume: {}", e.what()));
  }
  const auto stored = std::find_if(metadata.begin(), metadata.end(), [](auto& kv) { return kv.first == "train.args"; });
  if (stored == metadata.end())
    usage(fmt::format("--resume {}: not a training checkpoint of train_gpt (no train.args; --save writes the weights "
                      "only: start from those with --load)", given.resume));
  std::vector<std::string> args{argv[0]};
  for (std::size_t from = 0; from < stored->second.size();) {
    const std::size_t end = std::min(stored->second.find('\n', from), stored->second.size());
    args.push_back(stored->second.substr(from, end - from));
    from = end + 1;
  }
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  std::vector<char*> pointers;
  for (std::string& a : args) pointers.push_back(a.data());
  return parse(int(pointers.size()), pointers.data());
}

using pd::plan::compact_plan;  // plan/plan_names.hpp: "MTS/MTS UZ/METP"
using pd::plan::full_plan;        // "MegatronTS/MegatronTS UlyssesZ/METP"

// The per-rank state that lives across steps (threads or MPI processes): each rank's tracker (capped), model and
// buffer pool. Each step is one collective run whose ranks install their tracker, so a failed step (OutOfMemory on
// one thread rank ends the collectives of all) leaves the model and the trackers intact for the next one.
using Ranks = pd::Ranks<Model, pd::BufferPool>;

// The hardware profile: given, cached from an earlier calibration, or calibrated now (and cached).
template <class RanksT>
pd::cost::HardwareProfile hardware_profile(const TrainingOptions& o, RanksT& ranks) {
  if (!o.profile.empty()) {
    for (std::string_view name : pd::cost::kBuiltinProfileNames)
      if (name == o.profile) {
        fmt::print("hardware profile: {} (built in)\n", o.profile);
        return pd::cost::builtin_profile(name);
      }
    fmt::print("hardware profile: {} (given)\n", o.profile);
    return pd::cost::load_profile(o.profile);
  }
  const bool mpi = o.backend == pd::RankBackend::mpi;
  const std::filesystem::path cache = fmt::format("build/train_gpt_profile_{}p{}.json", mpi ? "mpi_" : "", o.ranks);
  // Under MPI every process decides from the same state: rank 0 writes the cache only after all have looked.
  const bool cached = std::filesystem::exists(cache);
  ranks.run([](auto& comm, int) { comm.barrier(); });
  if (cached) {
    try {
      pd::cost::HardwareProfile profile = pd::cost::load_profile(cache.string());
      fmt::print("hardware profile: calibrated on this machine earlier, {} (delete it to recalibrate)\n", cache.string());
      return profile;
    } catch (const pd::Error& e) {
      fmt::print("hardware profile: the cached {} does not load ({}); calibrating again\n", cache.string(), e.what());
    }
  }
  fmt::print("hardware profile: calibrating {} {} ranks on this machine (once; cached in {}) ...\n", o.ranks,
             mpi ? "MPI" : "thread", cache.string());
  pd::cost::CalibrationOptions options;
  options.repetitions = 3;
  options.attention_heads = o.heads;
  options.head_dim = std::max<std::int64_t>(o.hidden / o.heads, 1);
  const auto start = std::chrono::steady_clock::now();
  pd::cost::HardwareProfile profile;
  ranks.run([&](auto& comm, int r) {
    pd::cost::Calibration c = pd::cost::calibrate<pd::ops::Cpu>(comm, options);
    if (r == 0) profile = std::move(c.profile);
  });
  fmt::print("  calibrated in {:.1f} s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  if (ranks.reports()) {
    std::error_code ignored;
    std::filesystem::create_directories(cache.parent_path(), ignored);
    pd::cost::save_profile(profile, cache.string());
  }
  if (mpi) {  // every process plans with rank 0's profile
    ranks.run([](auto& comm, int) { comm.barrier(); });
    profile = pd::cost::load_profile(cache.string());
  }
  return profile;
}

// Whether every weight this rank holds (its shards and the replicated pack) is finite.
template <class ModelT>
bool finite_weights(ModelT& model) {
  const auto finite = [](const pd::Tensor<float>& t) {
    return std::all_of(t.span().begin(), t.span().end(), [](float x) { return std::isfinite(x); });
  };
  for (const pd::LayerWeights& w : model.stack().weights())
    if (!finite(w.attention.packed) || !finite(w.mlp.packed) || !finite(w.norms.packed)) return false;
  return finite(model.replicated());
}

// The GPU's memory (--device cuda), 0 when unknown.
double device_memory_bytes() {
#if PARADYSE_WITH_CUDA
  std::size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) == cudaSuccess) return double(total);
#endif
  return 0.0;
}

// This machine's memory, 0 when unknown.
double physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? double(pages) * double(page) : 0.0;
}

struct StepRecord {
  std::int64_t length = 0;  // real tokens
  std::int64_t padding = 0;  // masked tokens the step padded with
  double flops = 0;          // model FLOPs
  double loss = 0;
  double seconds = 0;
  bool failed = false;
};

// Trains the dense GPT on `ranks` (threads or MPI processes over ops::Cpu, or cuda_local ranks over ops::Cuda): the
// data, the memory cap, the per-step plans, the table and the summary. Returns the exit code.
template <class ModelT, class RanksT>
int train_dense(const TrainingOptions& o, RanksT& ranks) {
  using Strategies = typename StrategiesOf<ModelT>::type;
  using Model = ModelT;
  const bool mpi = o.backend == pd::RankBackend::mpi;
  constexpr bool on_device = StrategiesOf<ModelT>::on_device;
  pd::check(o.emulate.empty() || (!on_device && !mpi && o.profile.empty()),
            "--emulate paces the thread communicator against this machine's calibrated profile: it needs --backend "
            "threads, --device cpu and no --profile");
  if (on_device && (!o.save.empty() || !o.load.empty() || !o.resume.empty() || o.checkpoint_every > 0 || o.stop_after > 0))
    throw pd::Error("--device cuda: checkpoints (--save, --load, --resume, --checkpoint-every, --stop-after) are not "
                    "written from device memory yet; train on the host (--device cpu) to save");
  const pd::GptConfig config = pd::byte_gpt_config(pd::examples::byte_gpt_shape(o));  // model/byte_gpt.hpp
  config.validate_for(o.ranks);

  // The steps: rows padded to at least two tokens per rank (zigzag chunks), packed up to --pack-tokens, or packed
  // sequences (examples/train_gpt/training_data.hpp).
  const pd::examples::TrainingData data = pd::examples::training_data(o, {o.ranks, config.layer.zigzag}, o.pack_tokens);
  const std::vector<pd::data::Document>& docs = data.docs;
  const std::vector<pd::data::Step>& steps = data.steps;
  const int n_steps = int(steps.size());

  pd::cost::HardwareProfile hardware = hardware_profile(o, ranks);
  if (!o.emulate.empty()) {
    // An 8-GPU node's balance of compute and communication on this machine: transfers paced at the device's link
    // latency and bandwidth, stretched by how much slower this machine computes (cost/emulation.hpp).
    const pd::cost::Emulation e = pd::cost::emulate(pd::cost::builtin_profile(o.emulate), hardware);
    if constexpr (!on_device) ranks.set_link_pacing(e.pacing);
    fmt::print("emulated node: {} ranks with the links of {}, slowed {:.0f}x (its GEMM rate over this machine's); "
               "plans and predictions use the emulated links\n", o.ranks, pd::cost::builtin_profile(o.emulate).name,
               e.slowdown);
    hardware = e.profile;
  }
  const pd::plan::GptCosts<Model> costs{config, o.ranks, &hardware};

  // The cap: METP must fit the longest input, MegatronTS must not (unless --cap-mib says otherwise).
  const pd::plan::DefaultCap default_cap = pd::plan::default_memory_cap(costs, o.max_len);  // plan/memory_cap.hpp
  const std::int64_t metp_peak = default_cap.metp_peak, ts_peak = default_cap.ts_peak;
  std::int64_t cap = o.cap_mib > 0 ? std::int64_t(o.cap_mib * kMiB) : default_cap.cap;
  // The model's size before anything is allocated: its states (weights, gradients, AdamW moments) per rank, and
  // what a save adds (one layer gathered). Refused with the numbers when it cannot fit the cap or this machine.
  const pd::plan::CostTable longest = costs.table(o.max_len);
  const std::int64_t state_bytes = longest.model_state_bytes + Model::replicated_state_bytes(config);
  // Saving (--save, training checkpoints) and resuming gather or read one global layer at a time.
  const bool saves = !o.save.empty() || o.checkpoint_every > 0 || !o.resume.empty();
  const std::int64_t save_bytes = saves ? pd::save_checkpoint_bytes(config, o.ranks) : 0;
  bool cap_raised_for_save = false;
  const std::int64_t least_peak = std::max(std::min(metp_peak, ts_peak), state_bytes + save_bytes);
  if (const double machine = on_device ? device_memory_bytes() : physical_memory_bytes();
        machine > 0 && double(least_peak) * o.ranks > 0.9 * machine) {
    fmt::print(stderr,
               "train_gpt: the model does not fit this machine: {} layers of h={} ({:.3g} M parameters) need at "
               "least {:.1f} MiB per rank (states {:.1f} MiB{}; the least-memory plan at --max-len {} peaks at "
               "{:.1f} MiB), {:.2f} GiB for {} ranks; this machine has {:.2f} GiB\n",
               o.layers, o.hidden, double(config.parameter_count()) / 1e6, double(least_peak) / kMiB,
               double(state_bytes) / kMiB,
               save_bytes ? fmt::format(", + {:.1f} MiB to save", double(save_bytes) / kMiB) : std::string(),
               o.max_len, double(std::min(metp_peak, ts_peak)) / kMiB, double(least_peak) * o.ranks / (kMiB * 1024),
               o.ranks, machine / (kMiB * 1024));
    return 2;
  }
  if (state_bytes + save_bytes > cap) {
    if (o.cap_mib > 0) {
      fmt::print(stderr,
                 "train_gpt: the model needs {:.1f} MiB per rank for its weights, gradients and AdamW moments{}, "
                 "above the cap of {:.1f} MiB (--cap-mib): raise the cap to at least {:.1f} MiB{}\n",
                 double(state_bytes) / kMiB,
                 save_bytes ? fmt::format(" and {:.1f} MiB more to save the checkpoint", double(save_bytes) / kMiB)
                            : std::string(),
                 double(cap) / kMiB, double(state_bytes + save_bytes) / kMiB,
                 save_bytes ? " or drop --save" : "");
      return 2;
    }
    cap = (state_bytes + save_bytes + std::int64_t(kMiB) - 1) / std::int64_t(kMiB) * std::int64_t(kMiB);
    cap_raised_for_save = true;
  }

  fmt::print("model: GPT, {} layers, h={}, {} heads, ffn={}, vocab {} (bytes), causal + RoPE, zigzag tokens, untied "
             "replicated LM head; {:.2f} M parameters\n",
             o.layers, o.hidden, o.heads, config.layer.ffn, config.vocab, double(config.parameter_count()) / 1e6);
  const std::size_t shortest =
      std::min_element(docs.begin(), docs.end(), [](auto& a, auto& b) { return a.bytes.size() < b.bytes.size(); })->bytes.size();
  fmt::print("data: {} documents in {} ({}..{} bytes); {} steps, one window each, lengths {}..{} (the longest "
             "document gives {}), documents stratified by length, order {}, seed {}\n",
             docs.size(), data.corpus_dir.string(), shortest, data.longest_document, o.steps, o.min_len, o.max_len,
             o.max_len, o.sorted ? "sorted (curriculum)" : "random", o.seed);
  if (o.pack_tokens > 0)
    fmt::print("packing: {} documents in {} steps of up to {} tokens (one document per row, rows padded to the "
               "step's longest with masked tokens)\n", o.steps, n_steps, o.pack_tokens);
  if (o.pack_documents > 0)
    fmt::print("packing: {} documents in {} steps, each one sequence of up to {} tokens (documents back to back, "
               "attention within each, positions restarting at each)\n", o.steps, n_steps, o.pack_documents);
  fmt::print("ranks: {} {}; memory cap {:.0f} MiB per rank{} (predicted peak at s={}: all-METP {:.1f} MiB, "
             "all-MegatronTS {:.1f} MiB)\n",
             o.ranks, mpi ? "MPI processes" : "threads", double(cap) / kMiB,
             o.cap_mib > 0 ? " (given)"
             : cap_raised_for_save ? " (from the memory model, raised to fit the model and its save)"
                                   : " (from the memory model)",
             o.max_len,
             double(metp_peak) / kMiB, double(ts_peak) / kMiB);
  fmt::print("strategies: {}\n\n", o.strategy.empty() ? "chosen per layer and sublayer by the exact planner (attn/mlp per layer)"
                                                      : fmt::format("{} everywhere (static)", o.strategy));

  for (int r = 0; r < o.ranks; ++r) ranks.tracker(r).set_cap(std::size_t(cap));
  ranks.run([&](auto&, int r) {
    ranks.models[std::size_t(r)] = std::make_unique<Model>(config, o.ranks, r, o.seed);
    ranks.pools[std::size_t(r)] = std::make_unique<pd::BufferPool>();
  });
  // The states as allocated (the estimate above rounds no tensor): the save must still fit beside them.
  if (save_bytes > 0) {
    std::size_t held = 0;
    std::vector<double> in_use(std::size_t(o.ranks), 0.0);
    for (int r = 0; r < o.ranks; ++r)
      if (ranks.is_local(r)) in_use[std::size_t(r)] = double(ranks.tracker(r).in_use());
    ranks.share(in_use);
    held = std::size_t(*std::max_element(in_use.begin(), in_use.end()));
    const std::int64_t need = std::int64_t(held) + save_bytes;
    if (need > cap) {
      if (o.cap_mib > 0) {
        fmt::print(stderr, "train_gpt: the model holds {:.1f} MiB per rank and saving it needs {:.1f} MiB more, above "
                           "the cap of {:.1f} MiB (--cap-mib): raise the cap or drop --save\n",
                   double(held) / kMiB, double(save_bytes) / kMiB, double(cap) / kMiB);
        return 2;
      }
      cap = (need + std::int64_t(kMiB) - 1) / std::int64_t(kMiB) * std::int64_t(kMiB);
      for (int r = 0; r < o.ranks; ++r) ranks.tracker(r).set_cap(std::size_t(cap));
      fmt::print("memory cap raised to {:.0f} MiB per rank to fit the model and its save\n", double(cap) / kMiB);
    }
  }
  if (!o.load.empty()) {
    ranks.run([&](auto&, int r) { pd::load_checkpoint(*ranks.models[std::size_t(r)], o.load); });
    fmt::print("weights loaded from {}\n\n", o.load);
  }
  // Training checkpoints (model/resume.hpp): resumed from, and written on the way.
  const pd::TrainingCheckpoints checkpoints(pd::examples::resume_options(o), n_steps, pd::examples::data_description(o, n_steps, o.pack_tokens),
                                                      ranks);
  const int first_step = checkpoints.first_step(), end_step = checkpoints.end_step();
  if (!o.resume.empty())
    fmt::print("resumed from {}: weights, AdamW moments and optimizer step {}; the data continues at step {} of "
               "{}\n\n", o.resume, ranks.models[std::size_t(ranks.first_local())]->steps_taken(), first_step, n_steps);
  pd::examples::CsvTable csv(ranks.reports() ? o.csv : std::string(),
                             {"step", "length", "rows", "tokens", "padding", "plan", "loss", "seconds", "mfu",
                              "peak_mib", "predicted_mib", "cap_mib", "status", "predicted_s"});

  pd::ops::AdamWConfig adamw;
  adamw.learning_rate = float(o.lr);
  adamw.weight_decay = 0.01f;
  const int warmup = std::max(1, std::min(8, n_steps / 8));
  const double gemm_rate = pd::cost::gemm_rate_per_rank(hardware);

  fmt::print("peak: the largest per-rank peak measured by the memory trackers; pred: the memory model's peak for the "
             "plan (what the planner budgets)\n");
  fmt::print("MFU: model FLOPs per second against the GEMM rate of the profile, {:.1f} GFLOP/s per rank x {} ranks{}\n",
             gemm_rate / 1e9, o.ranks, hardware.source.find("calibrated") == std::string::npos
                                             ? " (not calibrated on this machine: MFU against that device)" : "");
  fmt::print("{:>4}  {:>6}  {:>4}  {:<{}}  {:>7}  {:>7}  {:>5}  {:>9}  {:>9}  {:>6}\n", "step", "len", "docs", "plan",
             8 * o.layers, "loss", "time s", "MFU%", "peak MiB", "pred MiB", "cap");
  std::vector<StepRecord> records;
  std::map<std::string, int> usage;
  int ooms = 0, unplanned = 0;
  const auto run_start = std::chrono::steady_clock::now();
  double planner_seconds = 0;
  pd::examples::Progress progress("step", end_step - first_step, "tokens");  // on a terminal only
  std::int64_t progress_tokens = 0;
  for (int step = first_step; step < end_step; ++step) {
    progress.clear();  // the rows print over it; it is drawn again when the step ends, however it ends
    struct ShowProgress {
      pd::examples::Progress& progress;
      std::int64_t done;
      double tokens;
      ~ShowProgress() { progress.show(done, tokens, true); }
    } show_progress{progress, step + 1 - first_step, double(progress_tokens += steps[std::size_t(step)].real_tokens())};
    checkpoints.before_step(ranks, step);
    // The step's rows [b, s]: one document each, padded with masked tokens; or (--pack-documents) one row holding
    // the documents back to back.
    const pd::data::Step& batch = steps[std::size_t(step)];
    const std::int64_t s = batch.length, rows = batch.sequences();
    const std::vector<std::int64_t> document_starts = batch.document_starts();  // empty: one document per row
    const std::int64_t documents = std::int64_t(batch.rows.size());  // the "docs" column
    std::vector<std::int32_t> inputs, targets;
    pd::data::step_tokens(batch, docs, pd::ops::cpu::kIgnoreIndex, inputs, targets);
    std::vector<std::int64_t> lengths;
    for (const pd::data::Window& w : batch.rows) lengths.push_back(w.length);
    const double step_flops = pd::cost::training_flops(config, lengths);
    const std::int64_t real = batch.real_tokens(), padding = batch.padded_tokens();
    // The plan: the exact planner's, or the forced strategy's (with its predicted memory).
    const auto plan_start = std::chrono::steady_clock::now();
    const pd::plan::CostTable table =
        document_starts.size() > 1 ? costs.packed_table(batch.document_lengths()) : costs.table(s, rows);
    std::optional<pd::plan::Plan> plan;
    try {
      plan = o.strategy.empty()
                 ? pd::plan::plan_exact(table, cap)
                 : pd::plan::plan_of(table, pd::plan::uniform_layers(table, pd::cost::default_catalog().index_of(o.strategy)), cap);
    } catch (const pd::plan::NoFeasiblePlan& e) {
      fmt::print("{:>4}  {:>6}  {:>4}  no plan fits the cap: {}\n", step, s, documents, e.what());
      ++unplanned;
      records.push_back({real, padding, step_flops, 0, 0, true});
      csv.row(step, s, rows, real, padding, "", "", 0, "", "", "", double(cap) / kMiB, "no plan fits", "");
      continue;
    }
    planner_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - plan_start).count();
    const std::vector<pd::cost::LayerStrategies> layers = plan->strategies();
    const pd::StackPlan stack_plan = pd::plan::stack_plan<Strategies>(*plan);
    adamw.learning_rate = float(o.lr * std::min(1.0, double(step + 1) / warmup));
    std::vector<double> peaks(std::size_t(o.ranks), 0.0);
    double loss = 0;
    bool over_cap = false;  // MPI: the step went over the cap on some rank (and was undone)
    const auto start = std::chrono::steady_clock::now();
    try {
      ranks.run([&](auto& comm, int r) {
        Model& model = *ranks.models[std::size_t(r)];
        pd::BufferPool& pool = *ranks.pools[std::size_t(r)];
        pool.trim();  // every step starts with an empty pool, as the memory model assumes
        pool.reset_high_water();
        ranks.tracker(r).reset_peak();
        const pd::SequenceLayout layout(s, o.ranks, config.layer.zigzag);
        // The rank's token ids are host memory on every backend (a device model copies them where it computes);
        // on the GPU the rank's current tracker is its device tracker, so they come from a host one.
        std::optional<pd::MemoryTracker> host_ids;
        std::optional<pd::ScopedTracker> on_host;
        if constexpr (on_device) on_host.emplace(host_ids.emplace());
        const pd::Tensor<std::int32_t> x = pd::shard_tokens(inputs, rows, layout, r);
        const pd::Tensor<std::int32_t> y = pd::shard_tokens(targets, rows, layout, r);
        on_host.reset();
        model.zero_gradients();
        // Under MPI an out-of-memory rank could not stop the others inside a collective: the step runs uncapped
        // and is undone when any rank's peak passed the cap, which is exactly when the thread run's step fails.
        if (mpi) ranks.tracker(r).set_cap(std::numeric_limits<std::size_t>::max());
        const pd::GptStepResult result =
            model.forward_backward(comm, pool, stack_plan, s, x.view(), y.view(), document_starts);
        if (mpi) {
          const double mine = double(ranks.tracker(r).peak());
          double most = 0;
          comm.all_reduce(std::span<const double>(&mine, 1), std::span<double>(&most, 1), pd::ReduceOp::max);
          ranks.tracker(r).set_cap(std::size_t(cap));
          if (most > double(cap)) {
            over_cap = true;
            peaks[std::size_t(r)] = most;
            model.recover_from_failed_step();
            pool.trim();
            return;
          }
        }
        model.optimizer_step(adamw);
        peaks[std::size_t(r)] = double(ranks.tracker(r).peak());
        if (r == ranks.first_local()) loss = result.loss;  // the same on every rank
      });
    } catch (const pd::OutOfMemory& e) {
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      fmt::print("{:>4}  {:>6}  {:>4}  {:<{}}  {:>7}  {:>7.2f}  OUT OF MEMORY on rank {} (predicted {:.1f} MiB, cap {:.0f} "
                 "MiB): {} more bytes asked with {:.1f} MiB in use\n",
                 step, s, documents, compact_plan(*plan), 8 * o.layers, "-", seconds, ranks.out_of_memory_rank(),
                 double(plan->peak_bytes()) / kMiB, double(cap) / kMiB, e.requested(), double(e.in_use()) / kMiB);
      ++ooms;
      records.push_back({real, padding, step_flops, 0, seconds, true});
      csv.row(step, s, rows, real, padding, full_plan(*plan), "", seconds, "", "", double(plan->peak_bytes()) / kMiB,
              double(cap) / kMiB, "out of memory", plan->time_s);
      // Under the same cap: the recovery allocates nothing, and the pool gives back what the step cached.
      ranks.run([&](auto&, int r) {
        ranks.models[std::size_t(r)]->recover_from_failed_step();
        ranks.pools[std::size_t(r)]->trim();
      });
      continue;
    }
    if (over_cap) {
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      ranks.share(peaks);
      fmt::print("{:>4}  {:>6}  {:>4}  {:<{}}  {:>7}  {:>7.2f}  OUT OF MEMORY: a rank peaked at {:.1f} MiB, over the cap "
                 "of {:.0f} MiB (predicted {:.1f} MiB); the step is undone\n",
                 step, s, documents, compact_plan(*plan), 8 * o.layers, "-", seconds,
                 *std::max_element(peaks.begin(), peaks.end()) / kMiB, double(cap) / kMiB,
                 double(plan->peak_bytes()) / kMiB);
      ++ooms;
      records.push_back({real, padding, step_flops, 0, seconds, true});
      csv.row(step, s, rows, real, padding, full_plan(*plan), "", seconds, "",
              *std::max_element(peaks.begin(), peaks.end()) / kMiB,
              double(plan->peak_bytes()) / kMiB, double(cap) / kMiB, "out of memory", plan->time_s);
      continue;
    }
    if (!std::isfinite(loss)) {
      fmt::print(stderr,
                 "train_gpt: step {}: the training loss is {} (learning rate {:g}, length {}): training diverged; "
                 "stopping without saving a checkpoint\n",
                 step, loss, double(adamw.learning_rate), s);
      return 1;
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ranks.share(peaks);
    const double peak = *std::max_element(peaks.begin(), peaks.end());
    const double mfu = pd::cost::model_flops_utilisation(step_flops, seconds, o.ranks, hardware);
    fmt::print("{:>4}  {:>6}  {:>4}  {:<{}}  {:>7.4f}  {:>7.2f}  {:>5.1f}  {:>9.1f}  {:>9.1f}  {:>6.0f}\n", step, s, documents,
               compact_plan(*plan), 8 * o.layers, loss, seconds, 100 * mfu, peak / kMiB, double(plan->peak_bytes()) / kMiB,
               double(cap) / kMiB);
    records.push_back({real, padding, step_flops, loss, seconds, false});
    csv.row(step, s, rows, real, padding, full_plan(*plan), fmt::format("{:.17g}", loss), seconds, mfu, peak / kMiB,
            double(plan->peak_bytes()) / kMiB, double(cap) / kMiB, "ok", plan->time_s);
    for (const auto& l : layers) {
      ++usage[std::string(plan->strategy_name(l.attention))];
      ++usage[std::string(plan->strategy_name(l.mlp))];
    }
  }
  progress.finish();
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
  checkpoints.at_end(ranks);

  // Summary.
  std::vector<const StepRecord*> done;
  std::int64_t tokens = 0, padded = 0;
  double flops = 0, step_seconds = 0;
  for (const StepRecord& r : records)
    if (!r.failed) {
      done.push_back(&r);
      tokens += r.length;
      padded += r.padding;
      flops += r.flops;
      step_seconds += r.seconds;
    }
  const auto mean_loss = [&](std::size_t from, std::size_t to) {
    double sum = 0;
    for (std::size_t i = from; i < to; ++i) sum += done[i]->loss;
    return to > from ? fmt::format("{:.4f}", sum / double(to - from)) : std::string("-");
  };
  const std::size_t k = std::min<std::size_t>(10, done.size());
  fmt::print("\nsummary\n");
  fmt::print("  steps                      {} run, {} out of memory, {} with no plan that fits\n", done.size(), ooms, unplanned);
  fmt::print("  tokens trained             {} in {} documents; {} padding tokens ({:.1f}% of the tokens run)\n", tokens,
             [&] { std::size_t n = 0; for (int i = first_step; i < end_step; ++i) n += steps[std::size_t(i)].rows.size(); return n; }(),
             padded, tokens + padded > 0 ? 100.0 * double(padded) / double(tokens + padded) : 0.0);
  fmt::print("  mean loss, first {:>2} steps  {}\n", k, mean_loss(0, k));
  fmt::print("  mean loss, last {:>2} steps   {}\n", k, mean_loss(done.size() - k, done.size()));
  fmt::print("  total time                 {:.1f} s ({:.0f} tokens/s; planning {:.1f} ms in all)\n", total,
             double(tokens) / total, planner_seconds * 1e3);
  fmt::print("  model FLOPs utilisation    {:.1f}% over the steps run ({:.2f} GFLOP/s of model FLOPs; GEMM rate {:.1f} "
             "GFLOP/s x {} ranks)\n",
             100 * pd::cost::model_flops_utilisation(flops, step_seconds, o.ranks, hardware),
             step_seconds > 0 ? flops / step_seconds / 1e9 : 0.0, gemm_rate / 1e9, o.ranks);
  fmt::print("  strategy usage (sublayers) ");
  bool first = true;
  for (const std::string& name : pd::cost::default_catalog().names()) {
    const auto it = usage.find(name);
    fmt::print("{}{} {}", first ? "" : ", ", name, it == usage.end() ? 0 : it->second);
    first = false;
  }
  fmt::print("\n");
  if (!o.strategy.empty()) fmt::print("  OOM steps under --strategy {:<10} {}\n", o.strategy, ooms);

  if (!o.save.empty()) {
    // No checkpoint of weights that are not finite (a last optimizer step that diverged).
    std::atomic<int> bad_rank{-1};
    ranks.run([&](auto& comm, int r) {
      // Every process learns the highest rank whose weights are not finite (-1: none).
      const int mine = finite_weights(*ranks.models[std::size_t(r)]) ? -1 : r;
      int worst = -1;
      comm.all_reduce(std::span<const int>(&mine, 1), std::span<int>(&worst, 1), pd::ReduceOp::max);
      if (r == ranks.first_local()) bad_rank = worst;
    });
    if (bad_rank >= 0) {
      fmt::print(stderr, "train_gpt: rank {} holds weights that are not finite (nan or inf) after training: the "
                         "checkpoint is not saved\n", int(bad_rank));
      return 1;
    }
    // Within the cap: the pools give back their buffers first (the cap was budgeted for the model + the save).
    try {
      ranks.run([&](auto& comm, int r) {
        ranks.pools[std::size_t(r)]->trim();
        pd::save_checkpoint(comm, *ranks.models[std::size_t(r)], o.save);
      });
    } catch (const std::exception& e) {
      const std::string message = fmt::format("saving the checkpoint to {} failed after {} steps of training (any "
                                              "earlier file there is unchanged): {}", o.save, done.size(), e.what());
#if PARADYSE_WITH_MPI
      if (mpi) pd::abort_mpi_job(message);  // the other processes wait in the save's collectives
#endif
      fmt::print(stderr, "train_gpt: {}\n", message);
      return 1;
    }
    fmt::print("  checkpoint                 {} (safetensors, global tensors)\n", o.save);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const TrainingOptions o = parse_resuming(argc, argv);
#if PARADYSE_WITH_MPI
  std::optional<pd::MpiSession> mpi_session;
  if (o.backend == pd::RankBackend::mpi) mpi_session.emplace(&argc, &argv);
#endif
  const bool mpi = o.backend == pd::RankBackend::mpi;
  try {
    // The group first (under MPI: this process's rank; the others print nothing), capped once the cap is known.
    Ranks ranks(o.backend, o.ranks, std::numeric_limits<std::size_t>::max());
    if (!ranks.reports() && !std::freopen("/dev/null", "w", stdout))
      throw pd::Error("cannot silence the standard output of MPI rank " + std::to_string(ranks.first_local()));
    if (o.experts > 0 && o.device == "cuda")
      throw pd::Error("--device cuda with --experts: the MoE GPT trains on the host only for now (--device cpu)");
    if (!o.mesh.empty()) return pd::examples::train_mesh<pd::AllStrategies<>>(o, hardware_profile(o, ranks), ranks);
    if (o.experts > 0) return pd::examples::train_moe(o, hardware_profile(o, ranks));
    if (o.device == "cuda") {
#if PARADYSE_WITH_CUDA
      pd::check(pd::device::available(), "--device cuda: {}", pd::device::unavailable_reason());
      TrainingOptions on_gpu = o;
      if (on_gpu.profile.empty()) on_gpu.profile = "H200-SXM-141GB-x8";  // calibration times host ops
      pd::DeviceRanks<DeviceModel, pd::BufferPool> device_ranks(o.ranks, std::numeric_limits<std::size_t>::max());
      return train_dense<DeviceModel>(on_gpu, device_ranks);
#else
      throw pd::Error("--device cuda: this train_gpt was built without CUDA (no nvcc found by CMake)");
#endif
    }
    return train_dense<Model>(o, ranks);
  } catch (const std::exception& e) {
#if PARADYSE_WITH_MPI
    if (mpi) pd::abort_mpi_job(e.what());  // the other processes may be waiting in a collective
#endif
    fmt::print(stderr, "train_gpt: {}\n", e.what());
    return 1;
  }
}
