// tests/fuzz/mutate.hpp: the in-house mutation fuzzer behind tests/fuzz/ (g++ 12 has no libFuzzer). Every reader of
// a user file gets a target (one doctest case) that starts from real, valid seed files, mutates them and asserts,
// for every mutated input, that the reader either returns or throws paradyse::Error with a whole message (never
// another exception type, never a crash, never a hang, never an absurd allocation).
//
// The mutations (Mutator::mutate, 1 to 4 per input, on one seed):
//   bytes:  flip a bit, set a byte (to a random or a structural one: NUL, 0xff, '\n', ',', '"', '{', ...), insert a
//           random run, delete a run, duplicate a run, truncate, splice (a prefix of one seed and a suffix of another);
//   tokens: replace a number by an odd one (-6, 0, 1e300, 1e-300, nan, inf, 99999999999, 2^63, 1e999, "6", null, ...),
//           replace a string by an odd one ("", a 64 KiB string, "\u0000", "x6", "-6", ...), replace the value after a
//           ':' by any odd value, delete a JSON member, duplicate a JSON member (a repeated key), nest deeply;
//   lines:  delete, duplicate or swap lines, replace a CSV / whitespace-separated field by an odd token.
// A fixed seed makes a run reproducible: the same seed and the same number of inputs give the same inputs.
//
// Budget (environment):
//   PARADYSE_FUZZ_SECONDS     seconds per target (default 0.6: the 23 targets of ctest `fuzz` take ~14 s)
//   PARADYSE_FUZZ_ITERATIONS  a fixed number of inputs per target instead (no time limit): reproducible counts
//   PARADYSE_FUZZ_SEED        the random seed (default 20261202)
//   PARADYSE_FUZZ_OUT         where a failing input is written (default: the current folder)
// A longer run by hand, e.g. ten minutes per target, or one target with another seed:
//   PARADYSE_FUZZ_SECONDS=600 build-test/tests/test_fuzz
//   PARADYSE_FUZZ_SEED=7 PARADYSE_FUZZ_SECONDS=60 build-test/tests/test_fuzz --test-case='*hf config*'
//
// Guards while a target runs (Guard): each input must finish within kInputSeconds (SIGALRM), the address space is
// capped at kAddressSpaceCap (an absurd allocation throws std::bad_alloc, reported as a leak, instead of taking the
// machine) and the library's memory tracker at kTrackedCap (OutOfMemory, a paradyse::Error). On a crash (SIGSEGV,
// SIGBUS, SIGFPE, SIGABRT) or a hang the input being read is written to fuzz-<target>-crash.bin before the process
// dies; a leaked exception writes fuzz-<target>-<input>.bin and fails the test naming it. A found case is then
// kept as a fixed regression input in the target's test file.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/memory.hpp"
#include "support/temp_folder.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <random>
#include <string>
#include <string_view>
#include <typeinfo>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

namespace paradyse::fuzz {

inline constexpr unsigned kInputSeconds = 10;                          // one input's limit (SIGALRM)
inline constexpr rlim_t kAddressSpaceCap = rlim_t(6) << 30;             // 6 GiB of address space while fuzzing
inline constexpr std::size_t kTrackedCap = std::size_t(1) << 30;        // 1 GiB through the library's tracker

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(bool(in), "fuzz: cannot read the seed " << path);
  return {std::istreambuf_iterator<char>(in), {}};
}
inline void write_file(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

// A fresh folder (support/temp_folder.hpp) that the fuzz targets write their inputs into.
struct TempFolder : testing::TempFolder {
  TempFolder() : testing::TempFolder("paradyse_fuzz") {}
  // Writes `bytes` as the file `name` of the folder, a fresh file per input (ext4 flushes a truncated-and-rewritten
  // file on close: slow); its path.
  std::string write(const std::string& name, std::string_view bytes) const {
    const std::string file = (path / name).string();
    std::error_code ignored;
    std::filesystem::remove(file, ignored);
    write_file(file, bytes);
    return file;
  }
};

// ---- the budget -------------------------------------------------------------------------------------------------

struct Budget {
  double seconds = 0.6;         // per target
  std::int64_t iterations = 0;  // > 0: exactly this many inputs, no time limit
  std::uint64_t seed = 20261202;

  static Budget from_environment() {
    Budget b;
    if (const char* s = std::getenv("PARADYSE_FUZZ_SECONDS"); s && *s) b.seconds = std::strtod(s, nullptr);
    if (const char* s = std::getenv("PARADYSE_FUZZ_ITERATIONS"); s && *s) b.iterations = std::strtoll(s, nullptr, 10);
    if (const char* s = std::getenv("PARADYSE_FUZZ_SEED"); s && *s) b.seed = std::strtoull(s, nullptr, 10);
    return b;
  }
};

inline std::string output_folder() {
  const char* out = std::getenv("PARADYSE_FUZZ_OUT");
  return out && *out ? out : ".";
}

// ---- the mutator ------------------------------------------------------------------------------------------------

// Numbers a hostile file might hold where a number goes (and non-numbers where one is expected).
inline constexpr std::string_view kOddNumbers[] = {
    "-6", "0", "-0", "-1", "1", "2", "1.5", "0.5", "1e300", "-1e300", "1e-300", "1e308", "1e999", "-1e999", "nan",
    "NaN", "inf", "-inf", "Infinity", "99999999999", "2147483648", "4294967297", "9007199254740993",
    "9223372036854775807", "9223372036854775808", "-9223372036854775808", "18446744073709551616",
    "99999999999999999999", "16777217", "65537", "1e6", "1e12", "007", "+5", "0x10", "1_000", "6x", "x6", "\"6\"",
    "\"\"", "null", "true", "false", "[]", "{}", "[1,2]", "-", "."};
// Strings a hostile file might hold.
inline const std::vector<std::string>& odd_strings() {
  static const std::vector<std::string> strings = {
      "\"\"", "\"x6\"", "\"-6\"", "\"99999999999\"", "\"nan\"", "\"1e300\"", "\"\\u0000\"", "\"a\\u0000b\"",
      "\"\\ud800\"", "\"\\n\"", "\"../..\"", "\"/\"", "\"..\"", "\"true\"", "\"null\"", "\"\\\\\"", "\" \"",
      "\"" + std::string(65536, 'x') + "\"", "\"\\u00e9\\u4e2d\"", "\"step_best\""};
  return strings;
}
// Bytes that carry structure in JSON, CSV and line formats.
inline constexpr char kStructuralBytes[] = {'\0', '\xff', '\n', '\r', ',', '"', '{', '}', '[', ']', ':', '\\', '#',
                                            ' ',  '-',    '.',  'e',  '0', '9', '\t'};

class Mutator {
public:
  explicit Mutator(std::uint64_t seed) : rng_(seed) {}

  // One mutated input from `seeds` (1 to 4 mutations of one seed; a splice takes a second one).
  std::string mutate(const std::vector<std::string>& seeds) {
    std::string text = seeds[below(seeds.size())];
    const int mutations = 1 + int(below(4));
    for (int m = 0; m < mutations; ++m) mutate_once(text, seeds);
    return text;
  }

  std::size_t below(std::size_t n) { return n ? std::size_t(rng_() % n) : 0; }

private:
  void mutate_once(std::string& text, const std::vector<std::string>& seeds) {
    switch (below(18)) {
      case 0:  // flip a bit
        if (!text.empty()) text[below(text.size())] ^= char(1 << below(8));
        break;
      case 1:  // set a byte: random or structural
        if (!text.empty())
          text[below(text.size())] = below(2) ? char(rng_() & 0xff) : kStructuralBytes[below(std::size(kStructuralBytes))];
        break;
      case 2: {  // insert a random run
        std::string run(1 + below(16), '\0');
        for (char& c : run) c = char(rng_() & 0xff);
        text.insert(below(text.size() + 1), run);
        break;
      }
      case 3: {  // delete a run
        const std::size_t at = below(text.size() + 1);
        text.erase(at, 1 + below(64));
        break;
      }
      case 4: {  // duplicate a run somewhere else
        const std::size_t at = below(text.size() + 1);
        const std::string run = text.substr(at, 1 + below(64));
        text.insert(below(text.size() + 1), run);
        break;
      }
      case 5:  // truncate
        text.resize(below(text.size() + 1));
        break;
      case 6: {  // splice: a prefix of this input and a suffix of another seed
        const std::string& other = seeds[below(seeds.size())];
        text = text.substr(0, below(text.size() + 1)) + other.substr(below(other.size() + 1));
        break;
      }
      case 7:
      case 8:
      case 9:
        replace_number(text);
        break;
      case 10:
        replace_string(text);
        break;
      case 11:
        replace_value(text);
        break;
      case 12:
        delete_member(text);
        break;
      case 13:
        duplicate_member(text);
        break;
      case 14: {  // deep nesting
        const std::size_t depth = 1 + below(600);
        text.insert(below(text.size() + 1), std::string(depth, below(2) ? '[' : '{'));
        break;
      }
      case 15:
        mutate_line(text);
        break;
      case 16:
      case 17:
        replace_field(text);
        break;
    }
  }

  static bool is_number_char(char c) {
    return (c >= '0' && c <= '9') || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E';
  }
  std::string odd_number() { return std::string(kOddNumbers[below(std::size(kOddNumbers))]); }
  std::string odd_value() {
    return below(3) == 0 ? odd_strings()[below(odd_strings().size())] : odd_number();
  }

  // A number token (a run of digits with its sign, point and exponent) becomes an odd number.
  void replace_number(std::string& text) {
    std::size_t at = below(text.size() + 1);
    while (at < text.size() && !(text[at] >= '0' && text[at] <= '9')) ++at;
    if (at >= text.size()) return;
    std::size_t begin = at, end = at;
    while (begin > 0 && is_number_char(text[begin - 1])) --begin;
    while (end < text.size() && is_number_char(text[end])) ++end;
    text.replace(begin, end - begin, odd_number());
  }
  // A JSON string (from a '"' to the next unescaped '"') becomes an odd string.
  void replace_string(std::string& text) {
    const std::size_t open = text.find('"', below(text.size() + 1));
    if (open == std::string::npos) return;
    std::size_t close = open + 1;
    while (close < text.size() && text[close] != '"') close += text[close] == '\\' ? 2 : 1;
    if (close >= text.size()) return;
    text.replace(open, close - open + 1, odd_strings()[below(odd_strings().size())]);
  }
  // The value after a ':' (up to the next ',', '}', ']' or line end) becomes an odd value.
  void replace_value(std::string& text) {
    std::size_t at = text.find(':', below(text.size() + 1));
    if (at == std::string::npos) return;
    ++at;
    while (at < text.size() && text[at] == ' ') ++at;
    std::size_t end = at;
    while (end < text.size() && text[end] != ',' && text[end] != '}' && text[end] != ']' && text[end] != '\n') ++end;
    text.replace(at, end - at, odd_value());
  }
  // The extent [begin, end) of a member `"key": value` starting at a key's quote: the value is skipped with its
  // nesting (strings included), up to the ',' or the closing bracket at its own depth.
  static std::pair<std::size_t, std::size_t> member_at(const std::string& text, std::size_t key) {
    std::size_t i = key + 1;
    while (i < text.size() && text[i] != '"') i += text[i] == '\\' ? 2 : 1;
    if (i >= text.size()) return {0, 0};
    for (++i; i < text.size() && (text[i] == ' ' || text[i] == '\t' || text[i] == '\n' || text[i] == '\r');) ++i;
    if (i >= text.size() || text[i] != ':') return {0, 0};  // a string, not a key
    int depth = 0;
    for (++i; i < text.size(); ++i) {
      const char c = text[i];
      if (c == '"') {
        for (++i; i < text.size() && text[i] != '"'; i += text[i] == '\\' ? 2 : 1) {
        }
      } else if (c == '{' || c == '[') {
        ++depth;
      } else if (c == '}' || c == ']') {
        if (depth-- == 0) return {key, i};
      } else if (c == ',' && depth == 0) {
        return {key, i + 1};
      }
    }
    return {key, text.size()};
  }
  std::pair<std::size_t, std::size_t> random_member(const std::string& text) {
    for (int tries = 0; tries < 8; ++tries) {
      const std::size_t key = text.find('"', below(text.size() + 1));
      if (key == std::string::npos) continue;
      const auto [begin, end] = member_at(text, key);
      if (end > begin) return {begin, end};
    }
    return {0, 0};
  }
  void delete_member(std::string& text) {
    const auto [begin, end] = random_member(text);
    if (end > begin) text.erase(begin, end - begin);
  }
  void duplicate_member(std::string& text) {
    const auto [begin, end] = random_member(text);
    if (end <= begin) return;
    std::string member = text.substr(begin, end - begin);
    if (member.back() != ',') member += ',';
    text.insert(begin, member);
  }
  // Deletes, duplicates or swaps whole lines.
  void mutate_line(std::string& text) {
    std::vector<std::string> lines;
    for (std::size_t at = 0; at <= text.size();) {
      const std::size_t nl = text.find('\n', at);
      lines.push_back(text.substr(at, nl == std::string::npos ? std::string::npos : nl - at));
      if (nl == std::string::npos) break;
      at = nl + 1;
    }
    if (lines.empty()) return;
    const std::size_t a = below(lines.size()), b = below(lines.size());
    switch (below(3)) {
      case 0: lines.erase(lines.begin() + std::ptrdiff_t(a)); break;
      case 1: lines.insert(lines.begin() + std::ptrdiff_t(a), lines[b]); break;
      case 2: std::swap(lines[a], lines[b]); break;
    }
    std::string out;
    for (std::size_t i = 0; i < lines.size(); ++i) out += (i ? "\n" : "") + lines[i];
    text = std::move(out);
  }
  // A field of a CSV or whitespace-separated line becomes an odd token.
  void replace_field(std::string& text) {
    auto separator = [](char c) { return c == ',' || c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
    std::size_t at = below(text.size() + 1);
    while (at > 0 && !separator(text[at - 1])) --at;
    std::size_t end = at;
    while (end < text.size() && !separator(text[end])) ++end;
    text.replace(at, end - at, below(4) == 0 ? std::string() : odd_value());
  }

  std::mt19937_64 rng_;
};

// ---- the guards -------------------------------------------------------------------------------------------------

namespace detail {
inline char crash_file[4096];                 // where a crashing input goes (set before the target runs)
inline const std::string* current = nullptr;  // the input being read
inline const char* target_name = "";

inline void write_all(int fd, const char* p, std::size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w <= 0) return;
    p += w, n -= std::size_t(w);
  }
}
inline void say(const char* s) { write_all(2, s, std::strlen(s)); }

// Async-signal-safe: writes the input and a line naming it, then dies of the signal as it would have.
inline void on_signal(int signal) {
  say("\nfuzz: target '");
  say(target_name);
  say(signal == SIGALRM ? "' hung (one input ran beyond its time limit)" : "' crashed (signal ");
  if (signal != SIGALRM) {
    char number[8] = {char('0' + signal / 10), char('0' + signal % 10), ')', '\0'};
    say(number);
  }
  if (current) {
    const int fd = ::open(crash_file, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      write_all(fd, current->data(), current->size());
      ::close(fd);
      say("; the input is in ");
      say(crash_file);
    }
  }
  say("\n");
  const int end = signal == SIGALRM ? SIGABRT : signal;  // a hang ends as an abort
  std::signal(end, SIG_DFL);
  std::raise(end);
}
}  // namespace detail

// While alive: crash and hang reports, the address-space cap and the tracker's cap.
class Guard {
public:
  explicit Guard(const char* target) {
    detail::target_name = target;
    const std::string path = output_folder() + "/fuzz-" + target + "-crash.bin";
    std::snprintf(detail::crash_file, sizeof detail::crash_file, "%s", path.c_str());
    for (int s : {SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGALRM, SIGILL}) std::signal(s, detail::on_signal);
    ::getrlimit(RLIMIT_AS, &saved_limit_);
    rlimit capped = saved_limit_;
    if (capped.rlim_cur == RLIM_INFINITY || capped.rlim_cur > kAddressSpaceCap) capped.rlim_cur = kAddressSpaceCap;
    ::setrlimit(RLIMIT_AS, &capped);
    saved_cap_ = MemoryTracker::process_default().cap();
    MemoryTracker::process_default().set_cap(kTrackedCap);
  }
  ~Guard() {
    ::alarm(0);
    detail::current = nullptr;
    ::setrlimit(RLIMIT_AS, &saved_limit_);
    MemoryTracker::process_default().set_cap(saved_cap_);
    for (int s : {SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGALRM, SIGILL}) std::signal(s, SIG_DFL);
  }
  Guard(const Guard&) = delete;
  Guard& operator=(const Guard&) = delete;

private:
  rlimit saved_limit_{};
  std::size_t saved_cap_ = 0;
};

// ---- the driver -------------------------------------------------------------------------------------------------

// What a target did, printed for the record.
struct Report {
  std::int64_t inputs = 0, accepted = 0, refused = 0;
  std::size_t longest_message = 0;
  double seconds = 0;
};

// Whether `e` is a whole paradyse::Error message: "paradyse: <something> [file.hpp:line]" (a message cut at a NUL
// byte would lack the location).
inline bool whole_message(const Error& e) {
  const std::string_view m = e.what();
  const std::size_t location = m.rfind(" [");
  return m.rfind("paradyse: ", 0) == 0 && location != std::string_view::npos && location > 10 && m.back() == ']' &&
         (m.find(".hpp:", location) != std::string_view::npos || m.find(".cpp:", location) != std::string_view::npos);
}

// Runs `read(input)` on `input`: true if it returned, false if it threw a whole paradyse::Error (that contains
// `names`, the file read, when that is not empty); anything else fails the test, naming the exception and the file
// the input was written to. `label` names the input in messages.
template <class Read>
bool read_one(const std::string& target, const std::string& label, const std::string& input, Read& read,
              Report& report, const std::string& names = {}) {
  detail::current = &input;
  ::alarm(kInputSeconds);
  try {
    read(input);
    ::alarm(0);
    return true;
  } catch (const Error& e) {
    ::alarm(0);
    report.longest_message = std::max(report.longest_message, std::strlen(e.what()));
    if (!whole_message(e)) {
      const std::string file = output_folder() + "/fuzz-" + target + "-" + label + ".bin";
      write_file(file, input);
      FAIL("fuzz " << target << ": input " << label << " (written to " << file
                   << ") threw a paradyse::Error without a whole message: " << std::string(e.what()));
    }
    if (!names.empty() && std::string_view(e.what()).find(names) == std::string_view::npos) {
      const std::string file = output_folder() + "/fuzz-" + target + "-" + label + ".bin";
      write_file(file, input);
      FAIL("fuzz " << target << ": input " << label << " (written to " << file << ") threw a paradyse::Error that does "
                   << "not name the file " << names << ": " << std::string(e.what()));
    }
    return false;
  } catch (const std::exception& e) {
    ::alarm(0);
    const std::string file = output_folder() + "/fuzz-" + target + "-" + label + ".bin";
    write_file(file, input);
    FAIL("fuzz " << target << ": input " << label << " (written to " << file << ") threw a "
                 << std::string(typeid(e).name()) << ", not a paradyse::Error: " << std::string(e.what()));
  } catch (...) {
    ::alarm(0);
    const std::string file = output_folder() + "/fuzz-" + target + "-" + label + ".bin";
    write_file(file, input);
    FAIL("fuzz " << target << ": input " << label << " (written to " << file << ") threw something not an exception");
  }
  return false;
}

// The target `target`: every seed must be accepted as it is (else the target tests nothing), then mutated inputs
// until the budget is spent; the fixed `regressions` (inputs that once crashed or leaked) run first and must each
// be refused with a whole paradyse::Error. With `names` (the file a file reader reads) every message must name it.
// Prints and returns the counts.
template <class Read>
Report run(const std::string& target, const std::vector<std::string>& seeds, Read read,
           const std::vector<std::string>& regressions = {}, const std::string& names = {}) {
  REQUIRE(!seeds.empty());
  const Budget budget = Budget::from_environment();
  Report report;
  Guard guard(target.c_str());
  for (std::size_t i = 0; i < seeds.size(); ++i) {
    const bool accepted = read_one(target, "seed" + std::to_string(i), seeds[i], read, report);
    REQUIRE_MESSAGE(accepted, "fuzz " << target << ": seed " << i << " is refused; a target must start from valid inputs");
  }
  for (std::size_t i = 0; i < regressions.size(); ++i) {
    const bool accepted = read_one(target, "regression" + std::to_string(i), regressions[i], read, report, names);
    CHECK_MESSAGE(!accepted, "fuzz " << target << ": regression input " << i << " was accepted; it must be refused");
  }
  Mutator mutator(budget.seed);
  const auto start = std::chrono::steady_clock::now();
  const auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  while (budget.iterations > 0 ? report.inputs < budget.iterations : elapsed() < budget.seconds) {
    const std::string input = mutator.mutate(seeds);
    if (read_one(target, std::to_string(report.inputs), input, read, report, names)) ++report.accepted;
    else ++report.refused;
    ++report.inputs;
  }
  report.seconds = elapsed();
  std::cout << "fuzz " << target << ": " << report.inputs << " inputs in " << report.seconds << " s, "
            << report.accepted << " accepted, " << report.refused << " refused with a paradyse::Error (longest message "
            << report.longest_message << " bytes)" << std::endl;
  // A target that refuses everything or accepts everything is not exercising the reader.
  CHECK(report.refused > 0);
  return report;
}

}  // namespace paradyse::fuzz
