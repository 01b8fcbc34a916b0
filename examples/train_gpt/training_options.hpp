// examples/train_gpt/training_options.hpp: the one set of options train_gpt trains with. train_gpt's command line
// (examples/train_gpt.cpp: every flag, its range and default) parses into it, and each training loop takes it by
// const reference: the dense loop (train_gpt.cpp), the mesh one (examples/train_gpt/train_mesh.hpp: --mesh) and the
// MoE one (examples/train_gpt/train_moe.hpp: --experts). A field read by one loop only says so; the defaults are
// train_gpt's.
#pragma once

#include "paradyse/comm/ranks.hpp"          // RankBackend
#include "paradyse/core/error.hpp"
#include "paradyse/model/byte_gpt.hpp"       // ByteGptShape
#include "paradyse/model/data_parallel.hpp"  // ZeroStage
#include "paradyse/model/resume.hpp"         // ResumeOptions

#include <cstdint>
#include <string>
#include <vector>

namespace paradyse::examples {

struct TrainingOptions {
  // The run and its data.
  int steps = 32;                   // documents (windows) drawn: one step each, or packed into steps
  std::uint64_t seed = 1;           // of the weights and the data
  int ranks = 4;                    // ranks of the group (with --mesh: the mesh's size)
  // The model.
  int layers = 4;                   // transformer layers
  std::int64_t hidden = 128;        // hidden size h
  std::int64_t heads = 4;           // attention heads
  // The windows: a document's length scaled so that the longest document gives max_len, clamped to [min_len, max_len].
  std::int64_t min_len = 256;
  std::int64_t max_len = 16384;
  double cap_mib = -1;              // memory cap per rank in MiB (MoE: the planner's budget); <= 0: the loop's default
  std::string strategy;             // one strategy everywhere instead of the planner; empty: the planner (dense only)
  double lr = 3e-3;                 // peak learning rate (AdamW, linear warm-up)
  bool sorted = false;              // documents in curriculum order (sorted by length) instead of shuffled
  std::string save;                 // at the end, the global weights (dense: safetensors; MoE: a Hugging Face folder)
  std::string load;                 // dense and --mesh: start from weights --save wrote
  std::string profile;              // a hardware profile, built-in name or JSON file; empty: calibrated and cached
  bool speed_probe = false;         // dense, host: the machine's speed against the profile before and after the steps
  int calibration_passes = 5;       // passes of a calibration this run makes, each measurement their median's
  std::string corpus;               // a folder of .txt documents; empty: the bundled State of the Union corpus
  RankBackend backend = RankBackend::threads;  // threads of this process, or one MPI process per rank
  std::string device = "cpu";       // dense: cuda runs the ranks as cuda_local threads on one GPU (ops::Cuda)
  std::string emulate;              // dense: a100, h100 or h200: thread ranks paced like that 8-GPU node's links
  std::string dtype = "fp32";       // dense, host: fp32, or bf16 mixed precision (ops::CpuBf16: bf16 operands and
                                    // residual stream, fp32 compute, fp32 masters, gradients and AdamW states)
  // Training checkpoints (model/resume.hpp; dense, MoE and the dense GPT on a mesh).
  int checkpoint_every = 0;         // every this many steps a training checkpoint; 0: none
  int keep = 2;                     // training checkpoints kept (the newest)
  std::string checkpoint_dir = "checkpoints";
  std::string resume;               // a training checkpoint to continue from
  int stop_after = 0;               // > 0: stop after this many steps of this invocation, with a training checkpoint
  std::string csv;                  // the per-step table as CSV
  // Packing (data/packing.hpp); the two exclude each other.
  std::int64_t pack_tokens = 0;     // > 0: documents as rows, packed into steps of up to this many tokens (rows x s)
  std::int64_t pack_documents = 0;  // > 0: documents back to back in one sequence of up to this many tokens
  bool pack_balanced = true;        // --pack-order: a packed sequence's documents ordered to even out the ranks' causal
                                    // attention (data/packing.hpp's PackedOrder), or kept as packed (longest first)
  // The mesh (examples/train_gpt/train_mesh.hpp).
  std::string mesh;                 // "dp=2,pp=2,cp=2"; empty: one group of `ranks`
  ZeroStage zero = ZeroStage::zero; // --mesh: the ZeRO stage over dp
  std::string zero3_prefetch;       // --zero 3: on | off (each layer's gather a layer ahead); empty: not given (on)
  std::string mesh_file;            // a configuration file of search_parallel --emit: sets mesh and zero
  int virtual_stages = 1;           // --mesh: model chunks per pipeline stage (interleaved 1F1B when > 1)
  std::int64_t micro_batch = 0;     // --mesh: rows per micro-batch (0: one with pp stages, a replica's rows without)
  std::string recompute = "auto";   // --mesh: none | selective | full (auto: full with pp stages, none without)
  std::string vocab_parallel = "on"; // --mesh: on (the embedding and head sharded by vocabulary rows over tp) | off
  // The MoE GPT (examples/train_gpt/train_moe.hpp; also on the mesh).
  std::int64_t experts = 0;         // > 0: an MoE GPT of this many experts; 0: the dense GPT
  std::int64_t top_k = 2;           // experts per token
  std::int64_t shared_experts = 0;  // shared experts behind a sigmoid gate (Qwen2-MoE)
  int first_dense = 0;              // the first this many layers dense
  double aux_loss_coef = 0.01;      // the router's load-balancing loss coefficient (no flag)
  double z_loss_coef = 0.001;       // the router's z-loss coefficient (no flag)
  int load_every = 4;               // expert load printed every this many steps (no flag)
  // The options that differ from the defaults as "--flag", "value" pairs, without --resume, --load and --stop-after
  // (examples/train_gpt/flags.hpp): saved in training checkpoints (train.args, one per line), read back by --resume.
  std::vector<std::string> args;
};

// The model's shape (model/byte_gpt.hpp).
inline ByteGptShape byte_gpt_shape(const TrainingOptions& o) {
  return {o.layers, o.hidden, o.heads, o.experts, o.top_k, o.shared_experts, o.first_dense, o.aux_loss_coef,
          o.z_loss_coef};
}

// The training checkpoints' options (model/resume.hpp).
// --device cuda: the model lives in device memory, and checkpoints are written from the host (refused, naming them).
inline void refuse_device_checkpoints(const TrainingOptions& o) {
  if (!o.save.empty() || !o.load.empty() || !o.resume.empty() || o.checkpoint_every > 0 || o.stop_after > 0)
    throw Error("--device cuda: checkpoints (--save, --load, --resume, --checkpoint-every, --stop-after) are not "
                "written from device memory yet; train on the host (--device cpu) to save");
}

inline ResumeOptions resume_options(const TrainingOptions& o) {
  return {o.checkpoint_every, o.keep, o.checkpoint_dir, o.resume, o.stop_after, o.args};
}

}  // namespace paradyse::examples
