// paradyse/cli/lists.hpp: a flag's comma-separated list, read strictly: every item named when it is empty, unknown or
// repeated, with the flag, the whole value and what was expected (issue 27: "--policies tp,dynamc" ran only tp,
// "--shape 1,,4" became a rank-2 shape, "--mesh dp=2,,sp=2" dropped the empty axis).
//
//   const std::vector<std::string> items = cli::list_items("--shape", text);           // "1,,4": refused (item 2)
//   cli::check_known("--policies", text, items, {"tp", "ep", "dynamic"});                // "dynamc": refused by name
//   cli::check_unique("--mesh", text, names);                                            // "dp" twice: refused
//
// Each throws std::invalid_argument with the message (the program prints it with its usage: Flags::fail).
#pragma once

#include "paradyse/core/printable.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace paradyse::cli {

// The items of `text` separated by `separator`; an empty text, an empty item (",," or a separator at either end) is
// refused naming the flag, the value and the item's position.
inline std::vector<std::string> list_items(std::string_view flag, std::string_view text, char separator = ',') {
  if (text.empty()) throw std::invalid_argument(fmt::format("{} is empty; expected a list separated by '{}'", flag, separator));
  std::vector<std::string> items;
  std::size_t from = 0;
  while (true) {
    const std::size_t end = std::min(text.find(separator, from), text.size());
    if (end == from)
      throw std::invalid_argument(fmt::format("{} \"{}\": item {} is empty; expected items separated by one '{}'", flag,
                                              printable(text), items.size() + 1, separator));
    items.emplace_back(text.substr(from, end - from));
    if (end == text.size()) break;
    from = end + 1;
  }
  return items;
}

// Refuses an item of `items` (read from `text`) that is not in `known`, naming it and the accepted ones.
inline void check_known(std::string_view flag, std::string_view text, const std::vector<std::string>& items,
                        const std::vector<std::string_view>& known) {
  for (const std::string& item : items)
    if (std::find(known.begin(), known.end(), std::string_view(item)) == known.end())
      throw std::invalid_argument(
          fmt::format("{} \"{}\": unknown item \"{}\"; expected one of {}", flag, printable(text), printable(item),
                      fmt::join(known, "|")));
}

// Refuses an item of `keys` (one per item of `text`: the item itself, or its name in name=value) that appears twice.
inline void check_unique(std::string_view flag, std::string_view text, const std::vector<std::string>& keys) {
  for (std::size_t i = 0; i < keys.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (keys[i] == keys[j])
        throw std::invalid_argument(fmt::format("{} \"{}\": \"{}\" appears twice (items {} and {}); each may appear once",
                                                flag, printable(text), printable(keys[i]), j + 1, i + 1));
}

}  // namespace paradyse::cli
