// Variable files: save/load by extension (the bytes go through core/files: read whole, written
// atomically).
#include <linum/core/fp_mode.hpp>
#include <linum/train/io/serialization.hpp>

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

#include <linum/train/io/serialization_internal.hpp>
#include <nlohmann/json.hpp>

namespace linum::serialization {

using namespace internal;

namespace {

std::string lower_ext(const std::filesystem::path& p) {
  std::string e = p.extension().string();
  std::transform(e.begin(), e.end(), e.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return e;
}

}  // namespace

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
