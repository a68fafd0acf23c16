// IDX files (the format of MNIST, Fashion-MNIST, EMNIST, KMNIST), plain or gzip-compressed, as
// arrays; and the MNIST layout of a split (images + labels) as a datasets::ArrayDataset.
//
//   datasets::ArrayDataset train = datasets::load_mnist("/usr/share/datasets/fashion-mnist", "train");
//   // columns "image": f32[60000, 28, 28, 1] in [0, 1], "label": i32[60000]
//   Array a = datasets::read_idx("t10k-labels-idx1-ubyte.gz", DType::i32);
//
// Only unsigned-byte IDX files (type code 0x08) are read: every published dataset in the format
// uses it. Errors are linum::IoError naming the file and what is wrong; nothing inflates past the
// size the header promises, so a corrupt or malicious file cannot exhaust memory.
#pragma once

#include <linum/core/array.hpp>
#include <linum/train/data/array_dataset.hpp>

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

namespace linum::datasets {

// The file `path` as an array of its header's shape: bytes as int32 (dtype i32) or as float32
// times `scale` (dtype f32; scale 1/255 maps pixels to [0, 1]).
Array read_idx(const std::filesystem::path& path, DType dtype = DType::f32, float scale = 1.0f);
// The same from an IDX file's decompressed bytes; `name` is for error messages.
Array parse_idx(std::span<const unsigned char> bytes, const std::string& name, DType dtype = DType::f32,
                float scale = 1.0f);

// Writes `values` (int32, or float32 holding the integers 0..255) as an unsigned-byte IDX file,
// gzip-compressed when the name ends in ".gz"; atomically (a temporary file renamed into place).
// ValueError when a value is not an integer in 0..255.
void write_idx(const std::filesystem::path& path, const Array& values);

// An IDX file's content from its bytes, which may be gzip-compressed: inflated no further than the
// size its header promises. IoError naming `name` when the gzip stream is corrupt or truncated.
std::vector<unsigned char> idx_bytes(std::span<const unsigned char> file, const std::string& name);

// The size in bytes of an unsigned-byte IDX file whose header starts `header`; 0 while the header
// is incomplete or not such a header.
std::uint64_t idx_file_size(std::span<const unsigned char> header);

// A split in MNIST's layout: `<dir>/<split>-images-idx3-ubyte[.gz]` and
// `<dir>/<split>-labels-idx1-ubyte[.gz]` (split "train" or "t10k"), as the columns
// "image" (float32 [N, rows, cols, 1] in [0, 1]) and "label" (int32 [N], each 0..9).
ArrayDataset load_mnist(const std::filesystem::path& dir, const std::string& split);
// The same from the two files' decompressed bytes; the names are for error messages.
ArrayDataset parse_mnist(std::span<const unsigned char> images, std::span<const unsigned char> labels,
                         const std::string& image_name, const std::string& label_name);
// Writes a split in that layout (gzip): `images` float32 or int32 [N, rows, cols(, 1)] holding
// 0..255, `labels` int32 [N]. For tests and for converting other data.
void write_mnist(const std::filesystem::path& dir, const std::string& split, const Array& images, const Array& labels);

}  // namespace linum::datasets
