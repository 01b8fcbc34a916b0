// paradyse/core/printable.hpp: text from a file or a user, made safe to quote in an error message.
#pragma once

#include <fmt/format.h>

#include <string>
#include <string_view>

namespace paradyse {

// `s` with every byte that is not printable ASCII written as \xNN: a message must not hold a NUL (it would cut
// the message) nor raw binary.
inline std::string printable(std::string_view s) {
  std::string out;
  for (const char c : s) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7f) out += c;
    else out += fmt::format("\\x{:02x}", byte);
  }
  return out;
}

}  // namespace paradyse
