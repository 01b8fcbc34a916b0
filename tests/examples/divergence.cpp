// train_gpt's divergence stop (examples/train_gpt/divergence.hpp): a non-finite loss is named as such with its step
// ("step 3: the training loss is nan (not a finite number ..."), an exploding one with its step and the limit, a healthy one passes.
#include "../../examples/train_gpt/divergence.hpp"

#include <doctest/doctest.h>

#include <limits>
#include <optional>
#include <string>

using paradyse::examples::divergence;

TEST_CASE("train_gpt divergence: a NaN or infinite loss is named with its step; an exploding one with the limit") {
  CHECK_FALSE(divergence(5.5, 1, 256, 1e-3, 1e-3).has_value());
  const std::optional<std::string> nan = divergence(std::numeric_limits<double>::quiet_NaN(), 3, 256, 2e-3, 3e-3);
  REQUIRE(nan.has_value());
  CHECK(nan->find("step 3: the training loss is nan (not a finite number: a NaN or an infinity reached the loss): "
                  "training diverged, most likely from the learning rate (0.002 at this step, --lr 0.003") !=
        std::string::npos);
  CHECK(nan->find("or from a non-finite value in the input or the weights") != std::string::npos);
  const std::optional<std::string> inf = divergence(std::numeric_limits<double>::infinity(), 7, 256, 2e-3, 3e-3);
  REQUIRE(inf.has_value());
  CHECK(inf->find("step 7: the training loss is inf (not a finite number") != std::string::npos);
  const std::optional<std::string> big = divergence(343951, 5, 256, 100, 100);
  REQUIRE(big.has_value());
  CHECK(big->find("step 5: the training loss is 343951 (above 4 x ln(256) = 22.18") != std::string::npos);
  CHECK(big->find("training diverged, most likely from the learning rate (100 at this step, --lr 100") !=
        std::string::npos);
}
