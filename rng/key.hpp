// JAX-compatible PRNG keys: threefry2x32 hashing, seeding, split, fold_in and raw random bits.
//
// A Key is the two uint32 words of a JAX `threefry2x32` key (`jax.random.key_data(k)`), high word
// first. Every function here is a pure function of its arguments: the same key always gives the
// same numbers, on every run and every thread. This is what makes rematerialization exact.
//
// JAX has two ways of turning a key into many values (`jax_threefry_partitionable`):
//   * Mode::partitionable (JAX >= 0.5, the default here too): element i of split/bits is
//     threefry2x32(key, hi32(i), lo32(i)), so `split(k, n)[i] == fold_in(k, i)` and each element
//     depends only on its own flat index;
//   * Mode::legacy (JAX <= 0.4.38): counters 0..2n-1 are hashed in two halves, so values depend
//     on the total size as well.
// Seeding and fold_in are the same in both modes. Every function that depends on the mode takes
// it as a last parameter that defaults to default_mode().
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/context.hpp>
#include <linum/core/shape.hpp>

#include <array>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace linum::rng {

struct KeyBatch;

// A threefry2x32 key: `jax.random.key_data(key)` is `[hi, lo]`.
//
// Or, inside lift::vmap with a split stream, one key per example (`batch`; hi and lo unused), as a
// batched key array in JAX: fold_in and split act on each example's key, and draws (uniform,
// normal, bernoulli, ...) give batched arrays (core/batch_levels.hpp), example e drawn with key e.
struct Key {
  std::uint32_t hi = 0;
  std::uint32_t lo = 0;
  std::shared_ptr<const KeyBatch> batch;

  bool batched() const { return batch != nullptr; }
  friend bool operator==(const Key&, const Key&) = default;
  // "[hi, lo]" in decimal, as NumPy prints `key_data` ("batched[n]" for a batched key).
  std::string str() const;
};

// The keys of a batched Key: one per example, row-major over `levels`.
struct KeyBatch {
  std::vector<BatchLevel> levels;
  std::vector<Key> keys;
};

// A key per example of `levels` (row-major; unbatched keys) as one batched Key.
Key batched_key(std::vector<BatchLevel> levels, std::vector<Key> keys);

// Internal: `draw` of every example's key, as one batched array (the draws of a batched key).
Array draw_per_example(const Key& key, const std::function<Array(const Key&)>& draw);
std::ostream& operator<<(std::ostream& os, const Key& k);

// How split() and bits() derive many values from one key (see the file comment).
enum class Mode { partitionable, legacy };

// "partitionable" or "legacy".
const char* mode_name(Mode mode);
// Parses "partitionable" / "legacy"; throws ValueError naming the accepted spellings otherwise.
Mode parse_mode(std::string_view name);

// The mode used when a call does not pass one: the innermost ModeGuard of the calling thread if
// there is one, else the process-wide default (Mode::partitionable unless set_default_mode changed it).
Mode default_mode();
// Sets the process-wide default mode (like `jax.config.update("jax_threefry_partitionable", ...)`).
// Threads inside a ModeGuard keep their guard's mode.
void set_default_mode(Mode mode);

// Overrides the default mode on the current thread for the guard's lifetime (like JAX's
// `with jax.threefry_partitionable(...)` context). Guards nest; other threads are not affected.
struct ModeContext { using Value = Mode; };
class ModeGuard {
 public:
  explicit ModeGuard(Mode mode) : set_(mode) {}

 private:
  linum::detail::ContextStack<ModeContext>::Entry set_;  // core/context.hpp
};

// The Threefry-2x32 block cipher with 20 rounds (Random123), as JAX's `threefry2x32_p`:
// encrypts the counter (x0, x1) under the key (key0, key1) and returns the two output words.
std::array<std::uint32_t, 2> threefry2x32(std::uint32_t key0, std::uint32_t key1, std::uint32_t x0,
                                          std::uint32_t x1);

// JAX's seeding of a 64-bit seed (`jax.random.key(seed)` with jax_enable_x64=True):
// [hi, lo] = [uint32(seed >> 32), uint32(seed)]. Negative seeds use their two's-complement bits,
// so key(-1) == [4294967295, 4294967295]. For 0 <= seed < 2^32 this equals key_x32(seed). To pass
// a uint64 seed above INT64_MAX, cast it: the bit pattern is what counts.
Key key(std::int64_t seed);
// JAX's seeding with the default jax_enable_x64=False, where the seed is canonicalized to 32
// bits first: [0, uint32(seed)]. So key_x32(-1) == [0, 4294967295].
Key key_x32(std::int64_t seed);

// `jax.random.split(key, n)`: n new keys. Throws ValueError if n < 0.
std::vector<Key> split(Key key, std::int64_t n = 2, Mode mode = default_mode());

// `jax.random.fold_in(key, data)`: threefry2x32(key, 0, data). The same in both modes.
Key fold_in(Key key, std::uint32_t data);

// `jax.random.bits(key, (count,), uint32)` as a flat vector of uint32 words.
std::vector<std::uint32_t> bits_u32(Key key, std::int64_t count, Mode mode = default_mode());

// `jax.random.bits(key, (count,), uintW)` for W = bit_width in {8, 16, 32, 64}, each value
// widened to uint64. W = 64 matches JAX with jax_enable_x64=True. Throws ValueError for other widths.
std::vector<std::uint64_t> bits_wide(Key key, int bit_width, std::int64_t count, Mode mode = default_mode());

// `jax.random.bits(key, shape)` (uint32) as an int32 Array: each element holds the uint32's bit
// pattern (values >= 2^31 appear negative; cast the element to std::uint32_t to read it).
Array bits(Key key, const Shape& shape, Mode mode = default_mode());

}  // namespace linum::rng
