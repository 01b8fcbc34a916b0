// paradyse/strategy/strategies.hpp: the list of strategies a model can switch between.
//
// Every strategy in the list works on the same unified layout and shards, so a plan may mix them per layer and per
// sublayer. Adding one: write strategy/<name>.hpp (the SublayerStrategy concept, strategy/policy.hpp), include it
// here and add its name to the list; nothing else changes (plans refer to strategies by name or by index).
#pragma once

#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/colossal_z.hpp"
#include "paradyse/strategy/megatron_cz.hpp"
#include "paradyse/strategy/megatron_ring.hpp"
#include "paradyse/strategy/megatron_ts.hpp"
#include "paradyse/strategy/metp.hpp"
#include "paradyse/strategy/switchable.hpp"
#include "paradyse/strategy/ulysses_z.hpp"

namespace paradyse {

template <class Backend = ops::Cpu>
using AllStrategies =
    Switchable<MegatronTS<Backend>, UlyssesZ<Backend>, MegatronCZ<Backend>, METP<Backend>, ColossalZ<Backend>>;

// The five and MegatronRing (cp x tp inside the group, strategy/megatron_ring.hpp): the list a mesh whose stage group
// is factorised cp x tp switches between (SublayerContext::tp_inner; the first five keep their indices). MegatronRing
// runs only on a factorised group (its supports() rules it out elsewhere), so it is not in AllStrategies, whose every
// member runs on any group the unified layout allows.
template <class Backend = ops::Cpu>
using MeshStrategies = Switchable<MegatronTS<Backend>, UlyssesZ<Backend>, MegatronCZ<Backend>, METP<Backend>,
                                  ColossalZ<Backend>, MegatronRing<Backend>>;

}  // namespace paradyse
