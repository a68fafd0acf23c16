// The pieces of the safetensors reader (safetensors.cpp) that datasets::FileDataset reads its
// shards with: the header checked on its own (the data section's bytes not needed, only its size),
// and elements of one tensor converted from a range of its bytes.
#pragma once

#include <linum/core/dtype.hpp>
#include <linum/train/io/serialization_internal.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace linum::safetensors::internal {

// One tensor of a header: its file dtype, dimensions and byte range within the data section.
struct Entry {
  std::string name;
  const serialization::internal::DTypeInfo* dtype = nullptr;
  std::vector<std::int64_t> dims;
  std::uint64_t begin = 0, end = 0;
};

// A checked header: the tensors in the header's order and the "__metadata__" strings.
struct Layout {
  std::vector<Entry> entries;
  std::map<std::string, std::string> metadata;
};

// The header length the first 8 bytes give, checked against the file's size (IoError naming
// `source` when the file is shorter than 8 bytes or the header runs past its end).
std::uint64_t header_length(std::span<const std::uint8_t> first_bytes, std::uint64_t file_size, std::string_view source);
// The header's JSON text checked entry by entry, and the entries' ranges checked to tile a data
// section of `data_size` bytes. IoError naming `source` and the tensor.
Layout parse_header(std::string_view text, std::uint64_t data_size, std::string_view source);

// The entry's dtype as the header names it ("F32", "BF16", "U8", ...).
const char* file_dtype_name(const Entry& e);
// The dtype a tensor of this entry is read as (BF16 kept, floats to f32, integers to i32).
DType array_dtype(const Entry& e);
// `count` elements of e's file dtype at `src` converted into `dst` (array_dtype(e) elements).
// IoError naming the tensor for a value the conversion cannot hold (an int64 past int32, ...).
void read_elements(std::string_view source, const Entry& e, const std::uint8_t* src, std::size_t count, void* dst);

// A whole file mapped read-only, unmapped on destruction. IoError naming the file.
class MappedFile {
 public:
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  std::span<const std::uint8_t> bytes() const;

 private:
  void* addr_ = reinterpret_cast<void*>(-1);  // MAP_FAILED
  std::size_t size_ = 0;
};

}  // namespace linum::safetensors::internal
