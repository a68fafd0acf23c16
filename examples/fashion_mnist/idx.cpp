#include "idx.hpp"

#include <linum/core/error.hpp>

#include <zlib.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace fashion {
namespace {

using linum::IoError;
using linum::detail::cat;

std::vector<unsigned char> read_maybe_gz(const std::filesystem::path& path) {
  gzFile f = gzopen(path.c_str(), "rb");  // reads plain files too
  if (f == nullptr) throw IoError(cat("cannot open '", path.string(), "'"));
  std::unique_ptr<gzFile_s, int (*)(gzFile)> guard(f, gzclose);
  std::vector<unsigned char> data;
  unsigned char buf[1 << 16];
  for (;;) {
    const int n = gzread(f, buf, sizeof buf);
    if (n < 0) {
      int err = 0;
      throw IoError(cat("'", path.string(), "' is corrupt: ", gzerror(f, &err)));
    }
    if (n == 0) break;
    data.insert(data.end(), buf, buf + n);
  }
  return data;
}

std::uint32_t be32(const std::vector<unsigned char>& d, std::size_t at) {
  return (std::uint32_t(d[at]) << 24) | (std::uint32_t(d[at + 1]) << 16) | (std::uint32_t(d[at + 2]) << 8) | d[at + 3];
}

std::filesystem::path find_file(const std::filesystem::path& dir, const std::string& name) {
  for (const std::string& candidate : {name + ".gz", name})
    if (std::filesystem::exists(dir / candidate)) return dir / candidate;
  throw IoError(cat("'", (dir / (name + ".gz")).string(), "' is missing"));
}

}  // namespace

Dataset load_split(const std::filesystem::path& dir, const std::string& prefix) {
  const auto image_path = find_file(dir, prefix + "-images-idx3-ubyte");
  const auto label_path = find_file(dir, prefix + "-labels-idx1-ubyte");
  const auto images = read_maybe_gz(image_path);
  const auto labels = read_maybe_gz(label_path);
  if (images.size() < 16 || be32(images, 0) != 0x00000803)
    throw IoError(cat("'", image_path.string(), "' is not an IDX image file (bad header)"));
  if (labels.size() < 8 || be32(labels, 0) != 0x00000801)
    throw IoError(cat("'", label_path.string(), "' is not an IDX label file (bad header)"));
  const std::uint64_t n = be32(images, 4), rows = be32(images, 8), cols = be32(images, 12);
  if (rows == 0 || cols == 0 || rows > 4096 || cols > 4096 || images.size() != 16 + n * rows * cols)
    throw IoError(cat("'", image_path.string(), "' is truncated or corrupt: header says ", n, " images of ", rows, "x", cols,
                      " but the file holds ", images.size() - 16, " pixel bytes"));
  if (be32(labels, 4) != n || labels.size() != 8 + n)
    throw IoError(cat("'", label_path.string(), "' does not match the images: ", labels.size() - 8, " labels for ", n,
                      " images"));
  Dataset d{linum::Array::empty(linum::Shape{static_cast<std::int64_t>(n), static_cast<std::int64_t>(rows),
                                             static_cast<std::int64_t>(cols), 1}),
            linum::Array::empty(linum::Shape{static_cast<std::int64_t>(n)}, linum::DType::i32)};
  float* px = d.images.mutable_data();
  for (std::size_t i = 0; i < n * rows * cols; ++i) px[i] = static_cast<float>(images[16 + i]) / 255.0f;
  std::int32_t* py = d.labels.mutable_data_i32();
  for (std::size_t i = 0; i < n; ++i) {
    if (labels[8 + i] > 9) throw IoError(cat("'", label_path.string(), "': label ", int(labels[8 + i]), " at ", i, " is not 0..9"));
    py[i] = labels[8 + i];
  }
  return d;
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
