#include "paradyse/core/error.hpp"
#include "paradyse/core/printable.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <string_view>

using namespace paradyse;
using namespace std::string_view_literals;

TEST_CASE("check formats the message only on failure and names the caller's line") {
  CHECK_NOTHROW(check(true, "never {}", 1));
  try {
    const int heads = 7;
    check(heads % 2 == 0, "heads = {} must be divisible by p = {}", heads, 2);
    FAIL("expected an Error");
  } catch (const Error& e) {
    const std::string what = e.what();
    CHECK(what.find("heads = 7 must be divisible by p = 2") != std::string::npos);
    CHECK(what.find("error.cpp:") != std::string::npos);
    CHECK(e.where().line() > 0);
  }
}

TEST_CASE("printable: control bytes escaped, and a long value clipped with an ellipsis and its whole length") {
  // Issue 27: a 131 KB flag value was echoed whole (twice) into one message.
  CHECK(printable("a\0b\n"sv) == "a\\x00b\\x0a");
  CHECK(printable(std::string(kMaxEchoedBytes, 'x')) == std::string(kMaxEchoedBytes, 'x'));
  const std::string echoed = printable(std::string(100000, 'x'));
  CHECK(echoed == std::string(kMaxEchoedBytes, 'x') + "... (100000 bytes)");
  CHECK(printable(std::string(300, '\x01'), 4) == "\\x01\\x01\\x01\\x01... (300 bytes)");
  CHECK(printable("abcdef", 3) == "abc... (6 bytes)");
}

TEST_CASE("Error: a message echoing a huge word (a path not quoted through printable) is clipped the same way") {
  const std::string path = "/nonexistent/" + std::string(100000, 'x');
  const Error e(fmt::format("cannot open \"{}\" for reading", path));
  const std::string what = e.what();
  CHECK(what.size() < 400);
  CHECK(what.find("paradyse: cannot open \"/nonexistent/xxx") == 0);
  CHECK(what.find("... (100015 bytes) for reading [error.cpp:") != std::string::npos);
  CHECK(bounded_message("short words stay as they are") == "short words stay as they are");
  const std::string edge(kMaxMessageWordBytes, 'y');
  CHECK(bounded_message(edge + " " + edge) == edge + " " + edge);
}

TEST_CASE("error_reason: an Error quoted inside another message without its prefix and, by default, its location") {
  const Error inner("json: cannot open \"a [b].json\"");  // a bracket inside the message is kept
  CHECK(error_reason(inner) == "json: cannot open \"a [b].json\"");
  const std::string located = error_reason(inner, /*drop_location=*/false);
  CHECK(located.starts_with("json: cannot open \"a [b].json\" [error.cpp:"));
  CHECK(located.ends_with("]"));
  // Nested once: the outer message holds the inner reason and one prefix, one location.
  const Error outer(fmt::format("cluster x.json: {}", error_reason(inner)));
  const std::string whole = outer.what();
  CHECK(whole.starts_with("paradyse: cluster x.json: json: cannot open"));
  CHECK(whole.find("paradyse:", 1) == std::string::npos);
  CHECK(whole.find("[error.cpp:") == whole.rfind("[error.cpp:"));
  // Any other exception is quoted whole.
  CHECK(error_reason(std::runtime_error("range [1, 2] refused")) == "range [1, 2] refused");
}
