// Flax-compatible derivation of per-module keys from named streams (see streams.hpp).
#include <linum/rng/streams.hpp>

#include <linum/core/error.hpp>
#include <linum/rng/sha1.hpp>

namespace linum::rng {

namespace {

std::string provided_list(const std::vector<std::string>& names) {
  if (names.empty()) return "none";
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "\"" : ", \"") + n + "\"";
  return s;
}

}  // namespace

std::uint32_t path_hash(std::span<const std::string> path, std::uint64_t count, bool separator) {
  Sha1 sha;
  const std::uint8_t zero = 0;
  for (const auto& name : path) {
    if (separator) sha.update(&zero, 1);
    sha.update(name);
  }
  if (separator) sha.update(&zero, 1);
  // Python's int.to_bytes((bit_length + 7) // 8, "big"): minimal big-endian bytes, none for 0.
  std::uint8_t bytes[8];
  int len = 0;
  for (std::uint64_t v = count; v != 0; v >>= 8) ++len;
  for (int i = 0; i < len; ++i) bytes[i] = static_cast<std::uint8_t>(count >> (8 * (len - 1 - i)));
  sha.update(bytes, static_cast<std::size_t>(len));
  const auto d = sha.digest();
  return (std::uint32_t{d[0]} << 24) | (std::uint32_t{d[1]} << 16) | (std::uint32_t{d[2]} << 8) | std::uint32_t{d[3]};
}

Key fold_in_path(Key stream_key, std::span<const std::string> path, std::uint64_t count, bool separator) {
  return fold_in(stream_key, path_hash(path, count, separator));
}

std::string format_path(std::span<const std::string> path) {
  if (path.empty()) return "<root>";
  std::string s;
  for (const auto& name : path) s += (s.empty() ? "" : "/") + name;
  return s;
}

Streams& Streams::set(std::string name, Key key) {
  keys_.insert_or_assign(std::move(name), key);
  return *this;
}

std::vector<std::string> Streams::names() const {
  std::vector<std::string> out;
  out.reserve(keys_.size());
  for (const auto& [name, key] : keys_) out.push_back(name);
  return out;
}

Key Streams::at(std::string_view name) const {
  const auto it = keys_.find(name);
  if (it == keys_.end())
    throw ValueError(detail::cat("rng stream \"", name, "\" was not provided (provided streams: ",
                                 provided_list(names()), "); pass a key for it in the rngs given to init/apply, e.g. ",
                                 "Streams{{\"", name, "\", rng::key(0)}}"));
  return it->second;
}

Key Streams::derive(std::string_view stream, std::span<const std::string> path, std::uint64_t count,
                    bool separator) const {
  const auto it = keys_.find(stream);
  if (it == keys_.end())
    throw ValueError(detail::cat("module \"", format_path(path), "\" draws from rng stream \"", stream,
                                 "\", but no key was provided for that stream (provided streams: ", provided_list(names()),
                                 "). Pass one in the rngs given to init/apply, e.g. rngs.set(\"", stream,
                                 "\", rng::key(seed)) or Streams{{\"", stream, "\", rng::key(seed)}}"));
  return fold_in_path(it->second, path, count, separator);
}

}  // namespace linum::rng
