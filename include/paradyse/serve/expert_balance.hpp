// paradyse/serve/expert_balance.hpp: EP load balance: token sorting, and on-demand expert loading from the owning
// rank. Each is a policy of its own (EnginePolicy::token_sorting, EnginePolicy::on_demand); together they are the
// Dynamo-MoE prefill path.
//
// Token sorting: the (token, expert) pairs, already sorted by expert (moe/dispatch.hpp), are cut into p contiguous
// chunks of equal size (chunk_range of the rows), and rank r computes chunk r, so every rank gets the same number of
// pairs whatever the routing skew; a hot expert's pairs are split over several ranks. A chunk spans a few experts; the
// rank computes the ones it holds from its own slots and takes the others' weights from the engine's loaded copy of
// the checkpoint (standing for host memory) unless on-demand loading is on.
//
// On-demand loading (PeerFetchWork): the experts a rank computes but does not hold are fetched from the rank that
// owns them (the lowest rank holding the expert) by point-to-point messages, posted before the layer computes and
// waited only right before the fetched expert's rows (the held experts compute meanwhile); the sends complete after
// the layer. A rank keeps at most `capacity` fetched experts in a least-recently-used cache; every rank mirrors every
// other rank's cache directory (the work and the placement are the same on every rank, so the mirrors agree), so an
// owner knows which fetches miss without asking. Alone (without token sorting) the work starts from the default EP
// split (each expert's rows to its holders) and moves rows from the busiest rank to the least busy one (largest piece
// first, at most half the gap each time) until the gap is at most one row: the receiving rank fetches the expert.
// Experts needed by the current layer are never evicted while it runs (the cache overflows instead, counted). Every
// rank derives the same pieces, so every pair is computed exactly once. With `overlap` off (a measurement baseline,
// bench/moe_serving) every fetch is waited for as soon as it is posted, before any expert computes; FetchStats::wait_s
// then holds the fetches' whole time, against their exposed time with overlap on. On thread ranks the waiting rank
// copies the weights itself (comm/threads.hpp), so there the overlap hides only the owner's late arrival, not the copy.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/serve/decoder_step.hpp"

#include <cstdint>
#include <map>
#include <set>
#include <memory>
#include <utility>
#include <vector>

namespace paradyse::serve {

struct FetchStats {
  std::int64_t hits = 0, fetches = 0, evictions = 0, overflows = 0;
  std::size_t bytes_fetched = 0;
  double wait_s = 0;  // PeerFetchWork: seconds this rank waited on fetch messages (its receives and its sends): the
                      // fetches' exposed time (with overlap off, all of their time)
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

  ExpertWork operator()(const RankShard& s, std::int64_t layer, const Dispatch& d) {
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
    return {std::move(tasks)};
  }
  const FetchStats& stats() const noexcept { return cache_.stats(); }

private:
  const DecoderWeights* whole_;
  ExpertFetchCache cache_;
  std::int64_t call_ = 0;
};

// A piece of EP work: expert `expert`'s permuted rows [begin, end).
struct ExpertPiece {
  std::int64_t expert = 0, begin = 0, end = 0;
  std::int64_t rows() const noexcept { return end - begin; }
  bool operator==(const ExpertPiece&) const = default;
};

// Every rank's pieces of one layer ([p][pieces]), the same on every rank: token sorting's equal cut, or the default
// split over the holders with rows moved from the busiest rank to the least busy one (see the top of this file).
inline std::vector<std::vector<ExpertPiece>> assign_pieces(const std::vector<std::vector<std::int64_t>>& placement,
                                                           const Dispatch& d, bool sorting) {
  const int p = int(placement.size());
  std::vector<std::vector<ExpertPiece>> pieces(static_cast<std::size_t>(p));
  if (sorting) {
    for (int r = 0; r < p; ++r) {
      const ChunkRange mine = chunk_range(d.rows(), p, r);
      for (std::int64_t e = 0; e < d.experts; ++e) {
        const std::int64_t a = std::max(mine.start, d.offsets[std::size_t(e)]),
                           b = std::min(mine.end(), d.offsets[std::size_t(e + 1)]);
        if (a < b) pieces[std::size_t(r)].push_back({e, a, b});
      }
    }
    return pieces;
  }
  std::vector<std::int64_t> load(static_cast<std::size_t>(p), 0);
  for (std::int64_t e = 0; e < d.experts; ++e) {  // holder i of m (rank, then slot order) takes part i
    std::vector<int> holders;
    for (int q = 0; q < p; ++q)
      for (const std::int64_t x : placement[std::size_t(q)])
        if (x == e) holders.push_back(q);
    check(!holders.empty(), "assign_pieces: expert {} is held by no rank", e);
    for (std::size_t i = 0; i < holders.size(); ++i) {
      const ChunkRange part = chunk_range(d.count(e), std::int64_t(holders.size()), std::int64_t(i));
      if (part.length == 0) continue;
      const std::int64_t begin = d.offsets[std::size_t(e)] + part.start;
      pieces[std::size_t(holders[i])].push_back({e, begin, begin + part.length});
      load[std::size_t(holders[i])] += part.length;
    }
  }
  for (std::int64_t move = 0; move < d.rows(); ++move) {  // each move lowers sum_r load_r^2: it ends
    const int hi = int(std::max_element(load.begin(), load.end()) - load.begin());
    const int lo = int(std::min_element(load.begin(), load.end()) - load.begin());
    const std::int64_t gap = load[std::size_t(hi)] - load[std::size_t(lo)];
    if (gap <= 1) break;
    std::vector<ExpertPiece>& from = pieces[std::size_t(hi)];
    const auto largest = std::max_element(from.begin(), from.end(), [](const ExpertPiece& a, const ExpertPiece& b) {
      return a.rows() < b.rows();
    });
    const std::int64_t moved = std::min(largest->rows(), gap / 2);
    pieces[std::size_t(lo)].push_back({largest->expert, largest->end - moved, largest->end});
    largest->end -= moved;
    if (largest->rows() == 0) from.erase(largest);
    load[std::size_t(hi)] -= moved;
    load[std::size_t(lo)] += moved;
  }
  return pieces;
}

// The least-recently-used directory of one rank's fetched experts (keys only; PeerFetchWork keeps one per rank).
class FetchDirectory {
public:
  explicit FetchDirectory(std::int64_t capacity) : capacity_(capacity) {
    check(capacity >= 1, "FetchDirectory: capacity = {} must be at least 1 expert", capacity);
  }
  struct Use {
    bool hit = false;
    std::vector<std::int64_t> evicted;  // experts whose entries go (this use's layer)
  };
  // Expert `expert` of layer `layer` used by call `call`.
  Use use(std::int64_t layer, std::int64_t expert, std::int64_t call, FetchStats& stats) {
    Use u;
    const std::pair<std::int64_t, std::int64_t> key{layer, expert};
    auto it = entries_.find(key);
    if (it != entries_.end()) {
      u.hit = true;
      ++stats.hits;
    } else {
      while (std::int64_t(entries_.size()) >= capacity_) {
        auto victim = entries_.end();
        for (auto e = entries_.begin(); e != entries_.end(); ++e)
          if (e->second.call != call && (victim == entries_.end() || e->second.last_use < victim->second.last_use))
            victim = e;
        if (victim == entries_.end()) {
          ++stats.overflows;
          break;
        }
        evicted_keys_.push_back(victim->first);
        entries_.erase(victim);
        ++stats.evictions;
      }
      ++stats.fetches;
      it = entries_.emplace(key, Entry{}).first;
    }
    it->second.last_use = ++clock_;
    it->second.call = call;
    return u;
  }
  // The keys evicted since the last call (for the rank that stores the weights).
  std::vector<std::pair<std::int64_t, std::int64_t>> take_evicted() { return std::exchange(evicted_keys_, {}); }
  std::int64_t size() const noexcept { return std::int64_t(entries_.size()); }

private:
  struct Entry {
    std::int64_t last_use = 0, call = -1;
  };
  std::int64_t capacity_;
  std::map<std::pair<std::int64_t, std::int64_t>, Entry> entries_;
  std::vector<std::pair<std::int64_t, std::int64_t>> evicted_keys_;
  std::int64_t clock_ = 0;
};

// On-demand expert loading from the owning rank (see the top of this file), with or without token sorting.
template <Communicator C>
class PeerFetchWork {
public:
  PeerFetchWork(C& comm, bool sorting, std::int64_t capacity, bool overlap = true)
      : comm_(&comm), sorting_(sorting), overlap_(overlap) {
    for (int q = 0; q < comm.size(); ++q) directories_.emplace_back(capacity);
  }
  PeerFetchWork(const PeerFetchWork&) = delete;
  PeerFetchWork& operator=(const PeerFetchWork&) = delete;

  ExpertWork operator()(const RankShard& s, std::int64_t layer, const Dispatch& d) {
    const RankLayer& L = s.layers[std::size_t(layer)];
    check(L.mode == MoeMode::ep, "PeerFetchWork: layer {} is in TP mode", layer);
    check(int(L.placement.size()) == s.ranks && s.ranks == comm_->size(),
          "PeerFetchWork: a placement of {} ranks on {} ranks", L.placement.size(), comm_->size());
    complete_pending();
    ++call_;
    const std::vector<std::vector<ExpertPiece>> pieces = assign_pieces(L.placement, d, sorting_);
    const auto holds = [&](int q, std::int64_t e) {
      const std::vector<std::int64_t>& mine = L.placement[std::size_t(q)];
      return std::find(mine.begin(), mine.end(), e) != mine.end();
    };
    const auto source_of = [&](std::int64_t e) {
      for (int q = 0; q < s.ranks; ++q)
        if (holds(q, e)) return q;
      throw Error(fmt::format("PeerFetchWork: expert {} is held by no rank", e));
    };
    const std::int64_t f = L.expert_out.extent(1), h = L.expert_out.extent(2);
    // Every rank's misses, in rank then piece order: the order of the messages between any two ranks, the same on
    // both sides (point-to-point messages between two ranks match in order).
    std::vector<std::pair<int, std::int64_t>> misses;
    FetchStats ignored;
    for (int q = 0; q < s.ranks; ++q) {
      std::set<std::int64_t> seen;
      for (const ExpertPiece& piece : pieces[std::size_t(q)]) {
        if (holds(q, piece.expert) || !seen.insert(piece.expert).second) continue;
        const FetchDirectory::Use u =
            directories_[std::size_t(q)].use(layer, piece.expert, call_, q == s.rank ? stats_ : ignored);
        if (!u.hit) misses.push_back({q, piece.expert});
      }
    }
    for (const auto& key : directories_[std::size_t(s.rank)].take_evicted()) store_.erase(key);
    for (auto& dir : directories_) (void)dir.take_evicted();
    for (const auto& [q, e] : misses) {
      const int source = source_of(e);
      if (source == s.rank) {
        const std::int64_t slot = std::find(L.slot_expert.begin(), L.slot_expert.end(), e) - L.slot_expert.begin();
        sends_.push_back(comm_->send_async(std::span<const float>(L.expert_in.view().slice(0, slot, 1).span()), q));
        sends_.push_back(comm_->send_async(std::span<const float>(L.expert_out.view().slice(0, slot, 1).span()), q));
      }
      if (q == s.rank) {
        auto entry = std::make_unique<Fetched>();
        entry->in = Tensor<float>(Shape{1, 2 * f, h});
        entry->out = Tensor<float>(Shape{1, f, h});
        entry->pending.push_back(comm_->recv_async(entry->in.span(), source));
        entry->pending.push_back(comm_->recv_async(entry->out.span(), source));
        stats_.bytes_fetched += entry->in.bytes() + entry->out.bytes();
        store_[{layer, e}] = std::move(entry);
      }
    }
    if (!overlap_) complete_pending();  // the baseline: every fetch whole on the critical path
    // The held experts first (they compute while the fetches travel), then the fetched ones.
    ExpertWork work;
    std::vector<ExpertTask> fetched;
    for (const ExpertPiece& piece : pieces[std::size_t(s.rank)]) {
      const auto held = std::find(L.slot_expert.begin(), L.slot_expert.end(), piece.expert);
      if (held != L.slot_expert.end()) {
        work.tasks.push_back(slot_task(L, held - L.slot_expert.begin(), piece.begin, piece.end));
        continue;
      }
      Fetched* entry = store_.at({layer, piece.expert}).get();
      fetched.push_back({piece.expert, piece.begin, piece.end, entry->in.view(), entry->out.view(), [this, entry] {
                           timed_wait(entry->pending);
                         }});
    }
    for (ExpertTask& t : fetched) work.tasks.push_back(std::move(t));
    work.finish = [this] { complete_pending(); };
    return work;
  }

  const FetchStats& stats() const noexcept { return stats_; }
  std::int64_t cached() const noexcept { return std::int64_t(store_.size()); }

private:
  struct Fetched {
    Tensor<float> in, out;
    std::vector<Request> pending;  // the receives, until the first task of this expert waits for them
  };
  // Waits for `requests` and clears them, adding the time to FetchStats::wait_s.
  void timed_wait(std::vector<Request>& requests) {
    if (requests.empty()) return;
    const Timer timer;
    for (Request& r : requests) r.wait();
    requests.clear();
    stats_.wait_s += timer.seconds();
  }
  void complete_pending() {
    timed_wait(sends_);
    for (auto& [key, entry] : store_) timed_wait(entry->pending);
  }

  C* comm_;
  bool sorting_, overlap_;
  std::vector<FetchDirectory> directories_;
  std::map<std::pair<std::int64_t, std::int64_t>, std::unique_ptr<Fetched>> store_;
  std::vector<Request> sends_;
  std::int64_t call_ = 0;
  FetchStats stats_;
};

}  // namespace paradyse::serve
