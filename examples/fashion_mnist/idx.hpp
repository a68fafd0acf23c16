// Reading MNIST-style IDX files (optionally gzip-compressed), as shipped by Debian's
// dataset-fashion-mnist package. Errors are linum::IoError with the file name and what is wrong.
#pragma once

#include <linum/core/array.hpp>

#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>
#include <string>

namespace fashion {

struct Dataset {
  linum::Array images;  // float32 [N, 28, 28, 1], scaled to [0, 1]
  linum::Array labels;  // int32 [N]
};

// Loads `<dir>/<prefix>-images-idx3-ubyte[.gz]` and `<dir>/<prefix>-labels-idx1-ubyte[.gz]`
// (prefix "train" or "t10k").
Dataset load_split(const std::filesystem::path& dir, const std::string& prefix);

// The same from the two files' bytes (already decompressed); the names are for error messages.
Dataset parse_split(std::span<const unsigned char> images, std::span<const unsigned char> labels,
                    const std::string& image_name, const std::string& label_name);

// An IDX file's content from its bytes, which may be gzip-compressed: inflated no further than the
// size its header promises, so a corrupt or malicious file cannot exhaust memory. IoError naming
// `name` when the gzip stream is corrupt or truncated.
std::vector<unsigned char> idx_bytes(std::span<const unsigned char> file, const std::string& name);

// The size in bytes of an unsigned-byte IDX file whose header starts `header`; 0 while the header
// is incomplete or not such a header.
std::uint64_t idx_file_size(std::span<const unsigned char> header);

// Writes a split in the same format (gzip); used by the tests to make a small synthetic dataset.
void write_split(const std::filesystem::path& dir, const std::string& prefix, const linum::Array& images_u8_as_f32,
                 const linum::Array& labels);

}  // namespace fashion
