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
#include "paradyse/strategy/ring_tp2d.hpp"
#include "paradyse/strategy/switchable.hpp"
#include "paradyse/strategy/tp2d.hpp"
#include "paradyse/strategy/ulysses_z.hpp"

namespace paradyse {

template <class Backend = ops::Cpu>
using AllStrategies =
    Switchable<MegatronTS<Backend>, UlyssesZ<Backend>, MegatronCZ<Backend>, METP<Backend>, ColossalZ<Backend>>;

// The five, MegatronRing, Tp2d and RingTp2d: the list of a training mesh's stage group (train_gpt --mesh).
// MegatronRing computes over a group factorised cp x tp (SublayerContext::tp_inner, strategy/megatron_ring.hpp), Tp2d
// over a group that is a tp_x x tp_y grid (SublayerContext::tp_x, strategy/tp2d.hpp), RingTp2d over cp x (tp_x x tp_y)
// (both set, tp_x dividing tp_inner: strategy/ring_tp2d.hpp); each runs only where its factorisation is set (its
// supports() rules it out elsewhere), so none is in AllStrategies, whose every member runs on any group the unified
// layout allows. The first seven keep their indices.
template <class Backend = ops::Cpu>
using MeshStrategies = Switchable<MegatronTS<Backend>, UlyssesZ<Backend>, MegatronCZ<Backend>, METP<Backend>,
                                  ColossalZ<Backend>, MegatronRing<Backend>, Tp2d<Backend>, RingTp2d<Backend>>;

}  // namespace paradyse
