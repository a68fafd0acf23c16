// Named random streams ("params", "dropout", any user name) and Flax's key derivation for them.
//
// A model is given one root key per stream. When the module at path p (the names of the scopes
// from the root down to the module, e.g. {"Encoder", "Dense_0"}; empty for the root module)
// draws from stream s for the c-th time (c = 1, 2, ... counted per module and per stream), it gets
//
//     fold_in(root_key[s], H(p..., c))
//
// exactly as Flax's `Scope.make_rng` (flax/core/scope.py, `LazyRng` and `_fold_in_static`):
// H is the first 4 bytes, read big-endian, of the SHA-1 of the path names (UTF-8) followed by the
// count as minimal big-endian bytes. Only one fold_in happens, so a module's numbers depend only
// on its own path and counter: adding a sibling or calling siblings in another order changes
// nothing, and any thread gets the same key. With `separator` (Flax's `flax_fix_rng_separator`,
// off by default there and here) a 0 byte precedes every element, so ("ab","c") != ("a","bc").
//
// Unlike Flax, which silently falls back to the "params" stream when a stream is missing, a
// missing stream is an error here (the fallback hides forgotten dropout keys).
#pragma once

#include <linum/rng/key.hpp>

#include <cstdint>
#include <initializer_list>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace linum::rng {

// Flax's static hash H(path..., count) of a module path and call count (see the file comment).
std::uint32_t path_hash(std::span<const std::string> path, std::uint64_t count, bool separator = false);

// fold_in(stream_key, path_hash(path, count, separator)): the key Flax's make_rng returns for the
// count-th draw of a module at `path` from a stream whose root key is `stream_key`.
Key fold_in_path(Key stream_key, std::span<const std::string> path, std::uint64_t count, bool separator = false);

// "Encoder/Dense_0", or "<root>" for the empty path: how paths appear in error messages.
std::string format_path(std::span<const std::string> path);

// A set of named stream keys, as passed to init/apply. A value type: cheap to copy, immutable
// after construction apart from set().
class Streams {
 public:
  Streams() = default;
  // Streams{{"params", rng::key(0)}, {"dropout", rng::key(1)}}.
  Streams(std::initializer_list<std::pair<const std::string, Key>> keys) : keys_(keys) {}
  // A single key means the "params" stream only (as in Flax's init(key)).
  explicit Streams(Key params_key) { keys_.emplace("params", params_key); }

  // Adds or replaces a stream; returns *this for chaining.
  Streams& set(std::string name, Key key);
  bool has(std::string_view name) const { return keys_.find(name) != keys_.end(); }
  std::size_t size() const { return keys_.size(); }
  bool empty() const { return keys_.empty(); }
  // The stream names in sorted order.
  std::vector<std::string> names() const;

  // The root key of a stream. Throws ValueError naming the stream and the streams provided.
  Key at(std::string_view name) const;

  // The key for the count-th draw (count >= 1 for Flax's make_rng) from `stream` by the module at
  // `path`: fold_in_path(at(stream), path, count, separator). Throws ValueError if the stream was
  // not provided; the message names the stream, the module path and the provided streams, and
  // says how to pass the missing key.
  Key derive(std::string_view stream, std::span<const std::string> path, std::uint64_t count,
             bool separator = false) const;

  friend bool operator==(const Streams&, const Streams&) = default;

 private:
  std::map<std::string, Key, std::less<>> keys_;
};

}  // namespace linum::rng
