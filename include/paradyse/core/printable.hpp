// paradyse/core/printable.hpp: text from a file or a user, made safe to quote in an error message: printable bytes
// only, and bounded (issue 27: a 131 KB flag value was echoed whole, twice, into one message).
//
//   check(ok, "--mesh {}: ...", printable(o.mesh));   // "xxxx...xxxx... (131072 bytes)" past kMaxEchoedBytes
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <string>
#include <string_view>

namespace paradyse {

// The most bytes of one quoted value a message echoes; a longer one is cut there and ends "... (N bytes)".
inline constexpr std::size_t kMaxEchoedBytes = 160;

// `s` with every byte that is not printable ASCII written as \xNN (a message must not hold a NUL, which would cut
// it, nor raw binary), and, when longer than `most` bytes, only its first `most` bytes followed by an ellipsis and
// its whole length: "aaaa... (131072 bytes)".
inline std::string printable(std::string_view s, std::size_t most = kMaxEchoedBytes) {
  std::string out;
  const std::string_view shown = s.substr(0, most);
  for (const char c : shown) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7f) out += c;
    else out += fmt::format("\\x{:02x}", byte);
  }
  if (shown.size() < s.size()) out += fmt::format("... ({} bytes)", s.size());
  return out;
}

// The most bytes of one word (a run without a space) a whole message may hold before bounded_message clips it.
inline constexpr std::size_t kMaxMessageWordBytes = 4 * kMaxEchoedBytes;

// `message` with every word (a run of bytes without a space) longer than kMaxMessageWordBytes clipped as printable
// clips a value: its first kMaxEchoedBytes bytes, "... (N bytes)". Every paradyse::Error passes through it, so a
// message that echoes a huge value without printable (a 100000-byte path in a file error) stays bounded too.
inline std::string bounded_message(std::string_view message) {
  std::string out;
  std::size_t from = 0;
  while (from < message.size()) {
    const std::size_t space = message.find(' ', from);
    const std::size_t end = space == std::string_view::npos ? message.size() : space;
    const std::string_view word = message.substr(from, end - from);
    if (word.size() > kMaxMessageWordBytes) out += printable(word);
    else out += word;
    if (end < message.size()) out += ' ';
    from = end + 1;
  }
  return out;
}

}  // namespace paradyse
