#include "idx.hpp"

#include <linum/core/error.hpp>
#include <linum/core/serialization.hpp>

#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

namespace fashion {
namespace {

using linum::IoError;
using linum::detail::cat;

std::uint32_t be32(std::span<const unsigned char> d, std::size_t at) {
  return (std::uint32_t(d[at]) << 24) | (std::uint32_t(d[at + 1]) << 16) | (std::uint32_t(d[at + 2]) << 8) | d[at + 3];
}

std::filesystem::path find_file(const std::filesystem::path& dir, const std::string& name) {
  for (const std::string& candidate : {name + ".gz", name})
    if (std::filesystem::exists(dir / candidate)) return dir / candidate;
  throw IoError(cat("'", (dir / (name + ".gz")).string(), "' is missing"));
}

}  // namespace

std::uint64_t idx_file_size(std::span<const unsigned char> header) {
  if (header.size() < 4 || header[0] != 0 || header[1] != 0 || header[2] != 0x08) return 0;  // ubyte IDX only
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
  const bool gzip = file.size() >= 2 && file[0] == 0x1f && file[1] == 0x8b;
  if (!gzip) return {file.begin(), file.end()};
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
    if (expected == 0 && out.size() >= 4 && !(out[0] == 0 && out[1] == 0 && out[2] == 0x08))
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

Dataset parse_split(std::span<const unsigned char> images, std::span<const unsigned char> labels,
                    const std::string& image_name, const std::string& label_name) {
  if (images.size() < 16 || be32(images, 0) != 0x00000803)
    throw IoError(cat("'", image_name, "' is not an IDX image file (bad header)"));
  if (labels.size() < 8 || be32(labels, 0) != 0x00000801)
    throw IoError(cat("'", label_name, "' is not an IDX label file (bad header)"));
  const std::uint64_t n = be32(images, 4), rows = be32(images, 8), cols = be32(images, 12);
  if (rows == 0 || cols == 0 || rows > 4096 || cols > 4096 || images.size() != 16 + n * rows * cols)
    throw IoError(cat("'", image_name, "' is truncated or corrupt: header says ", n, " images of ", rows, "x", cols,
                      " but the file holds ", images.size() - 16, " pixel bytes"));
  if (be32(labels, 4) != n || labels.size() != 8 + n)
    throw IoError(cat("'", label_name, "' does not match the images: ", labels.size() - 8, " labels for ", n,
                      " images"));
  Dataset d{linum::Array::empty(linum::Shape{static_cast<std::int64_t>(n), static_cast<std::int64_t>(rows),
                                             static_cast<std::int64_t>(cols), 1}),
            linum::Array::empty(linum::Shape{static_cast<std::int64_t>(n)}, linum::DType::i32)};
  float* px = d.images.mutable_data();
  for (std::size_t i = 0; i < n * rows * cols; ++i) px[i] = static_cast<float>(images[16 + i]) / 255.0f;
  std::int32_t* py = d.labels.mutable_data_i32();
  for (std::size_t i = 0; i < n; ++i) {
    if (labels[8 + i] > 9) throw IoError(cat("'", label_name, "': label ", int(labels[8 + i]), " at ", i, " is not 0..9"));
    py[i] = labels[8 + i];
  }
  return d;
}

Dataset load_split(const std::filesystem::path& dir, const std::string& prefix) {
  const auto image_path = find_file(dir, prefix + "-images-idx3-ubyte");
  const auto label_path = find_file(dir, prefix + "-labels-idx1-ubyte");
  const auto images = idx_bytes(linum::serialization::read_file(image_path), image_path.string());
  const auto labels = idx_bytes(linum::serialization::read_file(label_path), label_path.string());
  return parse_split(images, labels, image_path.string(), label_path.string());
}

void write_split(const std::filesystem::path& dir, const std::string& prefix, const linum::Array& images,
                 const linum::Array& labels) {
  auto put32 = [](std::vector<unsigned char>& v, std::uint32_t x) {
    for (int s = 24; s >= 0; s -= 8) v.push_back(static_cast<unsigned char>(x >> s));
  };
  auto write = [](const std::filesystem::path& path, const std::vector<unsigned char>& bytes) {
    gzFile f = gzopen(path.c_str(), "wb");
    if (f == nullptr || gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) != static_cast<int>(bytes.size()))
      throw IoError(cat("cannot write '", path.string(), "'"));
    gzclose(f);
  };
  std::vector<unsigned char> img, lab;
  put32(img, 0x803);
  put32(img, static_cast<std::uint32_t>(images.dim(0)));
  put32(img, static_cast<std::uint32_t>(images.dim(1)));
  put32(img, static_cast<std::uint32_t>(images.dim(2)));
  for (std::int64_t i = 0; i < images.numel(); ++i) img.push_back(static_cast<unsigned char>(images.data()[i]));
  put32(lab, 0x801);
  put32(lab, static_cast<std::uint32_t>(labels.dim(0)));
  for (std::int64_t i = 0; i < labels.numel(); ++i) lab.push_back(static_cast<unsigned char>(labels.data_i32()[i]));
  write(dir / (prefix + "-images-idx3-ubyte.gz"), img);
  write(dir / (prefix + "-labels-idx1-ubyte.gz"), lab);
}

}  // namespace fashion
