// paradyse/core/error.hpp: the one exception type of the library, and a check helper.
//
// Every bad input throws paradyse::Error with the source location of the check and a message that names the
// offending value and what was expected. Nothing in the library aborts on user input. A message stays bounded: a
// value quoted through printable() is clipped, and any other word longer than kMaxMessageWordBytes is clipped the
// same way (core/printable.hpp bounded_message).
#pragma once

#include "paradyse/core/printable.hpp"

#include <fmt/format.h>

#include <cstddef>
#include <source_location>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace paradyse {

class Error : public std::runtime_error {
public:
  explicit Error(const std::string& message, std::source_location where = std::source_location::current())
      : std::runtime_error(fmt::format("paradyse: {} [{}:{}]", bounded_message(message), short_file(where.file_name()),
                                       where.line())),
        where_(where) {}

  const std::source_location& where() const noexcept { return where_; }

private:
  static const char* short_file(const char* path) {
    const char* last = path;
    for (const char* c = path; *c; ++c)
      if (*c == '/') last = c + 1;
    return last;
  }
  std::source_location where_;
};

// An error's message as another message quotes it ("cluster h100.json: <reason>"): an Error's without its
// "paradyse: " prefix, and with `drop_location` without the " [file:line]" of the check that threw; any other
// exception's whole.
inline std::string error_reason(const std::exception& e, bool drop_location = true) {
  std::string what = e.what();
  if (!what.starts_with("paradyse: ")) return what;
  what.erase(0, 10);
  if (const std::size_t at = what.rfind(" ["); drop_location && at != std::string::npos) what.erase(at);
  return what;
}

// The most bytes any memory tracker counts (1 EiB, far beyond any device): an allocation that would take a tracker
// past it, or whose size does not even fit in 64 bits, throws OutOfMemory. Keeping every byte count below 2^60 is
// what lets the memory models add and scale them in 64-bit integers without overflow.
inline constexpr std::size_t kMaxTrackedBytes = std::size_t(1) << 60;

// An allocation beyond the per-rank memory cap (see core/memory.hpp), or beyond kMaxTrackedBytes.
class OutOfMemory : public Error {
public:
  OutOfMemory(std::size_t requested, std::size_t in_use, std::size_t cap,
              std::source_location where = std::source_location::current())
      : Error(cap >= kMaxTrackedBytes
                  ? fmt::format("out of memory: requested {} bytes with {} in use, beyond the 2^60 bytes (1 EiB) that "
                                "any memory tracker counts",
                                requested, in_use)
                  : fmt::format("out of memory: requested {} bytes with {} in use, cap is {} bytes", requested, in_use,
                                cap),
              where),
        requested_(requested), in_use_(in_use), cap_(cap) {}
  // With a message of its own (a size that does not fit in 64 bits, ...).
  OutOfMemory(const std::string& message, std::size_t requested, std::size_t in_use, std::size_t cap,
              std::source_location where = std::source_location::current())
      : Error(message, where), requested_(requested), in_use_(in_use), cap_(cap) {}

  std::size_t requested() const noexcept { return requested_; }
  std::size_t in_use() const noexcept { return in_use_; }
  std::size_t cap() const noexcept { return cap_; }

private:
  std::size_t requested_, in_use_, cap_;
};

// A rank failed (or a collective timed out) and this rank cannot go on.
class CommError : public Error {
public:
  explicit CommError(const std::string& message, std::source_location where = std::source_location::current())
      : Error(message, where) {}
};

// A format string that remembers where it was written (the default argument is evaluated at the call site).
template <class... Args>
struct LocatedFormat {
  template <class S>
  consteval LocatedFormat(const S& text, std::source_location where = std::source_location::current())
      : format(text), where(where) {}
  fmt::format_string<Args...> format;
  std::source_location where;
};

// check(cond, "...") throws Error naming the caller's location when cond is false.
// The message is only formatted on failure: check(n > 0, "n = {} must be positive", n).
template <class... Args>
inline void check(bool ok, LocatedFormat<std::type_identity_t<Args>...> format, Args&&... args) {
  if (!ok) [[unlikely]]
    throw Error(fmt::format(format.format, std::forward<Args>(args)...), format.where);
}

}  // namespace paradyse
