// tests/support/temp_folder.hpp: a fresh folder under the system's temporary folder, removed with everything in it at
// the end of the scope.
//
//   const paradyse::testing::TempFolder folder("paradyse_cache");   // folder.path: /tmp/paradyse_cache_XXXXXX
#pragma once

#include <doctest/doctest.h>

#include <stdlib.h>

#include <filesystem>
#include <string>
#include <system_error>

namespace paradyse::testing {

struct TempFolder {
  std::filesystem::path path;
  explicit TempFolder(const std::string& prefix = "paradyse") {
    std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "_XXXXXX")).string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path = pattern;
  }
  TempFolder(const TempFolder&) = delete;
  TempFolder& operator=(const TempFolder&) = delete;
  ~TempFolder() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

}  // namespace paradyse::testing
