#include "paradyse/core/error.hpp"

#include <doctest/doctest.h>

#include <string>

using namespace paradyse;

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
