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
// Hardware profile: --profile FILE.json, or else the one calibrated on this machine (with --device cuda, on the GPU)
// by cost/calibrate.hpp (a quick calibration on the first run, cached in build/). Memory cap: --cap-mib, or else a
// default from the memory model, between what all-METP needs at --max-len and what all-MegatronTS needs there, so
// that the longest inputs do not fit with MegatronTS but do with METP.
//
//   train_gpt --help     (every flag with its range and default: generated from examples/train_gpt/flags.hpp)
// --save writes a safetensors checkpoint of the global weights at the end (model/checkpoint.hpp); --load starts
// from one (saved on any number of ranks, same model configuration).
//
// This file is the dense training loop; its helpers are the program's own files in examples/train_gpt/ (flags,
// hardware profile, memory cap, the step, the report, the save), and the other loops are there too (--mesh:
// train_mesh.hpp, --experts: train_moe.hpp).
#include "paradyse/core/host_malloc.hpp"
#include "paradyse/core/printable.hpp"
#include "paradyse/core/progress.hpp"
#include "train_gpt/caps.hpp"
#include "train_gpt/dense_step.hpp"
#include "train_gpt/divergence.hpp"
#include "train_gpt/flags.hpp"
#include "train_gpt/hardware.hpp"
#include "train_gpt/report.hpp"
#include "train_gpt/save.hpp"
#include "train_gpt/train_mesh.hpp"
#include "train_gpt/train_moe.hpp"
#include "train_gpt/training_data.hpp"
#include "train_gpt/training_options.hpp"

#include "paradyse/comm/ranks.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/data/packing.hpp"
#include "paradyse/model/byte_gpt.hpp"
#include "paradyse/model/checkpoint.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/resume.hpp"
#include "paradyse/ops/cpu/bf16_backend.hpp"
#include "paradyse/ops/cpu/gemm_agreement.hpp"
#include "paradyse/plan/gpt_costs.hpp"
#include "paradyse/plan/planner.hpp"
#if PARADYSE_WITH_CUDA
#include "paradyse/ops/cuda_backend.hpp"
#endif

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace pd = paradyse;
using Model = pd::Gpt<pd::AllStrategies<>>;  // on the host (ops::Cpu)
// --dtype bf16: bf16 mixed precision on the host (ops::CpuBf16: bf16 operands, fp32 compute and masters)
using Bf16Model = pd::Gpt<pd::AllStrategies<pd::ops::CpuBf16>, pd::ops::CpuBf16>;
#if PARADYSE_WITH_CUDA
using DeviceModel = pd::Gpt<pd::AllStrategies<pd::ops::Cuda>, pd::ops::Cuda>;  // --device cuda: on one GPU
#endif

namespace {

using namespace pd::examples;  // the program's own files: examples/train_gpt/

// Trains the dense GPT on `ranks` (threads or MPI processes over ops::Cpu, or cuda_local ranks over ops::Cuda): the
// data, the memory cap, the per-step plans, the table and the summary. Returns the exit code.
template <class ModelT, class RanksT>
int train_dense(const TrainingOptions& o, RanksT& ranks) {
  const bool mpi = o.backend == pd::RankBackend::mpi;
  constexpr bool on_device = StrategiesOf<ModelT>::on_device;
  pd::check(o.emulate.empty() || (!on_device && !mpi && o.profile.empty()),
            "--emulate paces the thread communicator against this machine's calibrated profile: it needs --backend "
            "threads, --device cpu and no --profile");
  if (on_device) refuse_device_checkpoints(o);
  const pd::GptConfig config = pd::byte_gpt_config(byte_gpt_shape(o));  // model/byte_gpt.hpp
  config.validate_for(o.ranks);
  // The steps: rows padded to at least two tokens per rank (zigzag chunks), packed up to --pack-tokens, or packed
  // sequences (examples/train_gpt/training_data.hpp).
  const TrainingData data = training_data(o, {o.ranks, config.layer.zigzag}, o.pack_tokens);
  const std::vector<pd::data::Step>& steps = data.steps;
  const int n_steps = int(steps.size());
  pd::cost::HardwareProfile hardware = hardware_profile<typename StrategiesOf<ModelT>::backend>(o, ranks);
  if (!o.emulate.empty()) hardware = emulated(o, hardware, ranks);
  const pd::plan::GptCosts<ModelT> costs{config, o.ranks, &hardware};
  std::optional<DenseCap> cap = dense_cap<ModelT>(o, config, costs, on_device);  // examples/train_gpt/caps.hpp
  if (!cap) return 2;
  print_dense_header(o, config, data, n_steps, *cap, mpi);
  if (ModelT::compute_dtype == pd::DType::bf16)
    fmt::print("precision: bf16 mixed (bf16 weights and activations in compute, fp32 compute on the CPU; fp32 master "
               "weights, gradients and AdamW states; checkpoints hold the fp32 masters)\n");

  for (int r = 0; r < o.ranks; ++r) ranks.tracker(r).set_cap(std::size_t(cap->cap));
  ranks.run([&](auto&, int r) {
    ranks.models[std::size_t(r)] = std::make_unique<ModelT>(config, o.ranks, r, o.seed);
    ranks.pools[std::size_t(r)] = std::make_unique<pd::BufferPool>();
  });
  if (!fit_save(o, ranks, *cap)) return 2;
  if (!o.load.empty()) {
    if (const auto bad = pd::first_nonfinite_tensor(o.load))
      throw pd::Error(fmt::format("--load {}: tensor {}: weights that are not finite cannot train", o.load, *bad));
    ranks.run([&](auto&, int r) { pd::load_checkpoint(*ranks.models[std::size_t(r)], o.load); });
    fmt::print("weights loaded from {}\n\n", o.load);
  }
  // Training checkpoints (model/resume.hpp): resumed from, and written on the way.
  pd::TrainingCheckpoints checkpoints(resume_options(o), n_steps, data_description(o, n_steps, o.pack_tokens),
                                            ranks);
  const int first_step = checkpoints.first_step(), end_step = checkpoints.end_step();
  if (!o.resume.empty())
    fmt::print("resumed from {}: weights, AdamW moments and optimizer step {}; the data continues at step {} of "
               "{}\n\n", o.resume, ranks.models[std::size_t(ranks.first_local())]->steps_taken(), first_step, n_steps);
  DenseReport report(o, hardware, ranks.reports(), double(cap->cap));  // examples/train_gpt/report.hpp

  pd::ops::AdamWConfig adamw;
  adamw.learning_rate = float(o.lr);
  adamw.weight_decay = 0.01f;
  const int warmup = std::max(1, std::min(8, n_steps / 8));
  // --speed-probe: the machine's speed against the profile around the steps (examples/train_gpt/hardware.hpp).
  if (o.speed_probe)
    fmt::print("speed probe before the steps: measured / priced {:.4f}\n", probe_speed(ranks, hardware));
  const pd::Timer run_start;
  double planner_seconds = 0;
  paradyse::Progress progress("step", end_step - first_step, "tokens");  // on a terminal only
  std::int64_t progress_tokens = 0;
  for (int step = first_step; step < end_step; ++step) {
    progress.clear();  // the rows print over it; it is drawn again when the step ends, however it ends
    struct ShowProgress {
      paradyse::Progress& progress;
      std::int64_t done;
      double tokens;
      ~ShowProgress() { progress.show(done, tokens, true); }
    } show_progress{progress, step + 1 - first_step, double(progress_tokens += steps[std::size_t(step)].real_tokens())};
    checkpoints.before_step(ranks, step);
    const pd::data::Step& batch = steps[std::size_t(step)];
    const DenseStepRow row(step, batch, config);
    const pd::Timer plan_start;
    std::optional<pd::plan::Plan> plan;
    try {
      plan = plan_dense_step(o, costs, batch, cap->cap);
    } catch (const pd::plan::NoFeasiblePlan& e) {
      report.no_plan(row, e.what());
      continue;
    }
    planner_seconds += plan_start.seconds();
    adamw.learning_rate = float(o.lr * std::min(1.0, double(step + 1) / warmup));
    const pd::Timer start;
    const auto seconds = [&] { return start.seconds(); };
    DenseStepResult result;
    try {
      result = run_dense_step<ModelT>(ranks, o, config, batch, data.docs, *plan, adamw, cap->cap, mpi);
    } catch (const pd::OutOfMemory& e) {
      report.out_of_memory(row, *plan, seconds(), ranks.out_of_memory_rank(), e);
      // Under the same cap: the recovery allocates nothing, and the pool gives back what the step cached.
      ranks.run([&](auto&, int r) {
        ranks.models[std::size_t(r)]->recover_from_failed_step();
        ranks.pools[std::size_t(r)]->trim();
      });
      continue;
    }
    if (const auto why = divergence(result.loss, step, config.vocab, double(adamw.learning_rate), o.lr);
        why && !result.over_cap) {  // examples/train_gpt/divergence.hpp
      progress.clear();
      fmt::print(stderr, "train_gpt: {}\n", *why);
      return 1;
    }
    const double elapsed = seconds();
    ranks.share(result.peaks);
    const double peak = *std::max_element(result.peaks.begin(), result.peaks.end());
    if (result.over_cap) report.over_cap(row, *plan, elapsed, peak);  // MPI: the step was undone
    else report.trained(row, *plan, result.loss, elapsed, peak, result.cpu_s, result.optimizer_cpu_s);
  }
  progress.finish();
  const double total = run_start.seconds();
  if (o.speed_probe)
    fmt::print("speed probe after the steps: measured / priced {:.4f}\n", probe_speed(ranks, hardware));
  checkpoints.at_end(ranks);
  std::size_t documents = 0;
  for (int i = first_step; i < end_step; ++i) documents += steps[std::size_t(i)].rows.size();
  report.summary(documents, total, planner_seconds);
  const bool side_output_failed = report.close_csv() || checkpoints.failed();
  if (!o.save.empty())
    if (const int status = save_weights(o, ranks, report.steps_run(), mpi); status != 0)  // examples/train_gpt/save.hpp
      return status;
  return finished(side_output_failed);  // examples/train_gpt/divergence.hpp
}

// The group made (under MPI: this process's rank; the others print nothing): MPI ranks agree on the GEMM engines.
template <class RanksT>
void prepare_group(RanksT& ranks, bool mpi) {
  if (!ranks.reports() && !std::freopen("/dev/null", "w", stdout))
    throw pd::Error("cannot silence the standard output of MPI rank " + std::to_string(ranks.first_local()));
  if (mpi) ranks.run([](auto& world, int) { pd::ops::cpu::agree_gemm_engines(world); });  // bitwise-equal replicas
}

}  // namespace

int main(int argc, char** argv) {
  pd::retain_freed_host_memory();  // each step reuses what the last one freed (core/host_malloc.hpp)
  const TrainingOptions o = parse_resuming(argc, argv);
#if PARADYSE_WITH_MPI
  std::optional<pd::MpiSession> mpi_session;
  if (o.backend == pd::RankBackend::mpi) mpi_session.emplace(&argc, &argv);
#endif
  const bool mpi = o.backend == pd::RankBackend::mpi;
  try {
    if (o.dtype == "bf16") {  // bf16 mixed precision (ops/cpu/bf16_backend.hpp): the dense GPT on the host for now
      if (o.device == "cuda")
        throw pd::Error("--dtype bf16 with --device cuda: the bf16 GPU kernels (norms, activations, RoPE, embedding, "
                        "loss, AdamW) do not exist yet; train bf16 on the host (--device cpu) or fp32 on the GPU");
      if (!o.mesh.empty())
        throw pd::Error("--dtype bf16 with --mesh: the mesh trains in fp32 only for now (--dtype fp32)");
      if (o.experts > 0)
        throw pd::Error("--dtype bf16 with --experts: the MoE GPT trains in fp32 only for now (--dtype fp32)");
      pd::Ranks<Bf16Model, pd::BufferPool> ranks(o.backend, o.ranks, std::numeric_limits<std::size_t>::max());
      prepare_group(ranks, mpi);
      return train_dense<Bf16Model>(o, ranks);
    }
    // The group first (under MPI: this process's rank; the others print nothing), capped once the cap is known.
    pd::Ranks<Model, pd::BufferPool> ranks(o.backend, o.ranks, std::numeric_limits<std::size_t>::max());
    prepare_group(ranks, mpi);
    if (!o.mesh.empty()) {
      pd::check(o.emulate.empty() || (!mpi && o.profile.empty()), "--mesh {} --emulate {}: the emulation paces the "
                "thread communicator against this machine's calibrated profile: it needs --backend threads and no "
                "--profile", o.mesh, o.emulate);
      pd::cost::HardwareProfile hardware = hardware_profile(o, ranks);
      if (!o.emulate.empty()) hardware = emulated(o, hardware, ranks);  // every mesh group's links paced alike
      return pd::examples::train_mesh<pd::MeshStrategies<>>(o, hardware, ranks);
    }
    if (o.experts > 0 && o.device == "cpu") return pd::examples::train_moe<Model>(o, hardware_profile(o, ranks), ranks);
    if (o.device == "cuda") {
#if PARADYSE_WITH_CUDA
      pd::check(pd::device::available(), "--device cuda: {}", pd::device::unavailable_reason());
      pd::DeviceRanks<DeviceModel, pd::BufferPool> device_ranks(o.ranks, std::numeric_limits<std::size_t>::max());
      if (o.experts > 0)  // the MoE GPT on the GPU, its profile calibrated there
        return pd::examples::train_moe<DeviceModel>(o, hardware_profile<pd::ops::Cuda>(o, device_ranks), device_ranks);
      return train_dense<DeviceModel>(o, device_ranks);
#else
      throw pd::Error("--device cuda: this train_gpt was built without CUDA (no nvcc found by CMake)");
#endif
    }
    return train_dense<Model>(o, ranks);
  } catch (const std::exception& e) {
#if PARADYSE_WITH_MPI
    if (mpi) pd::abort_mpi_job(e.what());  // the other processes may be waiting in a collective
#endif
    fmt::print(stderr, "train_gpt: {}\n", paradyse::bounded_message(e.what()));  // a filesystem_error echoes paths whole
    return 1;
  }
}
