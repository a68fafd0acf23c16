// Sequential: modules (and plain functions) applied one after another, as Flax's `nn.Sequential`.
//
//   nn::Sequential mlp{nn::Dense{.features = 64}, nn::relu, nn::Dense{.features = 10}};
//   Array y = s(mlp, x);       // children "layers_0" and "layers_2" under "Sequential_0"
//
// As in Flax, layer i that is a module runs in a child scope named "layers_<i>" (i counts every
// entry, functions included, because Flax names the modules of its `layers` list by position);
// a plain function (Array -> Array) is simply called. The call's arguments go to the first layer,
// each later layer receives the previous output.
#pragma once

#include <linum/core/array.hpp>
#include <linum/modules/scope.hpp>

#include <concepts>
#include <cstddef>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace linum::nn {

namespace sequential_detail {
// Calls entry I of a layer list: a module in child scope "layers_<I>", or a plain function. Shared
// with lift::checkpoint_sequential, whose dicts must match Sequential's.
template <std::size_t I, class L, class... Args>
decltype(auto) call_sequential_layer(const L& layer, Scope& s, Args&&... args) {
  if constexpr (std::invocable<const L&, Scope&, Args...>)
    return s("layers_" + std::to_string(I), layer, std::forward<Args>(args)...);
  else
    return layer(std::forward<Args>(args)...);
}
}  // namespace sequential_detail

template <class... Layers>
struct Sequential {
  static_assert(sizeof...(Layers) > 0, "nn::Sequential needs at least one layer (Flax: 'Empty Sequential module')");
  static constexpr std::string_view module_name = "Sequential";

  std::tuple<Layers...> layers;  // the layers, in call order

  // The layers to run, in order.
  explicit Sequential(Layers... ls) : layers(std::move(ls)...) {}

  // Runs every layer in turn; the arguments (at least one) go to the first one. (Requiring one keeps
  // overload checks such as std::invocable<Sequential, Scope&> from instantiating the body.)
  template <class First, class... Args>
  decltype(auto) operator()(Scope& s, First&& first, Args&&... args) const {
    return run<0>(s, std::forward<First>(first), std::forward<Args>(args)...);
  }

 private:
  template <std::size_t I, class... Args>
  decltype(auto) run(Scope& s, Args&&... args) const {
    if constexpr (I + 1 == sizeof...(Layers)) {
      return sequential_detail::call_sequential_layer<I>(std::get<I>(layers), s, std::forward<Args>(args)...);
    } else {
      auto out = sequential_detail::call_sequential_layer<I>(std::get<I>(layers), s, std::forward<Args>(args)...);
      return run<I + 1>(s, std::move(out));
    }
  }
};

// Deduces the layer types: nn::Sequential{nn::Dense{...}, nn::relu}.
template <class... Layers>
Sequential(Layers...) -> Sequential<Layers...>;

}  // namespace linum::nn
