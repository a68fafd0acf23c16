#include <linum/train/data/idx.hpp>

#include <linum/core/error.hpp>
#include <linum/train/io/serialization.hpp>

#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

namespace linum::datasets {
namespace {

using linum::detail::cat;

constexpr unsigned char kUnsignedByte = 0x08;

std::uint32_t be32(std::span<const unsigned char> d, std::size_t at) {
  return (std::uint32_t(d[at]) << 24) | (std::uint32_t(d[at + 1]) << 16) | (std::uint32_t(d[at + 2]) << 8) | d[at + 3];
}

void put32(std::vector<unsigned char>& v, std::uint32_t x) {
  for (int s = 24; s >= 0; s -= 8) v.push_back(static_cast<unsigned char>(x >> s));
}

std::filesystem::path find_file(const std::filesystem::path& dir, const std::string& name) {
  for (const std::string& candidate : {name + ".gz", name})
    if (std::filesystem::exists(dir / candidate)) return dir / candidate;
  throw IoError(cat("'", (dir / (name + ".gz")).string(), "' is missing"));
}

std::vector<unsigned char> gzip(std::span<const unsigned char> bytes, const std::filesystem::path& path) {
  z_stream zs{};
  if (deflateInit2(&zs, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK)
    throw IoError(cat("cannot start gzip compression for '", path.string(), "'"));
  std::unique_ptr<z_stream, int (*)(z_stream*)> guard(&zs, deflateEnd);
  std::vector<unsigned char> out(deflateBound(&zs, static_cast<uLong>(bytes.size())));
  zs.next_in = const_cast<unsigned char*>(bytes.data());
  zs.avail_in = static_cast<uInt>(bytes.size());
  zs.next_out = out.data();
  zs.avail_out = static_cast<uInt>(out.size());
  if (deflate(&zs, Z_FINISH) != Z_STREAM_END) throw IoError(cat("gzip compression failed for '", path.string(), "'"));
  out.resize(zs.total_out);
  return out;
}

}  // namespace

std::uint64_t idx_file_size(std::span<const unsigned char> header) {
  if (header.size() < 4 || header[0] != 0 || header[1] != 0 || header[2] != kUnsignedByte) return 0;
  const std::size_t ndim = header[3];
  if (ndim == 0 || header.size() < 4 + 4 * ndim) return 0;
  std::uint64_t size = 1;
  for (std::size_t i = 0; i < ndim; ++i) {
    const std::uint64_t d = be32(header, 4 + 4 * i);
    if (d != 0 && size > (std::uint64_t{1} << 48) / d) return 0;  // no real dataset; the parser names the header
    size *= d;
  }
  return 4 + 4 * ndim + size;
}

std::vector<unsigned char> idx_bytes(std::span<const unsigned char> file, const std::string& name) {
  const bool gzipped = file.size() >= 2 && file[0] == 0x1f && file[1] == 0x8b;
  if (!gzipped) return {file.begin(), file.end()};
  z_stream zs{};
  if (inflateInit2(&zs, 15 + 16) != Z_OK) throw IoError(cat("'", name, "': cannot start gzip decompression"));
  std::unique_ptr<z_stream, int (*)(z_stream*)> guard(&zs, inflateEnd);
  zs.next_in = const_cast<unsigned char*>(file.data());
  zs.avail_in = static_cast<uInt>(std::min<std::size_t>(file.size(), std::numeric_limits<uInt>::max()));
  std::vector<unsigned char> out;
  std::uint64_t expected = 0;  // the size the header promises, once it is known
  unsigned char buf[1 << 16];
  for (;;) {
    zs.next_out = buf;
    zs.avail_out = sizeof buf;
    const int rc = inflate(&zs, Z_NO_FLUSH);
    if (rc != Z_OK && rc != Z_STREAM_END && !(rc == Z_BUF_ERROR && zs.avail_in == 0))
      throw IoError(cat("'", name, "' is corrupt: gzip says ", zs.msg != nullptr ? zs.msg : "data error"));
    out.insert(out.end(), buf, buf + (sizeof buf - zs.avail_out));
    if (expected == 0) expected = idx_file_size(out);
    if (expected == 0 && out.size() >= 4 && !(out[0] == 0 && out[1] == 0 && out[2] == kUnsignedByte))
      throw IoError(cat("'", name, "' is not an unsigned-byte IDX file (bad header)"));
    // A decompression bomb, or a header that lies: never inflate past what the header promises
    // (nor past the longest possible header while it is incomplete).
    const std::uint64_t bound = expected != 0 ? expected : 4 + 4 * 255;
    if (out.size() > bound)
      throw IoError(cat("'", name, "' is corrupt: it inflates to more than the ", bound, " bytes its IDX header ",
                        expected != 0 ? "promises" : "can describe before it is complete"));
    if (rc == Z_STREAM_END) break;
    if (zs.avail_in == 0 && zs.avail_out != 0)
      throw IoError(cat("'", name, "' is truncated: the gzip stream ends early"));
  }
  return out;
}

namespace {

// The array of an IDX file's bytes: int32 values, or float32 values looked up in `to_float`.
Array decode_idx(std::span<const unsigned char> bytes, const std::string& name, DType dtype, const float* to_float) {
  if (bytes.size() < 4 || bytes[0] != 0 || bytes[1] != 0 || bytes[2] != kUnsignedByte || bytes[3] == 0)
    throw IoError(cat("'", name, "' is not an unsigned-byte IDX file (bad header)"));
  const std::size_t ndim = bytes[3];
  if (ndim > static_cast<std::size_t>(Shape::kMaxRank))
    throw IoError(cat("'", name, "' has ", ndim, " dimensions; Linum's arrays have at most ", Shape::kMaxRank));
  const std::size_t header = 4 + 4 * ndim;
  if (bytes.size() < header) throw IoError(cat("'", name, "' is truncated: its header is incomplete"));
  std::vector<std::int64_t> dims;
  std::uint64_t count = 1;
  for (std::size_t i = 0; i < ndim; ++i) {
    const std::uint64_t d = be32(bytes, 4 + 4 * i);
    if (d != 0 && count > (std::uint64_t{1} << 40) / d)
      throw IoError(cat("'", name, "' is corrupt: its header describes more than 2^40 elements"));
    count *= d;
    dims.push_back(static_cast<std::int64_t>(d));
  }
  if (bytes.size() != header + count)
    throw IoError(cat("'", name, "' is truncated or corrupt: its header promises ", count, " bytes of data but the file holds ",
                      bytes.size() - header));
  Array out = Array::empty(Shape(dims), dtype);
  const unsigned char* src = bytes.data() + header;
  if (dtype == DType::i32) {
    std::int32_t* dst = out.mutable_data_i32();
    for (std::uint64_t i = 0; i < count; ++i) dst[i] = src[i];
  } else {
    float* dst = out.mutable_data();
    for (std::uint64_t i = 0; i < count; ++i) dst[i] = to_float[src[i]];
  }
  return out;
}

}  // namespace

Array parse_idx(std::span<const unsigned char> bytes, const std::string& name, DType dtype, float scale) {
  if (dtype == DType::bf16) throw ValueError(cat("read_idx('", name, "'): dtype must be float32 or int32, not bfloat16"));
  if (dtype == DType::i32 && scale != 1.0f)
    throw ValueError(cat("read_idx('", name, "'): a scale applies to float32 only (int32 keeps the bytes' values)"));
  float table[256];
  for (int b = 0; b < 256; ++b) table[b] = static_cast<float>(b) * scale;
  return decode_idx(bytes, name, dtype, table);
}

Array read_idx(const std::filesystem::path& path, DType dtype, float scale) {
  const std::vector<unsigned char> bytes = idx_bytes(serialization::read_file(path), path.string());
  return parse_idx(bytes, path.string(), dtype, scale);
}

void write_idx(const std::filesystem::path& path, const Array& values) {
  if (!values.defined() || values.rank() == 0 ||  values.dtype() == DType::bf16)
    throw ValueError(cat("write_idx('", path.string(), "'): needs a float32 or int32 array of rank 1 or more"));
  std::vector<unsigned char> bytes{0, 0, kUnsignedByte, static_cast<unsigned char>(values.rank())};
  for (int i = 0; i < values.rank(); ++i) {
    if (values.dim(i) > std::numeric_limits<std::uint32_t>::max())
      throw ValueError(cat("write_idx('", path.string(), "'): dimension ", i, " is ", values.dim(i), ", more than IDX holds"));
    put32(bytes, static_cast<std::uint32_t>(values.dim(i)));
  }
  const std::vector<float> v = values.dtype() == DType::f32 ? values.to_vector() : std::vector<float>{};
  for (std::int64_t i = 0; i < values.numel(); ++i) {
    const double x = values.dtype() == DType::f32 ? static_cast<double>(v[static_cast<std::size_t>(i)])
                                                   : static_cast<double>(values.data_i32()[i]);
    if (!(x >= 0 && x <= 255 && x == std::floor(x)))
      throw ValueError(cat("write_idx('", path.string(), "'): element ", i, " is ", x,
                           "; unsigned-byte IDX holds the integers 0..255 (scale the values first)"));
    bytes.push_back(static_cast<unsigned char>(x));
  }
  const std::string name = path.filename().string();
  const bool compress = name.size() > 3 && name.compare(name.size() - 3, 3, ".gz") == 0;
  serialization::write_file_atomic(path, compress ? gzip(bytes, path) : bytes);
}

ArrayDataset parse_mnist(std::span<const unsigned char> images, std::span<const unsigned char> labels,
                         const std::string& image_name, const std::string& label_name) {
  if (images.size() < 16 || be32(images, 0) != 0x00000803)
    throw IoError(cat("'", image_name, "' is not an IDX image file (bad header)"));
  if (labels.size() < 8 || be32(labels, 0) != 0x00000801)
    throw IoError(cat("'", label_name, "' is not an IDX label file (bad header)"));
  const std::uint64_t rows = be32(images, 8), cols = be32(images, 12);
  if (rows == 0 || cols == 0 || rows > 4096 || cols > 4096)
    throw IoError(cat("'", image_name, "' is corrupt: images of ", rows, "x", cols, " pixels"));
  float unit[256];  // pixel / 255, correctly rounded
  for (int b = 0; b < 256; ++b) unit[b] = static_cast<float>(b) / 255.0f;
  Array image = decode_idx(images, image_name, DType::f32, unit);
  Array label = decode_idx(labels, label_name, DType::i32, nullptr);
  if (label.dim(0) != image.dim(0))
    throw IoError(cat("'", label_name, "' does not match the images: ", label.dim(0), " labels for ", image.dim(0), " images"));
  const std::int32_t* y = label.data_i32();
  for (std::int64_t i = 0; i < label.numel(); ++i)
    if (y[i] > 9) throw IoError(cat("'", label_name, "': label ", y[i], " at ", i, " is not 0..9"));
  return ArrayDataset(Tree{{"image", image.with_shape(Shape{image.dim(0), image.dim(1), image.dim(2), 1})}, {"label", label}});
}

ArrayDataset load_mnist(const std::filesystem::path& dir, const std::string& split) {
  const auto image_path = find_file(dir, split + "-images-idx3-ubyte");
  const auto label_path = find_file(dir, split + "-labels-idx1-ubyte");
  const auto images = idx_bytes(serialization::read_file(image_path), image_path.string());
  const auto labels = idx_bytes(serialization::read_file(label_path), label_path.string());
  return parse_mnist(images, labels, image_path.string(), label_path.string());
}

void write_mnist(const std::filesystem::path& dir, const std::string& split, const Array& images, const Array& labels) {
  if (images.rank() < 3 || images.rank() > 4 || (images.rank() == 4 && images.dim(3) != 1))
    throw ValueError(cat("write_mnist: images must be [N, rows, cols] or [N, rows, cols, 1], got ", images.shape()));
  if (labels.rank() != 1 || labels.dim(0) != images.dim(0))
    throw ValueError(cat("write_mnist: labels must be [", images.dim(0), "], got ", labels.shape()));
  write_idx(dir / (split + "-images-idx3-ubyte.gz"), images.with_shape(Shape{images.dim(0), images.dim(1), images.dim(2)}));
  write_idx(dir / (split + "-labels-idx1-ubyte.gz"), labels);
}

}  // namespace linum::datasets
