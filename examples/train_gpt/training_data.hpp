// examples/train_gpt/training_data.hpp: the data of a train_gpt run, drawn the same way by each training loop (the dense one
// of train_gpt.cpp, the MoE one of train_moe.hpp, the mesh's of train_mesh.hpp): the corpus (--corpus, or the
// bundled State of the Union addresses), --steps windows drawn stratified by length (data/corpus.hpp) and shuffled
// unless --order sorted, and the steps they make for the group of ranks that holds a sequence: one window each, rows
// packed up to a token budget, or (--pack-documents) sequences of packed documents ordered for that group; packed
// steps are shuffled unless sorted. Every draw follows the seed, so a run resumed from a training checkpoint replays
// the same schedule.
#pragma once

#include "training_options.hpp"

#include "paradyse/data/corpus.hpp"
#include "paradyse/data/document_balance.hpp"  // SequenceSplit
#include "paradyse/data/packing.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace paradyse::examples {

struct TrainingData {
  std::filesystem::path corpus_dir;    // where the documents were read
  std::vector<data::Document> docs;  // sorted by name
  std::int64_t longest_document = 0;   // bytes: the document that gives --max-len
  std::vector<data::Step> steps;     // in training order
};

// The data of options `o` for sequences held by `group` (its ranks, and whether tokens are dealt zigzag: each step is
// at least two tokens per rank then, one otherwise), rows packed up to `pack_tokens` (0: one window per step; the
// MoE loop trains one row per step and passes 0).
inline TrainingData training_data(const TrainingOptions& o, data::SequenceSplit group, std::int64_t pack_tokens) {
  TrainingData out;
  out.corpus_dir = o.corpus.empty() ? data::ensure_extracted("data/corpus/sotu.tar.xz", "build", "sotu")
                                     : std::filesystem::path(o.corpus);
  out.docs = data::load(out.corpus_dir);
  data::WindowSampler sampler(out.docs, o.min_len, o.max_len, o.seed);
  out.longest_document = sampler.longest_document();
  std::vector<data::Window> windows = sampler.stratified(o.steps);  // shortest first: the curriculum order
  if (!o.sorted) sampler.shuffle(windows);
  const std::int64_t group_min_len = data::min_sequence_length(group);  // shorter windows run padded
  out.steps = o.pack_documents > 0
                   ? data::pack_sequences(windows, o.pack_documents, group_min_len, {group, o.pack_balanced})
                   : data::pack_steps(windows, pack_tokens, group_min_len);
  if ((pack_tokens > 0 || o.pack_documents > 0) && !o.sorted) sampler.shuffle(out.steps);
  return out;
}

// train.data: the data schedule of `o` in words (the seed and options fix it) for `n_steps` steps of rows packed up
// to `pack_tokens` tokens (0: one window each) or of packed sequences. A resumed run's must equal its checkpoint's
// (model/resume.hpp); the options behind it that the text leaves out (--min-len, --max-len, --corpus, --pack-order)
// are compared flag by flag with the checkpoint's train.args (examples/train_gpt/flags.hpp). The text is unchanged
// since the first training checkpoints, so that theirs still compare equal.
inline std::string data_description(const TrainingOptions& o, int n_steps, std::int64_t pack_tokens) {
  return fmt::format("seed {}, {} documents stratified by length{}, {} steps{}", o.seed, o.steps,
                     o.sorted ? "" : ", shuffled", n_steps,
                     pack_tokens > 0        ? fmt::format(" of up to {} tokens", pack_tokens)
                     : o.pack_documents > 0 ? fmt::format(" of one sequence of up to {} tokens", o.pack_documents)
                                            : std::string(" of one window"));
}

}  // namespace paradyse::examples
