// examples/training_data.hpp: the data of a train_gpt run, drawn the same way by each training loop (the dense one
// of train_gpt.cpp, the MoE one of train_moe.hpp, the mesh's of train_mesh.hpp): the corpus (--corpus, or the
// bundled State of the Union addresses), --steps windows drawn stratified by length (examples/corpus.hpp) and shuffled
// unless --order sorted, and the steps they make for the group of ranks that holds a sequence: one window each, rows
// packed up to a token budget, or (--pack-documents) sequences of packed documents ordered for that group; packed
// steps are shuffled unless sorted. Every draw follows the seed, so a run resumed from a training checkpoint replays
// the same schedule.
#pragma once

#include "corpus.hpp"
#include "training_options.hpp"

#include "paradyse/layout/document_balance.hpp"  // SequenceSplit

#include <cstdint>
#include <filesystem>
#include <vector>

namespace paradyse::examples {

struct TrainingData {
  std::filesystem::path corpus_dir;    // where the documents were read
  std::vector<corpus::Document> docs;  // sorted by name
  std::int64_t longest_document = 0;   // bytes: the document that gives --max-len
  std::vector<corpus::Step> steps;     // in training order
};

// The data of options `o` for sequences held by `group` (its ranks, and whether tokens are dealt zigzag: each step is
// at least two tokens per rank then, one otherwise), rows packed up to `pack_tokens` (0: one window per step; the
// MoE loop trains one row per step and passes 0).
inline TrainingData training_data(const TrainingOptions& o, SequenceSplit group, std::int64_t pack_tokens) {
  TrainingData data;
  data.corpus_dir = o.corpus.empty() ? corpus::ensure_extracted("data/corpus/sotu.tar.xz", "build", "sotu")
                                     : std::filesystem::path(o.corpus);
  data.docs = corpus::load(data.corpus_dir);
  corpus::WindowSampler sampler(data.docs, o.min_len, o.max_len, o.seed);
  data.longest_document = sampler.longest_document();
  std::vector<corpus::Window> windows = sampler.stratified(o.steps);  // shortest first: the curriculum order
  if (!o.sorted) sampler.shuffle(windows);
  const std::int64_t group_min_len = group.zigzag ? 2 * std::int64_t(group.ranks) : std::int64_t(group.ranks);
  data.steps = o.pack_documents > 0
                   ? corpus::pack_sequences(windows, o.pack_documents, group_min_len, {group, o.pack_balanced})
                   : corpus::pack_steps(windows, pack_tokens, group_min_len);
  if ((pack_tokens > 0 || o.pack_documents > 0) && !o.sorted) sampler.shuffle(data.steps);
  return data;
}

}  // namespace paradyse::examples
