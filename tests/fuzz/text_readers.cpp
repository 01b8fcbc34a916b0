// Fuzz targets (tests/fuzz/mutate.hpp) of the line-oriented readers of user files: plan_trace's length lists and
// length distributions (data/trace_input.hpp), Azure request traces (serve/request_trace.hpp), routing records
// (serve/routing_source.hpp), a corpus folder of .txt documents (data/corpus.hpp) and the GEMM engine cache (ops/cpu/gemm_choice.hpp, whose documented answer to a bad
// file is "no cached choice": it must never throw). Seeds: the repository's data/lengths/ distribution, the bundled
// Azure trace head, a routing record written by the library's RoutingRecorder and a cache text written by the
// library.
#include "fuzz/mutate.hpp"

#include "paradyse/data/corpus.hpp"
#include "paradyse/data/trace_input.hpp"
#include "paradyse/ops/cpu/gemm_choice.hpp"
#include "paradyse/serve/request_trace.hpp"
#include "paradyse/serve/routing_source.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

namespace {

using namespace paradyse;
namespace fs = std::filesystem;
using namespace std::string_literals;

const std::string kTextTestData = PARADYSE_TEST_DATA_DIR;                   // tests/data
const std::string kTextRepositoryData = kTextTestData + "/../../data";      // data/
constexpr std::int64_t kMaxLength = std::int64_t(1) << 28;

}  // namespace

TEST_CASE("fuzz length distribution and length list: data::parse_distribution, data::parse_lengths") {
  const std::string table = fuzz::read_file(kTextRepositoryData + "/lengths/paradyse_table3.csv");
  fuzz::run("length_distribution", {table}, [](const std::string& text) {
    for (const auto& [name, buckets] : data::parse_distribution(text, "fuzz.csv", kMaxLength))
      for (const data::LengthBucket& b : buckets)
        CHECK((b.lo >= 0 && b.lo < b.hi && b.hi <= kMaxLength && std::isfinite(b.probability)));
  });
  fuzz::run("length_list", {"100 200\n# note\n300,400 # tail\n", "4096\n8192\n16384\n131072\n7\n"},
            [](const std::string& text) {
              for (std::int64_t l : data::parse_lengths(text, "fuzz.txt", 1, kMaxLength)) CHECK((l >= 1 && l <= kMaxLength));
            });
}

TEST_CASE("fuzz Azure request trace: serve::read_azure_trace") {
  fuzz::TempFolder dir;
  const std::vector<std::string> seeds = {
      fuzz::read_file(kTextTestData + "/traces/azure_code_head20.csv"),
      "ContextTokens,TIMESTAMP,GeneratedTokens\r\n12,0.5,3\r\n7,0.75,1\r\n9,2,8\r\n"};
  // Found by this target: a NUL byte in a cell cut the message; a row earlier than the one before gave a negative
  // arrival; 9223372036854775807 prompt tokens were accepted (and materialised as a prompt by to_serve_requests).
  const std::vector<std::string> regressions = {
      "TIMESTAMP,ContextTokens,GeneratedTokens\n1\0,5,5\n"s,
      "TIMESTAMP,ContextTokens,GeneratedTokens\n1,5\0,5\n"s,
      "TIMESTAMP,ContextTokens,GeneratedTokens\n2,5,5\n1,5,5\n",
      "TIMESTAMP,ContextTokens,GeneratedTokens\n1,9223372036854775807,5\n",
      "TIMESTAMP,ContextTokens,GeneratedTokens\n1,5,99999999999\n"};
  fuzz::run("request_trace", seeds, [&](const std::string& text) {
    const std::vector<serve::TraceRequest> trace = serve::read_azure_trace(dir.write("trace.csv", text));
    for (const serve::TraceRequest& r : trace)
      CHECK((std::isfinite(r.arrival_s) && r.arrival_s >= 0 && r.prompt_tokens >= 1 && r.output_tokens >= 1));
    // What loads can be served: the requests' prompts are materialised (token ids below a vocabulary of 32).
    std::int64_t tokens = 0;
    for (const serve::ServeRequest& r : serve::to_serve_requests(trace, 32, 1)) tokens += std::int64_t(r.prompt.size());
    CHECK(tokens >= std::int64_t(trace.size()));
  }, regressions, (dir.path / "trace.csv").string());
}

TEST_CASE("fuzz routing record: serve::load_routing_record") {
  fuzz::TempFolder dir;
  // A record written by the library: 3 steps of 2 MoE layers over 4 experts, top-2 of 8, 5 and 1 tokens.
  serve::RoutingRecorder recorder;
  const std::vector<std::vector<std::int64_t>> routed = {{4, 4, 4, 4}, {2, 3, 3, 2}, {1, 0, 1, 0}};
  for (std::size_t s = 0; s < routed.size(); ++s) {
    serve::StepTrace t;
    t.routed = {routed[s], {}, routed[s]};  // layer 1 dense
    t.chunks = {{.tokens = std::accumulate(routed[s].begin(), routed[s].end(), std::int64_t(0)) / 2}};
    recorder.add(t);
  }
  const std::string written = (dir.path / "seed.csv").string();
  recorder.save(written);
  // Found by this target: a NUL byte in a cell cut the message; counts near 2^63 (whose sum overflowed in the
  // replay) were accepted.
  const std::vector<std::string> regressions = {"step,layer,tokens,e0,e1\n0,0,2,1\0,1\n"s,
                                                "step,layer,tokens,e0,e1\n0,0,9223372036854775807,9223372036854775807,5\n"};
  fuzz::run("routing_record", {fuzz::read_file(written)}, [&](const std::string& text) {
    serve::RoutingRecord record = serve::load_routing_record(dir.write("record.csv", text));
    const std::int64_t experts = record.experts;
    serve::RecordedRouting replay(std::move(record), "fuzz");
    // What loads replays: top-2 of 6 tokens gives 12 pairs, at most 6 per expert.
    std::int64_t pairs = 0;
    for (std::int64_t c : replay.counts(1, 0, 6, experts, 2)) {
      CHECK((c >= 0 && c <= 6));
      pairs += c;
    }
    CHECK(pairs <= 12);
  }, regressions, (dir.path / "record.csv").string());
}

TEST_CASE("fuzz corpus document: data::load and the windows a run draws from it") {
  fuzz::TempFolder dir;
  const std::string seed = "Mr. Speaker, Mr. President, and distinguished Members of the Congress, I come before you.\n";
  fuzz::run("corpus", {seed, seed + seed + seed}, [&](const std::string& text) {
    (void)dir.write("speech.txt", text);
    const std::vector<data::Document> docs = data::load(dir.path);
    data::WindowSampler sampler(docs, 4, 64, 1);
    for (const data::Window& w : sampler.stratified(8))
      CHECK((w.length >= 1 && w.offset >= 0 && w.offset + w.length + 1 <= std::int64_t(docs[w.document].bytes.size())));
  }, {}, dir.path.string());
}

TEST_CASE("fuzz GEMM engine cache: ops::cpu::parse_gemm_measurement never throws") {
  ops::cpu::GemmMeasurement m;
  for (std::size_t i = 0; i < m.engine.size(); ++i) {
    m.engine[i] = ops::cpu::GemmEngine::fallback;
    m.cblas_flops_per_s[i] = 1e9 * double(i + 1);
    m.fallback_flops_per_s[i] = 2.5e9 * double(i + 1);
  }
  const std::string key = "fuzz | simd 2 | none | /bin/test | margin 1.1 | probes 3";
  const std::string text = ops::cpu::gemm_measurement_text(m, key);
  ops::cpu::GemmMeasurement read;
  REQUIRE(ops::cpu::parse_gemm_measurement(text, key, read));
  fuzz::run("gemm_cache", {text}, [&](const std::string& input) {
    // The documented error answer is false (no cached choice; the engines are measured again), so a malformed file
    // counts as refused here, and any exception at all is a leak.
    ops::cpu::GemmMeasurement out;
    if (!ops::cpu::parse_gemm_measurement(input, key, out))
      throw Error("the cache text is malformed (parse_gemm_measurement returned false)");
    for (std::size_t i = 0; i < out.engine.size(); ++i)
      CHECK((out.cblas_flops_per_s[i] >= 0 && out.fallback_flops_per_s[i] >= 0 && std::isfinite(out.cblas_flops_per_s[i])));
  });
}
