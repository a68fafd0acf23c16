// Dropout, as Flax's `nn.Dropout`.
//
//   x = s(nn::Dropout{.rate = 0.1}, x, /*deterministic=*/!train);
//   auto [y, _] = apply(model, vars, {.rngs = {{"dropout", rng::key(1)}}}, x, /*train=*/true);
//
// In training each element is kept with probability 1 - rate (mask = rng::bernoulli(key, 1 - rate,
// shape), key from the "dropout" stream) and kept elements are divided by 1 - rate, so the same
// stream key gives Flax's mask. Deterministic calls and rate 0 return the input unchanged;
// rate 1 returns zeros.
#pragma once

#include <linum/core/array.hpp>
#include <linum/modules/scope.hpp>
#include <linum/rng/key.hpp>

#include <optional>
#include <string>
#include <vector>

namespace linum::nn {

// Randomly zeroes elements while training.
struct Dropout {
  double rate = 0.0;                           // probability of dropping an element, in [0, 1]
  std::vector<int> broadcast_dims;             // axes along which the mask is shared (size 1 in the mask)
  std::optional<bool> deterministic;           // set here or per call, not both (Flax's merge_param)
  std::string rng_collection = "dropout";      // the stream the mask's key comes from

  // Applies dropout to `x`. `rng` overrides the key drawn from `rng_collection`.
  void validate() const;  // ValueError naming an out-of-range field (on each call and on config load)
  Array operator()(Scope& s, const Array& x, std::optional<bool> deterministic = std::nullopt,
                   std::optional<rng::Key> rng = std::nullopt) const;
};

}  // namespace linum::nn
