// Internal: the fused LSTM layer's kernels (the op is lstm_layer, core/ops/recurrent.hpp), float32,
// row-major, time-major.
//
// Work is cut the same way on every run, whatever the thread count, so results are bitwise
// reproducible: the hidden units in fixed blocks (each block's four gates are adjacent columns of
// the interleaved weights below), the batch's rows in pieces fixed by their count (RowPieces: each
// piece's steps run on one thread without a barrier per step), the time steps in fixed chunks of
// kChunk (the input products are one product per chunk, the weight gradients one per
// kGradientSteps). A forward pass that keeps
// its activations and one that keeps the cell state every `segment` steps and computes a segment
// again in the backward pass run the same products on the same operands, so their gradients are
// bitwise equal.
#pragma once

#include <linum/core/kernels/recurrent_blocks.hpp>

#include <cstdint>

namespace linum::kernels::lstm {

inline constexpr std::int64_t kChunk = recurrent::kChunk;  // time steps per input product and weight-gradient product
using Dims = recurrent::Dims;

inline constexpr std::int64_t kGates = 4;
// The interleaved layout of [rows, 4H] matrices (the kernels', the biases', the gates'): blocks of
// hidden units, each holding its units' i, f, g, o columns side by side (recurrent_blocks.hpp).
inline recurrent::UnitBlocks blocks_of(std::int64_t hidden) { return recurrent::UnitBlocks(hidden, kGates); }

// One row of the cell over `w` hidden units (also lstm_cell's kernel): `gates` holds the
// pre-activations [i | f | g | o] (w each) and is replaced by the activations; c = f * c_prev + i *
// g, h = o * tanh(c) (h null: not written). Computed where the runs are when they all sit at 64-byte
// boundaries and w fills whole packets, else in `scratch` (cell_scratch_floats(w) floats, 64-byte
// aligned) on runs padded to whole packets: the same functions on the same packets either way, so
// the bits never depend on where the row is stored.
std::int64_t cell_scratch_floats(std::int64_t w);
void cell_row(float* gates, std::int64_t w, const float* c_prev, float* c, float* h, float* scratch);
// Its backward step: from the activations, c_prev and c, the cotangent of h (dh) and of c (dc,
// replaced by c_prev's), the gates' cotangents [i | f | g | o] into d_gates, which may be `acts`
// itself (each gate's run is written after its last read) but must not overlap it otherwise.
void cell_row_backward(const float* acts, std::int64_t w, const float* c_prev, const float* c, const float* dh, float* dc,
                       float* d_gates, float* scratch);

// Everything the passes read and write. wi [I, 4H] and b [4H] interleaved, wh [H, 4H] in gate order
// (the passes pack it a block at a time, or whole once for row pieces; recurrent_passes_internal.hpp); x [T, N, I];
// c0, h0 [N, H]; ys [T, N, H] (the h of every step). acts [T', N, 4H] and cs [T', N, H] hold the
// gate activations and cell states of the steps kept (T' = T when keeping all, else a segment).
struct Forward {
  Dims d;
  const float *x, *wi;
  recurrent::GateColumns wh;
  const float *b, *c0, *h0;
  float* ys;
  float* acts;       // T steps (keep all) or null (recompute mode)
  float* cs;         // T steps (keep all), or the cell state at each segment's start (recompute mode)
  std::int64_t segment = 0;  // 0: keep all; else a multiple of kChunk
  float* c_last;     // [N, H]: the final cell state (row n's at step lengths[n] - 1 with lengths)
  // Null, or each row's length [N] (0 <= lengths[n] <= T): every row still runs all T steps (ys
  // are the unmasked recurrence's, as Flax's nn.RNN with seq_lengths), but row n's final carry is
  // its state after lengths[n] steps (c0 / h0 for 0), and the backward pass adds the final carry's
  // cotangent there.
  const std::int32_t* lengths = nullptr;
};
void forward(const Forward& f);

struct Backward {
  Forward fw;            // the forward's operands and what it kept (acts / cs as above)
  const float* d_ys;     // [T, N, H] or null
  const float* d_c_last; // [N, H] or null (with fw.lengths: added at each row's last step)
  const float* d_h_last; // [N, H] or null (likewise)
  float *d_x, *d_wi, *d_wh, *d_b, *d_c0, *d_h0;  // outputs (interleaved weights' gradients); any may be null
};
void backward(const Backward& b);

}  // namespace linum::kernels::lstm
