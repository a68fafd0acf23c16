// Internal: what the fused recurrent layers' kernels (lstm.cpp, gru.cpp) share: the gate layout
// (hidden units in fixed blocks, each block's gates side by side), the per-row scratch that makes a
// cell row's bits independent of where the row is stored, per-thread buffers, and the handling of
// exceptions and threads inside their parallel regions.
#pragma once

#include <linum/core/array.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linum::kernels::recurrent {

struct Dims {
  std::int64_t steps = 0, rows = 0, inputs = 0, hidden = 0;  // T, N, I, H
};

inline constexpr std::int64_t kChunk = 16;      // time steps per input product and weight-gradient product
inline constexpr std::int64_t kUnitBlock = 128;  // hidden units per block

// The hidden units in blocks of kUnitBlock (the last one narrower); columns of a [rows, gates * H]
// matrix are interleaved so that block b's gates are adjacent: gate k of the block's units sits at
// base(b) + k * width(b).
struct UnitBlocks {
  std::int64_t hidden = 0, gates = 0, unit = 0, count = 0;
  UnitBlocks(std::int64_t h, std::int64_t g) : hidden(h), gates(g), unit(std::min(h, kUnitBlock)), count((h + unit - 1) / unit) {}
  std::int64_t first(std::int64_t b) const { return b * unit; }
  std::int64_t width(std::int64_t b) const { return std::min(unit, hidden - b * unit); }
  std::int64_t base(std::int64_t b) const { return gates * first(b); }  // the block's first interleaved column
  std::int64_t column(int gate, std::int64_t u) const {
    const std::int64_t b = u / unit;
    return base(b) + gate * width(b) + (u - first(b));
  }
  // A [rows, gates * H] matrix with columns in gate order into the interleaved layout, and back.
  void interleave(const float* in, float* out, std::int64_t rows) const { copy(in, out, rows, true); }
  void deinterleave(const float* in, float* out, std::int64_t rows) const { copy(in, out, rows, false); }

 private:
  void copy(const float* in, float* out, std::int64_t rows, bool to_blocks) const {
    const std::int64_t stride = gates * hidden;
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t b = 0; b < count; ++b)
        for (std::int64_t k = 0; k < gates; ++k) {
          const std::int64_t plain = r * stride + k * hidden + first(b), blocked = r * stride + base(b) + k * width(b);
          std::memcpy(out + (to_blocks ? blocked : plain), in + (to_blocks ? plain : blocked),
                      static_cast<std::size_t>(width(b)) * sizeof(float));
        }
  }
};

// A cell row is computed in aligned scratch, each run of w units padded to whole packets (padding
// repeats the run's first element): Eigen then takes the same packet path for every element
// whatever the address it is stored at, so a forward pass, its recomputation in another buffer and
// any thread give the same bits.
inline constexpr std::int64_t kLanes = 16;
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

}  // namespace linum::kernels::recurrent
