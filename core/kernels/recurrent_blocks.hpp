// The fused recurrent layers' work layout (lstm.cpp, gru.cpp): hidden units in fixed blocks, each
// block's gates side by side, time steps in fixed chunks. The same cut on every run, whatever the
// thread count, so results are bitwise reproducible.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

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
  UnitBlocks(std::int64_t h, std::int64_t g)
      : hidden(h), gates(g), unit(std::max<std::int64_t>(1, std::min(h, kUnitBlock))), count((h + unit - 1) / unit) {}
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

}  // namespace linum::kernels::recurrent
