// A seeded mutation fuzz of the JSON profile reader (cost/json.hpp + cost/profile.hpp): valid profiles mutated by
// bit flips, byte changes, truncations, insertions, deletions, duplicated spans and huge or odd numbers must each
// either load or throw paradyse::Error with a whole message (never crash, never another exception type). The
// counts are printed (MESSAGE) for the record. Deterministic: a fixed seed and a fixed number of inputs.
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/core/json.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/cost/profile_json.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <iostream>
#include <sstream>
#include <random>
#include <string>
#include <string_view>
#include <typeinfo>
#include <vector>

using namespace paradyse;

namespace {

// Tokens a hostile file might hold where a number or a value goes.
constexpr std::string_view kOddValues[] = {
    "1e999", "-1e999", "nan", "NaN", "Infinity", "-0", "0", "-1", "99999999999999999999", "9007199254740993",
    "4294967297", "2147483648", "1e-400", "1.5", "\"\"", "null", "true", "[]", "{}", "\"\\u0000\"", "\"\\ud800\"",
    "\"\\uDBFF\\uDFFF\"", "1e308", "-1e308", "0.000000000000000000000000001", "18446744073709551616"};

std::string mutate(std::string text, std::mt19937_64& rng) {
  auto below = [&](std::size_t n) { return n ? std::size_t(rng() % n) : 0; };
  const int mutations = 1 + int(rng() % 4);
  for (int m = 0; m < mutations; ++m) {
    switch (rng() % 9) {
      case 0:  // flip one bit
        if (!text.empty()) text[below(text.size())] ^= char(1 << (rng() % 8));
        break;
      case 1:  // set a byte (NULs and high bytes included)
        if (!text.empty()) text[below(text.size())] = char(rng() & 0xff);
        break;
      case 2:  // truncate
        text.resize(below(text.size() + 1));
        break;
      case 3: {  // insert random bytes
        std::string bytes(1 + below(8), '\0');
        for (char& c : bytes) c = char(rng() & 0xff);
        text.insert(below(text.size() + 1), bytes);
        break;
      }
      case 4: {  // delete a span
        const std::size_t at = below(text.size() + 1);
        text.erase(at, below(32));
        break;
      }
      case 5: {  // duplicate a span somewhere else
        const std::size_t at = below(text.size() + 1), n = below(64);
        const std::string span = text.substr(at, n);
        text.insert(below(text.size() + 1), span);
        break;
      }
      case 6:
      case 7: {  // replace a number (or the value after a ':') with an odd one
        std::size_t at = text.find(':', below(text.size() + 1));
        if (at == std::string::npos) break;
        ++at;
        while (at < text.size() && text[at] == ' ') ++at;
        std::size_t end = at;
        while (end < text.size() && text[end] != ',' && text[end] != '}' && text[end] != '\n' && text[end] != ']') ++end;
        text.replace(at, end - at, kOddValues[below(std::size(kOddValues))]);
        break;
      }
      case 8: {  // deep nesting
        const std::size_t depth = 1 + below(400);
        text.insert(below(text.size() + 1), std::string(depth, rng() % 2 ? '[' : '{'));
        break;
      }
    }
  }
  return text;
}

}  // namespace

TEST_CASE("json fuzz: mutated profiles load or throw paradyse::Error, never anything else") {
  std::vector<std::string> seeds;
  for (std::string_view name : cost::kBuiltinProfileNames) {
    cost::HardwareProfile p = cost::builtin_profile(name);
    p.set_collective(cost::Collective::all_gather, cost::LinkLevel::intra_node, 4, {2e-6, 1e-11}, 4096);
    seeds.push_back(json::dump(cost::to_json(p), 2));
    seeds.push_back(json::dump(cost::to_json(p), 0));
  }
  std::mt19937_64 rng(20261130);
  const int inputs = 20000;
  int loaded = 0, clear_errors = 0, whole_messages = 0;
  for (int i = 0; i < inputs; ++i) {
    const std::string text = mutate(seeds[std::size_t(i) % seeds.size()], rng);
    try {
      const cost::HardwareProfile p = cost::profile_from_json(json::parse(text, "fuzz.json"));
      // What loads is usable: the models' inputs are finite, rates positive.
      CHECK(std::isfinite(p.gemm.flops_per_s));
      CHECK(p.gemm.flops_per_s > 0);
      CHECK(p.usable_memory_bytes() > 0);
      ++loaded;
    } catch (const Error& e) {
      ++clear_errors;
      const std::string message = e.what();
      // The source location comes last: a message cut at a NUL byte would lack it.
      whole_messages += message.find(".hpp:") != std::string::npos && message.back() == ']';
    } catch (const std::exception& e) {
      FAIL("input " << i << " threw a " << typeid(e).name() << ": " << e.what());
    }
  }
  std::ostringstream counts;  // printed always (MESSAGE shows with -s only), for the record
  counts << "json profile fuzz: " << inputs << " inputs tried, " << loaded << " loaded, " << clear_errors
                                << " ended in a paradyse::Error (" << whole_messages << " with a whole message)";
  MESSAGE(counts.str());
  std::cout << counts.str() << std::endl;
  CHECK(loaded + clear_errors == inputs);
  CHECK(whole_messages == clear_errors);
  CHECK(loaded > 0);
  CHECK(clear_errors > inputs / 2);
}
