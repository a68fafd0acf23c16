#include <linum/core/storage/compression.hpp>
#include <linum/core/storage/transfer_stats.hpp>

#include <linum/core/error.hpp>
#include <linum/core/fp_mode.hpp>
#include <linum/core/threading.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

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

// Runs f(block) for every block, in parallel for large arrays (blocks are independent, so the
// result does not depend on the threads).
template <class F>
void for_each_block(std::int64_t nb, F f) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(linum::team_size()) if (nb >= 64 && !omp_in_parallel())
#endif
  for (std::int64_t b = 0; b < nb; ++b) {
    linum::detail::enter_compute();
    f(b);
  }
}

// Block b of x as floats: a pointer into x (float32) or into `tmp` (bfloat16, converted).
const float* block_floats(const Array& x, std::int64_t lo, std::int64_t len, float* tmp) {
  if (x.dtype() == DType::f32) return x.data() + lo;
  bf16_to_f32(x.data_bf16() + lo, tmp, len);
  return tmp;
}

// int8 and fp8: per block, the scale (largest magnitude / top code), then the codes. An undefined
// array when x holds a NaN or an infinity (found in the same pass).
template <class Encode>
Array encode_blocks(const Array& x, float top, Encode encode) {
  const std::int64_t n = x.numel(), nb = blocks_of(n);
  Array payload = Array::empty(Shape{payload_words(n)}, DType::i32);
  auto* words = payload.mutable_data_i32();
  auto* codes = reinterpret_cast<std::uint8_t*>(words + nb);
  std::memset(codes, 0, static_cast<std::size_t>((n + 3) / 4) * 4);
  std::atomic<bool> finite{true};
  for_each_block(nb, [&](std::int64_t b) {
    float tmp[kBlock];
    const std::int64_t lo = b * kBlock, len = std::min(n - lo, kBlock);
    const float* v = block_floats(x, lo, len, tmp);
    float m = 0.0f;
    for (std::int64_t i = 0; i < len; ++i) m = std::max(m, std::fabs(v[i]));
    if (!std::isfinite(m)) {  // max() drops NaNs: count them in too
      finite.store(false, std::memory_order_relaxed);
      return;
    }
    float s = 0.0f;
    for (std::int64_t i = 0; i < len; ++i) s += v[i] * 0.0f;  // NaN if any element is NaN or infinite
    if (s != 0.0f) {
      finite.store(false, std::memory_order_relaxed);
      return;
    }
    const float scale = m / top;
    words[b] = std::bit_cast<std::int32_t>(scale);
    std::uint8_t* out = codes + lo;
    if (scale > 0.0f)
      for (std::int64_t i = 0; i < len; ++i) out[i] = encode(v[i] / scale);
  });
  return finite.load() ? payload : Array();
}

template <class Decode>
Array decode_blocks(const Compressed& c, Decode decode) {
  const std::int64_t n = c.shape.numel(), nb = blocks_of(n);
  const auto* words = c.payload.data_i32();
  const auto* codes = reinterpret_cast<const std::uint8_t*>(words + nb);
  Array out = Array::empty(c.shape, c.dtype);
  float* f32 = c.dtype == DType::f32 ? out.mutable_data() : nullptr;
  bfloat16* b16 = c.dtype == DType::bf16 ? out.mutable_data_bf16() : nullptr;
  for_each_block(nb, [&](std::int64_t b) {
    float tmp[kBlock];
    const float scale = std::bit_cast<float>(words[b]);
    const std::int64_t lo = b * kBlock, len = std::min(n - lo, kBlock);
    float* v = f32 != nullptr ? f32 + lo : tmp;
    for (std::int64_t i = 0; i < len; ++i) v[i] = decode(codes[lo + i]) * scale;
    if (b16 != nullptr) f32_to_bf16(tmp, b16 + lo, len);
  });
  return out;
}

// Rounds half away from zero (|y| <= 127 by the scale): the bound m / 254 holds either way, and
// truncation vectorises where nearbyint is a library call.
inline std::uint8_t int8_code(float y) {
  const float r = std::clamp(y + (y < 0.0f ? -0.5f : 0.5f), -127.0f, 127.0f);
  return static_cast<std::uint8_t>(static_cast<std::int8_t>(static_cast<int>(r)));
}
inline float int8_value(std::uint8_t code) { return static_cast<float>(static_cast<std::int8_t>(code)); }
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
  if (codec == Codec::none || !is_floating(x.dtype()) || (codec == Codec::bf16 && x.dtype() == DType::bf16)) return c;
  const detail::TransferTimer timed(detail::Transfer::encode, static_cast<std::int64_t>(x.nbytes()));
  Array payload;
  switch (codec) {
    case Codec::bf16:
      if (all_finite(x)) payload = linum::detail::convert_float(x.detached(), DType::bf16);
      break;
    case Codec::int8: payload = encode_blocks(x, 127.0f, [](float y) { return int8_code(y); }); break;
    case Codec::fp8_e4m3: payload = encode_blocks(x, 448.0f, [](float y) { return float_to_e4m3(y); }); break;
    case Codec::none: break;
  }
  if (payload.defined()) {  // else a non-finite value: kept as it is
    c.codec = codec;
    c.payload = std::move(payload);
  }
  return c;
}

Array decompress(const Compressed& c) {
  const detail::TransferTimer timed(detail::Transfer::decode,
                                    c.codec == Codec::none ? 0 : c.shape.numel() * static_cast<std::int64_t>(dtype_size(c.dtype)));
  switch (c.codec) {
    case Codec::none: return c.payload;
    case Codec::bf16: return linum::detail::convert_float(c.payload, c.dtype);
    case Codec::int8: return decode_blocks(c, [](std::uint8_t code) { return int8_value(code); });
    case Codec::fp8_e4m3: {
      const auto& table = e4m3_table();
      return decode_blocks(c, [&](std::uint8_t code) { return table[code]; });
    }
  }
  return c.payload;
}

float e4m3_to_float(std::uint8_t code) { return e4m3_table()[code]; }

}  // namespace linum::storage
