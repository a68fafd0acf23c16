// The fused recurrent layers' work layout (lstm.cpp, gru.cpp): hidden units in fixed blocks, each
// block's gates side by side, time steps in fixed chunks. The same cut on every run, whatever the
// thread count, so results are bitwise reproducible.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>

namespace linum::kernels::recurrent {

struct Dims {
  std::int64_t steps = 0, rows = 0, inputs = 0, hidden = 0;  // T, N, I, H
  // Every product of the passes (the recurrent ones per step, the input projections, the weights'
  // and the inputs' cotangents) on bf16-rounded operands with float32 sums, for layers whose
  // weights are bf16; the cells and every sum of products stay float32.
  bool bf16_products = false;
};

inline constexpr std::int64_t kChunk = 16;  // time steps per input product (and per recomputation of a GRU's gates)
// Time steps per weight-gradient product in the backward passes (half a chunk): with kept
// activations the gates' cotangents then need a buffer this many steps long.
inline constexpr std::int64_t kGradientSteps = kChunk / 2;
inline constexpr std::int64_t kUnitBlock = 128;  // hidden units per block

// The batch's rows cut into `count` equal pieces of `rows` rows. A row's steps read only its own h
// and c, so each piece's recurrence runs on one thread without waiting for the others: no barrier
// per step, only where a chunk's input products or a part's weight gradients (over every row) are
// made. The cut depends on the row count alone (a power of two of pieces, at least kPieceRows rows
// each, at most kMaxPieces; or two halves of an even batch of kPieceRows to 2 kPieceRows - 1 rows),
// so the bits never depend on the thread count. One piece (batches under kPieceRows, odd ones) runs
// the steps by unit blocks across the threads instead, one barrier per step.
struct RowPieces {
  static constexpr std::int64_t kPieceRows = 16, kMaxPieces = 8;
  std::int64_t count = 1, rows = 0;
  explicit RowPieces(std::int64_t n) : rows(n) {
    while (count * 2 <= kMaxPieces && n % (count * 2) == 0 && n / (count * 2) >= kPieceRows) count *= 2;
    if (count == 1 && n >= kPieceRows && n % 2 == 0) count = 2;
    rows = n / count;
  }
  std::int64_t first(std::int64_t piece) const { return piece * rows; }
};

// A [rows, gates * H] matrix in gate order (a kernel, a bias, their gradients), given by where each
// gate's H columns start and the row stride: one array [rows, gates * H] (gate k at data + k * H,
// ld = gates * H), or one array per gate [rows, H] (ld = H; Flax's cells keep a kernel per gate).
template <class T>
struct GateColumnsOf {
  std::array<T*, 4> gate{};
  std::int64_t ld = 0;
  T* row(int k, std::int64_t r) const { return gate[static_cast<std::size_t>(k)] + r * ld; }
};
using GateColumns = GateColumnsOf<const float>;
using MutableGateColumns = GateColumnsOf<float>;

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
  // Block b's columns of rows [r0, r0 + rows) as they sit in the interleaved layout: out [rows,
  // gates * width(b)] (gate k's columns of the block's units at k * width(b)).
  void gather_block(const GateColumns& in, std::int64_t r0, std::int64_t rows, std::int64_t b, float* out) const {
    const std::int64_t w = width(b);
    for (std::int64_t r = 0; r < rows; ++r)
      for (int k = 0; k < gates; ++k) copy_run(in.row(k, r0 + r) + first(b), w, out + (r * gates + k) * w);
  }
  // Rows [r0, r0 + rows) into the interleaved layout: out [rows, gates * H].
  void interleave(const GateColumns& in, std::int64_t r0, std::int64_t rows, float* out) const {
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t b = 0; b < count; ++b)
        for (int k = 0; k < gates; ++k)
          copy_run(in.row(k, r0 + r) + first(b), width(b), out + r * gates * hidden + base(b) + k * width(b));
  }
  // An interleaved [rows, gates * H] matrix back into gate order.
  void deinterleave(const float* in, std::int64_t rows, const MutableGateColumns& out) const {
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t b = 0; b < count; ++b)
        for (int k = 0; k < gates; ++k)
          copy_run(in + r * gates * hidden + base(b) + k * width(b), width(b), out.row(k, r) + first(b));
  }

 private:
  static void copy_run(const float* from, std::int64_t n, float* to) {
    std::memcpy(to, from, static_cast<std::size_t>(n) * sizeof(float));
  }
};

}  // namespace linum::kernels::recurrent
