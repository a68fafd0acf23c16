// Internal: the fused GRU layer's kernels (the op is gru_layer, core/ops/recurrent.hpp), float32,
// row-major, time-major.
//
// Gates in the order [r | z | n] (PyTorch's nn.GRU; Flax's GRUCell names them ir/hr, iz/hz, in/hn):
//   xg = x_t . wi + bi,  hg = h . wh + bh,
//   r = sigmoid(xg_r + hg_r),  z = sigmoid(xg_z + hg_z),  n = tanh(xg_n + r * hg_n),
//   h_next = (1 - z) * n + z * h.
// Work is cut as in the LSTM kernels' unit-block scheme (recurrent_blocks.hpp; the GRU does not use
// their row pieces): hidden units in fixed blocks, time steps in fixed chunks, so results are bitwise
// the same for any thread count. A GRU's state is its
// output, so what the backward pass needs again (r, z, n and hg_n of each step) can be computed
// from the outputs ys alone: the recompute mode keeps nothing per step and computes each chunk's
// gates again in the backward pass, with the same products on the same operands as the forward
// pass, so the gradients are bitwise those of the mode that keeps them.
#pragma once

#include <linum/core/kernels/recurrent_blocks.hpp>

#include <cstdint>

namespace linum::kernels::gru {

inline constexpr std::int64_t kGates = 3;
using Dims = recurrent::Dims;

// The interleaved layout of [rows, 3H] matrices (the kernels', the biases', the gates').
recurrent::UnitBlocks blocks_of(std::int64_t hidden);

// One row of the cell over w units (the passes' kernel): `gates` holds xg [r | z | n] (w each),
// replaced by the activations r, z, n; hg the recurrent product's row [r | z | n], to which the
// recurrent biases bh are added; hg_n (with its bias) to hgn and the new state to h (either null:
// not written). Computed where the runs are when they sit at 64-byte boundaries and w fills whole
// packets, else in `scratch` (cell_scratch_floats(w) floats, 64-byte aligned): the same bits.
std::int64_t cell_scratch_floats(std::int64_t w);
void cell_row(float* gates, float* hg, const float* bh, std::int64_t w, const float* h_prev, float* hgn, float* h,
              float* scratch);
// Its backward step: from the activations, hg_n, h_prev and the cotangent reaching the new state,
// the gates' cotangents for the input product into d_xg, the n gate's for the recurrent product into
// d_hgn, and h_prev's cotangent not through the products into dh_prev. d_xg may be `acts` and d_hgn
// `hgn` (each run is written after its last read), but must not overlap them otherwise.
void cell_row_backward(const float* acts, const float* hgn, std::int64_t w, const float* h_prev, const float* dh_in,
                       float* d_xg, float* d_hgn, float* dh_prev, float* scratch);

// Everything the passes read and write. wi [I, 3H], bi and bh [3H] interleaved, wh [H, 3H] in gate
// order (the passes pack it a block at a time);
// x [T, N, I]; h0 [N, H]; ys [T, N, H] (the h of every step). acts [T, N, 3H] (r, z, n) and hgn
// [T, N, H] (hg_n) keep what the backward pass reads, or both null: recompute mode.
struct Forward {
  Dims d;
  const float *x, *wi;
  recurrent::GateColumns wh;
  const float *bi, *bh, *h0;
  float* ys;
  float* acts;
  float* hgn;
  // Null, or each row's length [N] (0 <= lengths[n] <= T): all T steps run for every row (Flax's
  // nn.RNN with seq_lengths), the final carry of row n is its state after lengths[n] steps (the op
  // reads it from ys), and the backward pass adds the final carry's cotangent there.
  const std::int32_t* lengths = nullptr;
};
void forward(const Forward& f);

struct Backward {
  Forward fw;             // the forward's operands and what it kept (acts / hgn, or null)
  const float* d_ys;      // [T, N, H] or null
  const float* d_h_last;  // [N, H] or null (with fw.lengths: added at each row's last step)
  float *d_x, *d_wi, *d_wh, *d_bi, *d_bh, *d_h0;  // outputs (interleaved weights' gradients); any may be null
};
void backward(const Backward& b);

}  // namespace linum::kernels::gru
