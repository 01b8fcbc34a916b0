// tests/support/profile_refusal.hpp: what loading a hardware profile says when one field of its JSON text is changed,
// for tests of the profile's validation.
#pragma once

#include "support/error_of.hpp"

#include "paradyse/core/json.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/cost/profile_json.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <string>

namespace paradyse::testing {

// profile_from_json's message for `profile`'s JSON text with the first `from` after the key `section` (quoted, as it
// appears in the text) replaced by `to`, or "accepted".
inline std::string profile_refusal(const cost::HardwareProfile& profile, const std::string& section,
                                   const std::string& from, const std::string& to) {
  std::string text = json::dump(cost::to_json(profile));
  const std::size_t key = text.find("\"" + section + "\"");
  REQUIRE(key != std::string::npos);
  const std::size_t at = text.find(from, key);
  REQUIRE(at != std::string::npos);
  text.replace(at, from.size(), to);
  return error_of([&] { (void)cost::profile_from_json(json::parse(text)); });
}

}  // namespace paradyse::testing
