// tests/moe/moe_cost.cpp: the dry run of the MoE strategies. The bytes forward saves equal, to the byte, what a real
// run on thread ranks saves under the same (balanced) routing; ExpertParallel's traffic grows with the tokens and
// ExpertTensorParallel's does not; the time model reads both traces.
#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/moe_cost.hpp"

#include <doctest/doctest.h>

#include <vector>

using namespace paradyse;

namespace {

MoeConfig cost_config() {
  MoeConfig c;
  c.hidden = 8;
  c.experts = 4;
  c.top_k = 2;
  c.expert_ffn = 6;
  c.shared_experts = 1;
  c.shared_ffn = 4;
  c.shared_gate = true;
  return c;
}

// What forward saves on each rank of a real run whose router sends local token t to experts t and t + 1 (mod E),
// as the counting router's stand-in does: the bytes freed when the saved state is destroyed.
template <template <class> class Strategy>
std::vector<std::int64_t> real_saved_bytes(const MoeConfig& c, int p, std::int64_t tokens) {
  std::vector<std::int64_t> saved_bytes(static_cast<std::size_t>(p));
  std::vector<int> as_assumed(static_cast<std::size_t>(p), 1);
  run_ranks(p, [&](ThreadCommunicator& comm) {
    BufferPool pool;
    const MoeContext ctx(c, pool);
    MoeShard w = MoeShard::zeros(c, p, comm.rank());
    for (std::int64_t e = 0; e < c.experts; ++e) w.router(e, e) = 1.0f;  // logit e = x[e]
    Tensor<float> x(Shape{1, tokens, c.hidden}), y(x.shape());
    for (std::int64_t t = 0; t < tokens; ++t) {
      x(0, t, t % c.experts) = 2.0f;
      x(0, t, (t + 1) % c.experts) = 1.0f;
    }
    std::size_t with = 0;
    {
      const MoeSaved saved = Strategy<ops::Cpu>{}.forward(comm, ctx, w, x.view(), y.view());
      for (std::int64_t t = 0; t < tokens; ++t)  // doctest's assertions are made on the main thread
        if (saved.routing.expert[std::size_t(2 * t)] != t % c.experts ||
            saved.routing.expert[std::size_t(2 * t + 1)] != (t + 1) % c.experts)
          as_assumed[std::size_t(comm.rank())] = 0;
      with = MemoryTracker::current().in_use();
    }
    saved_bytes[std::size_t(comm.rank())] = std::int64_t(with - MemoryTracker::current().in_use());
  });
  for (const int ok : as_assumed) CHECK(ok == 1);
  return saved_bytes;
}

double posted_bytes(const cost::SublayerTrace& t) {
  double bytes = 0;
  for (const auto* phase : {&t.forward, &t.backward})
    for (const TraceEvent& e : *phase)
      if (e.kind == TraceKind::post) bytes += e.bytes;
  return bytes;
}

}  // namespace

TEST_CASE("moe dry run: the saved bytes equal a real run's, to the byte") {
  const MoeConfig c = cost_config();
  for (int p : {1, 2, 4}) {
    CAPTURE(p);
    const std::vector<std::int64_t> ep = real_saved_bytes<ExpertParallel>(c, p, 8);
    const std::vector<std::int64_t> etp = real_saved_bytes<ExpertTensorParallel>(c, p, 8);
    for (int r = 0; r < p; ++r) {
      CAPTURE(r);
      CHECK(moe_cost<ExpertParallel>(c, p, r, 1, 8, nullptr).saved_bytes == ep[std::size_t(r)]);
      CHECK(moe_cost<ExpertTensorParallel>(c, p, r, 1, 8, nullptr).saved_bytes == etp[std::size_t(r)]);
    }
  }
}

TEST_CASE("moe dry run: ExpertParallel's traffic grows with the tokens, ExpertTensorParallel's does not; times") {
  MoeConfig c = cost_config();
  c.hidden = 64;
  c.experts = 8;
  c.expert_ffn = 128;
  const cost::HardwareProfile h100 = cost::builtin_profile("h100");
  const double ep_small = posted_bytes(moe_dry_run<ExpertParallel>(c, 4, 0, 1, 16));
  const double ep_large = posted_bytes(moe_dry_run<ExpertParallel>(c, 4, 0, 1, 1024));
  const double etp_small = posted_bytes(moe_dry_run<ExpertTensorParallel>(c, 4, 0, 1, 16));
  const double etp_large = posted_bytes(moe_dry_run<ExpertTensorParallel>(c, 4, 0, 1, 1024));
  CHECK(ep_large > 30 * ep_small);
  // ExpertTensorParallel moves the experts (and the small router statistics and replicated gradients).
  CHECK(etp_large == doctest::Approx(etp_small).epsilon(0.01));
  CHECK(etp_small > ep_small);
  const cost::SublayerCost ep = moe_cost<ExpertParallel>(c, 4, 0, 1, 1024, &h100);
  const cost::SublayerCost etp = moe_cost<ExpertTensorParallel>(c, 4, 0, 1, 1024, &h100);
  CHECK(ep.forward_s > 0);
  CHECK(ep.backward_s > ep.forward_s);
  CHECK(etp.forward_s > 0);
  CHECK(etp.backward_s > etp.forward_s);
  CHECK(ep.saved_bytes > 0);
}
