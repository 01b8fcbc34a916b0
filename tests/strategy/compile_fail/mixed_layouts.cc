// Must NOT compile: a Switchable that mixes a policy computing in another unified layout (here MegatronTS's schedule
// declared over activations sharded along the hidden dim) with MegatronTS. The ctest switchable_mixed_layouts builds
// this file and passes only when the compiler stops at Switchable's static_assert with its message
// (tests/CMakeLists.txt). Not a .cpp, so the test_strategy executable does not pick it up.
#include "paradyse/strategy/megatron_ts.hpp"
#include "paradyse/strategy/switchable.hpp"

namespace {

// Activations [b, s, h] cut along h between calls: not the sequence-sharded unified layout.
struct HiddenShardedLayout {
  static constexpr int hidden_dim = 2;
};

struct HiddenTS : paradyse::MegatronTS<> {
  static constexpr std::string_view name = "HiddenTS";
  using unified_layout = HiddenShardedLayout;
};

}  // namespace

int mixed_layouts_count() { return int(paradyse::Switchable<paradyse::MegatronTS<>, HiddenTS>::count); }
