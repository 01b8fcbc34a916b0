// Tests of paradyse/cost/tally.hpp: the memory and time bookkeeping that every strategy schedule goes through.
#include "paradyse/cost/tally.hpp"

#include <doctest/doctest.h>

using namespace paradyse::cost;

TEST_CASE("tally: allocations are rounded like the memory tracker's") {
  CHECK(round_allocation(0) == 0);
  CHECK(round_allocation(1) == 64);
  CHECK(round_allocation(64) == 64);
  CHECK(round_allocation(65) == 128);
}

TEST_CASE("tally: saved bytes, and transients measured above them, in forward and backward") {
  Tally t(nullptr, 4, /*recompute=*/false);
  t.save_input(640);   // live 640, saved 640
  t.alloc(6400);       // live 7040
  t.save(1280);        // live 8320, saved 1920
  t.free(6400);        // live 1920
  t.end_forward();
  t.alloc(3200);       // live 5120
  t.release(1280);
  t.free(3200);
  t.release(640);
  const SublayerCost c = t.result();
  CHECK(c.saved_bytes == 1920);
  CHECK(c.forward_transient_bytes == 8320 - 1920);
  CHECK(c.backward_transient_bytes == 5120 - 1920);
  CHECK(c.transient_bytes() == 8320 - 1920);
}

TEST_CASE("tally: recomputation keeps only the input, and backward replays the forward") {
  const auto run = [](bool recompute) {
    Tally t(nullptr, 4, recompute);
    const auto forward = [&] {
      t.save_input(640);
      t.alloc(6400);
      t.save(1280);
      t.free(6400);
    };
    forward();
    t.end_forward();
    if (recompute) {
      forward();
      t.end_replay();
    }
    t.alloc(3200);
    t.release(1280);
    t.free(3200);
    t.release(640);
    return t.result();
  };
  const SublayerCost plain = run(false), recomputed = run(true);
  CHECK(recomputed.saved_bytes == 640);
  CHECK(recomputed.forward_transient_bytes == 6400 + 1280);
  // Backward: the replay peaks at input + 6400 + 1280, then 3200 above input + 1280.
  CHECK(recomputed.backward_transient_bytes == 6400 + 1280);
  CHECK(plain.saved_bytes == 1920);
}

TEST_CASE("tally: a ring step costs the larger of compute and transfer when overlap is full") {
  HardwareProfile hw;
  hw.overlap = 1;
  Tally t(&hw, 4, false);
  t.ring(4, 2.0, 3.0);                // 3 overlapped steps at max(2, 3) and a last compute step
  CHECK(t.result().forward_s == doctest::Approx(3 * 3.0 + 2.0));
  CHECK(t.ring_s(4, 2.0, 3.0, true) == doctest::Approx(3 * 3.0 + 2.0 + 3.0));
  hw.overlap = 0;                     // nothing hides: compute + transfer
  Tally serial(&hw, 4, false);
  serial.ring(4, 2.0, 3.0, /*final_hop=*/true);
  CHECK(serial.result().forward_s == doctest::Approx(3 * 5.0 + 2.0 + 3.0));
  CHECK(serial.result().compute_s == doctest::Approx(8.0));
  CHECK(serial.result().exposed_comm_s == doctest::Approx(12.0));
}

TEST_CASE("tally: time lands in forward or backward by phase; without a profile every time is zero") {
  HardwareProfile hw;
  Tally t(&hw, 2, false);
  t.compute(1.0);
  t.end_forward();
  t.communicate(0.5);
  CHECK(t.result().forward_s == 1.0);
  CHECK(t.result().backward_s == 0.5);
  Tally none(nullptr, 2, false);
  CHECK(none.gemm_s(100, 100, 100, 4) == 0);
  CHECK(none.collective_s(Collective::all_reduce, 1e6) == 0);
}
