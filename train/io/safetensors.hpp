// safetensors: the weight files PyTorch and Hugging Face users exchange (huggingface/safetensors).
//
// Layout: an 8-byte little-endian header length N, N bytes of UTF-8 JSON, then the data:
//   {"__metadata__": {"format": "pt"},                         (optional, strings only)
//    "conv.weight": {"dtype": "F32", "shape": [8, 3, 3, 3], "data_offsets": [0, 864]}, ...}
// Offsets count from the first byte after the header; the tensors must cover the data exactly
// (no gaps, no overlaps), each `end - begin` equal to its element count times its element size.
//
// Tensor names become keys of a flat Tree ("conv.weight" stays one key; PyTorch's dots are not
// split: nest_at_dots() does that). A name containing '/' (TensorFlow-style "dense/kernel") is
// placed at that path. Writing joins nested keys with the separator (default '.'), so a flat tree
// read from a file writes back the same names.
//
// dtypes read: F32; BF16 (kept as bf16); F16 (to f32, exact, or to bf16, rounded: LoadOptions);
// F64 (to f32 when every value converts exactly, else an error); I32; BOOL, U8, I8, U16, I16 (to
// int32); I64, U32, U64 (to int32 when every value fits, else an error). Anything else (F8 kinds,
// complex) is an IoError naming the tensor and the dtype. Written: F32, BF16, I32.
//
// Loading checks everything before any allocation a header could not justify, and throws IoError
// naming the file (or source) and the tensor; a truncated or corrupt file is an error, never a
// crash. load() maps the file (mmap) and copies each tensor once, from the mapping into its array;
// LoadOptions::names loads a subset without reading the other tensors' bytes. save() is atomic.
#pragma once

#include <linum/core/tree.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace linum::safetensors {

struct LoadOptions {
  // F16 tensors become float32 (exact) or, with this set, bfloat16 (rounded to nearest even).
  bool f16_as_bf16 = false;
  // Only these tensors (every name must exist); empty: all of them.
  std::vector<std::string> names;
};

// A file's tensors (a flat Tree in the file's header order) and its "__metadata__" strings.
struct Contents {
  Tree tensors;
  std::map<std::string, std::string> metadata;
};

// Reads safetensors bytes. `source` names them in error messages.
Contents from_bytes(std::span<const std::uint8_t> bytes, std::string_view source = "<safetensors bytes>",
                    const LoadOptions& options = {});
// Maps the file and reads it (see the file comment).
Contents load(const std::filesystem::path& path, const LoadOptions& options = {});

// The tree as safetensors bytes: every leaf a tensor named by its path, nested keys joined with
// `separator`; float32, bfloat16 and int32 leaves. The header is padded with spaces to a multiple
// of 8 bytes, as the reference writer does. Throws ValueError for a leaf-only tree, an empty name,
// two paths that give the same name, or a metadata key "__metadata__" cannot hold.
std::vector<std::uint8_t> to_bytes(const Tree& tensors, const std::map<std::string, std::string>& metadata = {},
                                   char separator = '.');
// Atomically writes to_bytes(...) to `path`. Throws IoError.
void save(const std::filesystem::path& path, const Tree& tensors, const std::map<std::string, std::string>& metadata = {},
          char separator = '.');

// A flat tree {"encoder.layer.0.weight": ...} nested at its dots: {"encoder": {"layer": {"0": {...}}}}.
// Throws ValueError when a name is both a tensor and a prefix of another ("a" and "a.b"), or has an
// empty component.
Tree nest_at_dots(const Tree& flat);

}  // namespace linum::safetensors
