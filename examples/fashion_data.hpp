// The examples' data: Fashion-MNIST from disk, or generated stand-ins for machines without
// dataset-fashion-mnist (the test suite runs the examples on them): 28x28 images whose class is a
// bright horizontal band's row, plus noise.
#pragma once

#include <linum/linum.hpp>

#include "flags.hpp"

#include <cstdint>
#include <filesystem>
#include <utility>

namespace examples {

// n images of class-dependent bands plus noise, in [0, 1].
inline linum::datasets::ArrayDataset synthetic(std::int64_t n, std::uint32_t seed) {
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
  return linum::datasets::ArrayDataset(linum::Tree{{"image", images}, {"label", labels}});
}

// The (train, test) splits: Fashion-MNIST from `dir`, or `synthetic` generated training images (and
// 1000 test images) when synthetic > 0; the training split cut to its first `limit` images if given.
inline std::pair<linum::datasets::ArrayDataset, linum::datasets::ArrayDataset> fashion_or_synthetic(const std::filesystem::path& dir,
                                                                                          std::int64_t synthetic,
                                                                                          std::int64_t limit) {
  linum::datasets::ArrayDataset train = synthetic > 0 ? examples::synthetic(synthetic, 1) : linum::datasets::load_mnist(dir, "train");
  linum::datasets::ArrayDataset test = synthetic > 0 ? examples::synthetic(1000, 2) : linum::datasets::load_mnist(dir, "t10k");
  if (limit > 0 && limit < train.size()) train = train.slice(0, limit);
  return {std::move(train), std::move(test)};
}

// The data flags the Fashion-MNIST examples share: --data DIR, --synthetic N, --limit N, --seed N.
struct DataFlags {
  std::filesystem::path dir = "/usr/share/datasets/fashion-mnist";
  std::int64_t synthetic = 0, limit = 0;
  int seed = 0;

  // Takes `--name value` when it is one of them.
  bool parse(const Flags& flags, const std::string& name, const std::string& value) {
    if (name == "--limit") limit = static_cast<std::int64_t>(flags.number(name, value, 0, 1e9));
    else if (name == "--seed") seed = static_cast<int>(flags.number(name, value, 0, 1 << 30));
    else if (name == "--data") dir = value;
    else if (name == "--synthetic") synthetic = static_cast<std::int64_t>(flags.number(name, value, 16, 1 << 20));
    else return false;
    return true;
  }
  std::pair<linum::datasets::ArrayDataset, linum::datasets::ArrayDataset> load() const { return fashion_or_synthetic(dir, synthetic, limit); }
};

}  // namespace examples
