// RingPass: every rank sees every block exactly once, in the order (r - i) mod p, double-buffered; a mutable ring
// accumulates as it travels; two rings in flight on the same neighbours stay apart when finished in order.
#include "paradyse/strategy/ring.hpp"

#include "paradyse/comm/threads.hpp"
#include "strategy/harness.hpp"

#include <doctest/doctest.h>

using namespace paradyse;
using namespace paradyse::testing;

TEST_CASE("RingPass: blocks visit every rank in order; accumulators travel with them") {
  for (int p : {1, 2, 3, 5}) {
    Findings findings;
    run_ranks(p, [&](ThreadCommunicator& comm) {
      const int r = comm.rank();
      BufferPool pool;
      std::vector<float> block(7, float(r));
      RingPass<ThreadCommunicator> ring(comm, pool, block);
      RingPass<ThreadCommunicator> sums = RingPass<ThreadCommunicator>::zeros(comm, pool, 7);
      for (int i = 0; i < p; ++i) {
        if (i + 1 < p) ring.start_next();
        const int owner = ring.owner();
        if (owner != ((r - i) % p + p) % p) findings.fail(fmt::format("rank {} step {}: owner {}", r, i, owner));
        for (float v : ring.current())
          if (v != float(owner)) findings.fail(fmt::format("rank {} step {}: block of {} holds {}", r, i, owner, v));
        for (float& v : sums.mutable_current()) v += float(r + 1);
        if (i + 1 < p) {
          sums.start_next();
          ring.finish_next();  // finished in the order started
          sums.finish_next();
        }
      }
      // After p - 1 hops the accumulator of rank r + 1's block holds 1 + 2 + ... + p.
      for (float v : sums.current())
        if (v != float(p * (p + 1) / 2)) findings.fail(fmt::format("rank {}: sum {}", r, v));
    });
    findings.check_all(fmt::format("p={}", p));
  }
}
