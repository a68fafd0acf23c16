// lift::checkpoint_sequential: nn::Sequential in `segments` checkpointed segments (PyTorch's
// torch.utils.checkpoint.checkpoint_sequential, for a list of modules).
//
//   lift::checkpoint_sequential net{4, nn::Dense{.features = 512}, nn::gelu, ...};   // 4 segments
//   Array y = s(net, x);
//
// The layers are split into `segments` runs of ceil(n / segments) consecutive entries; every run
// but the last is checkpointed (keeps only its input; recomputed in the backward pass), the last
// runs plainly, as PyTorch does. Layers are named as in nn::Sequential ("layers_<i>" under
// "Sequential_<k>"), so variable dicts are interchangeable with nn::Sequential's, and gradients are
// bitwise the same. Every layer maps an Array to an Array.
#pragma once

#include <linum/lift/remat.hpp>
#include <linum/nn/sequential.hpp>

#include <algorithm>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

namespace linum::lift {

template <class... Layers>
struct checkpoint_sequential {
  static_assert(sizeof...(Layers) > 0, "lift::checkpoint_sequential needs at least one layer");
  static constexpr std::string_view module_name = "Sequential";

  int segments = 1;
  std::tuple<Layers...> layers;
  CheckpointOptions options{};  // the policy of the checkpointed segments

  checkpoint_sequential(int segment_count, Layers... ls) : segments(segment_count), layers(std::move(ls)...) {}

  Array operator()(Scope& s, const Array& x) const {
    constexpr int n = static_cast<int>(sizeof...(Layers));
    if (segments < 1)
      throw ValueError(linum::detail::cat("lift::checkpoint_sequential at '", s.path_str(), "': segments must be at least 1, got ",
                                          segments));
    const int per = (n + segments - 1) / segments;
    Array h = x;
    for (int a = 0; a < n; a += per) {
      const int b = std::min(n, a + per);
      if (b == n) return run_range(*this, s, a, b, h);  // the last segment runs plainly
      const checkpoint_sequential self = *this;          // the recomputation may outlive this call
      detail::ScopedBody body = [self, a, b, h](Scope& inner) { return std::vector<Array>{run_range(self, inner, a, b, h)}; };
      h = detail::lifted_run(s, body, options, LiftFilters{}, {h}).front();
    }
    return h;
  }

 private:
  // Layers [a, b) of `net` in scope `s`, each module in its child scope "layers_<i>".
  static Array run_range(const checkpoint_sequential& net, Scope& s, int a, int b, Array h) {
    auto one = [&]<std::size_t I>(std::integral_constant<std::size_t, I>) {
      if (static_cast<int>(I) >= a && static_cast<int>(I) < b)
        h = nn::sequential_detail::call_sequential_layer<I>(std::get<I>(net.layers), s, h);
    };
    [&]<std::size_t... Is>(std::index_sequence<Is...>) { (one(std::integral_constant<std::size_t, Is>{}), ...); }(
        std::index_sequence_for<Layers...>{});
    return h;
  }
};

template <class... Layers>
checkpoint_sequential(int, Layers...) -> checkpoint_sequential<Layers...>;

}  // namespace linum::lift
