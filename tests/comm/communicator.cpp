// Tests of paradyse/comm/communicator.hpp: the Request handle, the timeout setting, the element types and the
// concept itself (the backends' conformance is asserted next to each backend and exercised in threads.cpp / mpi).
#include "paradyse/comm/communicator.hpp"

#include "paradyse/comm/threads.hpp"

#include <doctest/doctest.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace pd = paradyse;

TEST_CASE("communicator: Request completes once, on wait or on destruction") {
  int completed = 0;
  {
    pd::Request r([&] { ++completed; });
    CHECK(r.pending());
    r.wait();
    CHECK(completed == 1);
    CHECK_FALSE(r.pending());
    r.wait();  // idempotent
    CHECK(completed == 1);
  }
  CHECK(completed == 1);
  { pd::Request r([&] { ++completed; }); }  // never waited: the destructor completes it
  CHECK(completed == 2);

  pd::Request a([&] { ++completed; });
  pd::Request b(std::move(a));
  CHECK_FALSE(a.pending());
  CHECK(b.pending());
  pd::Request c([&] { completed += 10; });
  c = std::move(b);  // the request c held is completed first
  CHECK(completed == 12);
  c.wait();
  CHECK(completed == 13);

  pd::Request empty;
  CHECK_FALSE(empty.pending());
  empty.wait();
}

TEST_CASE("communicator: a failing Request throws from wait, and quietly from its destructor") {
  pd::Request r([] { throw pd::CommError("peer failed"); });
  CHECK_THROWS_WITH_AS(r.wait(), doctest::Contains("peer failed"), pd::CommError);
  CHECK_FALSE(r.pending());  // a failed wait does not run again
  CHECK_NOTHROW([] { pd::Request quiet([] { throw std::runtime_error("swallowed"); }); }());
}

TEST_CASE("communicator: the timeout comes from PARADYSE_COMM_TIMEOUT, default 300 s") {
  const char* text = std::getenv("PARADYSE_COMM_TIMEOUT");
  const double seconds = text ? std::strtod(text, nullptr) : 0.0;
  const auto want = seconds > 0 ? std::chrono::milliseconds(std::int64_t(seconds * 1000)) : std::chrono::milliseconds(300'000);
  CHECK(pd::comm_timeout() == want);
  CHECK(pd::RunOptions{}.timeout == want);
}

TEST_CASE("communicator: reduce operators have names") {
  CHECK(pd::name_of(pd::ReduceOp::sum) == "sum");
  CHECK(pd::name_of(pd::ReduceOp::max) == "max");
  CHECK(pd::name_of(pd::ReduceOp::avg) == "avg");
}

namespace {
// Everything but shift: not a Communicator.
struct AlmostCommunicator {
  int rank() const { return 0; }
  int size() const { return 1; }
  pd::CommStats stats() const { return {}; }
};
}  // namespace

TEST_CASE("communicator: the concept and the element types") {
  static_assert(pd::Communicator<pd::ThreadCommunicator>);
  static_assert(!pd::Communicator<AlmostCommunicator>);
  static_assert(pd::CommElement<float> && pd::CommElement<double> && pd::CommElement<pd::bf16>);
  static_assert(pd::CommElement<std::int32_t> && pd::CommElement<std::int64_t> && pd::CommElement<std::byte>);
  static_assert(!pd::CommElement<pd::f16> && !pd::CommElement<char> && !pd::CommElement<std::uint32_t>);
  CHECK(true);
}
