// paradyse/core/error.hpp: the one exception type of the library, and a check helper.
//
// Every bad input throws paradyse::Error with the source location of the check and a message that names the
// offending value and what was expected. Nothing in the library aborts on user input.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <source_location>
#include <stdexcept>
#include <string>
#include <utility>

namespace paradyse {

class Error : public std::runtime_error {
public:
  explicit Error(const std::string& message, std::source_location where = std::source_location::current())
      : std::runtime_error(fmt::format("paradyse: {} [{}:{}]", message, short_file(where.file_name()), where.line())),
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

// An allocation beyond the per-rank memory cap (see core/memory.hpp).
class OutOfMemory : public Error {
public:
  OutOfMemory(std::size_t requested, std::size_t in_use, std::size_t cap,
              std::source_location where = std::source_location::current())
      : Error(fmt::format("out of memory: requested {} bytes with {} in use, cap is {} bytes", requested, in_use, cap),
              where),
        requested_(requested), in_use_(in_use), cap_(cap) {}

  std::size_t requested() const noexcept { return requested_; }
  std::size_t in_use() const noexcept { return in_use_; }
  std::size_t cap() const noexcept { return cap_; }

private:
  std::size_t requested_, in_use_, cap_;
};

// A rank failed (or a collective timed out) and this rank cannot go on.
class CommError : public Error {
public:
  using Error::Error;
};

// check(cond, "...") throws Error naming the caller's location when cond is false.
// The message is only formatted on failure: check(n > 0, "n = {} must be positive", n).
template <class... Args>
struct check {
  check(bool ok, fmt::format_string<Args...> format, Args&&... args,
        std::source_location where = std::source_location::current()) {
    if (!ok) [[unlikely]]
      throw Error(fmt::format(format, std::forward<Args>(args)...), where);
  }
};
template <class... Args>
check(bool, fmt::format_string<Args...>, Args&&...) -> check<Args...>;

}  // namespace paradyse
