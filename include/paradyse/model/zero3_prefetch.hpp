// paradyse/model/zero3_prefetch.hpp: when a ZeRO-3 stage gathers each layer's parameters and reduce-scatters its
// gradients (model/zero3_shards.hpp), driven by the layer stack's hook (TransformerStack::set_layer_hook).
//
// With prefetch (the default), the collectives overlap the neighbouring layer's compute:
//   forward   layer l begins: its gather (posted earlier) waited for, layer l+1's posted; l's parameters freed
//             when l ends. The first layer's gather is exposed.
//   backward  layer l begins: its gather waited for, layer l-1's posted; l ends: its parameters freed, layer l+1's
//             gradient reduce-scatter (posted when l+1 ended) finished, l's posted. Layer 0's is finished at once
//             (nothing left to hide it behind).
// Each pass (a forward, a recomputation, a backward) leaves nothing in flight, so the pipeline's schedules may put
// anything between passes. At most two layers' gathered parameters are held at once (the running layer's and the
// next one's), and in the backward at most two layers' full gradients (the running layer's and the one being
// reduce-scattered). Without prefetch every collective is waited for where it is posted (one layer's parameters).
// The values are the same either way: the same collectives, in the same order on every rank, on the same data.
//
//   Zero3Schedule<C> schedule(layers, prefetch);  // layers[l]: layer l's tensors and the groups they are sharded over
//   stack.set_layer_hook([&](int l, auto use, bool begin) { schedule.on_layer(l, use == Use::backward, begin); });
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/model/zero3_shards.hpp"

#include <cstddef>
#include <utility>
#include <vector>

namespace paradyse {

template <Communicator C>
class Zero3Schedule {
public:
  // One sharded tensor of a layer: the group it is sharded over, and whether the schedule reduces its gradient after
  // the layer's backward (false: the caller allocates and reduces it around the whole backward, as the stage does
  // the norms', whose gradients the stack writes after every layer's backward).
  struct Member {
    Zero3Tensor* tensor;
    C* group;
    bool gradient;
  };
  using Layer = std::vector<Member>;

  Zero3Schedule() = default;
  Zero3Schedule(std::vector<Layer> layers, bool prefetch) : layers_(std::move(layers)), prefetch_(prefetch) {}

  // From the next pass on (nothing may be in flight: between passes).
  void set_prefetch(bool on) {
    check(idle(), "Zero3Schedule::set_prefetch: a pass is in flight");
    prefetch_ = on;
  }
  bool prefetch() const noexcept { return prefetch_; }
  bool idle() const noexcept { return gathering_ < 0 && reducing_ < 0; }

  // The stack's hook: layer l's forward (backward = false) or backward begins (begin) or ends.
  void on_layer(int l, bool backward, bool begin) {
    check(l >= 0 && std::size_t(l) < layers_.size(), "Zero3Schedule: layer {} of {}", l, layers_.size());
    Layer& layer = layers_[std::size_t(l)];
    if (begin) {
      check(gathering_ < 0 || gathering_ == l, "Zero3Schedule: layer {} begins while layer {}'s gather is in flight",
            l, gathering_);
      if (gathering_ == l) wait_all(gathers_);
      else for (Request& r : post_gathers(layer)) r.wait();
      gathering_ = -1;
      const int next = backward ? l - 1 : l + 1;
      if (prefetch_ && next >= 0 && std::size_t(next) < layers_.size()) {
        gathers_ = post_gathers(layers_[std::size_t(next)]);
        gathering_ = next;
      }
      if (backward)
        for (Member& m : layer)
          if (m.gradient) m.tensor->begin_gradient();
      return;
    }
    for (Member& m : layer) m.tensor->release();
    if (!backward) return;
    finish_reduces();  // layer l+1's, hidden behind this layer's backward
    for (Member& m : layer)
      if (m.gradient) reduces_.push_back(m.tensor->post_reduce_gradient(*m.group));
    reducing_ = l;
    if (!prefetch_ || l == 0) finish_reduces();
  }

private:
  static std::vector<Request> post_gathers(Layer& layer) {
    std::vector<Request> posted;
    for (Member& m : layer) posted.push_back(m.tensor->post_gather(*m.group));
    return posted;
  }
  static void wait_all(std::vector<Request>& posted) {
    for (Request& r : posted) r.wait();
    posted.clear();
  }
  void finish_reduces() {
    if (reducing_ < 0) return;
    std::size_t i = 0;
    for (Member& m : layers_[std::size_t(reducing_)])
      if (m.gradient) m.tensor->finish_reduce_gradient(reduces_[i++]);
    reduces_.clear();
    reducing_ = -1;
  }

  std::vector<Layer> layers_;
  bool prefetch_ = true;
  int gathering_ = -1;             // the layer whose gathers_ are in flight (-1: none)
  std::vector<Request> gathers_;
  int reducing_ = -1;              // the layer whose reduces_ are in flight (-1: none)
  std::vector<Request> reduces_;
};

}  // namespace paradyse
