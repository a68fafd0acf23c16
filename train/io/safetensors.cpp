// safetensors reading and writing (see safetensors.hpp): the header parsed with nlohmann::json and
// checked entry by entry, the data ranges checked to tile the data section, elements converted by
// the codecs the MessagePack reader uses (serialization_internal.hpp).
#include <linum/train/io/safetensors.hpp>

#include <linum/core/error.hpp>
#include <linum/core/files.hpp>

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <utility>

#include <linum/train/io/safetensors_internal.hpp>
#include <linum/train/io/serialization_internal.hpp>

namespace linum::safetensors {

using serialization::internal::ConvertError;
using serialization::internal::DTypeInfo;
using serialization::internal::FileDType;
using internal::Entry;

namespace {

// The reference implementation refuses headers above 100 MB.
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

// safetensors dtype names and the file dtypes of the shared codecs.
struct NamedDType {
  const char* safetensors;
  const char* numpy;  // the codec's name (serialization_internal.hpp)
};
constexpr NamedDType kDTypes[] = {
    {"F32", "float32"}, {"BF16", "bfloat16"}, {"F16", "float16"}, {"F64", "float64"}, {"I32", "int32"},
    {"I64", "int64"},   {"U32", "uint32"},    {"U64", "uint64"},  {"I16", "int16"},   {"U16", "uint16"},
    {"I8", "int8"},     {"U8", "uint8"},      {"BOOL", "bool"},
};

[[noreturn]] void fail(std::string_view source, const std::string& what) {
  throw IoError(linum::detail::cat("safetensors ", source, ": ", what));
}

std::string describe(const nlohmann::ordered_json& j) {
  std::string s = j.dump();
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

std::uint64_t offset_of(std::string_view source, const std::string& name, const nlohmann::ordered_json& j) {
  if (!j.is_number_unsigned())
    fail(source, "tensor '" + name + "': data_offsets must hold two non-negative integers, got " + describe(j));
  return j.get<std::uint64_t>();
}

Entry parse_entry(std::string_view source, const std::string& name, const nlohmann::ordered_json& j) {
  if (name.empty()) fail(source, "a tensor has an empty name");
  if (!j.is_object()) fail(source, "tensor '" + name + "' must be an object with dtype, shape and data_offsets");
  for (const char* field : {"dtype", "shape", "data_offsets"})
    if (!j.contains(field)) fail(source, "tensor '" + name + "' has no '" + field + "'");
  Entry e;
  e.name = name;
  const nlohmann::ordered_json& dt = j.at("dtype");
  if (!dt.is_string()) fail(source, "tensor '" + name + "': dtype must be a string, got " + describe(dt));
  const std::string dname = dt.get<std::string>();
  for (const NamedDType& d : kDTypes)
    if (dname == d.safetensors) e.dtype = serialization::internal::find_dtype(d.numpy);
  if (e.dtype == nullptr)
    fail(source, "tensor '" + name + "' has dtype '" + dname +
                     "', which Linum does not read; convert it to F32, BF16, F16 or an integer type before saving");
  const nlohmann::ordered_json& shape = j.at("shape");
  if (!shape.is_array() || shape.size() > 64)
    fail(source, "tensor '" + name + "': shape must be an array of at most 64 non-negative integers, got " + describe(shape));
  for (const auto& d : shape) {
    if (!d.is_number_unsigned() || d.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      fail(source, "tensor '" + name + "': shape must hold non-negative integers, got " + describe(shape));
    e.dims.push_back(static_cast<std::int64_t>(d.get<std::uint64_t>()));
  }
  const nlohmann::ordered_json& off = j.at("data_offsets");
  if (!off.is_array() || off.size() != 2)
    fail(source, "tensor '" + name + "': data_offsets must be [begin, end], got " + describe(off));
  e.begin = offset_of(source, name, off.at(0));
  e.end = offset_of(source, name, off.at(1));
  if (e.end < e.begin) fail(source, linum::detail::cat("tensor '", name, "': data_offsets [", e.begin, ", ", e.end, "] end before they begin"));
  const auto numel = serialization::internal::checked_numel(e.dims);
  if (!numel) fail(source, "tensor '" + name + "': shape " + serialization::internal::dims_str(e.dims) + " overflows");
  const auto elements = static_cast<std::uint64_t>(*numel);
  if (elements > std::numeric_limits<std::uint64_t>::max() / e.dtype->size || elements * e.dtype->size != e.end - e.begin)
    fail(source, linum::detail::cat("tensor '", name, "': shape ", serialization::internal::dims_str(e.dims), " of ", dname,
                                    " needs ", elements, " x ", e.dtype->size, " bytes, but data_offsets [", e.begin, ", ",
                                    e.end, "] hold ", e.end - e.begin));
  return e;
}

Array read_tensor(std::string_view source, const Entry& e, std::span<const std::uint8_t> data, const LoadOptions& options) {
  const Shape shape(e.dims);
  Array a = Array::empty(shape, internal::array_dtype(e));
  internal::read_elements(source, e, data.data() + e.begin, static_cast<std::size_t>(shape.numel()), a.mutable_raw());
  if (e.dtype->type == FileDType::f16 && options.f16_as_bf16) {
    Array b = Array::empty(shape, DType::bf16);
    f32_to_bf16(a.data(), static_cast<bfloat16*>(b.mutable_raw()), shape.numel());
    return b;
  }
  return a;
}

// A tensor name's place in the Tree: the name itself, or the path its '/'s give.
void place(std::string_view source, Tree& tree, const std::string& name, Array a) {
  try {
    if (name.find('/') == std::string::npos) tree.set(name, Tree(std::move(a)));
    else tree.set_path(name, Tree(std::move(a)));
  } catch (const ValueError& err) {
    fail(source, "tensor '" + name + "' cannot be placed in a tree: " + err.what());
  }
}

}  // namespace

namespace internal {

const char* file_dtype_name(const Entry& e) {
  for (const NamedDType& d : kDTypes)
    if (e.dtype == serialization::internal::find_dtype(d.numpy)) return d.safetensors;
  return "?";
}

DType array_dtype(const Entry& e) {
  return e.dtype->type == FileDType::bf16 ? DType::bf16 : serialization::internal::target_dtype(e.dtype->type);
}

void read_elements(std::string_view source, const Entry& e, const std::uint8_t* src, std::size_t count, void* dst) {
  try {
    if (e.dtype->type == FileDType::bf16) serialization::internal::copy_bf16(src, count, static_cast<bfloat16*>(dst));
    else serialization::internal::convert_elements(*e.dtype, src, count, dst);
  } catch (const ConvertError& err) {
    fail(source, "tensor '" + e.name + "': " + err.message);
  }
}

std::uint64_t header_length(std::span<const std::uint8_t> first_bytes, std::uint64_t file_size, std::string_view source) {
  if (file_size < 8 || first_bytes.size() < 8)
    fail(source, linum::detail::cat("the file has ", file_size, " bytes; a safetensors file starts with an 8-byte header length"));
  const std::uint64_t n = serialization::internal::load_le<std::uint64_t>(first_bytes.data());
  if (n > kMaxHeaderBytes || n > file_size - 8)
    fail(source, linum::detail::cat("the header length ", n, " is beyond the file's ", file_size - 8,
                                    " remaining bytes (or the 100 MB limit): the file is truncated or not safetensors"));
  return n;
}

Layout parse_header(std::string_view text, std::uint64_t data_size, std::string_view source) {
  if (!serialization::internal::valid_utf8(text)) fail(source, "the header is not UTF-8");
  const nlohmann::ordered_json header = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) fail(source, "the header is not a JSON object");
  Layout out;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) fail(source, "__metadata__ must be an object of strings");
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string()) fail(source, "__metadata__ entry '" + k + "' must be a string, got " + describe(v));
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    out.entries.push_back(parse_entry(source, name, value));
  }
  // The tensors tile the data section: sorted by offset, each begins where the previous ended.
  std::vector<const Entry*> by_offset;
  for (const Entry& e : out.entries) by_offset.push_back(&e);
  std::stable_sort(by_offset.begin(), by_offset.end(),
                   [](const Entry* a, const Entry* b) { return a->begin != b->begin ? a->begin < b->begin : a->end < b->end; });
  std::uint64_t expected = 0;
  for (const Entry* e : by_offset) {
    if (e->begin != expected)
      fail(source, linum::detail::cat("tensor '", e->name, "' begins at ", e->begin, ", but the data before it ends at ",
                                      expected, ": tensors must cover the data with no gap or overlap"));
    expected = e->end;
  }
  if (expected != data_size)
    fail(source, linum::detail::cat("the tensors cover ", expected, " bytes of data but the file holds ", data_size,
                                    ": the file is truncated or has bytes no tensor owns"));
  return out;
}

MappedFile::MappedFile(const std::filesystem::path& path) {
  const std::string source = path.string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(source, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail(source, std::string("cannot stat: ") + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(source, "not a regular file");
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ > 0) {
    addr_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (addr_ == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      fail(source, std::string("cannot map: ") + std::strerror(err));
    }
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (addr_ != MAP_FAILED && size_ > 0) ::munmap(addr_, size_);
}

std::span<const std::uint8_t> MappedFile::bytes() const {
  return {size_ > 0 ? static_cast<const std::uint8_t*>(addr_) : nullptr, size_};
}

}  // namespace internal

Contents from_bytes(std::span<const std::uint8_t> bytes, std::string_view source, const LoadOptions& options) {
  const std::uint64_t n = internal::header_length(bytes, bytes.size(), source);
  const std::string_view text(reinterpret_cast<const char*>(bytes.data() + 8), static_cast<std::size_t>(n));
  const std::span<const std::uint8_t> data = bytes.subspan(8 + static_cast<std::size_t>(n));
  internal::Layout layout = internal::parse_header(text, data.size(), source);
  Contents out;
  out.metadata = std::move(layout.metadata);
  const std::vector<Entry>& entries = layout.entries;
  std::set<std::string> wanted(options.names.begin(), options.names.end());
  for (const std::string& name : options.names)
    if (std::none_of(entries.begin(), entries.end(), [&](const Entry& e) { return e.name == name; }))
      fail(source, "no tensor named '" + name + "'");
  // The tree lists the tensors in the header's order.
  for (const Entry& e : entries)
    if (wanted.empty() || wanted.count(e.name)) place(source, out.tensors, e.name, read_tensor(source, e, data, options));
  return out;
}

Contents load(const std::filesystem::path& path, const LoadOptions& options) {
  const internal::MappedFile file(path);
  return from_bytes(file.bytes(), path.string(), options);
}

std::vector<std::uint8_t> to_bytes(const Tree& tensors, const std::map<std::string, std::string>& metadata, char separator) {
  if (tensors.is_leaf())
    throw ValueError("safetensors::to_bytes: give a dict of tensors ({\"name\": array, ...}), not a single array");
  // Tree paths join keys with '/', which no key contains: the separator takes its place.
  std::vector<std::pair<std::string, Array>> flat = flatten(tensors);
  for (auto& [name, a] : flat) std::replace(name.begin(), name.end(), '/', separator);
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  std::uint64_t offset = 0;
  for (const auto& [name, a] : flat) {
    if (name == "__metadata__") throw ValueError("safetensors::to_bytes: a tensor cannot be named '__metadata__'");
    if (header.contains(name))
      throw ValueError("safetensors::to_bytes: two tensors would both be named '" + name +
                       "' (nested keys joined with '" + std::string(1, separator) + "'); rename one");
    const char* dtype = a.dtype() == DType::f32 ? "F32" : a.dtype() == DType::bf16 ? "BF16" : "I32";
    nlohmann::ordered_json shape = nlohmann::ordered_json::array();
    for (std::int64_t d : a.shape()) shape.push_back(d);
    const std::uint64_t size = a.nbytes();
    header[name] = {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {offset, offset + size}}};
    offset += size;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::vector<std::uint8_t> out(8 + text.size() + offset);
  serialization::internal::store_le<std::uint64_t>(text.size(), out.data());
  std::memcpy(out.data() + 8, text.data(), text.size());
  std::uint8_t* p = out.data() + 8 + text.size();
  for (const auto& [name, a] : flat) {
    // Little-endian hosts only (x86-64, ARM64): the array's bytes are the file's.
    if (a.nbytes() > 0) std::memcpy(p, a.raw(), a.nbytes());
    p += a.nbytes();
  }
  return out;
}

void save(const std::filesystem::path& path, const Tree& tensors, const std::map<std::string, std::string>& metadata,
          char separator) {
  const std::vector<std::uint8_t> bytes = to_bytes(tensors, metadata, separator);
  files::write_file_atomic(path, bytes);
}

Tree nest_at_dots(const Tree& flat) {
  Tree out;
  for (const auto& [name, a] : flatten(flat)) {
    std::string path = name;
    std::replace(path.begin(), path.end(), '.', '/');
    if (out.contains_path(path))
      throw ValueError("safetensors::nest_at_dots: '" + name + "' appears twice");
    try {
      out.set_path(path, Tree(a));
    } catch (const ValueError& e) {
      throw ValueError("safetensors::nest_at_dots: '" + name + "' cannot be nested: " + e.what() +
                       " (a name that is both a tensor and a prefix of another, or an empty component)");
    }
  }
  return out;
}

}  // namespace linum::safetensors
