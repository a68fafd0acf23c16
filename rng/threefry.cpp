// Threefry-2x32 and the key operations built on it, following JAX's threefry2x32 PRNG
// implementation (seed, split, fold_in, random_bits in both threefry modes).
#include <linum/rng/key.hpp>
#include <linum/core/threading.hpp>

#include <linum/core/error.hpp>

#include <atomic>
#include <cstring>
#include <ostream>

namespace linum::rng {

namespace {

std::atomic<Mode> g_default_mode{Mode::partitionable};

constexpr std::uint32_t rotl(std::uint32_t v, int r) { return (v << r) | (v >> (32 - r)); }

// The largest uint32, used by legacy random_bits to cut very long counter ranges into blocks.
constexpr std::uint64_t kUint32Max = 0xFFFFFFFFull;

// JAX's `threefry_2x32(key, iota(n))`: the counters 0..n-1 (padded with one 0 when n is odd) are
// split into a first and a second half that form the (x0, x1) pairs; the outputs are the y0 of
// all pairs followed by the y1 of all pairs, with the padding dropped. Writes n words to `out`.
void hash_iota(Key key, std::uint64_t n, std::uint32_t* out) {
  const std::uint64_t half = (n + 1) / 2;
  const auto pairs = static_cast<std::int64_t>(half);
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) num_threads(linum::team_size()) if (pairs > 65536)
#endif
  for (std::int64_t jj = 0; jj < pairs; ++jj) {
    const auto j = static_cast<std::uint64_t>(jj);
    const std::uint64_t second = half + j;
    const auto x1 = second < n ? static_cast<std::uint32_t>(second) : 0u;
    const auto y = threefry2x32(key.hi, key.lo, static_cast<std::uint32_t>(j), x1);
    out[j] = y[0];
    if (second < n) out[second] = y[1];
  }
}

// Legacy random_bits: `n_words` words from hash_iota, cut into blocks of 2^32-1 counters under
// split keys when there are that many (as JAX does).
std::vector<std::uint32_t> legacy_words(Key key, std::uint64_t n_words) {
  std::vector<std::uint32_t> words(n_words);
  const std::uint64_t nblocks = n_words / kUint32Max;
  const std::uint64_t rem = n_words % kUint32Max;
  if (nblocks == 0) {
    hash_iota(key, rem, words.data());
    return words;
  }
  const auto keys = split(key, static_cast<std::int64_t>(nblocks + 1), Mode::legacy);
  for (std::uint64_t b = 0; b < nblocks; ++b) hash_iota(keys[b], kUint32Max, words.data() + b * kUint32Max);
  hash_iota(keys[nblocks], rem, words.data() + nblocks * kUint32Max);
  return words;
}

void check_count(std::int64_t count, const char* op) {
  if (count < 0) throw ValueError(detail::cat(op, ": count must be non-negative, got ", count));
}

}  // namespace

std::string Key::str() const {
  if (batch) return detail::cat("batched[", batch->keys.size(), "]");
  return detail::cat("[", hi, ", ", lo, "]");
}

Key batched_key(std::vector<BatchLevel> levels, std::vector<Key> keys) {
  std::int64_t n = 1;
  for (const BatchLevel& l : levels) n *= l.size;
  if (static_cast<std::int64_t>(keys.size()) != n || levels.empty())
    throw ValueError(detail::cat("rng::batched_key: ", keys.size(), " keys for ", n, " examples"));
  for (const Key& k : keys)
    if (k.batched()) throw ValueError("rng::batched_key: the per-example keys must not be batched themselves");
  Key out;
  out.batch = std::make_shared<const KeyBatch>(KeyBatch{std::move(levels), std::move(keys)});
  return out;
}

namespace {
// The same function of every example's key, as a batched key.
template <class F>
Key per_example_key(const Key& k, F f) {
  std::vector<Key> out;
  out.reserve(k.batch->keys.size());
  for (const Key& m : k.batch->keys) out.push_back(f(m));
  return batched_key(k.batch->levels, std::move(out));
}
void refuse_batched(const Key& k, const char* what) {
  if (k.batched())
    throw BatchingError(detail::cat(what, ": the key differs per example (a split stream inside lift::vmap) and this "
                                          "function returns host values; draw an Array (rng::bits, uniform, ...) instead"));
}
}  // namespace

std::ostream& operator<<(std::ostream& os, const Key& k) { return os << k.str(); }

const char* mode_name(Mode mode) { return mode == Mode::partitionable ? "partitionable" : "legacy"; }

Mode parse_mode(std::string_view name) {
  if (name == "partitionable") return Mode::partitionable;
  if (name == "legacy") return Mode::legacy;
  throw ValueError(detail::cat("rng::parse_mode: unknown threefry mode '", name,
                               "'; use 'partitionable' (JAX >= 0.5, the default) or 'legacy' (JAX <= 0.4.38)"));
}

Mode default_mode() {
  if (const Mode* guarded = linum::detail::ContextStack<ModeContext>::top()) return *guarded;
  return g_default_mode.load(std::memory_order_relaxed);
}

void set_default_mode(Mode mode) { g_default_mode.store(mode, std::memory_order_relaxed); }

std::array<std::uint32_t, 2> threefry2x32(std::uint32_t key0, std::uint32_t key1, std::uint32_t x0,
                                          std::uint32_t x1) {
  const std::uint32_t ks[3] = {key0, key1, key0 ^ key1 ^ 0x1BD11BDAu};
  static constexpr int kRot[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  x0 += ks[0];
  x1 += ks[1];
  for (int group = 0; group < 5; ++group) {
    for (int r : kRot[group % 2]) {
      x0 += x1;
      x1 = rotl(x1, r);
      x1 ^= x0;
    }
    x0 += ks[(group + 1) % 3];
    x1 += ks[(group + 2) % 3] + static_cast<std::uint32_t>(group + 1);
  }
  return {x0, x1};
}

Key key(std::int64_t seed) {
  const auto bits = static_cast<std::uint64_t>(seed);
  return {static_cast<std::uint32_t>(bits >> 32), static_cast<std::uint32_t>(bits)};
}

Key key_x32(std::int64_t seed) { return {0u, static_cast<std::uint32_t>(static_cast<std::uint64_t>(seed))}; }

std::vector<Key> split(Key key, std::int64_t n, Mode mode) {
  check_count(n, "rng::split");
  if (key.batched()) {  // split of each example's key; result i holds every example's key i
    std::vector<std::vector<Key>> per;
    for (const Key& m : key.batch->keys) per.push_back(split(m, n, mode));
    std::vector<Key> out;
    for (std::int64_t i = 0; i < n; ++i) {
      std::vector<Key> column;
      for (const auto& p : per) column.push_back(p[static_cast<std::size_t>(i)]);
      out.push_back(batched_key(key.batch->levels, std::move(column)));
    }
    return out;
  }
  std::vector<Key> out(static_cast<std::size_t>(n));
  if (mode == Mode::partitionable) {
    for (std::int64_t i = 0; i < n; ++i) {
      const auto idx = static_cast<std::uint64_t>(i);
      const auto y = threefry2x32(key.hi, key.lo, static_cast<std::uint32_t>(idx >> 32),
                                  static_cast<std::uint32_t>(idx));
      out[static_cast<std::size_t>(i)] = {y[0], y[1]};
    }
    return out;
  }
  // Legacy: hash iota(2n) and read the result as n rows of two words.
  if (static_cast<std::uint64_t>(n) * 2 > kUint32Max + 1)
    throw ValueError(detail::cat("rng::split: ", n, " keys exceed what legacy threefry mode can produce (2^31)"));
  std::vector<std::uint32_t> words(static_cast<std::size_t>(2 * n));
  hash_iota(key, static_cast<std::uint64_t>(2 * n), words.data());
  for (std::int64_t i = 0; i < n; ++i)
    out[static_cast<std::size_t>(i)] = {words[static_cast<std::size_t>(2 * i)], words[static_cast<std::size_t>(2 * i + 1)]};
  return out;
}

Key fold_in(Key key, std::uint32_t data) {
  if (key.batched()) return per_example_key(key, [data](const Key& m) { return fold_in(m, data); });
  const auto y = threefry2x32(key.hi, key.lo, 0u, data);
  return {y[0], y[1]};
}

std::vector<std::uint32_t> bits_u32(Key key, std::int64_t count, Mode mode) {
  check_count(count, "rng::bits");
  refuse_batched(key, "rng::bits_u32");
  if (mode == Mode::legacy) return legacy_words(key, static_cast<std::uint64_t>(count));
  std::vector<std::uint32_t> out(static_cast<std::size_t>(count));
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) num_threads(linum::team_size()) if (count > 65536)
#endif
  for (std::int64_t i = 0; i < count; ++i) {
    const auto idx = static_cast<std::uint64_t>(i);
    const auto y = threefry2x32(key.hi, key.lo, static_cast<std::uint32_t>(idx >> 32), static_cast<std::uint32_t>(idx));
    out[static_cast<std::size_t>(i)] = y[0] ^ y[1];
  }
  return out;
}

std::vector<std::uint64_t> bits_wide(Key key, int bit_width, std::int64_t count, Mode mode) {
  check_count(count, "rng::bits_wide");
  refuse_batched(key, "rng::bits_wide");
  if (bit_width != 8 && bit_width != 16 && bit_width != 32 && bit_width != 64)
    throw ValueError(detail::cat("rng::bits_wide: bit_width must be 8, 16, 32 or 64, got ", bit_width));
  const auto n = static_cast<std::uint64_t>(count);
  std::vector<std::uint64_t> out(n);
  if (mode == Mode::partitionable) {
    for (std::uint64_t i = 0; i < n; ++i) {
      const auto y = threefry2x32(key.hi, key.lo, static_cast<std::uint32_t>(i >> 32), static_cast<std::uint32_t>(i));
      if (bit_width == 64) {
        out[i] = (static_cast<std::uint64_t>(y[0]) << 32) | y[1];
      } else {
        const std::uint32_t x = y[0] ^ y[1];
        out[i] = bit_width == 32 ? x : (x & ((1u << bit_width) - 1u));  // truncation to uint8/uint16
      }
    }
    return out;
  }
  if (bit_width == 64) {
    // Legacy 64-bit: 2n words; the first half gives the high words, the second half the low words.
    const auto words = legacy_words(key, 2 * n);
    for (std::uint64_t i = 0; i < n; ++i) out[i] = (static_cast<std::uint64_t>(words[i]) << 32) | words[n + i];
    return out;
  }
  // Legacy 8/16/32-bit: ceil(w*n/32) words, each cut into 32/w little-endian pieces, word-major.
  const std::uint64_t per_word = 32u / static_cast<unsigned>(bit_width);
  const auto words = legacy_words(key, (n + per_word - 1) / per_word);
  const std::uint64_t mask = bit_width == 32 ? 0xFFFFFFFFull : ((1ull << bit_width) - 1ull);
  for (std::uint64_t i = 0; i < n; ++i)
    out[i] = (words[i / per_word] >> (static_cast<unsigned>(bit_width) * (i % per_word))) & mask;
  return out;
}

Array bits(Key key, const Shape& shape, Mode mode) {
  if (key.batched()) return draw_per_example(key, [&](const Key& m) { return bits(m, shape, mode); });
  const auto words = bits_u32(key, shape.numel(), mode);
  Array a = Array::empty(shape, DType::i32);
  if (!words.empty()) std::memcpy(a.mutable_data_i32(), words.data(), words.size() * sizeof(std::uint32_t));
  return a;
}

}  // namespace linum::rng
