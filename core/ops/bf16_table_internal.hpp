// Internal: a costly function of one bf16 value as a table of its 65536 results.
//
// A bf16 argument has 2^16 possible values. For an elementwise function whose float32 kernel costs
// more than a memory access per element (gelu, silu, erf, sin, log, softplus ...), reading the result
// from a table beats widening, computing and rounding: on a bf16 [2048, 512] array (2 threads, AMD
// EPYC Zen 4) gelu's value takes 0.16 ms instead of 0.27 ms, its value and derivative (the fused
// linear's pair) 0.22 ms instead of 0.34 ms. Each table is filled
// by the function's own float32 kernel, on the same aligned float32 runs the computing path uses, and
// rounded by the same f32_to_bf16, so every result read from it has exactly the bits the computation
// gives (tests/test_bf16.cpp checks all 65536 inputs of every tabulated op, flushing subnormals and
// not). Results depend on the floating-point state of the thread computing them (subnormals flushed
// or not, the rounding mode), so each state has its own table, filled the first time a thread in that
// state needs it, in that thread.
#pragma once

#include <linum/core/dtype.hpp>
#include <linum/core/fp_mode.hpp>
#include <linum/core/ops/kernel_util.hpp>

#include <array>
#include <atomic>
#include <bit>
#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <memory>
#include <mutex>

namespace linum::ops::detail {

constexpr std::int64_t kBf16Values = 65536;
static_assert(kBf16Values % kChunk == 0, "a table is filled in whole chunks");
// Arrays with fewer elements compute instead: filling a table costs about as much as computing 65536
// elements (4x a first array at this threshold, once per function and floating-point mode).
constexpr std::int64_t kBf16TableMinElements = 16384;

// Calls that read a table (tests check that the ops they cover do).
inline std::atomic<std::int64_t> g_bf16_table_reads{0};

// The tables of one function (Entry per bf16 input), one per floating-point state.
template <class Entry>
class Bf16Tables {
 public:
  // The table for the calling thread's floating-point state, filled on first use by
  // fill(const float* x, Entry* out, std::int64_t n): n = kChunk widened bf16 values, 64-byte
  // aligned (whole packets), in the calling thread.
  template <class Fill>
  const Entry* get(Fill&& fill) {
    const unsigned key = linum::detail::fp_state_key();
    if (const Entry* t = ready_[key].load(std::memory_order_acquire)) return t;
    std::lock_guard<std::mutex> lock(mutex_);
    if (const Entry* t = ready_[key].load(std::memory_order_relaxed)) return t;
    auto table = std::make_unique<Entry[]>(kBf16Values);
    alignas(64) float x[kChunk];
    for (std::int64_t s = 0; s < kBf16Values; s += kChunk) {
      for (std::int64_t i = 0; i < kChunk; ++i) x[i] = std::bit_cast<float>(static_cast<std::uint32_t>(s + i) << 16);
      fill(static_cast<const float*>(x), table.get() + s, kChunk);
    }
    owned_[key] = std::move(table);
    ready_[key].store(owned_[key].get(), std::memory_order_release);
    return owned_[key].get();
  }

 private:
  std::array<std::atomic<const Entry*>, linum::detail::kFpStateKeys> ready_{};
  std::array<std::unique_ptr<Entry[]>, linum::detail::kFpStateKeys> owned_;
  std::mutex mutex_;
};

// out[i] = table[x[i]] for i < n (out may be x itself).
inline void bf16_lookup(const bfloat16* table, const bfloat16* x, bfloat16* out, std::int64_t n) {
#if defined(__clang__)
#pragma clang loop vectorize(assume_safety)
#elif defined(__GNUC__)
#pragma GCC ivdep
#endif
  for (std::int64_t i = 0; i < n; ++i) out[i] = table[x[i].bits];
}

// A table of pairs (low half: the first result, high half: the second), read into two arrays; either
// may be x itself.
inline void bf16_lookup_pair(const std::uint32_t* table, const bfloat16* x, bfloat16* first, bfloat16* second,
                             std::int64_t n) {
#if defined(__clang__)
#pragma clang loop vectorize(assume_safety)
#elif defined(__GNUC__)
#pragma GCC ivdep
#endif
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint32_t t = table[x[i].bits];
    first[i].bits = static_cast<std::uint16_t>(t);
    second[i].bits = static_cast<std::uint16_t>(t >> 16);
  }
}

// The same, for a `second` array that nothing reads soon (the fused linear's kept derivative, read
// in the backward pass): the pairs are read 64 at a time into a staging run, then split with vector
// stores, the second halves written around the caches (non-temporal stores) where AVX-512 is
// there and `second` is 32-byte aligned. The same values as bf16_lookup_pair; x must not be
// `second`.
inline void bf16_lookup_pair_streaming(const std::uint32_t* table, const bfloat16* x, bfloat16* first,
                                       bfloat16* second, std::int64_t n) {
#if defined(__AVX512F__)
  if (reinterpret_cast<std::uintptr_t>(second) % 32 == 0) {
    constexpr std::int64_t kStage = 64;
    alignas(64) std::uint32_t staged[kStage];
    std::int64_t i = 0;
    for (; i + kStage <= n; i += kStage) {
      for (std::int64_t j = 0; j < kStage; ++j) staged[j] = table[x[i + j].bits];
      for (std::int64_t j = 0; j < kStage; j += 16) {
        const __m512i t = _mm512_load_si512(static_cast<const void*>(staged + j));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(first + i + j), _mm512_cvtepi32_epi16(t));
        _mm256_stream_si256(reinterpret_cast<__m256i*>(second + i + j), _mm512_cvtepi32_epi16(_mm512_srli_epi32(t, 16)));
      }
    }
    _mm_sfence();  // the streamed stores are visible before anything that follows (another thread's reads)
    bf16_lookup_pair(table, x + i, first + i, second + i, n - i);
    return;
  }
#endif
  bf16_lookup_pair(table, x, first, second, n);
}

}  // namespace linum::ops::detail
