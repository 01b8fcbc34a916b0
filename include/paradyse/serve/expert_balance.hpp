// paradyse/serve/expert_balance.hpp: EP load balance by token sorting with on-demand expert loading.
//
// Token sorting: the (token, expert) pairs, already sorted by expert (moe/dispatch.hpp), are cut into p contiguous
// chunks of equal size (chunk_range of the rows), and rank r computes chunk r, so every rank gets the same number of
// pairs whatever the routing skew; a hot expert's pairs are split over several ranks. A chunk spans a few experts;
// the rank computes the ones it holds from its own slots and fetches the others' weights on demand (from the host
// copy of the checkpoint, the weight store the engine loaded), keeping at most `capacity` fetched experts in a
// least-recently-used cache. Experts needed by the current layer are never evicted while it runs (the cache
// overflows instead, counted). Every rank derives the same cut, so every pair is computed exactly once.
#pragma once

#include "paradyse/serve/decoder_step.hpp"

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

namespace paradyse::serve {

struct FetchStats {
  std::int64_t hits = 0, fetches = 0, evictions = 0, overflows = 0;
  std::size_t bytes_fetched = 0;
};

class ExpertFetchCache {
public:
  explicit ExpertFetchCache(std::int64_t capacity) : capacity_(capacity) {
    check(capacity >= 1, "ExpertFetchCache: capacity = {} must be at least 1 expert", capacity);
  }
  // The weights of expert e of layer l ([1, 2f, h], [1, f, h]), fetched from `whole` unless cached. `call` tags the
  // current layer's use: entries of the current call are not evicted.
  std::pair<TensorView<const float>, TensorView<const float>> get(const DecoderWeights& whole, std::int64_t layer,
                                                                  std::int64_t expert, std::int64_t call) {
    const std::pair<std::int64_t, std::int64_t> key{layer, expert};
    auto it = entries_.find(key);
    if (it != entries_.end()) {
      ++stats_.hits;
    } else {
      while (std::int64_t(entries_.size()) >= capacity_)
        if (!evict_one(call)) {
          ++stats_.overflows;  // every cached expert serves the current layer: the cache grows past its capacity
          break;
        }
      const DecoderLayerWeights& L = whole.layers[std::size_t(layer)];
      auto e = std::make_unique<Entry>();
      e->in = Tensor<float>::copy_of(L.moe.expert_in.view().slice(0, expert, 1));
      e->out = Tensor<float>::copy_of(L.moe.expert_out.view().slice(0, expert, 1));
      stats_.bytes_fetched += e->in.bytes() + e->out.bytes();
      ++stats_.fetches;
      it = entries_.emplace(key, std::move(e)).first;
    }
    it->second->last_use = ++clock_;
    it->second->call = call;
    return {it->second->in.view(), it->second->out.view()};
  }
  const FetchStats& stats() const noexcept { return stats_; }
  std::int64_t size() const noexcept { return std::int64_t(entries_.size()); }

private:
  struct Entry {
    Tensor<float> in, out;
    std::int64_t last_use = 0, call = -1;
  };
  // Evicts the least recently used expert not serving the current call; false when there is none.
  bool evict_one(std::int64_t call) {
    auto victim = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it)
      if (it->second->call != call && (victim == entries_.end() || it->second->last_use < victim->second->last_use))
        victim = it;
    if (victim == entries_.end()) return false;
    entries_.erase(victim);
    ++stats_.evictions;
    return true;
  }

  std::int64_t capacity_;
  std::map<std::pair<std::int64_t, std::int64_t>, std::unique_ptr<Entry>> entries_;
  std::int64_t clock_ = 0;
  FetchStats stats_;
};

// The token-sorting work of one rank (holds that rank's fetch cache).
class TokenSortingWork {
public:
  TokenSortingWork(const DecoderWeights& whole, std::int64_t cache_capacity) : whole_(&whole), cache_(cache_capacity) {}

  std::vector<ExpertTask> operator()(const RankShard& s, std::int64_t layer, const Dispatch& d) {
    const RankLayer& L = s.layers[std::size_t(layer)];
    check(L.mode == MoeMode::ep, "TokenSortingWork: layer {} is in TP mode", layer);
    ++call_;
    const ChunkRange mine = chunk_range(d.rows(), s.ranks, s.rank);
    std::vector<ExpertTask> tasks;
    for (std::int64_t e = 0; e < d.experts; ++e) {
      const std::int64_t a = std::max(mine.start, d.offsets[std::size_t(e)]),
                         b = std::min(mine.end(), d.offsets[std::size_t(e + 1)]);
      if (a >= b) continue;
      const auto held = std::find(L.slot_expert.begin(), L.slot_expert.end(), e);
      if (held != L.slot_expert.end()) {
        tasks.push_back(slot_task(L, held - L.slot_expert.begin(), a, b));
      } else {
        const auto [in, out] = cache_.get(*whole_, layer, e, call_);
        tasks.push_back({e, a, b, in, out});
      }
    }
    return tasks;
  }
  const FetchStats& stats() const noexcept { return cache_.stats(); }

private:
  const DecoderWeights* whole_;
  ExpertFetchCache cache_;
  std::int64_t call_ = 0;
};

}  // namespace paradyse::serve
