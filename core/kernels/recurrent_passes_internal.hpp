// Internal (not installed: it pulls in Eigen): what the fused recurrent layers' kernels (lstm.cpp,
// gru.cpp) share besides their layout (recurrent_blocks.hpp): the per-row scratch that makes a cell
// row's bits independent of where the row is stored, per-thread buffers, and the handling of
// exceptions and threads inside their parallel regions.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/kernels/recurrent_blocks.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linum::kernels::recurrent {

// A cell row is computed in aligned scratch, each run of w units padded to whole packets (padding
// repeats the run's first element): Eigen then takes the same packet path for every element
// whatever the address it is stored at, so a forward pass, its recomputation in another buffer and
// any thread give the same bits.
inline constexpr std::int64_t kLanes = 16;
// A chunk's first step starts a whole number of packets into a [T, N, width] buffer whatever N and
// width: keeping and recomputing a chunk's gates then see the same alignment.
static_assert(kChunk % kLanes == 0);
inline std::int64_t padded(std::int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }
using Aligned = Eigen::Map<Eigen::ArrayXf, Eigen::Aligned64>;
using Run = Eigen::Map<Eigen::ArrayXf>;
using ConstRun = Eigen::Map<const Eigen::ArrayXf>;

inline void load(const float* src, std::int64_t n, std::int64_t width, float* dst) {
  std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
  for (std::int64_t j = n; j < width; ++j) dst[j] = dst[0];
}
inline void store(const float* src, std::int64_t n, float* dst) {
  std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
}

// The first exception a worker thread raised (the others keep running the passes' barriers).
struct Failure {
  std::exception_ptr first;
  template <class F>
  void run(F&& f) {
    try {
      f();
    } catch (...) {
#pragma omp critical(linum_recurrent_failure)
      if (!first) first = std::current_exception();
    }
  }
  void rethrow() const {
    if (first) std::rethrow_exception(first);
  }
};

// Inside the passes' parallel regions: oneDNN's products (and anything else) called from a worker
// run on that thread alone, also when the team has one thread (an inactive region, where oneDNN
// would otherwise start a team of its own): the results then never depend on the team's size.
inline void single_threaded_calls() {
#ifdef _OPENMP
  omp_set_num_threads(1);
#endif
}

inline int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// Per-thread buffers of `per_thread` floats, allocated before a parallel region (an allocation
// failure inside one would end the process), as an Array so that the memory accounting sees them.
struct PerThread {
  Array buffer;
  std::int64_t per_thread;
  PerThread(int threads, std::int64_t floats) : per_thread(padded(floats)) {
    buffer = Array::empty(Shape{std::max(1, threads) * per_thread});
  }
  float* of_this_thread() { return buffer.mutable_data() + thread_index() * per_thread; }
};

// Workspace as Arrays, so that the memory accounting (peaks, timelines) sees it.
inline float* workspace(Array& a, std::int64_t floats) {
  a = Array::empty(Shape{floats});
  return a.mutable_data();
}

// The hidden state before each step of the first chunk, contiguous (the weight gradient's operand
// [steps * N, H]; later chunks read ys directly): h0, then ys of the chunk's steps but the last.
inline float* states_before_first_chunk(Array& a, const Dims& d, const float* h0, const float* ys) {
  const std::int64_t len = std::min(kChunk, d.steps), carry = d.rows * d.hidden;
  float* out = workspace(a, len * carry);
  if (len == 0) return out;
  std::memcpy(out, h0, static_cast<std::size_t>(carry) * sizeof(float));
  std::memcpy(out + carry, ys, static_cast<std::size_t>((len - 1) * carry) * sizeof(float));
  return out;
}

}  // namespace linum::kernels::recurrent
