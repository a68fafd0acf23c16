// Generated stand-ins for Fashion-MNIST, for machines without dataset-fashion-mnist (the test suite
// runs the examples on them): 28x28 images whose class is a bright horizontal band's row, plus noise.
#pragma once

#include <linum/linum.hpp>

#include <cstdint>

namespace examples {

// n images of class-dependent bands plus noise, in [0, 1].
inline linum::data::ArrayDataset synthetic(std::int64_t n, std::uint32_t seed) {
  const linum::Array labels = linum::rng::randint(linum::rng::key(seed), linum::Shape{n}, 0, 10);
  const linum::Array noise = linum::rng::uniform(linum::rng::key(seed + 1), linum::Shape{n, 28, 28, 1}, 0.0f, 0.25f);
  linum::Array images = linum::Array::empty(linum::Shape{n, 28, 28, 1});
  for (std::int64_t i = 0; i < n; ++i)
    for (int r = 0; r < 28; ++r)
      for (int c = 0; c < 28; ++c) {
        const int k = labels.data_i32()[i];
        const std::int64_t at = (i * 28 + r) * 28 + c;
        images.mutable_data()[at] = (r >= 2 * k + 2 && r < 2 * k + 6 ? 0.7f : 0.0f) + noise.data()[at];
      }
  return linum::data::ArrayDataset(linum::Tree{{"image", images}, {"label", labels}});
}

}  // namespace examples
