// A mutation fuzz of the safetensors reader (model/safetensors.hpp) and the checkpoint loader
// (model/checkpoint.hpp): a real checkpoint and a hand-made file of assorted dtypes, mutated by bit flips, byte
// changes, truncations, insertions, deletions, a changed length prefix and huge numbers in the header, must each
// either load or throw paradyse::Error with a whole message (never crash, never another exception type). The
// counts are printed (MESSAGE) for the record. A fresh seed each run (in the test's INFO) and a fixed number of inputs.
#include "paradyse/model/checkpoint.hpp"
#include "paradyse/model/safetensors.hpp"

#include "strategy/harness.hpp"

#include "paradyse/comm/threads.hpp"

#include "support/fresh_seed.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <iostream>
#include <sstream>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <string_view>
#include <typeinfo>
#include <vector>

namespace {

using namespace paradyse;
using Model = Gpt<AllStrategies<>>;
namespace fs = std::filesystem;

constexpr std::string_view kHugeNumbers[] = {"99999999999999999999", "18446744073709551615", "9223372036854775807",
                                             "9007199254740993", "4294967297", "2147483648", "0", "1", "-1", "1e3"};

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}
void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

std::uint64_t header_length(const std::string& file) {
  std::uint64_t n = 0;
  for (int i = 7; i >= 0 && file.size() >= 8; --i) n = (n << 8) | static_cast<unsigned char>(file[std::size_t(i)]);
  return n;
}

std::string mutate(std::string file, std::mt19937_64& rng) {
  auto below = [&](std::size_t n) { return n ? std::size_t(rng() % n) : 0; };
  const int mutations = 1 + int(rng() % 3);
  for (int m = 0; m < mutations; ++m) {
    // Half of the mutations land in the header (8 + n bytes), where the parser is.
    const std::size_t header_end =
        std::min<std::size_t>(file.size(), 8 + std::size_t(std::min<std::uint64_t>(header_length(file), file.size())));
    auto position = [&] { return rng() % 2 ? below(header_end) : below(file.size()); };
    switch (rng() % 9) {
      case 0:
        if (!file.empty()) file[position()] ^= char(1 << (rng() % 8));
        break;
      case 1:
        if (!file.empty()) file[position()] = char(rng() & 0xff);
        break;
      case 2:
        file.resize(below(file.size() + 1));
        break;
      case 3: {
        std::string bytes(1 + below(8), '\0');
        for (char& c : bytes) c = char(rng() & 0xff);
        file.insert(position(), bytes);
        break;
      }
      case 4:
        if (!file.empty()) file.erase(position(), 1 + below(16));
        break;
      case 5: {  // the length prefix: random, or off by a little
        if (file.size() < 8) break;
        std::uint64_t n = rng() % 2 ? rng() : header_length(file) + (rng() % 17) - 8;
        for (int i = 0; i < 8; ++i) file[std::size_t(i)] = char((n >> (8 * i)) & 0xff);
        break;
      }
      case 6:
      case 7: {  // a number in the header (a shape, an offset, a metadata value) becomes a huge or odd one
        std::size_t at = position();
        while (at < header_end && !(file[at] >= '0' && file[at] <= '9')) ++at;
        if (at >= header_end) break;
        std::size_t end = at;
        while (end < header_end && file[end] >= '0' && file[end] <= '9') ++end;
        file.replace(at, end - at, kHugeNumbers[below(std::size(kHugeNumbers))]);
        break;
      }
      case 8: {  // swap two header bytes
        if (header_end < 2) break;
        std::swap(file[below(header_end)], file[below(header_end)]);
        break;
      }
    }
  }
  return file;
}

}  // namespace

TEST_CASE("safetensors fuzz: mutated files load or throw paradyse::Error, never anything else") {
  std::string pattern = (fs::temp_directory_path() / "paradyse_fuzz_XXXXXX").string();
  REQUIRE(::mkdtemp(pattern.data()) != nullptr);
  const fs::path dir = pattern;

  // Seed 1: a real checkpoint.
  GptConfig c;
  c.layer = testing::small_config(4, 2, 16);
  c.layer.causal = c.layer.zigzag = true;
  c.layers = 2;
  c.vocab = 11;
  const std::string checkpoint = (dir / "seed.safetensors").string();
  run_ranks(1, [&](ThreadCommunicator& comm) {
    Model model(c, 1, 0, 3);
    save_checkpoint(comm, model, checkpoint);
  });
  // Seed 2: a hand-made file of other dtypes, a scalar and an empty tensor, with metadata.
  std::vector<safetensors::TensorEntry> entries = {{"a", "F16", {3, 5}, 0, 0},    {"b", "BF16", {7}, 0, 0},
                                                   {"scalar", "I64", {}, 0, 0},   {"empty", "F32", {0, 4}, 0, 0},
                                                   {"u8", "U8", {2, 2, 2}, 0, 0}, {"f64", "F64", {2}, 0, 0}};
  const std::string header = safetensors::encode_header(entries, {{"note", "x\ny"}, {"k", "v"}});
  std::string handmade = header + std::string(std::size_t(entries.back().end), '\x5a');
  const std::vector<std::string> seeds = {read_all(checkpoint), handmade};

  Model target(c, 1, 0, 1);  // loads into this; a failed load changes nothing
  const std::string path = (dir / "input.safetensors").string();
  PARADYSE_FRESH_RNG(rng);
  const int inputs = 20000;
  int headers_read = 0, configs_read = 0, checkpoints_loaded = 0, clear_errors = 0, whole_messages = 0;
  for (int i = 0; i < inputs; ++i) {
    const bool is_checkpoint = i % 4 != 3;
    fs::remove(path);  // a fresh file: ext4 flushes a truncated-and-rewritten one on close (slow)
    write_all(path, mutate(seeds[is_checkpoint ? 0 : 1], rng));
    try {
      {
        const safetensors::File file(path, O_RDONLY);
        const safetensors::Header h = safetensors::read_header(file);
        CHECK(h.data_start + h.data_bytes == file.size());
        ++headers_read;
      }
      if (is_checkpoint) {
        const GptConfig read = read_checkpoint_config(path);
        ++configs_read;
        CHECK(read.layers >= 1);
        load_checkpoint(target, path);
        ++checkpoints_loaded;
      }
    } catch (const Error& e) {
      ++clear_errors;
      const std::string message = e.what();
      whole_messages += message.find(".hpp:") != std::string::npos && message.back() == ']';
    } catch (const std::exception& e) {
      FAIL("input " << i << " threw a " << typeid(e).name() << ": " << e.what());
    }
  }
  std::error_code ignored;
  fs::remove_all(dir, ignored);
  std::ostringstream counts;  // printed always (MESSAGE shows with -s only), for the record
  counts << "safetensors fuzz (seed " << rng_seed << "): " << inputs << " inputs tried, " << headers_read
         << " headers valid, " << configs_read << " checkpoint configs read, " << checkpoints_loaded
         << " checkpoints loaded, " << clear_errors << " ended in a paradyse::Error (" << whole_messages
         << " with a whole message)";
  MESSAGE(counts.str());
  std::cout << counts.str() << std::endl;
  CHECK(whole_messages == clear_errors);
  CHECK(clear_errors > inputs / 2);
  CHECK(headers_read > 0);
}
