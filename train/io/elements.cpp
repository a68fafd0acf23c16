// Element conversion between a file's little-endian bytes and Linum's dtypes, shape checks and
// UTF-8 validation, shared by the MessagePack and JSON codecs.
#include <linum/core/fp_mode.hpp>
#include <linum/train/io/serialization.hpp>

#include <algorithm>
#include <bit>
#include <charconv>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>

#include <linum/train/io/serialization_internal.hpp>

namespace linum::serialization::internal {

float half_to_float(std::uint16_t h) {
  std::uint32_t sign = static_cast<std::uint32_t>(h >> 15) << 31;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal half: normalise
      int e = -1;
      do {
        mant <<= 1;
        ++e;
      } while ((mant & 0x400u) == 0);
      mant &= 0x3ffu;
      bits = sign | (static_cast<std::uint32_t>(127 - 15 - e) << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

const DTypeInfo* find_dtype(std::string_view name) {
  for (const auto& d : kFileDTypes)
    if (name == d.name) return &d;
  return nullptr;
}

DType target_dtype(FileDType t) {
  switch (t) {
    case FileDType::bf16:
      return DType::bf16;  // kept as bfloat16 (2 bytes per element), as Flax wrote it
    case FileDType::f32:
    case FileDType::f64:
    case FileDType::f16:
      return DType::f32;
    default:
      return DType::i32;
  }
}

// Little-endian 2-byte bfloat16 words from a file into an array.
void copy_bf16(const std::uint8_t* src, std::size_t count, bfloat16* dst) {
  for (std::size_t i = 0; i < count; ++i) dst[i].bits = load_le<std::uint16_t>(src + 2 * i);
}

std::string fmt_double(double d) {
  std::ostringstream os;
  os.precision(17);
  os << d;
  return os.str();
}

// Converts `count` elements of `info` from `src` into `dst` (float* or int32*), lossless or throws.
void convert_elements(const DTypeInfo& info, const std::uint8_t* src, std::size_t count, void* dst) {
  auto narrow_int = [&](auto value, std::size_t i) {
    using V = decltype(value);
    bool fits;
    if constexpr (std::is_signed_v<V>)
      fits = value >= std::numeric_limits<std::int32_t>::min() && value <= std::numeric_limits<std::int32_t>::max();
    else
      fits = value <= static_cast<V>(std::numeric_limits<std::int32_t>::max());
    if (!fits)
      throw ConvertError{detail::cat(info.name, " value ", value, " at flat index ", i,
                                     " does not fit in int32, Linum's integer dtype; convert the array in "
                                     "Python (e.g. .astype(np.int32)) if that is what you want")};
    return static_cast<std::int32_t>(value);
  };
  float* f = static_cast<float*>(dst);
  std::int32_t* n = static_cast<std::int32_t*>(dst);
  switch (info.type) {
    case FileDType::f32:
    case FileDType::i32:
      if constexpr (std::endian::native == std::endian::little) {
        if (count) std::memcpy(dst, src, count * 4);
      } else {
        for (std::size_t i = 0; i < count; ++i) n[i] = std::bit_cast<std::int32_t>(load_le<std::uint32_t>(src + 4 * i));
      }
      return;
    case FileDType::f64:
      for (std::size_t i = 0; i < count; ++i) {
        double d = std::bit_cast<double>(load_le<std::uint64_t>(src + 8 * i));
        if (std::isnan(d)) {
          f[i] = std::signbit(d) ? -std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::quiet_NaN();
          continue;
        }
        bool exact = std::isinf(d) || (std::fabs(d) <= std::numeric_limits<float>::max() &&
                                       static_cast<double>(static_cast<float>(d)) == d);
        if (!exact)
          throw ConvertError{detail::cat("float64 value ", fmt_double(d), " at flat index ", i,
                                         " is not exactly representable as float32, Linum's float dtype; "
                                         "convert the array in Python (e.g. .astype(np.float32)) first")};
        f[i] = static_cast<float>(d);
      }
      return;
    case FileDType::f16:
      for (std::size_t i = 0; i < count; ++i) f[i] = half_to_float(load_le<std::uint16_t>(src + 2 * i));
      return;
    case FileDType::bf16:
      for (std::size_t i = 0; i < count; ++i)
        f[i] = std::bit_cast<float>(static_cast<std::uint32_t>(load_le<std::uint16_t>(src + 2 * i)) << 16);
      return;
    case FileDType::i64:
      for (std::size_t i = 0; i < count; ++i)
        n[i] = narrow_int(std::bit_cast<std::int64_t>(load_le<std::uint64_t>(src + 8 * i)), i);
      return;
    case FileDType::u64:
      for (std::size_t i = 0; i < count; ++i) n[i] = narrow_int(load_le<std::uint64_t>(src + 8 * i), i);
      return;
    case FileDType::u32:
      for (std::size_t i = 0; i < count; ++i) n[i] = narrow_int(load_le<std::uint32_t>(src + 4 * i), i);
      return;
    case FileDType::i16:
      for (std::size_t i = 0; i < count; ++i) n[i] = std::bit_cast<std::int16_t>(load_le<std::uint16_t>(src + 2 * i));
      return;
    case FileDType::u16:
      for (std::size_t i = 0; i < count; ++i) n[i] = load_le<std::uint16_t>(src + 2 * i);
      return;
    case FileDType::i8:
      for (std::size_t i = 0; i < count; ++i) n[i] = static_cast<std::int8_t>(src[i]);
      return;
    case FileDType::u8:
      for (std::size_t i = 0; i < count; ++i) n[i] = src[i];
      return;
    case FileDType::boolean:
      for (std::size_t i = 0; i < count; ++i) n[i] = src[i] != 0 ? 1 : 0;
      return;
  }
}

// Number of elements of `dims`, or nullopt if the product of its nonzero dimensions overflows
// int64 (as Shape::numel: a zero dimension does not make an impossible shape acceptable).
std::optional<std::int64_t> checked_numel(std::span<const std::int64_t> dims) {
  std::int64_t n = 1;
  bool empty = false;
  for (auto d : dims) {
    if (d == 0) empty = true;
    else if (__builtin_mul_overflow(n, d, &n)) return std::nullopt;
  }
  return empty ? 0 : n;
}

std::string dims_str(std::span<const std::int64_t> dims) {
  std::string s = "(";
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  if (dims.size() == 1) s += ",";
  return s + ")";
}

// True when `s` is well-formed UTF-8 (Python's msgpack decodes str keys as UTF-8 and rejects the rest).
bool valid_utf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    auto c = static_cast<unsigned char>(s[i]);
    std::size_t n;
    std::uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      n = 1, cp = c & 0x1fu;
    } else if ((c & 0xf0) == 0xe0) {
      n = 2, cp = c & 0x0fu;
    } else if ((c & 0xf8) == 0xf0) {
      n = 3, cp = c & 0x07u;
    } else {
      return false;
    }
    if (s.size() - i <= n) return false;
    for (std::size_t k = 1; k <= n; ++k) {
      auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3fu);
    }
    static constexpr std::uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += n + 1;
  }
  return true;
}

}  // namespace linum::serialization::internal
