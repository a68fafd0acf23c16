#include <linum/core/storage/compression.hpp>

#include <linum/core/error.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

namespace linum::storage {

std::string_view codec_name(Codec codec) {
  switch (codec) {
    case Codec::none: return "none";
    case Codec::bf16: return "bf16";
    case Codec::int8: return "int8";
    case Codec::fp8_e4m3: return "fp8_e4m3";
  }
  return "none";
}

Codec codec_from_name(std::string_view name) {
  for (Codec c : {Codec::none, Codec::bf16, Codec::int8, Codec::fp8_e4m3})
    if (codec_name(c) == name) return c;
  throw ValueError(linum::detail::cat("storage: unknown codec '", name, "'; the codecs are none, bf16, int8, fp8_e4m3"));
}

std::uint8_t float_to_e4m3(float v) {
  const std::uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const float a = std::fabs(v);
  if (!(a < 448.0f)) return sign | 0x7e;  // saturate (NaN never reaches here: compress keeps such arrays)
  if (a < 0.015625f) {                    // below 2^-6: subnormal codes, steps of 2^-9 (8 rounds to 2^-6)
    return sign | static_cast<std::uint8_t>(std::nearbyint(a * 512.0f));
  }
  const std::uint32_t u = std::bit_cast<std::uint32_t>(a);
  const std::uint32_t r = (u + ((1u << 19) - 1) + ((u >> 20) & 1u)) >> 20;  // exponent and 3 mantissa bits, rounded
  const std::uint32_t field = (r >> 3) - 127 + 7;
  const std::uint32_t code = (field << 3) | (r & 7u);
  return sign | static_cast<std::uint8_t>(std::min<std::uint32_t>(code, 0x7e));
}

namespace {
const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) {
      const int mag = c & 0x7f, e = mag >> 3, m = mag & 7;
      float v = mag == 0x7f ? std::nanf("") : e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(static_cast<float>(8 + m), e - 10);
      t[static_cast<std::size_t>(c)] = (c & 0x80) ? -v : v;
    }
    return t;
  }();
  return table;
}

std::int64_t blocks_of(std::int64_t n) { return (n + kBlock - 1) / kBlock; }
std::int64_t payload_words(std::int64_t n) { return blocks_of(n) + (n + 3) / 4; }

std::vector<float> as_floats(const Array& x) {
  if (x.dtype() == DType::f32) return std::vector<float>(x.data(), x.data() + x.numel());
  std::vector<float> out(static_cast<std::size_t>(x.numel()));
  bf16_to_f32(x.data_bf16(), out.data(), x.numel());
  return out;
}

bool all_finite(const Array& x) {
  if (x.dtype() == DType::f32) {
    const float* p = x.data();
    for (std::int64_t i = 0; i < x.numel(); ++i)
      if (!std::isfinite(p[i])) return false;
    return true;
  }
  const bfloat16* p = x.data_bf16();
  for (std::int64_t i = 0; i < x.numel(); ++i)
    if ((p[i].bits & 0x7f80u) == 0x7f80u) return false;
  return true;
}

// int8 and fp8: per block, the scale (largest magnitude / top code), then the codes.
template <class Encode>
Array encode_blocks(const Array& x, float top, Encode encode) {
  const std::int64_t n = x.numel(), nb = blocks_of(n);
  const std::vector<float> v = as_floats(x);
  Array payload = Array::empty(Shape{payload_words(n)}, DType::i32);
  auto* words = payload.mutable_data_i32();
  auto* codes = reinterpret_cast<std::uint8_t*>(words + nb);
  std::memset(codes, 0, static_cast<std::size_t>((n + 3) / 4) * 4);
  for (std::int64_t b = 0; b < nb; ++b) {
    const std::int64_t lo = b * kBlock, hi = std::min(n, lo + kBlock);
    float m = 0.0f;
    for (std::int64_t i = lo; i < hi; ++i) m = std::max(m, std::fabs(v[static_cast<std::size_t>(i)]));
    const float scale = m / top;
    words[b] = std::bit_cast<std::int32_t>(scale);
    for (std::int64_t i = lo; i < hi; ++i)
      codes[i] = scale > 0.0f ? encode(v[static_cast<std::size_t>(i)] / scale) : std::uint8_t{0};
  }
  return payload;
}

template <class Decode>
Array decode_blocks(const Compressed& c, Decode decode) {
  const std::int64_t n = c.shape.numel(), nb = blocks_of(n);
  const auto* words = c.payload.data_i32();
  const auto* codes = reinterpret_cast<const std::uint8_t*>(words + nb);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t b = 0; b < nb; ++b) {
    const float scale = std::bit_cast<float>(words[b]);
    const std::int64_t lo = b * kBlock, hi = std::min(n, lo + kBlock);
    for (std::int64_t i = lo; i < hi; ++i) v[static_cast<std::size_t>(i)] = decode(codes[i]) * scale;
  }
  Array out = Array::empty(c.shape, c.dtype);
  if (c.dtype == DType::f32) std::copy(v.begin(), v.end(), out.mutable_data());
  else f32_to_bf16(v.data(), out.mutable_data_bf16(), n);
  return out;
}

std::uint8_t int8_code(float y) { return static_cast<std::uint8_t>(static_cast<std::int8_t>(std::clamp(std::nearbyint(y), -127.0f, 127.0f))); }
float int8_value(std::uint8_t code) { return static_cast<float>(static_cast<std::int8_t>(code)); }
}  // namespace

std::int64_t compressed_size(const Shape& shape, DType dtype, Codec codec) {
  const std::int64_t n = shape.numel();
  if (!is_floating(dtype) || codec == Codec::none) return n * static_cast<std::int64_t>(dtype_size(dtype));
  if (codec == Codec::bf16) return n * 2;
  return payload_words(n) * 4;
}

Compressed compress(const Array& x, Codec codec) {
  if (!x.defined()) throw ValueError("storage::compress: got an undefined array");
  Compressed c{Codec::none, x.shape(), x.dtype(), x.detached()};
  if (codec == Codec::none || !is_floating(x.dtype()) || (codec == Codec::bf16 && x.dtype() == DType::bf16) || !all_finite(x))
    return c;
  c.codec = codec;
  switch (codec) {
    case Codec::bf16: c.payload = linum::detail::convert_float(x.detached(), DType::bf16); break;
    case Codec::int8: c.payload = encode_blocks(x, 127.0f, int8_code); break;
    case Codec::fp8_e4m3: c.payload = encode_blocks(x, 448.0f, float_to_e4m3); break;
    case Codec::none: break;
  }
  return c;
}

Array decompress(const Compressed& c) {
  switch (c.codec) {
    case Codec::none: return c.payload;
    case Codec::bf16: return linum::detail::convert_float(c.payload, c.dtype);
    case Codec::int8: return decode_blocks(c, int8_value);
    case Codec::fp8_e4m3: {
      const auto& table = e4m3_table();
      return decode_blocks(c, [&](std::uint8_t code) { return table[code]; });
    }
  }
  return c.payload;
}

float e4m3_to_float(std::uint8_t code) { return e4m3_table()[code]; }

}  // namespace linum::storage
