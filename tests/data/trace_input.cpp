// Tests of data/trace_input.hpp (plan_trace's distribution CSV and lengths readers): every bad field is a
// paradyse::Error naming the file, the line, the field and the range, and a mutation fuzz of both formats on a fresh
// seed (every input loads or throws paradyse::Error; counts printed).
#include "paradyse/data/trace_input.hpp"
#include "support/error_of.hpp"
#include "support/fresh_seed.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <typeinfo>

using paradyse::testing::error_of;

using paradyse::Error;
using namespace paradyse::data;

namespace {

constexpr std::int64_t kMax = std::int64_t(1) << 28;

const char* const kTable = R"(# comment
dataset,lo,hi,prob
githubcode,0,4096,0.657
githubcode,4096,8192,0.145
githubcode,8192,309000,0.198
grch38,0,4096,0.035
grch38,4096,624000,0.965
)";

}  // namespace

TEST_CASE("trace input: the distribution CSV reads, and every bad field names the file, line and range") {
  const auto table = parse_distribution(kTable, "t.csv", kMax);
  REQUIRE(table.size() == 2);
  CHECK(table.at("githubcode").size() == 3);
  CHECK(table.at("grch38").back().hi == 624000);
  auto bad = [](const std::string& line) {
    return error_of([&] { parse_distribution("dataset,lo,hi,prob\n" + line + "\n", "d.csv", kMax); });
  };
  CHECK(bad("x,abc,10,0.5").find("d.csv:2: lo \"abc\" is not an integer in [0, 268435455]") != std::string::npos);
  CHECK(bad("x,10,5,0.5").find("d.csv:2: hi (above lo) \"5\" is not an integer in [11, 268435456]") != std::string::npos);
  CHECK(bad("x,-4,5,0.5").find("lo \"-4\"") != std::string::npos);
  CHECK(bad("x,0,5,nan").find("prob \"nan\" is not a finite number in [0, 1]") != std::string::npos);
  CHECK(bad("x,0,5,-0.5").find("prob \"-0.5\"") != std::string::npos);
  CHECK(bad("x,0,99999999999999999999,0.5").find("hi (above lo) \"99999999999999999999\"") != std::string::npos);
  CHECK(bad("x,0,5").find("expected dataset,lo,hi,prob, found 3 fields") != std::string::npos);
  CHECK(bad("x,0,5,0.5,7").find("found 5 fields") != std::string::npos);
  CHECK(bad("x,0,5,0").find("the shares of dataset x add up to 0") != std::string::npos);
  CHECK(bad("x,0,10,0.5\nx,5,20,0.5").find("d.csv:3: bucket (5, 20] of x overlaps or precedes the previous one (0, 10]") !=
        std::string::npos);
  CHECK(error_of([] { read_distribution(".", kMax); }).find("is a folder") != std::string::npos);
}

TEST_CASE("trace input: lengths read, and a length out of range names the file, line and range") {
  CHECK(parse_lengths("100 200\n# note\n300,400 # tail\n", "l.txt", 8, kMax) == std::vector<std::int64_t>{100, 200, 300, 400});
  CHECK(error_of([] { parse_lengths("7\n", "l.txt", 8, kMax); }).find("l.txt:1: length \"7\" is not an integer in [8, 268435456]") !=
        std::string::npos);
  CHECK(error_of([] { parse_lengths("10\n500000000000\n", "l.txt", 1, kMax); }).find("l.txt:2: length \"500000000000\"") !=
        std::string::npos);
  CHECK(error_of([] { parse_lengths("5e8", "l.txt", 1, kMax); }).find("length \"5e8\"") != std::string::npos);
  CHECK(error_of([] { parse_lengths("# nothing\n", "l.txt", 1, kMax); }).find("holds no lengths") != std::string::npos);
  CHECK(error_of([] { parse_lengths(std::string("1\0 2", 4), "l.txt", 1, kMax); }).find("\"1\\x00\"") != std::string::npos);
}

TEST_CASE("trace input fuzz: mutated distributions and length lists load or throw paradyse::Error") {
  PARADYSE_FRESH_RNG(rng);
  auto below = [&](std::size_t n) { return n ? std::size_t(rng() % n) : 0; };
  constexpr std::string_view kOdd[] = {"-1", "0", "nan", "inf", "1e999", "99999999999999999999", "4294967297", "",
                                       "0.5", "abc", ",", "\n", "#", "\0"};
  auto mutate = [&](std::string text) {
    const int mutations = 1 + int(rng() % 4);
    for (int m = 0; m < mutations; ++m) {
      switch (rng() % 6) {
        case 0: if (!text.empty()) text[below(text.size())] ^= char(1 << (rng() % 8)); break;
        case 1: if (!text.empty()) text[below(text.size())] = char(rng() & 0xff); break;
        case 2: text.resize(below(text.size() + 1)); break;
        case 3: text.insert(below(text.size() + 1), std::string(kOdd[below(std::size(kOdd))])); break;
        case 4: text.erase(below(text.size() + 1), below(12)); break;
        case 5: {
          const std::size_t at = below(text.size() + 1);
          text.insert(below(text.size() + 1), text.substr(at, below(40)));
          break;
        }
      }
    }
    return text;
  };
  const std::string lengths = "4096 8192\n16384, 32768\n# comment\n65536 131072 262144\n";
  const int inputs = 20000;
  int loaded = 0, clear_errors = 0, whole = 0;
  for (int i = 0; i < inputs; ++i) {
    const bool csv = i % 2 == 0;
    const std::string text = mutate(csv ? std::string(kTable) : lengths);
    try {
      if (csv) {
        for (const auto& [name, buckets] : parse_distribution(text, "fuzz.csv", kMax))
          for (const LengthBucket& b : buckets) CHECK((b.lo >= 0 && b.lo < b.hi && b.hi <= kMax && std::isfinite(b.probability)));
      } else {
        for (std::int64_t l : parse_lengths(text, "fuzz.txt", 8, kMax)) CHECK((l >= 8 && l <= kMax));
      }
      ++loaded;
    } catch (const Error& e) {
      ++clear_errors;
      const std::string message = e.what();
      whole += message.find(".hpp:") != std::string::npos && message.back() == ']';
    } catch (const std::exception& e) {
      FAIL("input " << i << " threw a " << typeid(e).name() << ": " << e.what());
    }
  }
  std::ostringstream counts;
  counts << "trace input fuzz (seed " << rng_seed << "): " << inputs
         << " inputs tried (half distributions, half length lists), " << loaded << " loaded, " << clear_errors
         << " ended in a paradyse::Error (" << whole << " with a whole message)";
  MESSAGE(counts.str());
  std::cout << counts.str() << std::endl;
  CHECK(loaded + clear_errors == inputs);
  CHECK(whole == clear_errors);
}
