// The MessagePack reader: Flax's layout (and plain msgpack values), every length and shape checked
// against the input, errors naming the source, the path in the tree and the byte offset.
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
                       "'; Linum reads float32, bfloat16 and int32, and converts bool, (u)int8/16/32/64, float16 "
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
    if (h.ext_type == 2) fail("complex numbers (ext type 2) are not supported; Linum arrays are float32/bfloat16/int32");
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
    // Flax's nn.WeightNorm and nn.SpectralNorm name variables by paths ("Dense_1/kernel/scale" as one
    // key); Linum nests them (value() below), so each part must be a key of its own.
    if (k.find('/') != std::string::npos &&
        (k.front() == '/' || k.back() == '/' || k.find("//") != std::string::npos))
      fail(detail::cat("map key '", k, "' has an empty part between '/'s; a key with '/' is read as a path of "
                                       "non-empty keys"));
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
    std::vector<Tree::Entry> entries, paths;  // paths: keys with '/', nested once the map is read
    entries.reserve(static_cast<std::size_t>(h.u));
    for (std::uint64_t e = 0; e < h.u; ++e) {
      std::string k = key(next());
      if (e == 0 && k == "__msgpack_chunked_array__") return chunked(h.u);
      path_.push_back(k);
      Tree v = value(depth + 1);
      path_.pop_back();
      (k.find('/') == std::string::npos ? entries : paths).emplace_back(std::move(k), std::move(v));
    }
    try {
      Tree t = Tree::from_entries(std::move(entries));
      for (auto& [k, v] : paths) {
        if (t.contains_path(k)) fail(detail::cat("map key '", k, "' names a path that other keys already hold"));
        t.set_path(k, std::move(v));
      }
      return t;
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

}  // namespace

Tree from_msgpack(std::span<const std::uint8_t> bytes, std::string_view source) {
  std::vector<std::string> path;
  MsgpackReader r(bytes, source, path, "msgpack data");
  if (bytes.empty()) r.fail("the data is empty (0 bytes); expected a msgpack map");
  Tree t = r.value(0);
  if (!r.at_end())
    r.fail(detail::cat(r.remaining(), " unexpected bytes after the end of the data at byte ", r.pos()));
  return t;
}

}  // namespace linum::serialization
