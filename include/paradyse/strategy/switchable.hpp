// paradyse/strategy/switchable.hpp: run-time choice among compile-time strategy policies.
//
// Switchable<Ps...> holds the policies, runs the one a plan chooses for each sublayer call, and keeps the saved
// state as a std::variant whose index records which strategy produced it, so backward always runs the strategy
// that ran forward. Choices are indices into the list (index_of(name) maps the names a planner uses). Because every
// strategy shares the unified layout and the same shards, a choice may change from call to call with no
// redistribution; that is checked at compile time (each policy's `unified_layout` type must be the same, a
// static_assert with its reason otherwise).
//
// Adding a strategy: write its file (strategy/policy.hpp's concept) and add its name to the list in
// strategy/strategies.hpp.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/strategy/policy.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <concepts>
#include <cstddef>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>

namespace paradyse {

// The unified layout policy P declares (P::unified_layout, strategy/policy.hpp), or NoUnifiedLayout if it declares
// none.
struct NoUnifiedLayout {};
template <class P>
struct unified_layout_of {
  using type = NoUnifiedLayout;
};
template <class P>
  requires requires { typename P::unified_layout; }
struct unified_layout_of<P> {
  using type = typename P::unified_layout;
};
template <class P>
using unified_layout_t = typename unified_layout_of<P>::type;

// Whether policies Ps... declare one and the same unified layout: what makes switching among them free.
template <class... Ps>
struct shares_unified_layout : std::false_type {};
template <class P, class... Ps>
struct shares_unified_layout<P, Ps...>
    : std::bool_constant<!std::same_as<unified_layout_t<P>, NoUnifiedLayout> &&
                         (std::same_as<unified_layout_t<Ps>, unified_layout_t<P>> && ...)> {};
template <class... Ps>
concept ShareUnifiedLayout = shares_unified_layout<Ps...>::value;

// The strategy of each sublayer of one layer, as indices into a Switchable's list.
struct SublayerChoice {
  std::size_t attention = 0;
  std::size_t mlp = 0;
  std::size_t moe = 0;  // an MoE layer's FFN strategy (moe/moe_strategies.hpp) instead of mlp; dense layers ignore it
  friend bool operator==(const SublayerChoice&, const SublayerChoice&) = default;
};

template <class... Ps>
class Switchable {
  static_assert(sizeof...(Ps) >= 1, "Switchable needs at least one strategy");
  static_assert((!std::same_as<unified_layout_t<Ps>, NoUnifiedLayout> && ...),
                "Switchable<Ps...>: every policy must declare the layout it takes and gives its tensors in between "
                "calls, `using unified_layout = SequenceShardedLayout;` (strategy/policy.hpp)");
  static_assert(!(!std::same_as<unified_layout_t<Ps>, NoUnifiedLayout> && ...) || ShareUnifiedLayout<Ps...>,
                "Switchable<Ps...>: the policies must share ONE unified layout (the same `unified_layout` type): a "
                "choice may change from call to call with no redistribution only because every policy takes and gives "
                "its tensors in that layout, so a policy that computes in another layout cannot be mixed in");

public:
  static constexpr std::size_t count = sizeof...(Ps);
  static constexpr std::array<std::string_view, count> names{Ps::name...};

  using Policy = std::variant<Ps...>;                          // one strategy, chosen
  using AttentionSaved = std::variant<typename Ps::AttentionSaved...>;  // alternative i: saved by strategy i
  using MlpSaved = std::variant<typename Ps::MlpSaved...>;

  Switchable() = default;
  explicit Switchable(Ps... policies) : policies_(std::move(policies)...) {}

  static std::string_view name(std::size_t index) {
    check_index(index);
    return names[index];
  }
  static std::size_t index_of(std::string_view name) {
    for (std::size_t i = 0; i < count; ++i)
      if (names[i] == name) return i;
    throw Error(fmt::format("no strategy named '{}'; the strategies are {}", name, fmt::join(names, ", ")));
  }
  static void check_index(std::size_t index) {
    check(index < count, "strategy index {} is out of range: there are {} strategies ({})", index, count,
          fmt::join(names, ", "));
  }

  // The chosen policy as a variant (for std::visit by code that wants the policy object itself).
  Policy select(std::size_t index) const {
    Policy chosen;
    visit_index(index, [&](auto i) { chosen.template emplace<decltype(i)::value>(std::get<decltype(i)::value>(policies_)); });
    return chosen;
  }

  // Whether strategy `index` can run this call, and why not (its own supports()).
  Support supports(std::size_t index, const SublayerContext& ctx) const {
    Support support;
    visit_index(index, [&](auto i) { support = std::get<decltype(i)::value>(policies_).supports(ctx); });
    return support;
  }
  void check_supported(std::size_t index, const SublayerContext& ctx) const { require(supports(index, ctx)); }
  // The layouts strategy `index` computes the attention / MLP sublayer in (its own attention_layouts, mlp_layouts).
  ComputeLayouts attention_layouts(std::size_t index, const SublayerContext& ctx) const {
    ComputeLayouts layouts;
    visit_index(index, [&](auto i) { layouts = std::get<decltype(i)::value>(policies_).attention_layouts(ctx); });
    return layouts;
  }
  ComputeLayouts mlp_layouts(std::size_t index, const SublayerContext& ctx) const {
    ComputeLayouts layouts;
    visit_index(index, [&](auto i) { layouts = std::get<decltype(i)::value>(policies_).mlp_layouts(ctx); });
    return layouts;
  }

  template <Communicator C>
  AttentionSaved attention_forward(std::size_t index, C& comm, const SublayerContext& ctx, const AttentionShard& w,
                                   TensorView<const float> x, TensorView<float> y) const {
    AttentionSaved saved;
    visit_index(index, [&](auto i) {
      saved.template emplace<decltype(i)::value>(std::get<decltype(i)::value>(policies_).attention_forward(comm, ctx, w, x, y));
    });
    return saved;
  }
  template <Communicator C>
  void attention_backward(C& comm, const SublayerContext& ctx, const AttentionShard& w, AttentionSaved& saved,
                          TensorView<const float> dy, TensorView<float> dx, AttentionShard& grad) const {
    visit_index(saved.index(), [&](auto i) {
      std::get<decltype(i)::value>(policies_).attention_backward(comm, ctx, w, std::get<decltype(i)::value>(saved), dy, dx, grad);
    });
  }
  // Selective recomputation: frees the attention core's own tensors in `saved` (its output, lse, probabilities), and
  // re-runs the core from what `saved` kept (q, k, v) before the backward. A strategy without the pair
  // (drop_attention_core, recompute_attention_core) is refused by name.
  void drop_attention_core(AttentionSaved& saved) const {
    visit_index(saved.index(), [&](auto i) {
      using P = std::tuple_element_t<decltype(i)::value, std::tuple<Ps...>>;
      if constexpr (requires(typename P::AttentionSaved& s) { P::drop_attention_core(s); })
        P::drop_attention_core(std::get<decltype(i)::value>(saved));
      else
        throw Error(fmt::format("selective recomputation: strategy {} cannot re-run its attention core (it has no "
                                "drop_attention_core / recompute_attention_core); use recompute none or full", P::name));
    });
  }
  template <Communicator C>
  void recompute_attention_core(C& comm, const SublayerContext& ctx, const AttentionShard& w,
                                AttentionSaved& saved) const {
    visit_index(saved.index(), [&](auto i) {
      using P = std::tuple_element_t<decltype(i)::value, std::tuple<Ps...>>;
      if constexpr (requires(typename P::AttentionSaved& s) { P::drop_attention_core(s); })
        std::get<decltype(i)::value>(policies_).recompute_attention_core(comm, ctx, w, std::get<decltype(i)::value>(saved));
      else
        throw Error(fmt::format("selective recomputation: strategy {} cannot re-run its attention core", P::name));
    });
  }
  template <Communicator C>
  MlpSaved mlp_forward(std::size_t index, C& comm, const SublayerContext& ctx, const MlpShard& w,
                       TensorView<const float> x, TensorView<float> y) const {
    MlpSaved saved;
    visit_index(index, [&](auto i) {
      saved.template emplace<decltype(i)::value>(std::get<decltype(i)::value>(policies_).mlp_forward(comm, ctx, w, x, y));
    });
    return saved;
  }
  template <Communicator C>
  void mlp_backward(C& comm, const SublayerContext& ctx, const MlpShard& w, MlpSaved& saved,
                    TensorView<const float> dy, TensorView<float> dx, MlpShard& grad) const {
    visit_index(saved.index(), [&](auto i) {
      std::get<decltype(i)::value>(policies_).mlp_backward(comm, ctx, w, std::get<decltype(i)::value>(saved), dy, dx, grad);
    });
  }

  template <std::size_t I>
  const auto& policy() const noexcept { return std::get<I>(policies_); }

private:
  // f(std::integral_constant<std::size_t, i>) for the runtime index i.
  template <class F>
  static void visit_index(std::size_t index, F&& f) {
    check_index(index);
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (void)((index == I ? (f(std::integral_constant<std::size_t, I>{}), true) : false) || ...);
    }(std::index_sequence_for<Ps...>{});
  }

  std::tuple<Ps...> policies_;
};

}  // namespace paradyse
