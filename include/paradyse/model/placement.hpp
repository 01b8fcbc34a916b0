// paradyse/model/placement.hpp: where a model's weights live. Weights are drawn (seeded streams) and loaded
// (checkpoints, global weights) on the host; a model over a device backend (ops::Cuda) places them in the calling
// thread's tracker, its device memory, once, when it is built. Over ops::Cpu nothing moves.
//
//   weights_.push_back(drawn_on_host<Backend>([&] { return init_shard(config, ranks, rank, seed); }));
#pragma once

#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/moe/moe_config.hpp"
#include "paradyse/ops/backend.hpp"

#include <utility>

namespace paradyse {

// A host tensor's copy in the calling thread's tracker, through the backend (host -> device over ops::Cuda).
template <class Backend>
Tensor<float> placed(const Tensor<float>& host) {
  Tensor<float> t(host.shape());
  Backend::copy(host.view(), t.view());
  return t;
}

// The same weights in the calling thread's tracker (metadata kept, every tensor copied).
template <class Backend>
LayerWeights placed(LayerWeights host) {
  host.attention.packed = placed<Backend>(host.attention.packed);
  host.mlp.packed = placed<Backend>(host.mlp.packed);
  host.norms.packed = placed<Backend>(host.norms.packed);
  return host;
}
template <class Backend>
MoeShard placed(MoeShard host) {
  for (Tensor<float>* t : {&host.router, &host.expert_in, &host.expert_out, &host.shared_in, &host.shared_out,
                           &host.shared_gate})
    *t = placed<Backend>(*t);
  return host;
}

// make() run with a host tracker current (it writes the weights on the host), its result placed where Backend
// computes; over a host backend simply make().
template <class Backend, class Make>
auto drawn_on_host(Make&& make) {
  if constexpr (!ops::on_device<Backend>) {
    return make();
  } else {
    MemoryTracker host;  // the staged weights keep its counts alive until they are freed below
    auto staged = [&] {
      ScopedTracker scope(host);
      return make();
    }();
    return placed<Backend>(std::move(staged));
  }
}

// Sets every element of a model state tensor to zero in whatever space it lives (gradients between steps).
template <class Backend>
void zero_state(Tensor<float>& t) {
  if (t.numel() > 0) Backend::fill(t.view(), 0.0f);
}
template <class Backend>
void zero_state(LayerWeights& w) {
  zero_state<Backend>(w.attention.packed);
  zero_state<Backend>(w.mlp.packed);
  zero_state<Backend>(w.norms.packed);
}
template <class Backend>
void zero_state(MoeShard& s) {
  for (Tensor<float>* t : {&s.router, &s.expert_in, &s.expert_out, &s.shared_in, &s.shared_out, &s.shared_gate})
    zero_state<Backend>(*t);
}

}  // namespace paradyse
