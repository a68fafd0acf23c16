// Fuzz target: the IDX reader (linum::datasets, used by the main example) (Fashion-MNIST files, plain or gzip).
// The input is split in two at a position given by its first two bytes: the image file and the
// label file. Properties: bad files are refused with linum::IoError only (gzip bombs included:
// nothing inflates past what the IDX header promises); a split that loads has images in [0, 1],
// labels in 0..9 and one label per image.
#include "fuzz_common.hpp"

#include <linum/train/data/idx.hpp>

#include <linum/core/memory.hpp>

#include <cstddef>
#include <cstdint>
#include <span>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace linum;
  if (size < 2) return 0;
  memory::LiveLimitScope cap(fuzz::kLiveLimitBytes);
  const std::size_t cut = std::min<std::size_t>(size - 2, (std::size_t{data[0]} << 8) | data[1]);
  const std::span<const std::uint8_t> image_file(data + 2, cut), label_file(data + 2 + cut, size - 2 - cut);
  try {
    const auto images = datasets::idx_bytes(image_file, "images.gz");
    const auto labels = datasets::idx_bytes(label_file, "labels.gz");
    const datasets::ArrayDataset d = datasets::parse_mnist(images, labels, "images.gz", "labels.gz");
    const Array& image = d.columns().at("image").array();
    const Array& label = d.columns().at("label").array();
    if (image.dim(0) != label.dim(0)) fuzz::fail("images and labels differ in number");
    for (float v : image.to_vector())
      if (!(v >= 0.0f && v <= 1.0f)) fuzz::fail("a pixel outside [0, 1]");
    for (std::int32_t y : label.to_vector_i32())
      if (y < 0 || y > 9) fuzz::fail("a label outside 0..9");
  } catch (const IoError&) {
  }
  return 0;
}
