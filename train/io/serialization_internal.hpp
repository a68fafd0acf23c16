// Internal to train/io/: what the MessagePack and JSON codecs share. Element
// conversion between a file's little-endian bytes in any NumPy dtype and Linum's float32, bf16 and
// int32 (lossless or an error), shape checks, UTF-8 validation, and the JSON text writer the file
// functions use.
#pragma once

#include <linum/train/io/serialization.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

namespace linum::serialization::internal {

constexpr int kMaxDepth = 128;  // deeper nesting in a file is treated as corrupt

template <class U>
inline U load_le(const std::uint8_t* p) {
  static_assert(std::is_unsigned_v<U>);
  U v = 0;
  for (std::size_t i = 0; i < sizeof(U); ++i) v = static_cast<U>(v | (static_cast<U>(p[i]) << (8 * i)));
  return v;
}

template <class U>
inline void store_le(U v, std::uint8_t* p) {
  for (std::size_t i = 0; i < sizeof(U); ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}

float half_to_float(std::uint16_t h);

// The dtypes a file may hold, with their element sizes.
enum class FileDType { f32, i32, f64, f16, bf16, i64, u64, u32, i16, u16, i8, u8, boolean };

struct DTypeInfo {
  const char* name;
  FileDType type;
  std::size_t size;
};

inline constexpr DTypeInfo kFileDTypes[] = {
    {"float32", FileDType::f32, 4}, {"int32", FileDType::i32, 4},   {"float64", FileDType::f64, 8},
    {"float16", FileDType::f16, 2}, {"bfloat16", FileDType::bf16, 2}, {"int64", FileDType::i64, 8},
    {"uint64", FileDType::u64, 8},  {"uint32", FileDType::u32, 4},  {"int16", FileDType::i16, 2},
    {"uint16", FileDType::u16, 2},  {"int8", FileDType::i8, 1},     {"uint8", FileDType::u8, 1},
    {"bool", FileDType::boolean, 1},
};

const DTypeInfo* find_dtype(std::string_view name);
DType target_dtype(FileDType t);

// Thrown by the converters with a message that the caller prefixes with the source and path.
struct ConvertError {
  std::string message;
};

// Little-endian 2-byte bfloat16 words from a file into an array.
void copy_bf16(const std::uint8_t* src, std::size_t count, bfloat16* dst);
std::string fmt_double(double d);
// Converts `count` elements of `info` from `src` into `dst` (float* or int32*), lossless or throws.
void convert_elements(const DTypeInfo& info, const std::uint8_t* src, std::size_t count, void* dst);
// Number of elements of `dims`, or nullopt if it overflows int64.
std::optional<std::int64_t> checked_numel(std::span<const std::int64_t> dims);
std::string dims_str(std::span<const std::int64_t> dims);
// True when `s` is well-formed UTF-8 (Python's msgpack decodes str keys as UTF-8 and rejects the rest).
bool valid_utf8(std::string_view s);

// JSON text of a tree: dicts indented one entry per line, each leaf on a single line (json.cpp).
void write_json_text(std::string& out, const Tree& t, int indent);

}  // namespace linum::serialization::internal
