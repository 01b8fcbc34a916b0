// paradyse/cli/model_flags.hpp: the model-shape flags the programs share, checked in one place: the head dimension
// is --hidden / --heads and is never truncated (issue 27: "--hidden 4097 --heads 32" trained a head dimension of 128
// in bench/emulated_switching while train_gpt and plan_trace refused it, each with its own copy of the check).
//
//   o.head_dim = cli::head_dim_of(o.hidden, o.heads);   // std::invalid_argument when --heads does not divide --hidden
//   // the program prints the message with its usage: flags.fail(e.what())
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <stdexcept>
#include <string_view>

namespace paradyse::cli {

// The head dimension of --hidden `hidden` over --heads `heads` (both >= 1): std::invalid_argument naming both flags,
// their values and the fractional head dimension when `heads` does not divide `hidden`. `alternative`: another way
// out the program offers, appended to the advice (plan_trace: "give --head-dim explicitly").
inline std::int64_t head_dim_of(std::int64_t hidden, std::int64_t heads, std::string_view alternative = {}) {
  if (hidden < 1 || heads < 1)
    throw std::invalid_argument(fmt::format("--hidden {} and --heads {} must be positive", hidden, heads));
  if (hidden % heads != 0)
    throw std::invalid_argument(fmt::format(
        "--hidden {} is not a multiple of --heads {} (head dimension {:.6g}): pick --hidden a multiple of --heads{}{}",
        hidden, heads, double(hidden) / double(heads), alternative.empty() ? "" : ", or ", alternative));
  return hidden / heads;
}

}  // namespace paradyse::cli
