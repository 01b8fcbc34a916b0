// examples/train_gpt/flags.hpp: train_gpt's command line (CLI11 through paradyse/cli/flags.hpp): every flag,
// its range and default (the usage, --help, is generated from them), the checks across flags, and --resume's
// options (those the checkpoint's run was started with, then those given now, which win).
#pragma once

#include "paradyse/cli/flags.hpp"
#include "paradyse/cli/model_flags.hpp"
#include "caps.hpp"  // machine_fit_refusal
#include "train_mesh.hpp"  // parse_mesh
#include "training_options.hpp"

#include "paradyse/comm/ranks.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/cost/dry_run.hpp"
#include "paradyse/model/checkpoint.hpp"
#include "paradyse/model/data_parallel.hpp"
#include "paradyse/model/resume.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace paradyse::examples {

namespace train_gpt_flags {

namespace pd = paradyse;

// The usage, generated from the flags parse() states (usage() is also called for problems found after parsing).
inline std::string& usage_text() {
  static std::string text;
  return text;
}
[[noreturn]] inline void usage(const std::string& problem) {
  cli::print_usage_and_exit("train_gpt", problem, usage_text());
}

// Every flag of train_gpt into `o` (--zero and --backend into `zero_stage` and `backend_name`).
inline void declare(cli::Flags& flags, TrainingOptions& o, std::int64_t& zero_stage, std::string& backend_name) {
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
  flags.choice("--strategy", o.strategy, pd::cost::mesh_catalog().names(),
               "one strategy everywhere instead of the planner (long inputs may then run out of memory: the step is "
               "reported and skipped); MegatronRing, Tp2d and RingTp2d on a factorised --mesh only (cp with tp, or "
               "tp_x,tp_y; RingTp2d: cp with tp_x,tp_y)")
      .without_default();
  flags.number("--lr", o.lr, {.min = 0, .max = 100, .min_open = true}, "peak learning rate (AdamW, linear warm-up)");
  flags.choice("--order", o.sorted, "sorted", "random", "document order: sorted by length (curriculum) or shuffled");
  flags.choice("--speed-probe", o.speed_probe, "on", "off",
               "dense, host: time the profile's GEMM shapes before the first step and after the last and print measured "
               "/ priced, the machine's speed against its profile (cost/speed_probe.hpp; scripts/validate_trainer.sh "
               "compares each run's steps with the prediction at that speed)");
  flags.integer("--calibration-passes", o.calibration_passes, 1, 15,
                "passes of the calibration this run makes when it has no profile (each measurement the median of its "
                "passes'; more passes hold a shared machine's slow spells out of the profile, each pass costs its "
                "seconds: cost/calibration_passes.hpp)");
  flags.text("--save", o.save,
             "write the global weights at the end as safetensors (with --experts: a Hugging Face folder, Mixtral or "
             "Qwen2-MoE)", "PATH")
      .nonempty("a file name (with --experts: a folder)");
  flags.text("--load", o.load, "start from weights --save wrote (on any number of ranks or any --mesh shape, same "
             "model)", "PATH")
      .nonempty("a checkpoint --save wrote");
  flags.text("--profile", o.profile,
             "hardware profile: a JSON file or a built-in name (default: calibrated on this machine, or the GPU, once, "
             "cached in build/train_gpt_profile_p<P>.json)", "A100-SXM4-80GB-x8|H100-SXM-80GB-x8|H200-SXM-141GB-x8|FILE.json")
      .nonempty("a built-in profile name or a profile .json");
  flags.text("--corpus", o.corpus, "a folder of text documents (default: the bundled data/corpus/sotu.tar.xz)", "DIR")
      .nonempty("a folder of text documents");
  flags.choice("--backend", backend_name, {"threads", "mpi"},
               "threads: P thread ranks; mpi: one rank per process, run as mpirun -np P train_gpt --backend mpi "
               "--ranks P ...");
  flags.integer("--checkpoint-every", o.checkpoint_every, 1, 10'000'000,
                "every N steps a training checkpoint (weights, AdamW moments, step, data position, options) "
                "DIR/step_<next step>.safetensors")
      .without_default();
  flags.integer("--keep", o.keep, 1, 1'000'000,
                "training checkpoints kept: the newest this run wrote (files it did not write are never removed)");
  flags.text("--checkpoint-dir", o.checkpoint_dir, "the folder of the training checkpoints", "DIR")
      .nonempty("a folder (made if missing)");
  flags.text("--resume", o.resume,
             "continue the run a training checkpoint was saved in, with its options (options given here override "
             "them; --mesh or --ranks given here replace its group shape); on the same number of thread ranks (or the "
             "same mesh) the losses are bit for bit those of a run that never stopped",
             "PATH")
      .nonempty("a training checkpoint (DIR/step_<n>.safetensors)");
  flags.integer("--stop-after", o.stop_after, 1, 10'000'000,
                "stop after N steps of this run and write a training checkpoint there (the data schedule stays that "
                "of --steps; --resume continues)")
      .without_default();
  flags.text("--csv", o.csv, "the per-step table as CSV (scripts/plot.py draws it)", "FILE").nonempty("a file name");
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
               "cuda: the P ranks are threads on one GPU (cuda_local, ops::Cuda, fp32; dense or --experts); default "
               "profile calibrated on the GPU once (build/train_gpt_profile_cuda_h<hidden>_p<P>.json); --save, "
               "--load, --resume and training checkpoints are host-only for now");
  flags.choice("--dtype", o.dtype, {"fp32", "bf16"},
               "bf16: mixed precision as on a GPU (bf16 weights and activations in compute, fp32 master weights, "
               "gradients and AdamW states; on the CPU computed in fp32); dense GPT on the host only for now");
  flags.choice("--emulate", o.emulate, {"a100", "h100", "h200"},
               "thread ranks paced like that 8-GPU node's links (latency and bandwidth stretched by its GEMM rate over "
               "this machine's), planned with those links (see also bench/emulated_switching)")
      .without_default();
  flags.text("--mesh", o.mesh,
             "D x P x C ranks: dp replicas (ZeRO --zero over dp), P pipeline stages (1F1B, --micro-batch rows per micro-batch), "
             "cp groups in which the strategies switch per layer; the losses of the single group (--ranks C) on the "
             "same batches (use --pack-tokens to batch rows; with --pack-documents each dp replica trains a packed "
             "sequence of its own, planned by its cp group); with --experts the MoE layers run over dp x cp of each "
             "stage (ep), each expert split over the tp group with tp (etp = tp)",
             "dp=D,pp=P,cp=C")
      .nonempty("axes such as dp=2,cp=2");
  flags.text("--mesh-file", o.mesh_file,
             "run the configuration a file of search_parallel --emit holds (its dp, pp, cp and zero; axes train_gpt "
             "cannot run yet and a model other than these flags' are refused by name)", "FILE")
      .nonempty("a configuration file of search_parallel --emit");
  flags.integer("--virtual-stages", o.virtual_stages, 1, 64,
                "--mesh: model chunks per pipeline stage, on the interleaved 1F1B schedule (each replica's rows per "
                "step a multiple of pp)");
  flags.integer("--micro-batch", o.micro_batch, std::int64_t(1), std::int64_t(1) << 20,
                "--mesh: rows per micro-batch (the last of a replica's the rest); with pp stages through the pipeline, "
                "without them accumulating gradients micro-batch by micro-batch (default: one row with pp, a "
                "replica's rows without)")
      .without_default();
  flags.choice("--recompute", o.recompute, {"auto", "none", "selective", "full"},
               "--mesh: what a pipeline stage keeps for its backward: every activation of each in-flight micro-batch "
               "(none), all of them but attention's core, re-run from the kept q, k, v before each layer's backward "
               "(selective), or its input, the stage's forward recomputed (full); auto: full with pp stages, none "
               "without");
  flags.choice("--vocab-parallel", o.vocab_parallel, {"on", "off"},
               "--mesh with tp: the embedding and the LM head sharded by vocabulary rows over the tp group (on, V/tp "
               "rows each, as Megatron and the search's memory) or whole on every tp rank (off)");
  flags.integer("--zero", zero_stage, std::int64_t(0), std::int64_t(3),
                "--mesh: the ZeRO stage over dp (3: parameters sharded too, each layer gathered around its use)");
  flags.choice("--zero3-prefetch", o.zero3_prefetch, {"on", "off"},
               "--zero 3: each layer's parameter gather posted while the layer before it computes, each gradient "
               "reduce-scatter finished after the next layer's backward (on, the default; two layers' parameters "
               "held at once), or each waited for where it is posted (off); the same values either way")
      .without_default();
  flags.integer("--experts", o.experts, std::int64_t(1), std::int64_t(1) << 16,
                "an MoE GPT of E experts of width ffn/K, every sublayer planned (MoE: ExpertParallel or "
                "ExpertTensorParallel), expert load and router losses printed")
      .without_default();
  flags.integer("--top-k", o.top_k, std::int64_t(1), std::int64_t(1) << 16, "--experts: experts per token");
  flags.integer("--shared-experts", o.shared_experts, std::int64_t(0), std::int64_t(1) << 10,
                "--experts: shared experts");
  flags.integer("--first-dense", o.first_dense, 0, 4096, "--experts: the first N layers dense");
}

inline cli::Flags make_flags() {
  return cli::Flags("train_gpt",
      "Trains a byte-level GPT on the bundled State of the Union corpus (or --corpus DIR) on p ranks under a per-rank "
      "memory cap, the exact planner choosing a strategy for every attention and MLP sublayer of every layer and "
      "step (or --strategy NAME everywhere). Prints per step the length, the plan, the loss, the time, the model "
      "FLOPs utilisation and the measured peak memory against the model's prediction; a summary at the end. Exit "
      "status: 0 done; 1 failed, or stopped because the loss diverged (not finite, or above 4 ln(vocab)); 2 the "
      "command line was refused; 3 the training and --save finished but a side output (--csv, a training "
      "checkpoint) failed, as reported on stderr.");
}

// Whether --ranks is on the command line (CLI11 parses it again into a probe whose --ranks is 0, no rank count).
inline bool ranks_given(int argc, char** argv) {
  TrainingOptions probe;
  probe.ranks = 0;
  std::int64_t zero_stage = 0;
  std::string backend_name = "threads";
  cli::Flags flags = make_flags();
  declare(flags, probe, zero_stage, backend_name);
  flags.parse(argc, argv);
  return probe.ranks != 0;
}

// The options of `o` that differ from the defaults as "--flag", "value" pairs, without --resume, --load and
// --stop-after (a resumed run starts from its checkpoint and runs to the end): what training checkpoints save as
// train.args, so that parsing them gives `o` again.
inline std::vector<std::string> given_args(const TrainingOptions& o) {
  const TrainingOptions d;
  std::vector<std::string> args;
  const auto add = [&](const char* flag, bool differs, const std::string& value) {
    if (!differs) return;
    args.push_back(flag);
    args.push_back(value);
  };
  const auto text = [](const auto& v) { return fmt::format("{}", v); };
  add("--steps", o.steps != d.steps, text(o.steps));
  add("--seed", o.seed != d.seed, text(o.seed));
  add("--ranks", o.ranks != d.ranks, text(o.ranks));
  add("--layers", o.layers != d.layers, text(o.layers));
  add("--hidden", o.hidden != d.hidden, text(o.hidden));
  add("--heads", o.heads != d.heads, text(o.heads));
  add("--min-len", o.min_len != d.min_len, text(o.min_len));
  add("--max-len", o.max_len != d.max_len, text(o.max_len));
  add("--cap-mib", o.cap_mib != d.cap_mib, text(o.cap_mib));
  add("--strategy", o.strategy != d.strategy, o.strategy);
  add("--lr", o.lr != d.lr, text(o.lr));
  add("--order", o.sorted != d.sorted, o.sorted ? "sorted" : "random");
  add("--speed-probe", o.speed_probe != d.speed_probe, o.speed_probe ? "on" : "off");
  add("--calibration-passes", o.calibration_passes != d.calibration_passes, text(o.calibration_passes));
  add("--save", o.save != d.save, o.save);
  add("--profile", o.profile != d.profile, o.profile);
  add("--corpus", o.corpus != d.corpus, o.corpus);
  add("--backend", o.backend != d.backend, o.backend == RankBackend::mpi ? "mpi" : "threads");
  add("--checkpoint-every", o.checkpoint_every != d.checkpoint_every, text(o.checkpoint_every));
  add("--keep", o.keep != d.keep, text(o.keep));
  add("--checkpoint-dir", o.checkpoint_dir != d.checkpoint_dir, o.checkpoint_dir);
  add("--csv", o.csv != d.csv, o.csv);
  add("--pack-tokens", o.pack_tokens != d.pack_tokens, text(o.pack_tokens));
  add("--pack-documents", o.pack_documents != d.pack_documents, text(o.pack_documents));
  add("--pack-order", o.pack_balanced != d.pack_balanced, o.pack_balanced ? "balanced" : "as-packed");
  add("--device", o.device != d.device, o.device);
  add("--emulate", o.emulate != d.emulate, o.emulate);
  add("--dtype", o.dtype != d.dtype, o.dtype);
  add("--mesh", o.mesh != d.mesh, o.mesh);
  add("--mesh-file", o.mesh_file != d.mesh_file, o.mesh_file);
  add("--virtual-stages", o.virtual_stages != d.virtual_stages, text(o.virtual_stages));
  add("--zero", o.zero != d.zero, text(int(o.zero)));
  add("--zero3-prefetch", o.zero3_prefetch != d.zero3_prefetch, o.zero3_prefetch);
  add("--micro-batch", o.micro_batch != d.micro_batch, text(o.micro_batch));
  add("--recompute", o.recompute != d.recompute, o.recompute);
  add("--vocab-parallel", o.vocab_parallel != d.vocab_parallel, o.vocab_parallel);
  add("--experts", o.experts != d.experts, text(o.experts));
  add("--top-k", o.top_k != d.top_k, text(o.top_k));
  add("--shared-experts", o.shared_experts != d.shared_experts, text(o.shared_experts));
  add("--first-dense", o.first_dense != d.first_dense, text(o.first_dense));
  return args;
}

// Throws unless a file can be written at `path` for `flag`: an existing device or pipe (/dev/null, /dev/full) is
// written in place; otherwise the folder exists and a file can be made in it, and `path` is not a folder.
inline void check_output_file(const std::string& flag, const std::string& path) {
  std::error_code error;
  const std::filesystem::file_status status = std::filesystem::status(path, error);
  if (std::filesystem::exists(status) && !std::filesystem::is_directory(status) && !std::filesystem::is_regular_file(status))
    return;  // written in place (core/atomic_file.hpp)
  try {
    pd::check_writable_target(path);
  } catch (const pd::Error& e) {
    throw pd::Error(fmt::format("{}: {}", flag, pd::error_reason(e, /*drop_location=*/false)));
  }
}

// Throws unless `flag` can write a folder at `path`: an existing folder in which a file can be made, or a path whose
// nearest existing ancestor is such a folder (the missing ones are made when saving).
inline void check_output_folder(const std::string& flag, const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code error;
  fs::path at = fs::absolute(path, error);
  while (!fs::exists(fs::symlink_status(at, error)) && at.has_parent_path() && at.parent_path() != at) at = at.parent_path();
  pd::check(fs::is_directory(at, error), "{} {}: \"{}\" is not a folder; expected a folder to write (or a path whose "
            "missing folders can be made)", flag, path, at.string());
  try {
    pd::check_writable_target((at / "probe").string());
  } catch (const pd::Error& e) {
    throw pd::Error(fmt::format("{}: {}", flag, pd::error_reason(e, /*drop_location=*/false)));
  }
}

// Every output path of `o` checked before any work, in every mode (dense, --experts, --mesh): --save (a file; with
// --experts a Hugging Face folder), --csv, and --checkpoint-dir when checkpoints are written. Exits with the usage.
inline void check_outputs(const TrainingOptions& o) {
  try {
    if (!o.save.empty()) {
      if (o.experts > 0 && o.mesh.empty()) check_output_folder("--save", o.save);  // a mesh saves one file
      else check_output_file("--save", o.save);
    }
    if (!o.csv.empty()) check_output_file("--csv", o.csv);
    if (o.checkpoint_every > 0 || o.stop_after > 0) pd::check_checkpoint_dir(o.checkpoint_dir);
  } catch (const pd::Error& e) {
    usage(pd::error_reason(e, /*drop_location=*/false));
  }
}

// The options of a command line, checked (every output path too unless `check_output_paths` is false: the options a
// checkpoint saved, before those given now override them).
inline TrainingOptions parse(int argc, char** argv, bool check_output_paths = true) {
  TrainingOptions o;
  std::int64_t zero_stage = 0;
  std::string backend_name = "threads";  // --backend, read into o.backend
  cli::Flags flags = make_flags();
  declare(flags, o, zero_stage, backend_name);
  usage_text() = flags.usage();
  flags.parse(argc, argv);
  o.zero = pd::ZeroStage(int(zero_stage));
  o.backend = backend_name == "mpi" ? pd::RankBackend::mpi : pd::RankBackend::threads;
  o.args = given_args(o);
  if (!o.resume.empty() && !o.load.empty()) usage("--resume and --load exclude each other (--resume loads the weights)");
  if (o.min_len > o.max_len) usage(fmt::format("--min-len {} exceeds --max-len {}", o.min_len, o.max_len));
  if (o.pack_documents > 0 && o.pack_tokens > 0)
    usage("--pack-tokens (documents as rows) and --pack-documents (documents in one sequence) exclude each other");
  if (o.experts > 0) {  // the MoE mode (examples/train_gpt/train_moe.hpp) plans every sublayer and saves a Hugging Face folder
    if (o.top_k > o.experts) usage(fmt::format("--top-k {} exceeds --experts {}", o.top_k, o.experts));
    if (o.first_dense >= o.layers)
      usage(fmt::format("--first-dense {} leaves no MoE layer of --layers {}", o.first_dense, o.layers));
    if ((!o.strategy.empty() && o.mesh.empty() && o.mesh_file.empty()) || !o.load.empty())
      usage("--experts: --strategy (without --mesh) and --load are for the dense GPT (the MoE GPT resumes with "
            "--resume; on a mesh --strategy names the attention and dense MLPs' strategy)");
  } else if (o.shared_experts > 0 || o.first_dense > 0) {
    usage("--shared-experts and --first-dense need --experts");
  }
  try {  // the head dimension is --hidden / --heads, never truncated
    pd::cli::head_dim_of(o.hidden, o.heads);
  } catch (const std::invalid_argument& e) {
    usage(e.what());
  }
  if ((o.strategy == "MegatronRing" || o.strategy == "Tp2d" || o.strategy == "RingTp2d") && o.mesh.empty() &&
      o.mesh_file.empty())
    usage(fmt::format("--strategy {} computes over a factorised group: give --mesh cp=C,tp=T or --mesh "
                      "tp_x=X,tp_y=Y (without --mesh the strategies are {})", o.strategy,
                      fmt::join(pd::cost::default_catalog().names(), ", ")));
  if (!o.mesh_file.empty()) {  // --mesh-file: the mesh and ZeRO stage of a search_parallel --emit file
    if (!o.mesh.empty()) usage(fmt::format("--mesh {} and --mesh-file {} both give the mesh; give one", o.mesh,
                                           o.mesh_file));
    pd::examples::MeshFileRun run;
    try { run = pd::examples::mesh_file_run(o.mesh_file, pd::examples::mesh_model_config(o)); }
    catch (const pd::Error& e) { usage(e.what()); }
    if (zero_stage != 0 && pd::ZeroStage(int(zero_stage)) != run.zero)
      usage(fmt::format("--zero {} but --mesh-file {} gives zero={}; give it in one place", zero_stage, o.mesh_file,
                        int(run.zero)));
    if (o.virtual_stages != 1 && o.virtual_stages != run.virtual_stages)
      usage(fmt::format("--virtual-stages {} but --mesh-file {} gives virtual_stages={}; give it in one place",
                        o.virtual_stages, o.mesh_file, run.virtual_stages));
    if (o.micro_batch != 0 && o.micro_batch != run.micro_batch)
      usage(fmt::format("--micro-batch {} but --mesh-file {} gives micro_batch={}; give it in one place",
                        o.micro_batch, o.mesh_file, run.micro_batch));
    if (o.recompute != "auto" && o.recompute != run.recompute)
      usage(fmt::format("--recompute {} but --mesh-file {} gives recompute={}; give it in one place", o.recompute,
                        o.mesh_file, run.recompute));
    if (run.zero3_prefetch) {
      const std::string file_value = *run.zero3_prefetch ? "on" : "off";
      if (!o.zero3_prefetch.empty() && o.zero3_prefetch != file_value)
        usage(fmt::format("--zero3-prefetch {} but --mesh-file {} gives zero3_prefetch={}; give it in one place",
                          o.zero3_prefetch, o.mesh_file, *run.zero3_prefetch));
      if (run.zero == pd::ZeroStage::three) o.zero3_prefetch = file_value;
    }
    o.mesh = run.mesh;
    o.zero = run.zero;
    o.virtual_stages = run.virtual_stages;
    o.micro_batch = run.micro_batch;
    o.recompute = run.recompute;
  }
  if ((o.micro_batch != 0 || o.recompute != "auto") && o.mesh.empty())
    usage("--micro-batch and --recompute need --mesh (the single group runs a step's rows at once)");
  if (o.virtual_stages > 1 && o.mesh.empty()) usage("--virtual-stages needs --mesh (pipeline stages)");
  if (!o.zero3_prefetch.empty() && o.zero != pd::ZeroStage::three)
    usage(fmt::format("--zero3-prefetch \"{}\" needs --zero 3 (it schedules ZeRO-3's parameter gathers; --zero is {})",
                      o.zero3_prefetch, int(o.zero)));
  if (o.vocab_parallel != "on" && o.mesh.empty()) usage("--vocab-parallel needs --mesh (its tp axis)");
  if (!o.mesh.empty()) {  // examples/train_gpt/train_mesh.hpp
    int mesh_ranks = 0;
    try {
      const pd::DeviceMesh mesh = pd::examples::parse_mesh(o.mesh);
      mesh_ranks = mesh.size();
      pd::examples::check_recompute(o, mesh.axis_size("pp"));
    } catch (const pd::Error& e) {
      usage(e.what());
    }
    if (mesh_ranks > 256)  // the --ranks limit holds for a mesh too (each rank is a thread or a process)
      usage(fmt::format("--mesh \"{}\" holds {} ranks; at most 256 (as --ranks)", o.mesh, mesh_ranks));
    if (ranks_given(argc, argv) && o.ranks != mesh_ranks)
      usage(fmt::format("--ranks {} but --mesh {} holds {} ranks", o.ranks, o.mesh, mesh_ranks));
    o.ranks = mesh_ranks;
    if (o.device != "cpu")
      usage(fmt::format("--mesh trains on the host: --device {} is not available with it yet", o.device));
  }
  if (o.speed_probe && (o.device != "cpu" || !o.mesh.empty() || o.experts > 0))
    usage("--speed-probe on: the dense GPT on the host only (it times the host GEMMs its profile prices)");
  // The model must fit this machine at all (examples/train_gpt/caps.hpp): refused now, before calibrating or
  // allocating (a model of 65536 experts would otherwise grow until the system kills it).
  if (const std::string why = machine_fit_refusal(o); !why.empty()) usage(why);
  if (check_output_paths) check_outputs(o);  // fail now, not after the whole run
  return o;
}

// The options that fix the data schedule (examples/train_gpt/training_data.hpp), as flag and value.
inline std::vector<std::pair<std::string, std::string>> data_options(const TrainingOptions& o) {
  return {{"--steps", fmt::format("{}", o.steps)},
          {"--seed", fmt::format("{}", o.seed)},
          {"--min-len", fmt::format("{}", o.min_len)},
          {"--max-len", fmt::format("{}", o.max_len)},
          {"--order", o.sorted ? "sorted" : "random"},
          {"--corpus", o.corpus.empty() ? std::string("(the bundled corpus)") : o.corpus},
          {"--pack-tokens", o.pack_tokens > 0 ? fmt::format("{}", o.pack_tokens) : std::string("(none)")},
          {"--pack-documents", o.pack_documents > 0 ? fmt::format("{}", o.pack_documents) : std::string("(none)")},
          {"--pack-order", o.pack_balanced ? "balanced" : "as-packed"}};
}

// With --resume PATH: the options the checkpoint's run was started with, then those given now (which win). Options
// that would change the data schedule (--seed, --steps, ...: data_options) are refused, naming both values; so is a
// checkpoint at or past the end of the run.
inline TrainingOptions parse_resuming(int argc, char** argv) {
  TrainingOptions given = parse(argc, argv);
  if (given.resume.empty()) return given;
  pd::TrainingCheckpointInfo info;
  try {
    info = pd::read_training_checkpoint(given.resume);
  } catch (const pd::Error& e) {
    usage(fmt::format("--resume: {}", pd::error_reason(e, /*drop_location=*/false)));
  }
  // The group's shape given now replaces the checkpoint's (a checkpoint holds one logical model: it resumes on any
  // shape): --mesh or --mesh-file given drops the saved --ranks, --mesh, --mesh-file, --zero and --virtual-stages;
  // --ranks given without them drops the saved mesh (a plain group).
  const auto given_flag = [&](std::string_view flag) {
    for (int i = 1; i < argc; ++i) {
      const std::string_view a = argv[i];
      if (a == flag || (a.size() > flag.size() && a.substr(0, flag.size()) == flag && a[flag.size()] == '=')) return true;
    }
    return false;
  };
  std::vector<std::string_view> replaced;
  if (given_flag("--mesh") || given_flag("--mesh-file"))
    replaced = {"--ranks", "--mesh", "--mesh-file", "--zero", "--zero3-prefetch", "--virtual-stages"};
  else if (given_flag("--ranks"))
    replaced = {"--mesh", "--mesh-file", "--zero", "--zero3-prefetch", "--virtual-stages"};
  std::vector<std::string> saved_args{argv[0]};
  for (std::size_t i = 0; i < info.args.size(); ++i) {
    const bool pair = i + 1 < info.args.size() && info.args[i].rfind("--", 0) == 0;
    if (pair && std::find(replaced.begin(), replaced.end(), info.args[i]) != replaced.end()) {
      ++i;  // the flag and its value
      continue;
    }
    saved_args.push_back(info.args[i]);
  }
  std::vector<std::string> args = saved_args;
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  const auto parse_strings = [](std::vector<std::string> strings, bool check_output_paths) {
    std::vector<char*> pointers;
    for (std::string& a : strings) pointers.push_back(a.data());
    return parse(int(pointers.size()), pointers.data(), check_output_paths);
  };
  const TrainingOptions saved = parse_strings(saved_args, false), o = parse_strings(args, true);
  const auto before = data_options(saved), now = data_options(o);
  for (std::size_t i = 0; i < now.size(); ++i) {
    if (now[i].second == before[i].second) continue;
    if (now[i].first == "--steps")
      usage(fmt::format("--resume {}: --steps {} differs from the checkpoint's --steps {} (it continues at step {} "
                        "of that run): another --steps draws another data schedule; resume without --steps",
                        o.resume, now[i].second, before[i].second, info.next_step));
    usage(fmt::format("--resume {}: {} {} differs from the checkpoint's {} {}: the data schedule would change; resume "
                      "with the checkpoint's {} (or start a new run)", o.resume, now[i].first, now[i].second,
                      before[i].first, before[i].second, now[i].first));
  }
  return o;
}

}  // namespace train_gpt_flags

using train_gpt_flags::parse_resuming;
using train_gpt_flags::usage;

}  // namespace paradyse::examples
