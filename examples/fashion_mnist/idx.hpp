// Reading MNIST-style IDX files (optionally gzip-compressed), as shipped by Debian's
// dataset-fashion-mnist package. Errors are linum::IoError with the file name and what is wrong.
#pragma once

#include <linum/core/array.hpp>

#include <filesystem>
#include <string>

namespace fashion {

struct Dataset {
  linum::Array images;  // float32 [N, 28, 28, 1], scaled to [0, 1]
  linum::Array labels;  // int32 [N]
};

// Loads `<dir>/<prefix>-images-idx3-ubyte[.gz]` and `<dir>/<prefix>-labels-idx1-ubyte[.gz]`
// (prefix "train" or "t10k").
Dataset load_split(const std::filesystem::path& dir, const std::string& prefix);

// Writes a split in the same format (gzip); used by the tests to make a small synthetic dataset.
void write_split(const std::filesystem::path& dir, const std::string& prefix, const linum::Array& images_u8_as_f32,
                 const linum::Array& labels);

}  // namespace fashion
