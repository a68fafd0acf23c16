// Lossy compression of saved values (residuals): the backward pass reads a close copy of the value
// in a fraction of the memory, as activation-compressed training does.
//
//   storage::Compressed c = storage::compress(x, storage::Codec::int8);   // ~4x smaller than f32
//   Array y = storage::decompress(c);                                    // x's shape and dtype
//
// Codecs and their error, for each element x of a block of kBlock consecutive elements whose
// largest magnitude is m (the block's scale is m / 127 for int8, m / 448 for fp8):
//   bf16      |x - y| <= 2^-8 |x|                         (round to nearest even; 2 bytes/element)
//   int8      |x - y| <= m / 254                            (1 byte/element + 4 bytes/block)
//   fp8_e4m3  |x - y| <= max(2^-4 |x|, m / (448 * 1024))    (OCP E4M3: 1 byte/element + 4 bytes/block)
// (plus one float rounding of the scale product; a bfloat16 value is rounded to bfloat16 again on
// the way back). An array holding a NaN or an infinity is kept as it is: compression never turns a
// value non-finite or finite. Integer arrays are never compressed.
#pragma once

#include <linum/core/array.hpp>

#include <cstdint>
#include <string_view>

namespace linum::storage {

enum class Codec : std::uint8_t { none, bf16, int8, fp8_e4m3 };

// "none", "bf16", "int8", "fp8_e4m3".
std::string_view codec_name(Codec codec);
// The codec a name names; ValueError listing the names otherwise.
Codec codec_from_name(std::string_view name);

// Elements per scale of int8 and fp8_e4m3.
inline constexpr std::int64_t kBlock = 256;

// A compressed array: `payload` holds the codes (and the block scales first, for int8 and fp8) as
// an ordinary array, so its bytes are counted as live memory and it can be offloaded like any array.
struct Compressed {
  Codec codec = Codec::none;  // none: `payload` is the array itself
  Shape shape;
  DType dtype = DType::f32;
  Array payload;
};

// Compresses `x` with `codec` (none, an integer array or one with a non-finite element: kept as is).
Compressed compress(const Array& x, Codec codec);
// The array back: `x`'s shape and dtype, within the codec's error.
Array decompress(const Compressed& c);
// Bytes `x` takes compressed with `codec` (what compress would allocate).
std::int64_t compressed_size(const Shape& shape, DType dtype, Codec codec);

// The E4M3 code of v (|v| <= 448; rounding to nearest even, saturating) and the value of a code.
std::uint8_t float_to_e4m3(float v);
float e4m3_to_float(std::uint8_t code);

}  // namespace linum::storage
