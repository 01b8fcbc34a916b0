// paradyse/strategy/strategies.hpp: the list of strategies a model can switch between.
//
// Every strategy in the list works on the same unified layout and shards, so a plan may mix them per layer and per
// sublayer. Adding one: write strategy/<name>.hpp (the SublayerStrategy concept, strategy/policy.hpp), include it
// here and add its name to the list; nothing else changes (plans refer to strategies by name or by index).
#pragma once

#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/colossal_z.hpp"
#include "paradyse/strategy/megatron_cz.hpp"
#include "paradyse/strategy/megatron_ts.hpp"
#include "paradyse/strategy/metp.hpp"
#include "paradyse/strategy/switchable.hpp"
#include "paradyse/strategy/tp2d.hpp"
#include "paradyse/strategy/ulysses_z.hpp"

namespace paradyse {

template <class Backend = ops::Cpu>
using AllStrategies =
    Switchable<MegatronTS<Backend>, UlyssesZ<Backend>, MegatronCZ<Backend>, METP<Backend>, ColossalZ<Backend>>;

// The same with 2-D tensor parallelism (strategy/tp2d.hpp) appended: the list of a stage group that is a tp_x x tp_y
// grid (SublayerContext::tp_x). Tp2d runs only where a grid is set (its supports() refuses a group without one), so
// it sits in a list of its own rather than in AllStrategies, whose users run every strategy on plain groups.
template <class Backend = ops::Cpu>
using GridStrategies = Switchable<MegatronTS<Backend>, UlyssesZ<Backend>, MegatronCZ<Backend>, METP<Backend>,
                                  ColossalZ<Backend>, Tp2d<Backend>>;

}  // namespace paradyse
