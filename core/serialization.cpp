// MessagePack (Flax layout) and JSON encodings of Trees, and atomic file writing.
// See serialization.hpp for the formats.
#include <linum/core/fp_mode.hpp>
#include <linum/core/serialization.hpp>

#include <algorithm>
#include <chrono>
#include <atomic>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

namespace linum::serialization {

namespace {

constexpr int kMaxDepth = 128;  // deeper nesting in a file is treated as corrupt

// =================================================================================================
// Element conversion (little-endian file bytes <-> Linum's float32 / int32)
// =================================================================================================

template <class U>
U load_le(const std::uint8_t* p) {
  static_assert(std::is_unsigned_v<U>);
  U v = 0;
  for (std::size_t i = 0; i < sizeof(U); ++i) v = static_cast<U>(v | (static_cast<U>(p[i]) << (8 * i)));
  return v;
}

template <class U>
void store_le(U v, std::uint8_t* p) {
  for (std::size_t i = 0; i < sizeof(U); ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}

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

// The dtypes a file may hold, with their element sizes.
enum class FileDType { f32, i32, f64, f16, bf16, i64, u64, u32, i16, u16, i8, u8, boolean };

struct DTypeInfo {
  const char* name;
  FileDType type;
  std::size_t size;
};

constexpr DTypeInfo kFileDTypes[] = {
    {"float32", FileDType::f32, 4}, {"int32", FileDType::i32, 4},   {"float64", FileDType::f64, 8},
    {"float16", FileDType::f16, 2}, {"bfloat16", FileDType::bf16, 2}, {"int64", FileDType::i64, 8},
    {"uint64", FileDType::u64, 8},  {"uint32", FileDType::u32, 4},  {"int16", FileDType::i16, 2},
    {"uint16", FileDType::u16, 2},  {"int8", FileDType::i8, 1},     {"uint8", FileDType::u8, 1},
    {"bool", FileDType::boolean, 1},
};

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

// Thrown by the converters with a message that the caller prefixes with the source and path.
struct ConvertError {
  std::string message;
};

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

// Number of elements of `dims`, or nullopt if it overflows int64.
std::optional<std::int64_t> checked_numel(std::span<const std::int64_t> dims) {
  for (auto d : dims)
    if (d == 0) return 0;
  std::int64_t n = 1;
  for (auto d : dims)
    if (__builtin_mul_overflow(n, d, &n)) return std::nullopt;
  return n;
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

// =================================================================================================
// MessagePack writer
// =================================================================================================

std::size_t uint_size(std::uint64_t v) {
  if (v < 0x80) return 1;
  if (v <= 0xff) return 2;
  if (v <= 0xffff) return 3;
  if (v <= 0xffffffffu) return 5;
  return 9;
}
std::size_t array_header_size(std::size_t n) { return n <= 15 ? 1 : n <= 0xffff ? 3 : 5; }
std::size_t str_header_size(std::size_t n) { return n <= 31 ? 1 : n <= 0xff ? 2 : n <= 0xffff ? 3 : 5; }
std::size_t bin_header_size(std::size_t n) { return n <= 0xff ? 2 : n <= 0xffff ? 3 : 5; }

class MsgpackWriter {
 public:
  explicit MsgpackWriter(std::vector<std::uint8_t>& out) : out_(out) {}

  void u8(std::uint8_t v) { out_.push_back(v); }
  void be16(std::uint16_t v) { u8(static_cast<std::uint8_t>(v >> 8)), u8(static_cast<std::uint8_t>(v)); }
  void be32(std::uint32_t v) { be16(static_cast<std::uint16_t>(v >> 16)), be16(static_cast<std::uint16_t>(v)); }
  void be64(std::uint64_t v) { be32(static_cast<std::uint32_t>(v >> 32)), be32(static_cast<std::uint32_t>(v)); }
  void bytes(const void* p, std::size_t n) {
    if (n == 0) return;
    const auto* b = static_cast<const std::uint8_t*>(p);
    out_.insert(out_.end(), b, b + n);
  }

  void uint(std::uint64_t v) {
    if (v < 0x80) {
      u8(static_cast<std::uint8_t>(v));
    } else if (v <= 0xff) {
      u8(0xcc), u8(static_cast<std::uint8_t>(v));
    } else if (v <= 0xffff) {
      u8(0xcd), be16(static_cast<std::uint16_t>(v));
    } else if (v <= 0xffffffffu) {
      u8(0xce), be32(static_cast<std::uint32_t>(v));
    } else {
      u8(0xcf), be64(v);
    }
  }
  void boolean(bool b) { u8(b ? 0xc3 : 0xc2); }
  void map_header(std::size_t n) {
    if (n <= 15)
      u8(static_cast<std::uint8_t>(0x80 | n));
    else if (n <= 0xffff)
      u8(0xde), be16(static_cast<std::uint16_t>(n));
    else
      u8(0xdf), be32(static_cast<std::uint32_t>(n));
  }
  void array_header(std::size_t n) {
    if (n <= 15)
      u8(static_cast<std::uint8_t>(0x90 | n));
    else if (n <= 0xffff)
      u8(0xdc), be16(static_cast<std::uint16_t>(n));
    else
      u8(0xdd), be32(static_cast<std::uint32_t>(n));
  }
  void str(std::string_view s) {
    std::size_t n = s.size();
    if (n <= 31)
      u8(static_cast<std::uint8_t>(0xa0 | n));
    else if (n <= 0xff)
      u8(0xd9), u8(static_cast<std::uint8_t>(n));
    else if (n <= 0xffff)
      u8(0xda), be16(static_cast<std::uint16_t>(n));
    else
      u8(0xdb), be32(static_cast<std::uint32_t>(n));
    bytes(s.data(), n);
  }
  void bin_header(std::size_t n) {
    if (n <= 0xff)
      u8(0xc4), u8(static_cast<std::uint8_t>(n));
    else if (n <= 0xffff)
      u8(0xc5), be16(static_cast<std::uint16_t>(n));
    else
      u8(0xc6), be32(static_cast<std::uint32_t>(n));
  }
  void ext_header(std::size_t n, std::int8_t type) {
    switch (n) {
      case 1: u8(0xd4); break;
      case 2: u8(0xd5); break;
      case 4: u8(0xd6); break;
      case 8: u8(0xd7); break;
      case 16: u8(0xd8); break;
      default:
        if (n <= 0xff)
          u8(0xc7), u8(static_cast<std::uint8_t>(n));
        else if (n <= 0xffff)
          u8(0xc8), be16(static_cast<std::uint16_t>(n));
        else
          u8(0xc9), be32(static_cast<std::uint32_t>(n));
    }
    u8(static_cast<std::uint8_t>(type));
  }

  // An ext-1 record for `count` elements starting at element `first` of `a`, with `dims` as shape.
  void ndarray(const Array& a, std::span<const std::int64_t> dims, std::size_t first, std::size_t count,
               const std::string& path) {
    const char* dt = dtype_name(a.dtype());
    std::size_t nbytes = count * dtype_size(a.dtype());
    if (nbytes > 0xffffffffu)
      throw IoError(detail::cat("to_msgpack: ", path, ": a chunk of ", nbytes,
                                " bytes does not fit in a msgpack bin record; lower max_chunk_bytes"));
    std::size_t payload = array_header_size(3) + array_header_size(dims.size()) + str_header_size(std::strlen(dt)) +
                          std::strlen(dt) + bin_header_size(nbytes) + nbytes;
    for (auto d : dims) payload += uint_size(static_cast<std::uint64_t>(d));
    ext_header(payload, 1);
    std::size_t body = out_.size();
    array_header(3);
    array_header(dims.size());
    for (auto d : dims) uint(static_cast<std::uint64_t>(d));
    str(dt);
    bin_header(nbytes);
    const auto* src = static_cast<const std::uint8_t*>(a.raw()) + first * dtype_size(a.dtype());
    if constexpr (std::endian::native == std::endian::little) {
      bytes(src, nbytes);
    } else {
      for (std::size_t i = 0; i < count; ++i) {
        std::uint32_t v;
        std::memcpy(&v, src + 4 * i, 4);
        std::uint8_t le[4];
        store_le(v, le);
        bytes(le, 4);
      }
    }
    if (out_.size() - body != payload)
      throw std::logic_error(detail::cat("to_msgpack: internal size mismatch at ", path));
  }

  void tree(const Tree& t, const std::string& path, std::size_t max_chunk_bytes) {
    if (t.is_dict()) {
      map_header(t.size());
      for (const auto& [k, v] : t) {
        str(k);
        tree(v, join_path(path, k), max_chunk_bytes);
      }
      return;
    }
    const Array& a = t.array();
    auto dims = a.shape().vec();
    std::size_t numel = static_cast<std::size_t>(a.numel());
    std::size_t itemsize = dtype_size(a.dtype());
    if (a.nbytes() <= max_chunk_bytes) {
      ndarray(a, dims, 0, numel, path);
      return;
    }
    // Flax's _chunk: {"__msgpack_chunked_array__": True, "shape": {"0": d0, ...}, "chunks": {"0": ..., ...}}
    std::size_t chunk = std::max<std::size_t>(1, max_chunk_bytes / itemsize);
    std::size_t nchunks = (numel + chunk - 1) / chunk;
    map_header(3);
    str("__msgpack_chunked_array__");
    boolean(true);
    str("shape");
    map_header(dims.size());
    for (std::size_t i = 0; i < dims.size(); ++i) {
      str(std::to_string(i));
      uint(static_cast<std::uint64_t>(dims[i]));
    }
    str("chunks");
    map_header(nchunks);
    for (std::size_t c = 0; c < nchunks; ++c) {
      str(std::to_string(c));
      std::size_t first = c * chunk;
      std::size_t count = std::min(chunk, numel - first);
      std::int64_t d = static_cast<std::int64_t>(count);
      ndarray(a, std::span<const std::int64_t>(&d, 1), first, count, path);
    }
  }

 private:
  std::vector<std::uint8_t>& out_;
};

// =================================================================================================
// MessagePack reader
// =================================================================================================

enum class Kind { nil, boolean, uint, sint, f32, f64, str, bin, ext, array, map, never_used };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::nil: return "nil";
    case Kind::boolean: return "bool";
    case Kind::uint: return "unsigned int";
    case Kind::sint: return "int";
    case Kind::f32: return "float32";
    case Kind::f64: return "float64";
    case Kind::str: return "str";
    case Kind::bin: return "bin";
    case Kind::ext: return "ext";
    case Kind::array: return "array";
    case Kind::map: return "map";
    case Kind::never_used: return "the reserved byte 0xc1";
  }
  return "?";
}

struct Header {
  Kind kind;
  std::uint64_t u = 0;  // uint value, or the length of str/bin/ext/array/map
  std::int64_t i = 0;   // sint value
  bool b = false;
  std::int8_t ext_type = 0;
  std::span<const std::uint8_t> data;  // str/bin/ext bytes
  std::size_t offset = 0;              // where the header starts
};

// An array read from an ext payload, still pointing into the input.
struct RawArray {
  std::vector<std::int64_t> dims;
  const DTypeInfo* dtype = nullptr;
  std::span<const std::uint8_t> data;
  std::int64_t numel = 0;
};

class MsgpackReader {
 public:
  MsgpackReader(std::span<const std::uint8_t> in, std::string_view source, std::vector<std::string>& path,
                std::string_view what)
      : in_(in), source_(source), path_(path), what_(what) {}

  [[noreturn]] void fail(const std::string& msg) const {
    std::string p;
    for (const auto& k : path_) p = join_path(p, k);
    throw IoError(detail::cat("cannot load '", source_, "': ", p.empty() ? std::string() : p + ": ", msg));
  }

  std::size_t remaining() const { return in_.size() - pos_; }
  bool at_end() const { return pos_ == in_.size(); }
  std::size_t pos() const { return pos_; }

  void need(std::size_t n, const char* for_what) const {
    if (remaining() < n)
      fail(detail::cat("truncated ", what_, ": ", for_what, " at byte ", pos_, " needs ", n, " bytes but only ",
                       remaining(), " remain"));
  }

  std::uint64_t be(std::size_t n, const char* for_what) {
    need(n, for_what);
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i) v = (v << 8) | in_[pos_ + i];
    pos_ += n;
    return v;
  }

  std::span<const std::uint8_t> take(std::uint64_t n, const char* for_what) {
    if (n > remaining())
      fail(detail::cat("truncated ", what_, ": ", for_what, " at byte ", pos_, " declares ", n,
                       " bytes but only ", remaining(), " remain"));
    auto s = in_.subspan(pos_, static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return s;
  }

  Header next() {
    Header h;
    h.offset = pos_;
    std::uint8_t c = static_cast<std::uint8_t>(be(1, "a value"));
    auto with_data = [&](Kind k, std::uint64_t n) {
      h.kind = k;
      h.u = n;
      if (k == Kind::ext) h.ext_type = static_cast<std::int8_t>(be(1, "an ext type code"));
      h.data = take(n, k == Kind::str ? "a str" : k == Kind::bin ? "a bin" : "an ext record");
    };
    if (c <= 0x7f) {
      h.kind = Kind::uint, h.u = c;
    } else if (c <= 0x8f) {
      h.kind = Kind::map, h.u = c & 0x0fu;
    } else if (c <= 0x9f) {
      h.kind = Kind::array, h.u = c & 0x0fu;
    } else if (c <= 0xbf) {
      with_data(Kind::str, c & 0x1fu);
    } else if (c >= 0xe0) {
      h.kind = Kind::sint, h.i = static_cast<std::int8_t>(c);
    } else {
      switch (c) {
        case 0xc0: h.kind = Kind::nil; break;
        case 0xc1: h.kind = Kind::never_used; break;
        case 0xc2: h.kind = Kind::boolean, h.b = false; break;
        case 0xc3: h.kind = Kind::boolean, h.b = true; break;
        case 0xc4: with_data(Kind::bin, be(1, "a bin length")); break;
        case 0xc5: with_data(Kind::bin, be(2, "a bin length")); break;
        case 0xc6: with_data(Kind::bin, be(4, "a bin length")); break;
        case 0xc7: with_data(Kind::ext, be(1, "an ext length")); break;
        case 0xc8: with_data(Kind::ext, be(2, "an ext length")); break;
        case 0xc9: with_data(Kind::ext, be(4, "an ext length")); break;
        case 0xca: h.kind = Kind::f32, take(4, "a float32"); break;
        case 0xcb: h.kind = Kind::f64, take(8, "a float64"); break;
        case 0xcc: h.kind = Kind::uint, h.u = be(1, "a uint8"); break;
        case 0xcd: h.kind = Kind::uint, h.u = be(2, "a uint16"); break;
        case 0xce: h.kind = Kind::uint, h.u = be(4, "a uint32"); break;
        case 0xcf: h.kind = Kind::uint, h.u = be(8, "a uint64"); break;
        case 0xd0: h.kind = Kind::sint, h.i = static_cast<std::int8_t>(be(1, "an int8")); break;
        case 0xd1: h.kind = Kind::sint, h.i = static_cast<std::int16_t>(be(2, "an int16")); break;
        case 0xd2: h.kind = Kind::sint, h.i = static_cast<std::int32_t>(be(4, "an int32")); break;
        case 0xd3: h.kind = Kind::sint, h.i = static_cast<std::int64_t>(be(8, "an int64")); break;
        case 0xd4: with_data(Kind::ext, 1); break;
        case 0xd5: with_data(Kind::ext, 2); break;
        case 0xd6: with_data(Kind::ext, 4); break;
        case 0xd7: with_data(Kind::ext, 8); break;
        case 0xd8: with_data(Kind::ext, 16); break;
        case 0xd9: with_data(Kind::str, be(1, "a str length")); break;
        case 0xda: with_data(Kind::str, be(2, "a str length")); break;
        case 0xdb: with_data(Kind::str, be(4, "a str length")); break;
        case 0xdc: h.kind = Kind::array, h.u = be(2, "an array length"); break;
        case 0xdd: h.kind = Kind::array, h.u = be(4, "an array length"); break;
        case 0xde: h.kind = Kind::map, h.u = be(2, "a map length"); break;
        case 0xdf: h.kind = Kind::map, h.u = be(4, "a map length"); break;
        default: h.kind = Kind::never_used; break;
      }
    }
    if (h.kind == Kind::never_used) fail(detail::cat("invalid msgpack byte 0x", std::hex, int(c), std::dec, " at byte ", h.offset));
    return h;
  }

  // A non-negative integer (shape entries).
  std::int64_t dim(const Header& h, const char* what) const {
    if (h.kind == Kind::sint) {
      if (h.i < 0) fail(detail::cat(what, " is negative (", h.i, "); dimensions must be >= 0"));
      return h.i;
    }
    if (h.kind != Kind::uint) fail(detail::cat(what, " must be an integer, found ", kind_name(h.kind)));
    if (h.u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      fail(detail::cat(what, " ", h.u, " is too large"));
    return static_cast<std::int64_t>(h.u);
  }

  // Parses an ext-1/ext-3 payload: [shape, dtype name, data].
  RawArray ndarray_payload(std::span<const std::uint8_t> payload) {
    MsgpackReader r(payload, source_, path_, "array record");
    RawArray a;
    Header top = r.next();
    if (top.kind != Kind::array || top.u != 3)
      fail(detail::cat("an array record must hold a msgpack array [shape, dtype, data], found ",
                       top.kind == Kind::array ? detail::cat("an array of ", top.u, " elements") : kind_name(top.kind)));
    Header shape = r.next();
    if (shape.kind != Kind::array)
      fail(detail::cat("an array record's shape must be a msgpack array of ints, found ", kind_name(shape.kind)));
    if (shape.u > static_cast<std::uint64_t>(Shape::kMaxRank))
      fail(detail::cat("array of rank ", shape.u, " is not supported (Linum arrays have rank <= ", Shape::kMaxRank, ")"));
    for (std::uint64_t i = 0; i < shape.u; ++i) a.dims.push_back(r.dim(r.next(), "a shape dimension"));
    Header dt = r.next();
    if (dt.kind != Kind::str && dt.kind != Kind::bin)
      fail(detail::cat("an array record's dtype must be a string such as \"float32\", found ", kind_name(dt.kind)));
    std::string_view dtname(reinterpret_cast<const char*>(dt.data.data()), dt.data.size());
    a.dtype = find_dtype(dtname);
    if (!a.dtype) {
      std::string shown(dtname.substr(0, 40));
      for (auto& ch : shown)
        if (static_cast<unsigned char>(ch) < 0x20 || static_cast<unsigned char>(ch) >= 0x7f) ch = '?';
      fail(detail::cat("unsupported dtype '", shown,
                       "'; Linum reads float32 and int32, and converts bool, (u)int8/16/32/64, float16, bfloat16 "
                       "and float64 when that is lossless"));
    }
    Header data = r.next();
    if (data.kind != Kind::bin && data.kind != Kind::str)
      fail(detail::cat("an array record's data must be bin bytes, found ", kind_name(data.kind)));
    if (!r.at_end()) fail(detail::cat("an array record has ", r.remaining(), " unexpected trailing bytes"));
    auto numel = checked_numel(a.dims);
    std::uint64_t need = 0;
    if (!numel || __builtin_mul_overflow(static_cast<std::uint64_t>(*numel), a.dtype->size, &need))
      fail(detail::cat("shape ", dims_str(a.dims), " is too large"));
    if (need != data.data.size())
      fail(detail::cat("shape ", dims_str(a.dims), " needs ", need, " bytes of ", a.dtype->name, " data, found ",
                       data.data.size()));
    a.numel = *numel;
    a.data = data.data;
    return a;
  }

  RawArray ext_array(const Header& h) {
    if (h.ext_type == 2) fail("complex numbers (ext type 2) are not supported; Linum arrays are float32/int32");
    if (h.ext_type != 1 && h.ext_type != 3)
      fail(detail::cat("unknown msgpack ext type ", int(h.ext_type),
                       "; Flax arrays use ext type 1 (ndarray) or 3 (numpy scalar)"));
    return ndarray_payload(h.data);
  }

  Array to_array(const RawArray& raw) {
    Array out = Array::empty(Shape(raw.dims), target_dtype(raw.dtype->type));
    if (out.dtype() == DType::bf16) {
      copy_bf16(raw.data.data(), static_cast<std::size_t>(raw.numel), out.mutable_data_bf16());
      return out;
    }
    void* dst = out.dtype() == DType::f32 ? static_cast<void*>(out.mutable_data()) : out.mutable_data_i32();
    try {
      convert_elements(*raw.dtype, raw.data.data(), static_cast<std::size_t>(raw.numel), dst);
    } catch (const ConvertError& e) {
      fail(e.message);
    }
    return out;
  }

  std::string key(const Header& h) {
    if (h.kind != Kind::str)
      fail(detail::cat("map key at byte ", h.offset, " is a ", kind_name(h.kind), "; tree keys must be strings"));
    std::string k(reinterpret_cast<const char*>(h.data.data()), h.data.size());
    if (k.empty()) fail("empty map key; tree keys must be non-empty strings");
    if (!valid_utf8(k)) fail(detail::cat("map key at byte ", h.offset, " is not valid UTF-8"));
    if (k.find('/') != std::string::npos)
      fail(detail::cat("map key '", k, "' contains '/', which Linum uses to separate path components"));
    return k;
  }

  // A chunked array: the map header and its first key have been read.
  Tree chunked(std::uint64_t entries) {
    Header flag = next();
    if (flag.kind != Kind::boolean || !flag.b)
      fail("'__msgpack_chunked_array__' must be true in a chunked array record");
    std::optional<std::vector<std::int64_t>> dims;
    std::vector<std::pair<std::size_t, RawArray>> indexed_chunks;
    bool have_chunks = false;
    for (std::uint64_t e = 1; e < entries; ++e) {
      std::string k = key(next());
      // Reads a map {"0": v0, "1": v1, ...} calling `item(index, header)` for each value.
      auto indexed_map = [&](const char* name, auto&& item) -> std::size_t {
        Header m = next();
        if (m.kind != Kind::map) fail(detail::cat("chunked array '", name, "' must be a map, found ", kind_name(m.kind)));
        if (m.u > remaining() / 2) fail(detail::cat("truncated chunked array '", name, "'"));
        std::size_t n = static_cast<std::size_t>(m.u);
        for (std::size_t i = 0; i < n; ++i) {
          std::string ik = key(next());
          std::size_t idx = 0;
          auto [p, ec] = std::from_chars(ik.data(), ik.data() + ik.size(), idx);
          if (ec != std::errc() || p != ik.data() + ik.size() || idx >= n)
            fail(detail::cat("chunked array '", name, "' has key '", ik, "'; expected \"0\" .. \"", n - 1, "\""));
          item(idx, next());
        }
        return n;
      };
      if (k == "shape") {
        if (dims) fail("chunked array has two 'shape' entries");
        std::vector<std::optional<std::int64_t>> d;
        indexed_map("shape", [&](std::size_t idx, const Header& h) {
          if (d.size() <= idx) {
            if (idx >= static_cast<std::size_t>(Shape::kMaxRank))
              fail(detail::cat("chunked array of rank above ", Shape::kMaxRank, " is not supported"));
            d.resize(idx + 1);
          }
          if (d[idx]) fail(detail::cat("chunked array shape index ", idx, " appears twice"));
          d[idx] = dim(h, "a shape dimension");
        });
        dims.emplace();
        for (std::size_t i = 0; i < d.size(); ++i) {
          if (!d[i]) fail(detail::cat("chunked array shape is missing index ", i));
          dims->push_back(*d[i]);
        }
      } else if (k == "chunks") {
        if (have_chunks) fail("chunked array has two 'chunks' entries");
        have_chunks = true;
        indexed_map("chunks", [&](std::size_t idx, const Header& h) {
          if (h.kind != Kind::ext) fail(detail::cat("chunk ", idx, " must be an array record, found ", kind_name(h.kind)));
          indexed_chunks.emplace_back(idx, ext_array(h));
        });
      } else {
        fail(detail::cat("unexpected key '", k, "' in a chunked array record (expected 'shape' and 'chunks')"));
      }
    }
    if (!dims || !have_chunks) fail("chunked array record needs both 'shape' and 'chunks'");
    std::sort(indexed_chunks.begin(), indexed_chunks.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<RawArray> chunks;
    for (auto& [idx, raw] : indexed_chunks) {
      if (idx != chunks.size()) fail(detail::cat("chunked array chunk index ", idx, " appears twice"));
      chunks.push_back(std::move(raw));
    }
    auto numel = checked_numel(*dims);
    if (!numel) fail(detail::cat("chunked array shape ", dims_str(*dims), " is too large"));
    std::int64_t total = 0;
    const DTypeInfo* dt = nullptr;
    for (std::size_t i = 0; i < chunks.size(); ++i) {
      if (dt && chunks[i].dtype != dt)
        fail(detail::cat("chunk ", i, " has dtype ", chunks[i].dtype->name, " but chunk 0 has ", dt->name));
      if (chunks[i].dims.size() != 1)
        fail(detail::cat("chunk ", i, " has shape ", dims_str(chunks[i].dims), "; chunks are 1-D"));
      dt = chunks[i].dtype;
      total += chunks[i].numel;  // each is bounded by the input size, so no overflow
    }
    if (total != *numel)
      fail(detail::cat("chunked array of shape ", dims_str(*dims), " needs ", *numel, " elements, the chunks hold ",
                       total));
    Array out = Array::empty(Shape(*dims), dt ? target_dtype(dt->type) : DType::f32);
    auto* dst = static_cast<std::uint8_t*>(out.mutable_raw());
    std::size_t offset = 0;
    for (std::size_t i = 0; i < chunks.size(); ++i) {
      if (out.dtype() == DType::bf16) {
        copy_bf16(chunks[i].data.data(), static_cast<std::size_t>(chunks[i].numel),
                  reinterpret_cast<bfloat16*>(dst + offset));
        offset += static_cast<std::size_t>(chunks[i].numel) * 2;
        continue;
      }
      try {
        convert_elements(*dt, chunks[i].data.data(), static_cast<std::size_t>(chunks[i].numel), dst + offset);
      } catch (const ConvertError& e) {
        fail(detail::cat("chunk ", i, ": ", e.message));
      }
      offset += static_cast<std::size_t>(chunks[i].numel) * 4;
    }
    return Tree(out);
  }

  Tree value(int depth) {
    if (depth > kMaxDepth) fail(detail::cat("nesting deeper than ", kMaxDepth, " levels; the file is corrupt"));
    Header h = next();
    if (h.kind == Kind::ext) return Tree(to_array(ext_array(h)));
    if (h.kind != Kind::map)
      fail(detail::cat("found a msgpack ", kind_name(h.kind), " at byte ", h.offset,
                       "; a Linum tree holds only dicts (maps) and arrays (ext records)"));
    // Every entry takes at least two bytes, so a count beyond that is a lie: check before reserving.
    if (h.u > remaining() / 2)
      fail(detail::cat("truncated ", what_, ": a map at byte ", h.offset, " declares ", h.u, " entries but only ",
                       remaining(), " bytes remain"));
    std::vector<Tree::Entry> entries;
    entries.reserve(static_cast<std::size_t>(h.u));
    for (std::uint64_t e = 0; e < h.u; ++e) {
      std::string k = key(next());
      if (e == 0 && k == "__msgpack_chunked_array__") return chunked(h.u);
      path_.push_back(k);
      Tree v = value(depth + 1);
      path_.pop_back();
      entries.emplace_back(std::move(k), std::move(v));
    }
    try {
      return Tree::from_entries(std::move(entries));
    } catch (const ValueError& err) {
      fail(err.what());
    }
  }

 private:
  std::span<const std::uint8_t> in_;
  std::size_t pos_ = 0;
  std::string_view source_;
  std::vector<std::string>& path_;
  std::string_view what_;
};

// =================================================================================================
// JSON
// =================================================================================================

std::string nan_string(std::uint32_t bits) {
  if (bits == 0x7fc00000u) return "nan";
  char buf[32];
  std::snprintf(buf, sizeof buf, "nan(0x%08" PRIx32 ")", bits);
  return buf;
}

template <class Json>
Json float_json(float v) {
  std::uint32_t bits = std::bit_cast<std::uint32_t>(v);
  if (std::isnan(v)) return Json(nan_string(bits));
  if (std::isinf(v)) return Json(v > 0 ? "inf" : "-inf");
  // The shortest decimal for the float reads more easily than the exact double (0.1 rather than
  // 0.10000000149011612); use it when, read as a double and rounded to float, it gives the same bits.
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, v);
  double d = 0;
  auto back = std::from_chars(buf, res.ptr, d);
  if (back.ec == std::errc() && std::bit_cast<std::uint32_t>(static_cast<float>(d)) == bits) return Json(d);
  return Json(static_cast<double>(v));
}

template <class Json>
Json leaf_json(const Array& a) {
  Json j = Json::object();
  Json shape = Json::array();
  for (auto d : a.shape()) shape.push_back(d);
  j["shape"] = std::move(shape);
  j["dtype"] = dtype_name(a.dtype());
  Json data = Json::array();
  auto n = static_cast<std::size_t>(a.numel());
  data.template get_ref<typename Json::array_t&>().reserve(n);
  if (a.dtype() == DType::f32) {
    const float* p = a.data();
    for (std::size_t i = 0; i < n; ++i) data.push_back(float_json<Json>(p[i]));
  } else if (a.dtype() == DType::bf16) {  // every bfloat16 value is a float32 value: written exactly
    const bfloat16* p = a.data_bf16();
    for (std::size_t i = 0; i < n; ++i) data.push_back(float_json<Json>(static_cast<float>(p[i])));
  } else {
    const std::int32_t* p = a.data_i32();
    for (std::size_t i = 0; i < n; ++i) data.push_back(p[i]);
  }
  j["data"] = std::move(data);
  return j;
}

nlohmann::ordered_json tree_json(const Tree& t) {
  if (t.is_leaf()) return leaf_json<nlohmann::ordered_json>(t.array());
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& [k, v] : t) j[k] = tree_json(v);
  return j;
}

// JSON text: dicts indented one entry per line, each leaf on a single line.
void write_json_text(std::string& out, const Tree& t, int indent) {
  if (t.is_leaf()) {
    out += leaf_json<nlohmann::ordered_json>(t.array()).dump();
    return;
  }
  if (t.size() == 0) {
    out += "{}";
    return;
  }
  out += "{\n";
  std::size_t i = 0;
  for (const auto& [k, v] : t) {
    out.append(static_cast<std::size_t>(indent + 2), ' ');
    out += nlohmann::ordered_json(k).dump();
    out += ": ";
    write_json_text(out, v, indent + 2);
    out += ++i == t.size() ? "\n" : ",\n";
  }
  out.append(static_cast<std::size_t>(indent), ' ');
  out += "}";
}

template <class Json>
class JsonReader {
 public:
  JsonReader(std::string_view source) : source_(source) {}

  [[noreturn]] void fail(const std::string& msg) const {
    std::string p;
    for (const auto& k : path_) p = join_path(p, k);
    throw IoError(detail::cat("cannot load '", source_, "': ", p.empty() ? std::string() : p + ": ", msg));
  }

  static const char* type_name(const Json& j) { return j.type_name(); }

  float element_f32(const Json& e, std::size_t i) {
    if (e.is_number_float()) {
      double d = e.template get<double>();
      if (std::isnan(d)) return std::numeric_limits<float>::quiet_NaN();
      // Values up to FLT_MAX + half an ulp round to FLT_MAX (e.g. 3.4028235e+38); beyond, to infinity.
      constexpr double kOverflow = 0x1.ffffffp127;
      if (!std::isinf(d) && std::fabs(d) >= kOverflow)
        fail(detail::cat("data[", i, "] = ", fmt_double(d), " is outside the float32 range"));
      return static_cast<float>(d);
    }
    if (e.is_number_integer()) {
      if (e.is_number_unsigned()) return static_cast<float>(e.template get<std::uint64_t>());
      return static_cast<float>(e.template get<std::int64_t>());
    }
    if (e.is_string()) {
      const auto& s = e.template get_ref<const typename Json::string_t&>();
      if (s == "nan") return std::bit_cast<float>(0x7fc00000u);
      if (s == "inf") return std::numeric_limits<float>::infinity();
      if (s == "-inf") return -std::numeric_limits<float>::infinity();
      if (s.size() == 15 && s.compare(0, 6, "nan(0x") == 0 && s.back() == ')') {
        std::uint32_t bits = 0;
        auto [p, ec] = std::from_chars(s.data() + 6, s.data() + 14, bits, 16);
        if (ec == std::errc() && p == s.data() + 14 && std::isnan(std::bit_cast<float>(bits)))
          return std::bit_cast<float>(bits);
      }
      fail(detail::cat("data[", i, "] is the string \"", s.substr(0, 40),
                       "\"; float elements are numbers or \"nan\", \"inf\", \"-inf\", \"nan(0xXXXXXXXX)\""));
    }
    fail(detail::cat("data[", i, "] is a JSON ", type_name(e), "; float32 elements must be numbers"));
  }

  std::int32_t element_i32(const Json& e, std::size_t i) {
    if (e.is_number_unsigned()) {
      auto v = e.template get<std::uint64_t>();
      if (v > static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max()))
        fail(detail::cat("data[", i, "] = ", v, " does not fit in int32"));
      return static_cast<std::int32_t>(v);
    }
    if (e.is_number_integer()) {
      auto v = e.template get<std::int64_t>();
      if (v < std::numeric_limits<std::int32_t>::min() || v > std::numeric_limits<std::int32_t>::max())
        fail(detail::cat("data[", i, "] = ", v, " does not fit in int32"));
      return static_cast<std::int32_t>(v);
    }
    fail(detail::cat("data[", i, "] is a JSON ", type_name(e), "; int32 elements must be integers"));
  }

  Array leaf(const Json& j) {
    for (auto it = j.begin(); it != j.end(); ++it)
      if (it.key() != "shape" && it.key() != "dtype" && it.key() != "data")
        fail(detail::cat("array entry has an unexpected field '", it.key(),
                         "'; an array is {\"shape\": [...], \"dtype\": \"float32\", \"data\": [...]}"));
    if (!j.contains("shape") || !j.contains("data"))
      fail("array entry needs \"shape\", \"dtype\" and \"data\" fields");
    const auto& dt = j["dtype"].template get_ref<const typename Json::string_t&>();
    DType dtype;
    if (dt == "float32")
      dtype = DType::f32;
    else if (dt == "bfloat16")
      dtype = DType::bf16;
    else if (dt == "int32")
      dtype = DType::i32;
    else
      fail(detail::cat("unsupported dtype \"", dt.substr(0, 40), "\"; JSON files hold float32, bfloat16 or int32 arrays"));
    const Json& shape = j["shape"];
    if (!shape.is_array()) fail(detail::cat("\"shape\" must be an array of integers, found ", type_name(shape)));
    if (shape.size() > static_cast<std::size_t>(Shape::kMaxRank))
      fail(detail::cat("array of rank ", shape.size(), " is not supported (at most ", Shape::kMaxRank, ")"));
    std::vector<std::int64_t> dims;
    for (const auto& d : shape) {
      if (!d.is_number_integer()) fail(detail::cat("\"shape\" entries must be integers, found ", type_name(d)));
      if (!d.is_number_unsigned() && d.template get<std::int64_t>() < 0)
        fail(detail::cat("\"shape\" has a negative dimension ", d.template get<std::int64_t>()));
      if (d.is_number_unsigned() &&
          d.template get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        fail("\"shape\" has a dimension that is too large");
      dims.push_back(d.template get<std::int64_t>());
    }
    auto numel = checked_numel(dims);
    if (!numel) fail(detail::cat("shape ", dims_str(dims), " is too large"));
    const Json& data = j["data"];
    if (!data.is_array()) fail(detail::cat("\"data\" must be an array, found ", type_name(data)));
    if (data.size() != static_cast<std::uint64_t>(*numel))
      fail(detail::cat("shape ", dims_str(dims), " needs ", *numel, " elements of ", dt, " data, found ", data.size()));
    Array out = Array::empty(Shape(dims), dtype);
    std::size_t i = 0;
    if (dtype == DType::f32) {
      float* p = out.mutable_data();
      for (const auto& e : data) p[i] = element_f32(e, i), ++i;
    } else if (dtype == DType::bf16) {
      bfloat16* p = out.mutable_data_bf16();
      for (const auto& e : data) {
        const float v = element_f32(e, i);
        p[i] = bfloat16(v);
        if (!std::isnan(v) && std::bit_cast<std::uint32_t>(static_cast<float>(p[i])) != std::bit_cast<std::uint32_t>(v))
          fail(detail::cat("\"data\"[", i, "] = ", fmt_double(v), " is not exactly representable as bfloat16"));
        ++i;
      }
    } else {
      std::int32_t* p = out.mutable_data_i32();
      for (const auto& e : data) p[i] = element_i32(e, i), ++i;
    }
    return out;
  }

  Tree value(const Json& j, int depth) {
    if (depth > kMaxDepth) fail(detail::cat("nesting deeper than ", kMaxDepth, " levels"));
    if (!j.is_object())
      fail(detail::cat("found a JSON ", type_name(j), "; a tree holds only objects (dicts and arrays)"));
    auto dt = j.find("dtype");
    if (dt != j.end() && dt->is_string()) return Tree(leaf(j));
    std::vector<Tree::Entry> entries;
    entries.reserve(j.size());
    for (auto it = j.begin(); it != j.end(); ++it) {
      const std::string& k = it.key();
      if (k.empty()) fail("empty key; tree keys must be non-empty strings");
      if (k.find('/') != std::string::npos)
        fail(detail::cat("key '", k, "' contains '/', which Linum uses to separate path components"));
      path_.push_back(k);
      Tree v = value(it.value(), depth + 1);
      path_.pop_back();
      entries.emplace_back(k, std::move(v));
    }
    try {
      return Tree::from_entries(std::move(entries));
    } catch (const ValueError& err) {
      fail(err.what());
    }
  }

 private:
  std::string_view source_;
  std::vector<std::string> path_;
};

std::string lower_ext(const std::filesystem::path& p) {
  std::string e = p.extension().string();
  std::transform(e.begin(), e.end(), e.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return e;
}

std::string errno_str(int err) { return std::strerror(err); }

}  // namespace

// =================================================================================================
// Public API
// =================================================================================================

std::vector<std::uint8_t> to_msgpack(const Tree& tree, std::size_t max_chunk_bytes) {
  std::vector<std::uint8_t> out;
  out.reserve(static_cast<std::size_t>(byte_count(tree)) + 64 * (leaf_count(tree) + 1));
  MsgpackWriter w(out);
  w.tree(tree, std::string(), std::max<std::size_t>(max_chunk_bytes, 4));
  return out;
}

Tree from_msgpack(std::span<const std::uint8_t> bytes, std::string_view source) {
  std::vector<std::string> path;
  MsgpackReader r(bytes, source, path, "msgpack data");
  if (bytes.empty()) r.fail("the data is empty (0 bytes); expected a msgpack map");
  Tree t = r.value(0);
  if (!r.at_end())
    r.fail(detail::cat(r.remaining(), " unexpected bytes after the end of the data at byte ", r.pos()));
  return t;
}

// JSON holds numbers as doubles: converting subnormal floats to and from them must not flush.
nlohmann::ordered_json to_json(const Tree& tree) {
  IeeeSubnormalScope exact;
  return tree_json(tree);
}

Tree from_json(const nlohmann::ordered_json& json, std::string_view source) {
  IeeeSubnormalScope exact;
  JsonReader<nlohmann::ordered_json> r(source);
  return r.value(json, 0);
}

Tree from_json(const nlohmann::json& json, std::string_view source) {
  IeeeSubnormalScope exact;
  JsonReader<nlohmann::json> r(source);
  return r.value(json, 0);
}

std::vector<std::uint8_t> read_file(const std::filesystem::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError(detail::cat("cannot open '", path.string(), "' for reading: ", errno_str(errno)));
  std::vector<std::uint8_t> out;
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) out.reserve(static_cast<std::size_t>(st.st_size));
  std::uint8_t buf[1 << 16];
  while (true) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      throw IoError(detail::cat("cannot read '", path.string(), "': ", errno_str(err)));
    }
    if (n == 0) break;
    out.insert(out.end(), buf, buf + n);
  }
  ::close(fd);
  return out;
}

// Removes temporary files that earlier writers of `name` in `dir` left behind when they were killed
// mid-write: ".<name>.tmp-<pid>-<n>" whose process no longer exists and that have not been touched
// for a minute (so a writer in another PID namespace sharing the directory is left alone).
// Best effort: errors are ignored.
void remove_stale_temporaries(const std::filesystem::path& dir, const std::string& name) {
  const std::string prefix = "." + name + ".tmp-";
  std::error_code ec;
  const auto now = std::filesystem::file_time_type::clock::now();
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string file = it->path().filename().string();
    if (file.compare(0, prefix.size(), prefix) != 0) continue;
    long pid = 0;
    const auto [p, parse] = std::from_chars(file.data() + prefix.size(), file.data() + file.size(), pid);
    if (parse != std::errc() || p == file.data() + file.size() || *p != '-' || pid <= 0) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to judge)
    std::error_code time_ec;
    const auto written = std::filesystem::last_write_time(it->path(), time_ec);
    if (time_ec || now - written < std::chrono::minutes(1)) continue;
    std::filesystem::remove(it->path(), time_ec);
  }
}

void write_file_atomic(const std::filesystem::path& path, std::span<const std::uint8_t> bytes) {
  static std::atomic<unsigned> counter{0};
  std::filesystem::path dir = path.parent_path();
  if (path.filename().empty())
    throw IoError(detail::cat("cannot write '", path.string(), "': the path names a directory, not a file"));
  remove_stale_temporaries(dir.empty() ? std::filesystem::path(".") : dir, path.filename().string());
  std::filesystem::path tmp =
      (dir.empty() ? std::filesystem::path(".") : dir) /
      detail::cat(".", path.filename().string(), ".tmp-", ::getpid(), "-", counter.fetch_add(1));
  auto failure = [&](const char* step, int err) {
    return IoError(detail::cat("cannot write '", path.string(), "': ", step, ": ", errno_str(err),
                               "; the previous file (if any) is unchanged"));
  };
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) throw failure(detail::cat("creating the temporary file '", tmp.string(), "'").c_str(), errno);
  auto abandon = [&](const char* step) {
    int err = errno;
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw failure(step, err);
  };
  std::size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, std::min<std::size_t>(bytes.size() - done, std::size_t{1} << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      abandon("writing");
    }
    if (n == 0) {
      errno = EIO;
      abandon("writing");
    }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0) abandon("flushing to disk (fsync)");
  int rc = ::close(fd);
  fd = -1;
  if (rc != 0) abandon("closing");
  if (::rename(tmp.c_str(), path.c_str()) != 0) abandon("renaming the temporary file over the target");
  // Make the rename itself durable; failure here leaves a complete file, so it is not an error.
  int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
}

void save_msgpack(const std::filesystem::path& path, const Tree& tree) {
  auto bytes = to_msgpack(tree);
  write_file_atomic(path, bytes);
}

void save_json(const std::filesystem::path& path, const Tree& tree) {
  std::string text;
  try {
    IeeeSubnormalScope exact;  // subnormal floats are written exactly
    write_json_text(text, tree, 0);
  } catch (const nlohmann::json::exception& e) {  // keys that are not valid UTF-8
    throw IoError(detail::cat("cannot write '", path.string(), "' as JSON: ", e.what(),
                              "; JSON keys must be valid UTF-8"));
  }
  text += '\n';
  write_file_atomic(path, std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()));
}

Tree load_msgpack(const std::filesystem::path& path) {
  auto bytes = read_file(path);
  return from_msgpack(bytes, path.string());
}

Tree load_json(const std::filesystem::path& path) {
  auto bytes = read_file(path);
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(bytes.begin(), bytes.end());
  } catch (const nlohmann::json::exception& e) {
    throw IoError(detail::cat("cannot load '", path.string(), "': not valid JSON: ", e.what()));
  }
  return from_json(j, path.string());
}

void save(const std::filesystem::path& path, const Tree& tree) {
  std::string ext = lower_ext(path);
  if (ext == ".msgpack") return save_msgpack(path, tree);
  if (ext == ".json") return save_json(path, tree);
  throw IoError(detail::cat("cannot save '", path.string(), "': unknown extension '", ext,
                            "'; use .msgpack or .json, or call save_msgpack/save_json"));
}

Tree load(const std::filesystem::path& path) {
  std::string ext = lower_ext(path);
  if (ext == ".msgpack") return load_msgpack(path);
  if (ext == ".json") return load_json(path);
  throw IoError(detail::cat("cannot load '", path.string(), "': unknown extension '", ext,
                            "'; use .msgpack or .json, or call load_msgpack/load_json"));
}

}  // namespace linum::serialization
