// The MessagePack writer: trees in the layout of flax.serialization.msgpack_serialize (arrays as
// ext type 1 [shape, dtype, bytes], large arrays chunked as Flax does).
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

namespace linum::serialization {

using namespace internal;

namespace {

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
        // Readers (Flax's and Linum's) take a dict holding this key for a chunked array: a tree that
        // uses it could be written but never read back.
        if (k == "__msgpack_chunked_array__")
          throw ValueError(detail::cat("to_msgpack: the key '", k, "' at '", join_path(path, k),
                                       "' is reserved by the MessagePack variable format (it marks Flax's chunked "
                                       "arrays); rename it, or save this tree as JSON"));
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

}  // namespace

std::vector<std::uint8_t> to_msgpack(const Tree& tree, std::size_t max_chunk_bytes) {
  std::vector<std::uint8_t> out;
  out.reserve(static_cast<std::size_t>(byte_count(tree)) + 64 * (leaf_count(tree) + 1));
  MsgpackWriter w(out);
  w.tree(tree, std::string(), std::max<std::size_t>(max_chunk_bytes, 4));
  return out;
}

}  // namespace linum::serialization
