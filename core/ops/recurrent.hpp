// Fused recurrent ops. LSTM: the cell (the gate nonlinearities and the state update of one time
// step in one op, one pass forward, one pass backward) and the whole layer over time, as PyTorch's
// and oneDNN's LSTM kernels fuse them. GRU: the whole layer (gru_layer, below).
//
//   auto [c_next, h_next] = lstm_cell(x_gates, h_gates, c);
//
// x_gates and h_gates are the two products feeding the gates ([..., 4 * hidden]: the input's and
// the recurrent state's, biases added to either); their sum z is laid out [i | f | g | o] along the
// last axis (the order of Flax's OptimizedLSTMCell and of PyTorch's nn.LSTM):
//   i = sigmoid(z_i), f = sigmoid(z_f), g = tanh(z_g), o = sigmoid(z_o),
//   c_next = f * c + i * g,  h_next = o * tanh(c_next).
// c is [..., hidden] with the gates' leading axes. Computed in float32 (bf16 widened on load), the
// results rounded once to the promoted dtype of the three inputs. The backward rule keeps only the
// inputs and computes the gates again (no activations kept per step); it is one pass that gives
// the gates' gradient (the same array for both products) and c's.
#pragma once

#include <linum/core/array.hpp>

#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace linum {

// (c_next, h_next); see above.
std::pair<Array, Array> lstm_cell(const Array& x_gates, const Array& h_gates, const Array& c);

// A whole LSTM layer over time in one op, as PyTorch's nn.LSTM and cuDNN run it:
//
//   auto [ys, c_last, h_last] = lstm_layer(x, input_kernel, bias, recurrent_kernel, c0, h0);
//
// x [time, batch, in] (time-major); input_kernel [in, 4 * hidden], recurrent_kernel [hidden,
// 4 * hidden] and bias [4 * hidden] in gate order [i | f | g | o]; c0, h0 [batch, hidden]. Step t
// computes the gates x_t . input_kernel + h . recurrent_kernel + bias and then lstm_cell's
// equations; ys [time, batch, hidden] are the h of every step. Computed in float32: bf16 arguments
// are widened and the results rounded back once; with a bf16 recurrent kernel every product (the
// input and recurrent products, and the backward pass's products for the cotangents and the
// weights' gradients) rounds its operands to bf16 and sums in float32, as oneDNN's and PyTorch's
// bf16 LSTMs do (about twice the speed of float32 products on CPUs with AVX512-BF16); the cell's
// math and the states stay float32.
//
// The input products run as one product per chunk of 16 steps, and the backward pass computes the
// weights' gradients as one product per 8 steps (not one per step), the hidden units split into
// fixed blocks among the threads: results are bitwise the same for any thread count.
// What the forward pass keeps: every step's gate activations and cell state (4 + 1 floats per
// hidden unit and row), or, with `recompute_segment` S > 0 (rounded up to a multiple of 16), only
// the cell state every S steps; the backward pass then computes each segment's steps again from
// it (remat over time inside the op). Both give bitwise the same gradients.
//
// `seq_lengths` (int32 [batch], each in [0, time]), as Flax's nn.RNN: every row still runs all the
// steps (ys are the unmasked recurrence's; mask the padded steps' outputs in the loss), and row b's
// final carry (c_last, h_last) is its state after seq_lengths[b] steps, c0 / h0 for 0. (Flax reads a
// length of 0 as the last step's carry, an artefact of indexing at -1.)
//
// `dtype`, as Flax's modules' dtype: the layer computes as if x and the weights were cast to it
// first (the carries as given; results in the promoted dtype of it and the carries). With bf16 and
// float32 parameters (Flax's dtype=bf16, param_dtype=float32; PyTorch's autocast) the op reads the
// float32 arrays where they are and rounds what it reads (each product's operands, its interleaved
// copies of the input kernel and the biases): bitwise the layer on cast copies, with the same
// gradients (the cotangents of x and the weights rounded to bf16, as the casts' would be), but no
// cast copy is made, and none kept for the backward pass. (Arguments already bf16 are widened to
// float32 copies, as without the option.)
struct LSTMLayerOptions {
  std::int64_t recompute_segment = 0;
  std::optional<Array> seq_lengths;
  std::optional<DType> dtype;  // the computation dtype (float32 or bf16); none: the arguments' own
};
inline constexpr std::int64_t kLSTMLayerChunk = 16;  // steps per input product and weight-gradient product
std::tuple<Array, Array, Array> lstm_layer(const Array& x, const Array& input_kernel, const Array& bias,
                                           const Array& recurrent_kernel, const Array& c0, const Array& h0,
                                           const LSTMLayerOptions& options = {});
// The same with each of the kernels and the bias given as one array or as one array per gate, in
// gate order i, f, g, o: input kernels [in, hidden], biases [hidden], recurrent kernels [hidden,
// hidden], as Flax's LSTMCell keeps them. The op reads the gates where they are (no concatenated
// copy made or kept) and returns each part's own gradient; results are bitwise those of the
// concatenated arrays.
std::tuple<Array, Array, Array> lstm_layer(const Array& x, const std::vector<Array>& input_kernel, const std::vector<Array>& bias,
                                           const std::vector<Array>& recurrent_kernel, const Array& c0, const Array& h0,
                                           const LSTMLayerOptions& options = {});

// A whole GRU layer over time in one op (PyTorch's nn.GRU; Flax's GRUCell scanned by nn.RNN):
//
//   auto [ys, h_last] = gru_layer(x, input_kernel, input_bias, recurrent_kernel, recurrent_bias, h0);
//
// x [time, batch, in] (time-major); input_kernel [in, 3 * hidden], recurrent_kernel [hidden,
// 3 * hidden], input_bias and recurrent_bias [3 * hidden], all in gate order [r | z | n]; h0
// [batch, hidden]. Step t computes xg = x_t . input_kernel + input_bias and hg = h .
// recurrent_kernel + recurrent_bias, then
//   r = sigmoid(xg_r + hg_r), z = sigmoid(xg_z + hg_z), n = tanh(xg_n + r * hg_n),
//   h = (1 - z) * n + z * h.
// (Flax's GRUCell has biases on its input kernels ir, iz, in and on hn only: recurrent_bias
// [0 | 0 | b_hn].) ys [time, batch, hidden] are the h of every step. float32 (bf16 arguments are
// widened, results rounded back; a bf16 recurrent kernel makes the products bf16, as lstm_layer's).
//
// Products and threads as lstm_layer's: input products per chunk of 16 steps, one recurrent product
// per step, the weights' gradients per 8 steps, results bitwise the same for any thread count. What
// the forward pass keeps: the gates r, z, n and hg_n of every step (4 floats per hidden unit and
// row), or with `recompute` nothing beyond the outputs: a GRU's state is its output, so the backward
// pass computes each chunk's gates again from ys with the forward pass's products (remat over time
// at the cost of the forward's products, without segments); the gradients are bitwise the same.
// `seq_lengths` as lstm_layer's: all steps run; row b's h_last is its state after seq_lengths[b]
// steps (h0 for 0). `dtype` as lstm_layer's.
struct GRULayerOptions {
  bool recompute = false;
  std::optional<Array> seq_lengths;
  std::optional<DType> dtype;
};
std::pair<Array, Array> gru_layer(const Array& x, const Array& input_kernel, const Array& input_bias,
                                  const Array& recurrent_kernel, const Array& recurrent_bias, const Array& h0,
                                  const GRULayerOptions& options = {});
// The same with each kernel and bias given as one array or as one array per gate, in gate order r,
// z, n (as Flax's GRUCell keeps them; its absent recurrent biases of r and z are zeros), read where
// they are; results bitwise those of the concatenated arrays.
std::pair<Array, Array> gru_layer(const Array& x, const std::vector<Array>& input_kernel, const std::vector<Array>& input_bias,
                                  const std::vector<Array>& recurrent_kernel, const std::vector<Array>& recurrent_bias,
                                  const Array& h0, const GRULayerOptions& options = {});

}  // namespace linum
