// The ring engine (strategy/ring_schedule.hpp): every rank's block visits every rank exactly once, in the order
// r, r - 1, ... (mod p), with uneven block sizes; with sums, every rank's contribution reaches the block's owner,
// complete, after the last hop.
#include "paradyse/strategy/ring_schedule.hpp"

#include "paradyse/comm/threads.hpp"
#include "strategy/harness.hpp"

#include <doctest/doctest.h>

using namespace paradyse;
using namespace paradyse::testing;

TEST_CASE("ring engine: blocks of uneven sizes visit every rank in order; sums come home complete") {
  for (int p : {1, 2, 3, 5}) {
    Findings findings;
    run_ranks(p, [&](ThreadCommunicator& comm) {
      const int r = comm.rank();
      BufferPool pool;
      const auto size_of = [](int owner) { return std::int64_t(3 + 2 * owner); };  // uneven on purpose
      int step = 0;
      rotate_blocks(
          comm, pool, size_of, [&](std::span<float> own) { std::fill(own.begin(), own.end(), float(r)); },
          [&](int owner, std::span<const float> block) {
            if (owner != ((r - step) % p + p) % p) findings.fail(fmt::format("rank {} step {}: owner {}", r, step, owner));
            if (std::int64_t(block.size()) != size_of(owner))
              findings.fail(fmt::format("rank {}: block of {} has {} elements", r, owner, block.size()));
            for (float v : block)
              if (v != float(owner)) findings.fail(fmt::format("rank {} step {}: block of {} holds {}", r, step, owner, v));
            ++step;
          });
      if (step != p) findings.fail(fmt::format("rank {}: {} visits for {} ranks", r, step, p));
      // Sums: every rank adds r + 1 to every element of every block's sum; the owner gets 1 + 2 + ... + p.
      rotate_blocks_with_sums(
          comm, pool, size_of, size_of, [&](std::span<float> own) { std::fill(own.begin(), own.end(), float(r)); },
          [&](int, std::span<const float>, std::span<float> sum) {
            for (float& v : sum) v += float(r + 1);
          },
          [&](std::span<const float> total) {
            if (std::int64_t(total.size()) != size_of(r))
              findings.fail(fmt::format("rank {}: its sum has {} elements", r, total.size()));
            for (float v : total)
              if (v != float(p * (p + 1) / 2)) findings.fail(fmt::format("rank {}: sum {}", r, v));
          });
    });
    findings.check_all(fmt::format("p={}", p));
  }
}
