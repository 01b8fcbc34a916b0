// tests/support/error_of.hpp: what a call's refusal says, for tests of error messages.
#pragma once

#include <string>

#include "paradyse/core/error.hpp"

namespace paradyse::testing {

// The message of the paradyse::Error that f() throws, or "accepted" if it returns.
inline std::string error_of(auto&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "accepted";
}

}  // namespace paradyse::testing
