// examples/train_gpt/train_mesh.hpp: train_gpt --mesh dp=D,pp=P,cp=C (or tp=T in place of cp): the GPT trained on a
// D x P x C (or D x P x T) mesh of ranks (mesh/device_mesh.hpp; the group innermost, so it holds consecutive ranks).
// (cp and tp both, or tp_x and tp_y: a factorised group per stage, where the planner also prices and picks
// MegatronRing, tp inside each cp group, and Tp2d, 2-D tensor parallelism.)
// Each rank runs its stage of the model (model/mesh_stage.hpp: cp groups in which the strategies switch per layer,
// or tp groups running Megatron's tensor parallelism with sequence parallelism, MegatronTS, in every sublayer; pp
// stages on the 1F1B schedule over micro-batches of --micro-batch rows, every in-flight micro-batch's activations
// kept (--recompute none), all but attention's core (selective) or each stage's forward recomputed (full), and with --experts the MoE layers over an expert group folded over dp x cp, or with
// ep=E,etp=T in the mesh over expert groups of E ranks of dp x cp and columns over T ranks of tp, the experts
// replicated over the rest: model/expert_groups.hpp; with tp the embedding and the LM head sharded by vocabulary rows
// over each stage's tp ranks, --vocab-parallel on, the default: MeshGptStage::shard_vocabulary), the dp
// replicas train the rows or packed sequences of each mesh step (data/mesh_steps.hpp) and sum their gradients in
// model/mesh_optimizer.hpp's MeshOptimizer (ZeRO --zero over dp; with --zero 3 each rank keeps 1/dp of every parameter,
// each layer gathered around its use: model/zero3_shards.hpp; the MoE tensors 1/edp of theirs over edp). --mesh-file FILE runs a configuration file of
// search_parallel --emit (mesh_file_run below). Checkpoints (--save, --load, --resume, --checkpoint-every,
// --stop-after) in the dense run's format: examples/train_gpt/mesh_checkpoints.hpp.
//
// Packed documents (--pack-documents B): each replica's cp group plans its own sequence (strategies must agree only
// within a cp group and along its pp stages; the replicas meet only in the gradient reduction, so the step's time is
// its slowest replica's). With --experts the MoE layers span the replicas, so every replica runs the plan of the
// step's most expensive sequence, and every replica must hold a sequence in every step (checked); with pp stages each
// stage's MoE layers run over that stage's dp x cp ranks, every replica running as many micro-batches (checked), the
// router losses entering as their mean over the step's micro-batches (model/mesh_stage.hpp).
//
// The loss and every gradient are those of the whole step's batch: each token's loss gradient is scaled by
// 1 / (counted tokens of the whole batch) and the dp reduction sums, so the losses equal those of the single cp group
// training on the same batch (`train_gpt --ranks C` with the same --pack-tokens; with --experts, `--mesh cp=C`) within
// float rounding; the ctest train_gpt_mesh checks it (and tests/model/mesh_stage.cpp against the documents alone).
// With --experts and pp stages a step of M micro-batches per replica takes the mean of their router losses, so its
// losses equal the single group's when every replica holds one row per step (M = 1; ctest train_gpt_mesh_moe), and
// other stage layouts of the same dp otherwise (tests/model/mesh_experts.cpp: every gradient against the single group
// run micro-batch by micro-batch).
//
// The whole run is one collective call over the world's ranks (thread ranks, or MPI processes under mpirun): the
// mesh groups are split once, every step's plan is computed before training (it depends on the step's shape
// only), and world rank 0 prints the table. Memory: planned under the cap (--cap-mib, or the single-group default);
// the trackers measure the peak but do not enforce the cap.
#pragma once

#include "paradyse/core/csv_table.hpp"
#include "divergence.hpp"
#include "mesh_checkpoints.hpp"
#include "train_moe.hpp"
#include "training_data.hpp"
#include "training_options.hpp"

#include "paradyse/comm/ranks.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/printable.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/data/mesh_steps.hpp"
#include "paradyse/data/packing.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/model/byte_gpt.hpp"
#include "paradyse/model/data_parallel.hpp"
#include "paradyse/model/expert_groups.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/mesh_optimizer.hpp"
#include "paradyse/model/mesh_stage.hpp"
#include "paradyse/plan/gpt_costs.hpp"
#include "paradyse/plan/memory_cap.hpp"
#include "paradyse/plan/moe_plan.hpp"
#include "paradyse/plan/plan_names.hpp"
#include "paradyse/plan/planner.hpp"
#include "paradyse/plan/stack_plan.hpp"
#include "paradyse/search/config_file.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <tuple>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace paradyse::examples {

// "dp=2,pp=2,cp=2" or "dp=2,tp=2" (any order, each axis at most once, missing axes of size 1) as the mesh
// {dp, pp, cp, tp}, the innermost last. The group of each stage (consecutive ranks) is the cp group, in which the
// strategies switch per layer, or the tp group, which runs Megatron's tensor parallelism with sequence parallelism
// (MegatronTS) in every sublayer, or with cp and tp both the cp x tp group (tp innermost) where MegatronRing
// (strategy/megatron_ring.hpp: tp inside each cp group) joins the planner's choices. tp_x=X,tp_y=Y in place of tp: the
// tp group of X x Y ranks is a 2-D tensor-parallel grid where Tp2d (strategy/tp2d.hpp) joins them (the planner picks
// per sublayer among the eight: train_mesh); the mesh's tp axis is then X x Y and
// `tp_x` (if given) receives X (1 without). With cp too, each cp group holds such grids and RingTp2d
// (strategy/ring_tp2d.hpp: ring attention over cp, Tp2d's linears on each grid) joins. Throws an Error naming the bad part.
inline DeviceMesh parse_mesh(std::string_view text, int* tp_x = nullptr);

// The MoE layers' axes of a --mesh text ("ep=2,etp=1" among the device axes; 0: not given): ep, the expert group of
// ep consecutive ranks of dp x cp, and etp, each expert's columns over etp consecutive ranks of tp
// (model/expert_groups.hpp). Throws an Error naming the bad part.
struct ExpertAxes {
  int ep = 0, etp = 0;
};
inline ExpertAxes parse_expert_axes(std::string_view text);

namespace mesh_detail {

// The axes a --mesh text may name, and their sizes in it (0: not given). Throws an Error naming the bad part.
inline constexpr std::string_view kMeshAxes[8] = {"dp", "pp", "cp", "tp", "tp_x", "tp_y", "ep", "etp"};
inline std::array<int, 8> mesh_axis_sizes(std::string_view text) {
  std::array<int, 8> sizes{};
  std::size_t from = 0;
  check(!text.empty(), "--mesh: empty; expected axes such as dp=2,cp=2 (axes dp, pp, cp, tp)");
  while (from <= text.size()) {
    const std::size_t comma = std::min(text.find(',', from), text.size());
    const std::string_view part = text.substr(from, comma - from);
    from = comma + 1;
    const std::size_t eq = part.find('=');
    check(eq != std::string_view::npos, "--mesh {}: \"{}\" is not AXIS=SIZE (axes dp, pp, cp, tp)", printable(text),
          printable(part));
    const std::string_view name = part.substr(0, eq), value = part.substr(eq + 1);
    const auto axis = std::find(std::begin(kMeshAxes), std::end(kMeshAxes), name) - std::begin(kMeshAxes);
    check(axis < 8, "--mesh {}: unknown axis \"{}\"; train_gpt trains on the axes dp, pp, cp and tp (or tp_x and "
          "tp_y), and ep and etp for the experts", printable(text), printable(name));
    int& size = sizes[std::size_t(axis)];
    check(size == 0, "--mesh {}: axis {} is given twice", printable(text), name);
    for (char ch : value) {
      check(std::isdigit(static_cast<unsigned char>(ch)) && size < 100000, "--mesh {}: the size of {} is \"{}\", "
            "expected a positive integer", printable(text), name, printable(value));
      size = size * 10 + (ch - '0');
    }
    check(!value.empty() && size >= 1, "--mesh {}: the size of {} is \"{}\", expected a positive integer",
          printable(text), name, printable(value));
  }
  return sizes;
}

}  // namespace mesh_detail

inline DeviceMesh parse_mesh(std::string_view text, int* tp_x) {
  std::array<int, 8> sizes = mesh_detail::mesh_axis_sizes(text);
  check(sizes[3] == 0 || (sizes[4] == 0 && sizes[5] == 0), "--mesh {}: give tp (1-D) or tp_x and tp_y (2-D), not "
        "both", printable(text));
  for (int& size : sizes) size = std::max(size, 1);
  if (tp_x) *tp_x = sizes[4];
  if (sizes[4] > 1 || sizes[5] > 1) sizes[3] = sizes[4] * sizes[5];  // the 2-D grid as the tp axis
  return DeviceMesh({{"dp", sizes[0]}, {"pp", sizes[1]}, {"cp", sizes[2]}, {"tp", sizes[3]}});
}

inline ExpertAxes parse_expert_axes(std::string_view text) {
  const std::array<int, 8> sizes = mesh_detail::mesh_axis_sizes(text);
  return {sizes[6], sizes[7]};
}

// ---- train_gpt --mesh-file: a configuration file of search_parallel --emit (search/config_file.hpp) ----------------

// The model train_gpt's flags build (`config`), as the search describes a model (search/training_model.hpp).
inline search::TrainingModel training_model_of(const GptConfig& config) {
  search::TrainingModel m;
  m.name = "train_gpt";
  m.layers = config.layers;
  m.hidden = config.layer.hidden;
  m.heads = config.layer.heads;
  m.kv_heads = config.layer.kv_heads;
  m.head_dim = config.layer.head_dim;
  m.ffn = config.layer.ffn;
  m.vocab = config.vocab;
  m.swiglu = config.layer.activation == Activation::swiglu;
  m.tied_embeddings = config.tied_head;
  if (config.moe) {
    m.experts = config.moe->moe.experts;
    m.top_k = config.moe->moe.top_k;
    m.expert_ffn = config.moe->moe.expert_ffn;
    m.shared_experts = config.moe->moe.shared_experts;
    m.shared_ffn = config.moe->moe.shared_ffn;
    m.dense_layers = config.moe->first_k_dense;
  }
  return m;
}

// The model of the mesh: the MoE GPT of train_gpt --experts, or the dense one (model/byte_gpt.hpp).
inline GptConfig mesh_model_config(const TrainingOptions& o) {
  return o.experts > 0 ? moe_gpt_config(o) : byte_gpt_config(byte_gpt_shape(o));
}

// What train_gpt runs for a configuration file: the --mesh text and the ZeRO stage.
struct MeshFileRun {
  std::string mesh;  // "dp=D,pp=P,cp=C,tp=T"
  ZeroStage zero = ZeroStage::zero;
  int virtual_stages = 1;
  std::int64_t micro_batch = 1;  // rows per micro-batch
  std::string recompute;         // "none", "selective" or "full"
  std::optional<bool> zero3_prefetch;  // the file's zero3_prefetch, if it gives one
  search::ConfigFile file;
};

// Reads `path` (search/config_file.hpp's reader) for train_gpt's model `config`. Refused, by name and value: a
// model whose shape differs from the flags' (both named), and every axis or knob train_gpt cannot run yet (the
// configuration is never run as something else). What the file states about the run's setup (seq, global_batch,
// flops, flash_attention, overlap_grad_reduce, cluster, published) is the prediction's: train_gpt's own flags say
// what it trains on.
inline MeshFileRun mesh_file_run(const std::string& path, const GptConfig& config) {
  MeshFileRun run;
  const std::string where = fmt::format("--mesh-file {}", path);
  try {
    run.file = search::load_config_file(path);
  } catch (const Error& e) {
    throw Error(fmt::format("{}: {} (expected a configuration file of search_parallel --emit)", where, e.what()));
  }
  const search::ParallelConfig& c = run.file.config;
  if (run.file.model) {  // the file's model must be the one train_gpt's flags build
    const search::TrainingModel& f = *run.file.model;
    const search::TrainingModel m = training_model_of(config);
    const auto same = [&](std::string_view key, std::int64_t file_value, std::int64_t flags_value,
                          std::string_view flags_name) {
      check(file_value == flags_value, "{}: the model's {} is {} but train_gpt's {} gives {} (the file describes "
            "another model: run search_parallel --emit on this one, or change the flags)", where, key, file_value,
            flags_name, flags_value);
    };
    same("num_hidden_layers", f.layers, m.layers, "--layers");
    same("hidden_size", f.hidden, m.hidden, "--hidden");
    same("num_attention_heads", f.heads, m.heads, "--heads");
    same("num_key_value_heads", f.kv_heads, m.kv_heads, "--heads (multi-head attention)");
    same("head_dim", f.head_dim, m.head_dim, "--hidden / --heads");
    same("intermediate_size", f.ffn, m.ffn, "4 x --hidden");
    same("vocab_size", f.vocab, m.vocab, "byte vocabulary");
    same("gated MLP (hidden_act silu)", f.swiglu, m.swiglu, "--experts (SwiGLU) or its absence (GELU)");
    same("tie_word_embeddings", f.tied_embeddings, m.tied_embeddings, "untied head");
    same("multi-head latent attention (kv_lora_rank)", f.kv_lora_rank, 0, "attention (no MLA)");
    same("experts", f.experts, m.experts, "--experts");
    if (m.experts > 0) {
      same("experts per token", f.top_k, m.top_k, "--top-k");
      same("expert width", f.expert_ffn, m.expert_ffn, "ffn / --top-k");
      same("shared experts", f.shared_experts, m.shared_experts, "--shared-experts");
      same("shared expert width", f.shared_ffn, m.shared_ffn, "ffn / --top-k");
      same("first dense layers", f.dense_layers, m.dense_layers, "--first-dense");
    }
  }
  // The axes and knobs train_gpt cannot run yet, refused by name and value.
  const auto refuse_unless = [&](bool trainable, std::string what) {
    check(trainable, "{}: {} (issue 26)", where, what);
  };
  refuse_unless(c.zero <= 3, fmt::format("zero={}: train_gpt runs ZeRO 0 to 3", c.zero));
  // Experts: ep consecutive ranks of dp x cp, each expert's columns over etp consecutive ranks of tp, replicated
  // over edp = dp x cp x tp / (ep x etp) (model/expert_groups.hpp), as the search folds them.
  if (config.moe) {
    refuse_unless((c.dp * c.cp) % c.ep == 0, fmt::format("ep={}: the expert group must divide dp x cp = {}", c.ep,
                                                         c.dp * c.cp));
    refuse_unless(c.tp() % c.etp == 0, fmt::format("etp={}: the expert columns' group must divide tp = {}", c.etp,
                                                   c.tp()));
  } else {
    refuse_unless(c.ep == 1, fmt::format("ep={}: the model has no experts (train_gpt --experts E)", c.ep));
    refuse_unless(c.etp == 1, fmt::format("etp={}: the model has no experts (train_gpt --experts E)", c.etp));
  }
  refuse_unless(c.cp == 1 || c.cp_scheme == search::CpScheme::ring,
                fmt::format("cp_scheme={}: the cp groups switch strategies per layer (ring attention among them); "
                            "the all-gather scheme is not a trainable strategy yet", name_of(c.cp_scheme)));
  refuse_unless(c.tp() == 1 || c.sequence_parallel,
                "sequence_parallel=false: tensor parallelism trains with sequence parallelism only");
  // Micro-batches and recomputation as train_gpt runs them (model/mesh_stage.hpp): micro_batch rows per
  // micro-batch, through the pipeline stages or, without them, accumulating gradients micro-batch by micro-batch;
  // with pp stages every in-flight micro-batch's activations kept (recompute=none), all but attention's core
  // (selective, re-run per layer before its backward) or each stage's forward recomputed before its backward
  // (recompute=full); without, each backward follows its forward (nothing to recompute under full).
  if (c.pp == 1)
    refuse_unless(c.recompute != search::Recompute::full,
                  fmt::format("recompute={}: without pipeline stages each micro-batch's backward follows its forward, "
                              "so train_gpt keeps every activation (recompute=none or selective)", name_of(c.recompute)));
  if (run.file.global_batch)
    refuse_unless(*run.file.global_batch % (c.micro_batch * c.dp) == 0,
                  fmt::format("micro_batch={}: the global batch of {} rows is not whole micro-batches of every one of "
                              "the dp = {} replicas", c.micro_batch, *run.file.global_batch, c.dp));
  run.micro_batch = c.micro_batch;
  run.recompute = std::string(name_of(c.recompute));
  run.mesh = c.tp_x > 1 ? fmt::format("dp={},pp={},cp={},tp_x={},tp_y={}", c.dp, c.pp, c.cp, c.tp_x, c.tp_y)
                        : fmt::format("dp={},pp={},cp={},tp={}", c.dp, c.pp, c.cp, c.tp_y);
  if (config.moe) run.mesh += fmt::format(",ep={},etp={}", c.ep, c.etp);
  run.zero = ZeroStage(c.zero);
  run.zero3_prefetch = run.file.zero3_prefetch;
  run.virtual_stages = c.virtual_stages;
  return run;
}

namespace mesh_detail {

// A step's plan for the stack, and its compact name for the table.
struct StepPlan {
  StackPlan stack;
  std::string name;
  double time_s = 0;  // the planner's predicted time
};


}  // namespace mesh_detail

// --recompute full without pipeline stages is refused (flags.hpp asks before calibrating, train_mesh again).
inline void check_recompute(const TrainingOptions& o, int pp) {
  check(pp > 1 || o.recompute != "full", "--mesh {} --recompute full: without pipeline stages each micro-batch's "
        "backward follows its forward, so nothing is recomputed; give --recompute none or selective (or pp stages)",
        o.mesh);
}

// Trains the dense GPT on `ranks` (threads or MPI processes, as many as the mesh holds). Returns the exit code.
template <class Strategies, class RanksT>
int train_mesh(const TrainingOptions& o, const cost::HardwareProfile& hardware, RanksT& ranks) {
  using Model = Gpt<Strategies>;
  int tp_x = 1;  // > 1: the tp group is a tp_x x tp_y grid for Tp2d (strategy/tp2d.hpp)
  const DeviceMesh mesh = parse_mesh(o.mesh, &tp_x);
  mesh.check_world_size(ranks.size());
  const bool experts = o.experts > 0;
  const int dp = mesh.axis_size("dp"), pp = mesh.axis_size("pp"), tp = mesh.axis_size("tp");
  // The group of each stage: the cp group (the strategies switch per layer), or the tp group (MegatronTS, Megatron's
  // tensor parallelism with sequence parallelism, in every sublayer); parse_mesh refuses both at once. Everything
  // below that says cp means this group.
  const int cp = mesh.axis_size("cp") * tp;
  // With experts: ep consecutive ranks of the dp x cp devices of each stage (all of them by default); with tp, every
  // expert split by columns over etp consecutive ranks of the tp group (all of it by default:
  // moe/expert_columns.hpp), the router replicated over it; the experts replicated over edp = dp x cp x tp / (ep x
  // etp) (model/expert_groups.hpp).
  const ExpertAxes expert_axes = parse_expert_axes(o.mesh);
  const int ep = expert_axes.ep > 0 ? expert_axes.ep : dp * mesh.axis_size("cp");
  const int etp = expert_axes.etp > 0 ? expert_axes.etp : tp;
  check(experts || (expert_axes.ep <= 1 && expert_axes.etp <= 1),
        "--mesh {}: ep and etp are the MoE layers' axes; the model has no experts (train_gpt --experts E)", o.mesh);
  check(!experts || (dp * mesh.axis_size("cp")) % ep == 0, "--mesh {}: ep={} must divide dp x cp = {} (the expert "
        "groups are consecutive ranks of dp x cp)", o.mesh, ep, dp * mesh.axis_size("cp"));
  check(!experts || tp % etp == 0, "--mesh {}: etp={} must divide tp = {} (each expert's columns over etp "
        "consecutive ranks of tp)", o.mesh, etp, tp);
  const int edp = dp * mesh.axis_size("cp") / ep * (tp / etp);
  // cp and tp both: the stage's group is cp x tp (tp innermost), factorised for MegatronRing (tp inside each cp
  // group), which runs in every sublayer unless --strategy names one of the five (over the whole group).
  const bool cp_by_tp = mesh.axis_size("cp") > 1 && tp > 1;
  check(tp == 1 || tp_x > 1 || cp_by_tp || o.strategy.empty() || o.strategy == "MegatronTS", "--mesh {} --strategy "
        "{}: the tp axis runs MegatronTS in every sublayer (Megatron's tensor parallelism; other strategies are the cp "
        "axis's)", o.mesh, o.strategy);
  // A factorised stage group (cp x tp, tp innermost, or a tp_x x tp_y grid) is an outer x inner grid of its ranks:
  // MegatronRing (tp_inner) and Tp2d (tp_x) both compute over it with inner = tp (tp_x), beside the five over the
  // whole group, and with RingTp2d (both: grid_x below) the planner chooses among the eight per sublayer
  // (--strategy: one of the five everywhere).
  const int grid_inner = cp_by_tp ? tp : tp_x > 1 ? tp_x : 0;
  // With cp and tp_x,tp_y: the tp sub-group of each cp group is itself the tp_x x tp_y grid (RingTp2d's; Tp2d's grid
  // is then tp_x x (cp tp_y)). Otherwise both factorisations share one grid.
  const int grid_x = cp_by_tp && tp_x > 1 ? tp_x : grid_inner;
  check(grid_inner > 0 || (o.strategy != "MegatronRing" && o.strategy != "Tp2d" && o.strategy != "RingTp2d"),
        "--mesh {} --strategy {}: it "
        "computes over a factorised stage group; give cp with tp (cp=C,tp=T) or tp_x,tp_y", o.mesh, o.strategy);
  const std::string strategy = tp > 1 && grid_inner == 0 ? std::string("MegatronTS") : o.strategy;
  // The embedding and the LM head by vocabulary rows over the tp group of each stage (the whole grid with tp_x,
  // tp_y), replicated over its cp ranks (--vocab-parallel on, with tp > 1: Megatron's layout, and the search's).
  const bool vocab_parallel = tp > 1 && o.vocab_parallel == "on";
  // Interleaved 1F1B: v model chunks per pp rank, virtual stage c * pp + r of pp * v (model/pipeline.hpp).
  const int v = o.virtual_stages;
  check(o.layers >= pp * v, "--mesh {}: {} pipeline stages of {} chunks need at least as many layers (--layers {})",
        o.mesh, pp, v, o.layers);
  check(v == 1 || pp == 1 || o.pack_documents == 0, "--mesh {} --virtual-stages {} --pack-documents {}: a replica's "
        "one packed sequence is one micro-batch, and the interleaved schedule needs a multiple of the {} stages",
        o.mesh, v, o.pack_documents, pp);
  GptConfig config = mesh_model_config(o);
  config.validate_for(cp);
  check(o.pack_documents == 0 || o.pack_tokens == 0, "--mesh {}: --pack-tokens {} (documents as rows) and "
        "--pack-documents {} (documents in one sequence) exclude each other", o.mesh, o.pack_tokens, o.pack_documents);

  // The data: the single-group run's (examples/train_gpt.cpp with --ranks C; examples/train_gpt/training_data.hpp).
  const TrainingData data = training_data(o, {cp, config.layer.zigzag}, o.pack_tokens);
  const std::vector<data::Document>& docs = data.docs;
  const std::vector<data::Step>& steps = data.steps;

  // Micro-batches (model/mesh_stage.hpp): --micro-batch rows each, the last of a replica's the rest (by default one
  // row with pp stages, a replica's rows at once without), through the stages or, without them, accumulating
  // gradients micro-batch by micro-batch. What a stage keeps for its backward: every in-flight micro-batch's
  // activations (--recompute none), all but attention's core tensors, each layer's core re-run from its kept q, k, v
  // before its backward (selective, with or without pp), or its input, the stage's forward recomputed (full; the
  // default with pp).
  check_recompute(o, pp);
  const PipelineRecompute recompute = o.recompute == "selective"                      ? PipelineRecompute::selective
                                      : o.recompute == "full" || (o.recompute == "auto" && pp > 1) ? PipelineRecompute::full
                                                                                      : PipelineRecompute::none;
  const auto rows_per_micro_batch = [&](std::int64_t replica_rows) {
    return o.micro_batch > 0 ? o.micro_batch : pp > 1 ? std::int64_t(1) : std::max<std::int64_t>(replica_rows, 1);
  };
  const auto micro_batch_count = [&](std::int64_t replica_rows) {
    return (replica_rows + rows_per_micro_batch(replica_rows) - 1) / rows_per_micro_batch(replica_rows);
  };
  // The rows of a step's (first) micro-batch, as planned.
  const auto micro_rows = [&](const data::Step& step) {
    const std::int64_t replica_rows = std::max<std::int64_t>((step.sequences() + dp - 1) / dp, 1);
    return std::min(rows_per_micro_batch(replica_rows), replica_rows);
  };
  // Every step's plan for a cp group running one micro-batch, computed before training; under selective
  // recomputation its dry runs drop attention's core and re-run it in backward.
  const cost::StrategyCatalog* catalog = grid_inner > 0 ? &cost::mesh_catalog() : &cost::default_catalog();
  plan::GptCosts<Model> costs{config, cp, &hardware, catalog, grid_inner, std::max(grid_x, 1)};
  costs.stash.recompute = recompute;
  costs.vocab_shards = vocab_parallel ? tp : 1;
  plan::MoeGptCosts<Model> moe_costs{config, cp, &hardware, catalog, grid_inner, std::max(grid_x, 1)};
  moe_costs.stash = costs.stash;
  moe_costs.vocab_shards = costs.vocab_shards;
  // What a rank keeps for a step of `micro_batches` (plan/activation_stash.hpp: the in-flight micro-batches of its
  // pipeline stage, and what the recompute mode keeps and re-runs).
  const auto stash_of = [&](std::int64_t micro_batches) {
    return plan::ActivationStash{recompute, plan::pipeline_stash_factor(recompute, o.layers, pp, v, micro_batches)};
  };
  std::int64_t cap = 0;
  if (o.cap_mib > 0) cap = std::int64_t(o.cap_mib * 1024 * 1024);
  else if (experts) cap = hardware.usable_memory_bytes();  // as train_gpt --experts
  else cap = plan::default_memory_cap(costs, o.max_len).cap;  // the single group's default
  const Timer plan_start;
  // With experts the MoE FFN's row models the expert group as the cp group (the planner's view of train_gpt
  // --experts); the choice between ExpertParallel and ExpertTensorParallel is exact either way, its cost approximate.
  //
  // Packed sequences over dp > 1: each replica's cp group plans its own sequence (the strategies must agree within
  // a cp group and along its pp stages only; the replicas meet only in the gradient reduction, so the step takes as
  // long as its slowest replica, and planning each for its own sequence minimises each). With experts the MoE layers
  // span the replicas (ep = dp x cp), so every sublayer's strategy must agree over the whole mesh: the step runs
  // every replica on the plan of its most expensive sequence (the largest predicted time).
  // plans[k][d]: replica d's plan in step k (std::nullopt: no plan fits the cap, and the step is skipped).
  // Keyed by a part's shape: its length, or its packed documents' lengths, and the micro-batch's rows (and count).
  std::map<std::tuple<std::vector<std::int64_t>, std::int64_t, std::int64_t>, std::optional<mesh_detail::StepPlan>>
      planned;
  const auto plan_of = [&](const data::Step& step) {
    const bool packed = step.document_starts().size() > 1;
    const std::int64_t length = step.length;
    const std::int64_t replica_rows = std::max<std::int64_t>((step.sequences() + dp - 1) / dp, 1);
    const std::tuple full_key{packed ? step.document_lengths() : std::vector<std::int64_t>{length}, micro_rows(step),
                              micro_batch_count(replica_rows)};
    const auto key = std::pair{std::get<0>(full_key), std::get<1>(full_key)};
    if (!planned.count(full_key)) {
      plan::GptCosts<Model> step_costs = costs;
      plan::MoeGptCosts<Model> step_moe_costs = moe_costs;
      step_costs.stash = step_moe_costs.stash = stash_of(std::get<2>(full_key));
      try {
        if (experts) {
          const plan::MoeCostTable table = packed ? step_moe_costs.packed_table(key.first)
                                                  : step_moe_costs.table(length, key.second);
          plan::MoePlan plan = plan::plan_moe_exact(table, cap);
          if (!strategy.empty()) {  // one strategy in the attention and dense MLPs; the planner picks the MoE FFN's
            const auto at = std::find(plan.strategy_names.begin(), plan.strategy_names.end(), strategy);
            check(at != plan.strategy_names.end(), "--mesh {}: the planner's catalog has no {}", o.mesh, strategy);
            std::vector<plan::MoeLayerPlan> choices = plan.layers;
            for (plan::MoeLayerPlan& layer : choices) {
              layer.attention = int(at - plan.strategy_names.begin());
              if (!layer.moe) layer.ffn = layer.attention;
            }
            plan = plan::moe_plan_of(table, choices, cap);
          }
          planned[full_key] = mesh_detail::StepPlan{plan.stack_plan<Strategies>(), compact_plan(plan), plan.time_s};
        } else {
          const plan::CostTable table = packed ? step_costs.packed_table(key.first) : step_costs.table(length, key.second);
          const plan::Plan plan = strategy.empty()
              ? plan::plan_exact(table, cap)
              : plan::plan_of(table, plan::uniform_layers(table, costs.catalog->index_of(strategy)), cap);
          planned[full_key] = mesh_detail::StepPlan{plan::stack_plan<Strategies>(plan), compact_plan(plan),
                                               plan.time_s};
        }
      } catch (const plan::NoFeasiblePlan&) {
        planned[full_key] = std::nullopt;
      }
    }
    return planned[full_key];
  };
  // Rows are dealt over dp; packed sequences go one per replica, D per mesh step, grouped by their predicted time
  // (the planner's, for the cp group) so that a step's replicas wait little for each other.
  std::vector<double> predicted;
  for (const data::Step& step : steps) {
    const std::optional<mesh_detail::StepPlan>& plan = plan_of(step);
    predicted.push_back(plan ? plan->time_s : std::numeric_limits<double>::infinity());
  }
  const std::vector<data::MeshStep> mesh_steps_ = data::mesh_steps(steps, dp, predicted);
  const int n_steps = int(mesh_steps_.size());
  if (experts && dp > 1) {  // the expert group spans the replicas: each must bring tokens to every MoE layer
    check(o.pack_documents == 0 || steps.size() % std::size_t(dp) == 0, "--mesh {} --experts --pack-documents {}: "
          "the {} documents make {} packed sequences, not a multiple of the {} dp replicas (each replica must bring a "
          "sequence to every step's MoE layers): change --steps or --pack-documents", o.mesh, o.pack_documents,
          o.steps, steps.size(), dp);
    for (int k = 0; k < n_steps; ++k)
      check(mesh_steps_[std::size_t(k)].sequences() >= dp, "--mesh {} --experts: step {} holds {} row(s), "
            "fewer than the {} dp replicas (each must hold a row: raise --pack-tokens or lower --max-len)", o.mesh, k,
            mesh_steps_[std::size_t(k)].sequences(), dp);
    // Every replica must run as many micro-batches: the MoE layers' all-to-alls of micro-batch i meet the other
    // replicas' micro-batch i.
    for (int k = 0; k < n_steps; ++k)
      for (int d = 1; d < dp; ++d) {
        const std::int64_t first = mesh_steps_[std::size_t(k)].work(0, dp).second.length;
        const std::int64_t theirs = mesh_steps_[std::size_t(k)].work(d, dp).second.length;
        check(micro_batch_count(theirs) == micro_batch_count(first), "--mesh {} --experts: step {} gives dp replica 0 "
              "{} row(s) ({} micro-batches) and replica {} {} ({}); the MoE layers span the replicas micro-batch by "
              "micro-batch, so every replica must run as many (give every step a multiple of dp = {} rows, e.g. "
              "--min-len = --max-len and --pack-tokens a multiple of dp times it)", o.mesh, k, first,
              micro_batch_count(first), d, theirs, micro_batch_count(theirs), dp);
      }
  }
  if (v > 1 && pp > 1)  // the interleaved schedule runs a multiple of pp micro-batches
    for (int k = 0; k < n_steps; ++k)
      for (int d = 0; d < dp; ++d) {
        const std::int64_t mine = mesh_steps_[std::size_t(k)].work(d, dp).second.length;
        check(micro_batch_count(mine) % pp == 0, "--mesh {} --virtual-stages {}: step {} gives dp replica {} {} row(s) "
              "in {} micro-batch(es) of up to {} rows, not a multiple of the {} pipeline stages (interleaved 1F1B runs "
              "whole rounds of micro-batches): give every step a multiple of dp x pp x micro-batch rows (e.g. "
              "--min-len = --max-len and --pack-tokens a multiple of it)", o.mesh, v, k, d, mine,
              micro_batch_count(mine), rows_per_micro_batch(mine), pp);
      }
  if (o.zero == ZeroStage::three && dp > 1)  // each layer is gathered over dp at each use: equal schedules
    for (int k = 0; k < n_steps; ++k) {
      const auto micro_batches = [&](int d) {
        return micro_batch_count(mesh_steps_[std::size_t(k)].work(d, dp).second.length);
      };
      for (int d = 1; d < dp; ++d)
        check(micro_batches(d) == micro_batches(0), "--mesh {} --zero 3: step {} gives dp replica 0 {} and replica {} "
              "{} micro-batch(es); ZeRO-3 gathers every layer over dp at each use, so every replica must run as many "
              "(give every step a multiple of dp{} rows, e.g. --min-len = --max-len and --pack-tokens a multiple of "
              "it)", o.mesh, k, micro_batches(0), d, micro_batches(d), pp > 1 ? "" : " (or at least dp)");
    }
  // Checkpoints (examples/train_gpt/mesh_checkpoints.hpp): --resume checked now, before any training.
  MeshCheckpoints checkpoints(o, config, mesh, n_steps, mesh_data_description(o, n_steps, dp), ranks.reports(),
                              experts ? ExpertFolding{ep, etp} : ExpertFolding{});
  std::vector<std::vector<std::optional<mesh_detail::StepPlan>>> plans(mesh_steps_.size());
  for (std::size_t k = 0; k < mesh_steps_.size(); ++k) {
    const data::MeshStep& step = mesh_steps_[k];
    for (const data::Step& part : step.parts) plans[k].push_back(plan_of(part));
    const bool all_fit = std::all_of(plans[k].begin(), plans[k].end(), [](const auto& p) { return p.has_value(); });
    if (!all_fit) plans[k].assign(1, std::nullopt);
    else if (experts && plans[k].size() > 1)  // one plan over the expert group: the most expensive part's
      plans[k].assign(1, *std::max_element(plans[k].begin(), plans[k].end(),
                                           [](const auto& a, const auto& b) { return a->time_s < b->time_s; }));
  }
  // Replica d's plan in step k (a replica without a part runs none: any plan of the step).
  const auto replica_plan = [&](std::size_t k, int d) -> const std::optional<mesh_detail::StepPlan>& {
    return plans[k][std::min(std::size_t(d), plans[k].size() - 1)];
  };
  const double planning_s = plan_start.seconds();

  fmt::print("model: GPT, {} layers, h={}, {} heads, ffn={}, vocab {} (bytes), causal + RoPE, zigzag tokens; {:.2f} M "
             "parameters\n", o.layers, o.hidden, o.heads, config.layer.ffn, config.vocab,
             double(config.parameter_count()) / 1e6);
  if (experts)
    fmt::print("experts: {} MoE layers of {} experts (top-{}, ffn {}), {} dense first; ep = {} consecutive ranks of "
               "dp x cp = {}{}, edp = {} (attention in {} groups of {}, the MoE layers over expert groups of {} "
               "devices{}{}{})\n",
               o.layers - o.first_dense, o.experts, o.top_k, config.moe->moe.expert_ffn, o.first_dense, ep,
               dp * mesh.axis_size("cp"),
               tp > 1 ? fmt::format(" x etp = {} of tp = {} (each expert's columns over etp ranks)", etp, tp)
                      : std::string(),
               edp, tp > 1 ? "tp" : "cp", cp, ep, tp > 1 ? " of each tp index" : "",
               edp > 1 ? ", replicated over edp: router statistics and expert gradients summed over it" : "",
               pp > 1 ? " of each pipeline stage; router losses averaged over a step's micro-batches" : "");
  if (tp_x > 1)
    fmt::print("tensor parallelism: tp groups of {} consecutive ranks, each a {} x {} grid (tp_x x tp_y) for Tp2d "
               "(2-D tensor parallelism from and to the unified layout; norms and residuals sequence parallel), "
               "MegatronRing and RingTp2d{}; {}\n", tp, tp_x, tp / tp_x,
               cp_by_tp ? fmt::format(" (ring attention over cp = {})", mesh.axis_size("cp")) : std::string(),
               strategy.empty() ? "the planner chooses among the eight strategies" : "running " + strategy);
  else if (cp_by_tp)
    fmt::print("tensor parallelism inside each cp group: groups of {} x {} consecutive ranks (tp innermost) for "
               "MegatronRing (Megatron's tensor parallelism over the tp sub-groups, ring attention over the cp "
               "sub-groups) and Tp2d; {}\n", mesh.axis_size("cp"), tp,
               strategy.empty() ? "the planner chooses among the eight strategies" : "running " + strategy);
  else if (tp > 1)
    fmt::print("tensor parallelism: tp groups of {} consecutive ranks run MegatronTS in every sublayer (Megatron's "
               "tensor parallelism, sequence parallel over the norms and residuals)\n", tp);
  if (tp > 1) {
    std::vector<std::int64_t> vocab_split;  // the vocabulary rows each tp rank holds
    for (int r = 0; r < tp; ++r) vocab_split.push_back(vocab_parallel ? vocab_rows(config.vocab, tp, r).length : config.vocab);
    fmt::print("vocabulary: the embedding and the LM head {} ({} rows per tp rank{})\n",
               vocab_parallel ? "sharded by rows over each stage's tp group" : "whole on every rank (--vocab-parallel "
               "off)", fmt::join(vocab_split, "/"), vocab_parallel && mesh.axis_size("cp") > 1 ? ", replicated over cp"
                                                                                                : "");
  }
  fmt::print("mesh: {} on {} {} (dp outermost, cp or tp innermost); {} stage{}{} of {} layers; {}; {}\n",
             mesh.to_string(), mesh.size(),
             o.backend == RankBackend::mpi ? "MPI processes" : "threads", pp, pp > 1 ? "s" : "",
             v > 1 ? fmt::format(" x {} interleaved chunks (1F1B, virtual stage c x {} + rank)", v, pp) : std::string(),
             fmt::join([&] {
               std::vector<std::int64_t> n;
               for (int s = 0; s < pp * v; ++s) n.push_back(chunk_range(o.layers, pp * v, s).length);
               return n;
             }(), "+"), name_of(o.zero),
             recompute == PipelineRecompute::full ? "each stage's forward recomputed for the backward (recompute full)"
             : recompute == PipelineRecompute::selective
                 ? "every in-flight micro-batch's activations kept but attention's core, re-run before each layer's "
                   "backward (recompute selective)"
                 : "every in-flight micro-batch's activations kept (recompute none)");
  if (o.zero == ZeroStage::three)
    fmt::print("ZeRO-3 schedule: {}\n", o.zero3_prefetch != "off"
               ? "each layer's gather posted while the layer before it computes, each reduce-scatter finished after "
                 "the next layer's backward (--zero3-prefetch on)"
               : "each gather and reduce-scatter waited for where it is posted (--zero3-prefetch off)");
  if (!o.mesh_file.empty())
    fmt::print("configuration: {} (search_parallel --emit; its seq, global batch and cluster are the prediction's, "
               "the data flags say what trains)\n", o.mesh_file);
  fmt::print("data: {} documents, {} steps (lengths {}..{}, {}), {}, {} per micro-batch; plans "
             "for a cp group of {} under a cap of {:.0f} MiB ({:.1f} ms of planning)\n",
             docs.size(), n_steps, o.min_len, o.max_len,
             o.pack_tokens > 0      ? fmt::format("packed up to {} tokens", o.pack_tokens)
             : o.pack_documents > 0 ? fmt::format("sequences of documents packed up to {} tokens, attention "
                                                  "within each", o.pack_documents)
                                    : std::string("one window each"),
             o.pack_documents > 0 ? fmt::format("one sequence per dp replica ({} per step, each replica's cp group "
                                                "planning its own{})", dp, experts && dp > 1 ? ": with experts the "
                                                "most expensive's plan for all" : "")
                                  : std::string("rows dealt over dp"),
             o.micro_batch > 0 ? fmt::format("{} row(s)", o.micro_batch)
             : pp > 1          ? std::string("one row")
                               : std::string("a replica's rows"), cp, double(cap) / (1024 * 1024), planning_s * 1e3);
  if (!o.load.empty()) fmt::print("weights loaded from {}\n", o.load);
  if (!o.resume.empty())
    fmt::print("resumed from {}: weights, AdamW moments and optimizer step {}; the data continues at step {} of {}\n",
               o.resume, checkpoints.first_step(), checkpoints.first_step(), n_steps);
  fmt::print("{:>4}  {:>6}  {:>4}  {:<{}}  {:>7}  {:>7}  {:>9}\n", "step", "len", "docs", "plan", 8 * o.layers, "loss",
             "time s", "peak MiB");

  CsvTable csv(ranks.reports() ? o.csv : std::string(), {"step", "length", "rows", "plan", "loss", "seconds", "peak_mib"},
               CsvTable::OnFailure::warns);
  ops::AdamWConfig adamw;
  adamw.learning_rate = float(o.lr);
  adamw.weight_decay = 0.01f;
  const int warmup = std::max(1, std::min(8, n_steps / 8));
  std::vector<double> losses;
  for (int r = 0; r < ranks.size(); ++r) ranks.tracker(r).set_cap(std::numeric_limits<std::size_t>::max());
  const Timer run_start;
  int save_status = 0;  // --save's (examples/train_gpt/mesh_checkpoints.hpp)

  ranks.run([&](auto& world, int rank) {
    using Comm = std::remove_reference_t<decltype(world)>;
    Comm dp_group = mesh.group(world, {"dp"});
    Comm pp_group = mesh.group(world, {"pp"});
    Comm cp_group = mesh.group(world, {"cp", "tp"});  // the stage's group: cp or tp (one of them 1)
    std::optional<ExpertGroups<Comm>> expert;  // experts: model/expert_groups.hpp
    std::optional<Comm> vocab_group, vocab_replicas;  // --vocab-parallel: the tp ranks, the cp ranks of the stage
    if (experts) expert.emplace(expert_groups(world, mesh, ep, etp));
    const MeshCoordinate at = mesh.coordinate(rank);
    const int replica = at[0], stage_index = at[1], cp_rank = mesh.group_index(rank, {"cp", "tp"});
    const auto chunk_layers = [&](int c) { return chunk_range(o.layers, pp * v, c * pp + stage_index); };
    // This rank's model chunks: virtual stages c * pp + stage_index of pp * v (one chunk without interleaving).
    std::vector<MeshGptStage<Strategies, Comm>> chunks;
    chunks.reserve(std::size_t(v));
    for (int c = 0; c < v; ++c)
      chunks.emplace_back(config, c * pp + stage_index, pp * v, chunk_layers(c), cp, cp_rank, experts ? ep : cp,
                          experts ? expert->ep_rank : cp_rank, o.seed, experts && tp > 1, experts ? etp : 0);
    if (experts)
      for (auto& chunk : chunks) {
        chunk.set_expert_replicas(expert->edp);
        chunk.set_expert_column_group(expert->etp);
      }
    for (auto& chunk : chunks) chunk.set_recompute(recompute);
    if (grid_inner > 0)  // the stage's group as a grid: MegatronRing's cp x tp, Tp2d's tp_x x tp_y
      for (auto& chunk : chunks) {
        chunk.stack().set_tp_inner(cp_group, grid_inner);  // one grid, split once, shared unless grid_x differs
        chunk.stack().set_tp_x(cp_group, grid_x);
      }
    if (vocab_parallel) {  // the embedding and the head by vocabulary rows over tp (model/vocab_parallel.hpp)
      vocab_group.emplace(mesh.group(world, {"tp"}));
      vocab_replicas.emplace(mesh.group(world, {"cp"}));
      for (auto& chunk : chunks) chunk.shard_vocabulary(*vocab_group, *vocab_replicas);
    }
    if (o.zero == ZeroStage::three)  // each rank keeps 1/dp of every parameter (chunks stay put: reserved above)
      for (auto& chunk : chunks) {
        chunk.set_zero3_prefetch(o.zero3_prefetch != "off");
        chunk.shard_over_dp(dp_group);
      }
    std::vector<MeshOptimizer> optimizers;
    for (auto& chunk : chunks)
      optimizers.emplace_back(chunk, o.zero, dp, replica, adamw, experts ? edp : 1, experts ? expert->edp_rank : 0);
    checkpoints.load(rank, chunks, optimizers);  // --load, --resume
    const bool first_local = rank == ranks.first_local();
    BufferPool pool;
    for (int k = checkpoints.first_step(); k < checkpoints.end_step(); ++k) {
      checkpoints.before_step(world, dp_group, cp_group, chunks, optimizers, k, first_local, ranks.reports(),
                              expert ? &*expert : nullptr);
      const data::MeshStep& step = mesh_steps_[std::size_t(k)];
      const std::int64_t s = step.longest(), rows = step.sequences(), documents = step.documents();
      if (!plans[std::size_t(k)][0]) {
        if (rank == 0) fmt::print("{:>4}  {:>6}  {:>4}  no plan fits the cap\n", k, s, documents);
        continue;
      }
      const Timer start;
      // This replica's part of the step (rows: the one step, of which it trains `mine`; packed: its own sequence).
      const auto [part, mine] = step.work(replica, dp);
      const data::Step& tokens_of = part ? *part : step.parts[0];
      std::vector<std::int32_t> inputs, targets;
      data::step_tokens(tokens_of, docs, ops::cpu::kIgnoreIndex, inputs, targets);
      const double counted = double(step.real_tokens());  // the whole step's: every replica's tokens
      const float grad_scale = float(1.0 / counted);
      const StackPlan& full = replica_plan(std::size_t(k), replica)->stack;
      const std::vector<std::int64_t> document_starts = tokens_of.document_starts();  // empty: one document per row
      for (int c = 0; c < v; ++c) {
        const ChunkRange layers = chunk_layers(c);
        chunks[std::size_t(c)].begin_step(cp_group, expert ? expert->ep : cp_group, pool,
                                          StackPlan(full.begin() + layers.start, full.begin() + layers.end()),
                                          tokens_of.length, document_starts);
      }
      pool.trim();
      ranks.tracker(rank).reset_peak();
      // This replica's rows, run through the stages.
      const double loss_sum = mesh_forward_backward(std::span(chunks), pp_group, cp_group, mine, tokens_of.length,
                                                    inputs, targets, grad_scale, o.micro_batch);
      adamw.learning_rate = float(o.lr * std::min(1.0, double(k + 1) / warmup));
      for (MeshOptimizer& optimizer : optimizers)
        optimizer.step(dp_group, expert ? expert->edp : dp_group, adamw.learning_rate, k + 1);
      double sums[2] = {loss_sum, double(ranks.tracker(rank).peak())}, total[2] = {0, 0};
      world.all_reduce(std::span<const double>(&sums[0], 1), std::span<double>(&total[0], 1), ReduceOp::sum);
      world.all_reduce(std::span<const double>(&sums[1], 1), std::span<double>(&total[1], 1), ReduceOp::max);
      if (const auto why = divergence(total[0] / counted, k, config.vocab, double(adamw.learning_rate), o.lr))
        throw Error(*why);  // on every rank (the loss is the world's)
      if (rank != 0) continue;
      const double loss = total[0] / counted;
      const double seconds = start.seconds();
      losses.push_back(loss);
      // The plan, or with packed sequences over dp each replica's, "|" between them where they differ.
      std::vector<std::string> names;
      for (const auto& p : plans[std::size_t(k)]) names.push_back(p->name);
      const bool one_plan = std::all_of(names.begin(), names.end(), [&](const std::string& n) { return n == names[0]; });
      const std::string plan_name = one_plan ? names[0] : fmt::format("{}", fmt::join(names, " | "));
      fmt::print("{:>4}  {:>6}  {:>4}  {:<{}}  {:>7.4f}  {:>7.2f}  {:>9.1f}\n", k, s, documents, plan_name, 8 * o.layers,
                 loss, seconds, total[1] / (1024 * 1024));
      std::fflush(stdout);
      csv.row(k, s, rows, plan_name, fmt::format("{:.17g}", loss), seconds, total[1] / (1024 * 1024));
    }
    checkpoints.at_end(world, dp_group, cp_group, chunks, optimizers, first_local, ranks.reports(),
                       expert ? &*expert : nullptr);
    const int saved = checkpoints.save_final(world, dp_group, cp_group, chunks, optimizers,
                                             first_local && ranks.reports(), expert ? &*expert : nullptr);
    if (first_local) save_status = saved;
  });
  const double total = run_start.seconds();
  const std::size_t k = std::min<std::size_t>(10, losses.size());
  const auto mean = [&](std::size_t from, std::size_t to) {
    double sum = 0;
    for (std::size_t i = from; i < to; ++i) sum += losses[i];
    return to > from ? sum / double(to - from) : 0.0;
  };
  fmt::print("\nsummary\n  steps                      {} run on the mesh {}\n", losses.size(), mesh.to_string());
  fmt::print("  mean loss, first {:>2} steps  {:.4f}\n  mean loss, last {:>2} steps   {:.4f}\n", k, mean(0, k), k,
             mean(losses.size() - k, losses.size()));
  fmt::print("  total time                 {:.1f} s\n", total);
  {  // the per-step planner's predictions (one stage group's micro-batch; the step's with dp = pp = 1)
    double sum = 0;
    int priced = 0;
    for (double t : predicted)
      if (std::isfinite(t) && t > 0) sum += t, ++priced;
    if (priced > 0) fmt::print("  predicted time per plan    {:.4f} s (mean of {} steps' plans)\n", sum / priced, priced);
  }
  csv.close();
  const bool side_output_failed = csv.failed() || checkpoints.failed();
  if (save_status != 0) return save_status;
  return finished(side_output_failed);  // examples/train_gpt/divergence.hpp
}

}  // namespace paradyse::examples
