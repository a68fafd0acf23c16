// Recurrent layers, as flax.linen's: the cells LSTMCell, OptimizedLSTMCell, GRUCell, MGUCell,
// SimpleCell and ConvLSTMCell (parameter names, shapes, gate layout and initializers as Flax's, so
// variable dicts move between the two), nn::RNN, which scans a cell over the time axis, and
// nn::Bidirectional, which runs one RNN forwards and another backwards and merges their outputs.
//
//   nn::RNN<nn::LSTMCell> lstm{.cell = {.features = 128}};
//   Array ys = s(lstm, xs);                                       // xs [batch, time, in] -> [batch, time, 128]
//   auto [carry, ys2] = s(lstm, xs, nn::RNNOptions{.return_carry = true, .seq_lengths = lengths});
//
// A cell is called as cell(scope, carry, x) -> (new carry, y) on one time step; initialize_carry
// gives the zero carry for inputs of a given shape. Gates are Flax's: sigmoid gates, tanh
// activations.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/autodiff/pytree.hpp>
#include <linum/core/ops/all.hpp>
#include <linum/lift/remat.hpp>
#include <linum/lift/scan.hpp>
#include <linum/modules/initializers.hpp>
#include <linum/modules/scope.hpp>
#include <linum/nn/conv.hpp>
#include <linum/nn/dtypes.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace linum::nn {

// A cell's gate or activation function (Flax's gate_fn / activation_fn), e.g. nn::relu.
using CellFunction = std::function<Array(const Array&)>;

// The cells' default gate and activation functions, as named types: nn::RNN recognizes them (and
// linum::sigmoid / linum::tanh given as functions) and runs LSTMs and GRUs as one fused layer op
// (lstm_layer, gru_layer).
struct Sigmoid {
  Array operator()(const Array& x) const { return sigmoid(x); }
};
struct Tanh {
  Array operator()(const Array& x) const { return tanh(x); }
};

// An LSTM's carry: the cell state c and the hidden state h, by name. Flax's carry is the tuple
// (c, h) and PyTorch's nn.LSTM returns (h, c): named members keep the two apart. It is a pytree
// (scan, grad and checkpoint see both arrays) and unpacks as `auto [c, h] = carry`.
struct LSTMCarry {
  Array c, h;
};

// Long short-term memory (flax.linen.LSTMCell): i = sigmoid(ii(x) + hi(h)), f, g = tanh(...), o
// likewise, c' = f c + i g, h' = o tanh(c') (sigmoid is gate_fn, tanh activation_fn). Input kernels ii, if, ig, io have no bias; the
// recurrent ones hi, hf, hg, ho have one. Carry: LSTMCarry{c, h}.
struct LSTMCell {
  std::int64_t features = 0;
  CellFunction gate_fn = Sigmoid{};
  CellFunction activation_fn = Tanh{};
  Initializer kernel_init = initializers::lecun_normal();
  Initializer recurrent_kernel_init = initializers::orthogonal();
  Initializer bias_init = initializers::zeros();
  std::optional<DType> dtype;
  DType param_dtype = DType::f32;

  using Carry = LSTMCarry;
  std::pair<Carry, Array> operator()(Scope& s, const Carry& carry, const Array& x) const;
  Carry initialize_carry(const Shape& input_shape) const;
};

// The same LSTM with the four input products and the four recurrent ones each done as one product
// on concatenated kernels (flax.linen.OptimizedLSTMCell): the same parameters, names and results
// within float rounding; faster for small hidden sizes. The concatenated kernels are built on every
// call and kept for its backward pass (5 x features^2 floats per time step in an RNN), so over long
// sequences prefer LSTMCell, or remat.
struct OptimizedLSTMCell {
  std::int64_t features = 0;
  CellFunction gate_fn = Sigmoid{};
  CellFunction activation_fn = Tanh{};
  Initializer kernel_init = initializers::lecun_normal();
  Initializer recurrent_kernel_init = initializers::orthogonal();
  Initializer bias_init = initializers::zeros();
  std::optional<DType> dtype;
  DType param_dtype = DType::f32;

  using Carry = LSTMCarry;
  std::pair<Carry, Array> operator()(Scope& s, const Carry& carry, const Array& x) const;
  Carry initialize_carry(const Shape& input_shape) const;
};

// Gated recurrent unit (flax.linen.GRUCell): r = sigmoid(ir(x) + hr(h)), z = sigmoid(iz(x) +
// hz(h)), n = tanh(in(x) + r * hn(h)), h' = (1 - z) n + z h (sigmoid is gate_fn, tanh activation_fn). Input kernels have biases; of the
// recurrent ones only hn. Carry h.
struct GRUCell {
  std::int64_t features = 0;
  CellFunction gate_fn = Sigmoid{};
  CellFunction activation_fn = Tanh{};
  Initializer kernel_init = initializers::lecun_normal();
  Initializer recurrent_kernel_init = initializers::orthogonal();
  Initializer bias_init = initializers::zeros();
  std::optional<DType> dtype;
  DType param_dtype = DType::f32;

  using Carry = Array;
  std::pair<Carry, Array> operator()(Scope& s, const Carry& carry, const Array& x) const;
  Carry initialize_carry(const Shape& input_shape) const;
};

// Elman cell (flax.linen.SimpleCell): h' = tanh(i(x) + h(h) [+ h if residual]) (tanh is
// activation_fn); i has a bias.
struct SimpleCell {
  std::int64_t features = 0;
  CellFunction activation_fn = Tanh{};
  Initializer kernel_init = initializers::lecun_normal();
  Initializer recurrent_kernel_init = initializers::orthogonal();
  Initializer bias_init = initializers::zeros();
  std::optional<DType> dtype;
  DType param_dtype = DType::f32;
  bool residual = false;

  using Carry = Array;
  std::pair<Carry, Array> operator()(Scope& s, const Carry& carry, const Array& x) const;
  Carry initialize_carry(const Shape& input_shape) const;
};

// Minimal gated unit (flax.linen.MGUCell, Zhou et al. 2016): f = sigmoid(if(x) + hf(h)), n =
// tanh(in(x) + f * hn(h)) (without reset_gate: + hn(h)), h' = (1 - f) n + f h. One gate where the
// GRU has two. The input kernels if, in have biases (if's starts at forget_bias_init, ones, so the
// unit starts by keeping its state); hn has one only with reset_gate; hf has none.
struct MGUCell {
  std::int64_t features = 0;
  CellFunction gate_fn = Sigmoid{};
  CellFunction activation_fn = Tanh{};
  Initializer kernel_init = initializers::lecun_normal();
  Initializer recurrent_kernel_init = initializers::orthogonal();
  Initializer forget_bias_init = initializers::ones();
  Initializer activation_bias_init = initializers::zeros();
  std::optional<DType> dtype;
  DType param_dtype = DType::f32;
  bool reset_gate = true;

  using Carry = Array;
  std::pair<Carry, Array> operator()(Scope& s, const Carry& carry, const Array& x) const;
  Carry initialize_carry(const Shape& input_shape) const;
};

// Convolutional LSTM (flax.linen.ConvLSTMCell, Shi et al. 2015): the LSTM's products become
// convolutions, gates = ih(x) + hh(h) with two Convs of 4 * features channels (in gate order i, g,
// f, o), c' = sigmoid(f + 1) c + sigmoid(i) tanh(g), h' = sigmoid(o) tanh(c'). Inputs are one
// step's images [batch, spatial..., channels]; the carry LSTMCarry{c, h} has the input's spatial
// shape and `features` channels (keep strides at 1 and padding SAME for that to hold).
struct ConvLSTMCell {
  std::int64_t features = 0;
  std::vector<std::int64_t> kernel_size;
  std::vector<std::int64_t> strides;
  Padding padding = Padding::same();
  bool use_bias = true;
  std::optional<DType> dtype;
  DType param_dtype = DType::f32;

  using Carry = LSTMCarry;
  std::pair<Carry, Array> operator()(Scope& s, const Carry& carry, const Array& x) const;
  Carry initialize_carry(const Shape& input_shape) const;
};

// Per-call settings of nn::RNN (Flax's call arguments).
struct RNNOptions {
  bool return_carry = false;           // return (final carry, outputs) instead of the outputs
  // int32 [batch], each in [0, time] (else ValueError): row b's final carry is its carry after
  // seq_lengths[b] steps, and `reverse` runs each row's first seq_lengths[b] steps backwards
  // (padding stays at the end). As Flax's nn.RNN, every row still runs all the steps: outputs at
  // padded steps are the unmasked recurrence's (mask them in the loss). One difference: a length
  // of 0 gives the initial carry, where Flax indexes step -1 and returns the last step's carry.
  std::optional<Array> seq_lengths;
};

namespace recurrent_detail {

// One time step inside the scan: the cell on (carry, x).
template <class Cell>
struct RNNStep {
  Cell cell;
  std::pair<typename Cell::Carry, Array> operator()(Scope& s, const typename Cell::Carry& carry, const Array& x) const {
    return cell(s, carry, x);  // the cell's params live in this (the "cell") scope
  }
};

// `next` where step t is row b's last (t + 1 == lengths[b]), `selected` elsewhere.
template <class Carry>
Carry select_last_step(const Carry& next, const Carry& selected, const Array& t, const Array& lengths) {
  const Array last_f = astype(equal(astype(t, DType::f32) + 1.0f, astype(lengths, DType::f32)), DType::f32);
  const std::vector<Array> n = pytree::flatten(next), o = pytree::flatten(selected);
  std::vector<Array> kept;
  for (std::size_t k = 0; k < n.size(); ++k) {
    std::vector<std::int64_t> dims(static_cast<std::size_t>(n[k].rank()), 1);
    dims[0] = lengths.dim(0);
    kept.push_back(where(reshape(last_f, dims), n[k], o[k]));
  }
  return pytree::rebuild(selected, std::span<const Array>(kept));
}

// With seq_lengths: the cell on the running carry, and each row's carry at its last step kept
// beside it (Flax picks it from every step's carry afterwards; this keeps one).
template <class Cell>
struct SelectingRNNStep {
  Cell cell;
  using Carry = typename Cell::Carry;
  std::pair<std::pair<Carry, Carry>, Array> operator()(Scope& s, const std::pair<Carry, Carry>& carry, const Array& x,
                                                       const Array& t, const Array& lengths) const {
    auto [next, y] = cell(s, carry.first, x);
    Carry selected = select_last_step(next, carry.second, t, lengths);
    return {{std::move(next), std::move(selected)}, std::move(y)};
  }
};

// Flax's flip_sequences: xs [time, batch, ...] with row b's first lengths[b] steps reversed, and
// its padding steps reversed after them.
Array flip_sequences(const Array& xs, const Array& lengths);

// seq_lengths checked (int32 [batch], each in [0, steps]) and given one per row of the layer ops
// (x's batch axes flattened: `rows` = batch * the other batch axes).
Array checked_lengths(const Array& lengths, std::int64_t batch, std::int64_t steps);
Array lengths_per_row(const Array& lengths, std::int64_t rows);

// An LSTM's parameters under Flax's names, created (at init) in Flax's order ii, hi, if, hf, ig,
// hg, io, ho, and returned one per gate in gate order i, f, g, o, as stored (param_dtype; the layer
// op computes in the cell's dtype itself, LSTMLayerOptions::dtype): the 4 input kernels [in,
// features], the 4 recurrent kernels [features, features], the 4 recurrent biases [features] (the
// layer op reads them where they are). Called in the cell's scope.
struct LSTMWeights {
  std::int64_t features = 0;
  Initializer kernel_init, recurrent_kernel_init, bias_init;
  DType param_dtype = DType::f32;
  std::vector<Array> operator()(Scope& s, const Array& inputs) const;
};

// A GRU's parameters under Flax's names, created (at init) in Flax's order ir, hr, iz, hz, in, hn,
// and returned one per gate in gate order r, z, n, as stored (param_dtype): the 3 input kernels, the
// 3 input biases, the 3 recurrent kernels and the 3 recurrent biases (zeros, zeros, hn's bias).
// Called in the cell's scope.
struct GRUWeights {
  std::int64_t features = 0;
  Initializer kernel_init, recurrent_kernel_init, bias_init;
  DType param_dtype = DType::f32;
  std::vector<Array> operator()(Scope& s, const Array& inputs) const;
};

// Whether a cell's gate and activation functions are those the fused ops compute (sigmoid, tanh).
bool fusable_cell(const CellFunction& gate_fn, const CellFunction& activation_fn);

// The recompute segment of lstm_layer for nn::RNN's remat and schedule settings (0: keep every
// step): remat per step and sqrt_segments() keep the cell state every 16 or about sqrt(T) steps,
// binomial(s) at most s of them.
std::int64_t lstm_recompute_segment(bool remat, const lift::ScanSchedule& schedule, std::int64_t steps);

template <class Cell>
inline constexpr bool kLSTM = std::is_same_v<Cell, LSTMCell> || std::is_same_v<Cell, OptimizedLSTMCell>;

// The layer op's time-major view: x [time, batch..., in] as [time, rows, in], a carry [batch...,
// features] as [rows, features] (checked against the inputs), and the outputs back.
struct LayerRows {
  std::vector<std::int64_t> dims;  // x's
  std::int64_t rows = 1, features = 0;
  LayerRows(const Array& x, std::int64_t features);
  Array carry(const Array& c, const char* cell, const char* name) const;  // [rows, features]
  Array inputs(const Array& x, bool reverse) const;                       // [time, rows, in], time flipped if reverse
  Array outputs(Array ys, bool reverse) const;                            // [time, batch..., features], input order
};

}  // namespace recurrent_detail

// Runs `cell` over the time axis (flax.linen.RNN): inputs [batch, time, features] (or [time,
// batch, features] with time_major), outputs the same with the cell's features; `reverse` runs from
// the last step to the first (keep_order: outputs in input order, else in the order computed).
// The cell's parameters are shared by every step and live under "cell" (RNN_0/cell/hi/kernel, as
// Flax). `remat` checkpoints every time step (only the carries are kept; each step is recomputed in
// the backward pass): the memory of a long sequence becomes one carry per step instead of every
// gate's activations. `schedule` checkpoints segments of time steps instead (lift/schedule.hpp):
// sqrt_segments() keeps about 2 sqrt(T) carries (Chen et al.), binomial(s) at most s with the fewest
// recomputations (Griewank's Revolve); the outputs ys are kept either way (they are the result).
// Gradients are bitwise those without checkpointing.
template <class Cell>
struct RNN {
  Cell cell{};
  bool time_major = false;
  bool reverse = false;
  bool keep_order = false;
  bool remat = false;
  lift::ScanSchedule schedule{};

  Array operator()(Scope& s, const Array& inputs) const { return std::get<1>(run(s, inputs, {}, std::nullopt)); }
  Array operator()(Scope& s, const Array& inputs, const typename Cell::Carry& initial_carry) const {
    return std::get<1>(run(s, inputs, {}, initial_carry));
  }
  std::pair<typename Cell::Carry, Array> operator()(Scope& s, const Array& inputs, const RNNOptions& options) const {
    return run(s, inputs, options, std::nullopt);
  }
  std::pair<typename Cell::Carry, Array> operator()(Scope& s, const Array& inputs, const RNNOptions& options,
                                                    const typename Cell::Carry& initial_carry) const {
    return run(s, inputs, options, initial_carry);
  }

 private:
  std::pair<typename Cell::Carry, Array> run(Scope& s, const Array& inputs, const RNNOptions& options,
                                             const std::optional<typename Cell::Carry>& initial_carry) const {
    if (inputs.rank() < 3)
      throw ShapeError(detail_cat_shape("nn::RNN: inputs must be [batch, time, features] (or time-major), got ", inputs));
    Array xs = time_major ? inputs : swapaxes(inputs, 0, 1);  // [time, batch, ...]
    const std::int64_t steps = xs.dim(0), batch = xs.dim(1);
    const std::vector<std::int64_t> dims = xs.shape().vec();
    const Shape step_shape(std::vector<std::int64_t>(dims.begin() + 1, dims.end()));
    const typename Cell::Carry carry = initial_carry ? *initial_carry : cell.initialize_carry(step_shape);
    std::optional<Array> lengths;
    if (options.seq_lengths) lengths = recurrent_detail::checked_lengths(*options.seq_lengths, batch, steps);
    // With seq_lengths, reverse reverses each row within its length (Flax's flip_sequences), and the
    // steps then run forwards; without, the steps run from the last.
    const bool flip_rows = lengths && reverse;
    if (flip_rows) xs = recurrent_detail::flip_sequences(xs, *lengths);
    const bool backwards = reverse && !flip_rows;
    auto out = over_time(s, xs, carry, lengths, backwards);  // outputs in input order
    if (flip_rows && keep_order) out.second = recurrent_detail::flip_sequences(out.second, *lengths);
    if (backwards && !keep_order) out.second = flip_time(out.second);
    if (!time_major) out.second = swapaxes(out.second, 0, 1);
    return out;
  }
  // The cell over xs [time, batch, ...] from `carry` (from the last step if `backwards`): the final
  // carry (each row's after its length, with lengths) and the outputs [time, batch, ...] in xs' order.
  std::pair<typename Cell::Carry, Array> over_time(Scope& s, const Array& xs, const typename Cell::Carry& carry,
                                                   const std::optional<Array>& lengths, bool backwards) const {
    if constexpr (recurrent_detail::kLSTM<Cell>)
      if (recurrent_detail::fusable_cell(cell.gate_fn, cell.activation_fn)) return run_fused(s, xs, carry, lengths, backwards);
    if constexpr (std::is_same_v<Cell, GRUCell>)
      if (recurrent_detail::fusable_cell(cell.gate_fn, cell.activation_fn))
        return run_fused_gru(s, xs, carry, lengths, backwards);
    auto scan_with = [&](auto body, const auto& initial, auto... broadcast) {
      lift::scan<decltype(body)> scan{};
      scan.body = body;
      scan.variable_broadcast = {"params"};
      scan.split_rngs = {{"params", false}};
      scan.reverse = backwards;
      scan.schedule = schedule;
      return s("cell", scan, initial, lift::scanned(xs), broadcast...);
    };
    if (!lengths) {
      using Step = recurrent_detail::RNNStep<Cell>;
      return remat ? scan_with(lift::remat<Step>{Step{cell}}, carry) : scan_with(Step{cell}, carry);
    }
    std::vector<std::int32_t> t_values(static_cast<std::size_t>(xs.dim(0)));
    for (std::size_t i = 0; i < t_values.size(); ++i) t_values[i] = static_cast<std::int32_t>(i);
    const Array t = Array::from_i32(Shape{xs.dim(0)}, t_values);
    using Step = recurrent_detail::SelectingRNNStep<Cell>;
    const std::pair<typename Cell::Carry, typename Cell::Carry> both{carry, carry};
    auto [carries, ys] = remat ? scan_with(lift::remat<Step>{Step{cell}}, both, lift::scanned(t), *lengths)
                               : scan_with(Step{cell}, both, lift::scanned(t), *lengths);
    return {std::move(carries.second), std::move(ys)};
  }
  // An LSTM with sigmoid gates and tanh: the whole layer is one op (lstm_layer: input products per
  // chunk of steps, one recurrent product per step, the weights' gradients per chunk; remat and
  // schedules become its recompute segments, with gradients bitwise those without), in the cell's
  // computation dtype (Flax's promote_dtype over the inputs and the parameters, or its dtype): with
  // bf16 the products' operands are bf16, read from the float32 parameters where they are (no cast
  // copies), as the cell's Dense layers would cast them. The parameters are the cell's (same names,
  // shapes and initial values); results equal the cell's within float rounding.
  std::pair<LSTMCarry, Array> run_fused(Scope& s, const Array& xs, const LSTMCarry& carry, const std::optional<Array>& lengths,
                                        bool backwards) const {
    const std::vector<Array> parts =
        s("cell", recurrent_detail::LSTMWeights{cell.features, cell.kernel_init, cell.recurrent_kernel_init,
                                                cell.bias_init, cell.param_dtype},
          xs);
    const std::int64_t steps = xs.dim(0);
    auto gates = [&](std::size_t first) { return std::vector<Array>(parts.begin() + first, parts.begin() + first + 4); };
    const DType dt = computation_dtype({&xs, &parts[0]}, cell.dtype);
    const Array x = is_floating(xs.dtype()) ? xs : astype(xs, dt);  // (integer inputs as the cell's Dense takes them)
    const recurrent_detail::LayerRows rows(x, cell.features);
    LSTMLayerOptions options{.recompute_segment = recurrent_detail::lstm_recompute_segment(remat, schedule, steps),
                             .dtype = dt};
    if (lengths) options.seq_lengths = recurrent_detail::lengths_per_row(*lengths, rows.rows);
    auto [ys, c, h] = lstm_layer(rows.inputs(x, backwards), gates(0), gates(8), gates(4), rows.carry(carry.c, "LSTM", "c"),
                                 rows.carry(carry.h, "LSTM", "h"), options);
    return {LSTMCarry{reshape(c, carry.c.shape().vec()), reshape(h, carry.h.shape().vec())}, rows.outputs(ys, backwards)};
  }
  // A GRU with sigmoid gates and tanh: the whole layer is one op (gru_layer; remat and schedules make
  // it keep nothing but the outputs, with gradients bitwise those without), in the cell's computation
  // dtype as run_fused. The parameters are the cell's, read where they are.
  std::pair<Array, Array> run_fused_gru(Scope& s, const Array& xs, const Array& carry, const std::optional<Array>& lengths,
                                        bool backwards) const {
    const std::vector<Array> w =
        s("cell", recurrent_detail::GRUWeights{cell.features, cell.kernel_init, cell.recurrent_kernel_init, cell.bias_init,
                                               cell.param_dtype},
          xs);
    const DType dt = computation_dtype({&xs, &w[0]}, cell.dtype);
    const Array x = is_floating(xs.dtype()) ? xs : astype(xs, dt);
    const recurrent_detail::LayerRows rows(x, cell.features);
    GRULayerOptions options{.recompute = remat || schedule.kind != lift::ScanSchedule::Kind::none, .dtype = dt};
    if (lengths) options.seq_lengths = recurrent_detail::lengths_per_row(*lengths, rows.rows);
    auto gates = [&](std::size_t first) { return std::vector<Array>(w.begin() + first, w.begin() + first + 3); };
    auto [ys, h] = gru_layer(rows.inputs(x, backwards), gates(0), gates(3), gates(6), gates(9), rows.carry(carry, "GRU", "h"),
                             options);
    return {reshape(h, carry.shape().vec()), rows.outputs(ys, backwards)};
  }
  static std::string detail_cat_shape(const char* what, const Array& a) { return std::string(what) + a.type_str(); }
  static Array swapaxes(const Array& x, int a, int b) {
    std::vector<int> perm(static_cast<std::size_t>(x.rank()));
    for (int i = 0; i < x.rank(); ++i) perm[static_cast<std::size_t>(i)] = i;
    std::swap(perm[static_cast<std::size_t>(a)], perm[static_cast<std::size_t>(b)]);
    return transpose(x, perm);
  }
  static Array flip_time(const Array& ys) {
    std::vector<Array> parts;
    for (std::int64_t i = ys.dim(0); i-- > 0;) parts.push_back(slice_axis(ys, 0, i, i + 1));
    return concatenate(parts, 0);
  }
};

// A bidirectional RNN (flax.linen.Bidirectional): forward_rnn runs over the inputs from the first
// step, backward_rnn from the last (with its outputs put back in input order), and merge_fn joins
// the two outputs of each step (default: concatenated features, [..., f_forward + f_backward]).
// Both see the same seq_lengths (the backward one reverses each row within its length, as Flax's
// flip_sequences); their own reverse, keep_order and time_major settings are overridden, as Flax's
// call arguments override them. Parameters live under "forward_rnn" and "backward_rnn".
//
//   nn::Bidirectional<nn::RNN<nn::LSTMCell>> bi{.forward_rnn = {.cell = {.features = 64}},
//                                               .backward_rnn = {.cell = {.features = 64}}};
//   Array ys = s(bi, xs);                                   // [batch, time, 128]
//   auto [carries, ys2] = s(bi, xs, nn::RNNOptions{.return_carry = true, .seq_lengths = n});
//   // carries.first: the forward RNN's final carry, carries.second: the backward one's
template <class ForwardRNN, class BackwardRNN = ForwardRNN>
struct Bidirectional {
  ForwardRNN forward_rnn{};
  BackwardRNN backward_rnn{};
  std::function<Array(const Array& forward, const Array& backward)> merge_fn;  // empty: concatenate the features
  bool time_major = false;

  using ForwardCarry = typename decltype(ForwardRNN::cell)::Carry;
  using BackwardCarry = typename decltype(BackwardRNN::cell)::Carry;

  Array operator()(Scope& s, const Array& inputs) const { return run(s, inputs, {}).second; }
  // With seq_lengths and return_carry as nn::RNN's: ((forward carry, backward carry), outputs).
  std::pair<std::pair<ForwardCarry, BackwardCarry>, Array> operator()(Scope& s, const Array& inputs,
                                                                      const RNNOptions& options) const {
    return run(s, inputs, options);
  }

 private:
  std::pair<std::pair<ForwardCarry, BackwardCarry>, Array> run(Scope& s, const Array& inputs, const RNNOptions& options) const {
    ForwardRNN forward = forward_rnn;
    forward.time_major = time_major;
    forward.reverse = false;
    BackwardRNN backward = backward_rnn;
    backward.time_major = time_major;
    backward.reverse = true;
    backward.keep_order = true;
    RNNOptions with_carry = options;
    with_carry.return_carry = true;
    auto [forward_carry, forward_out] = s("forward_rnn", forward, inputs, with_carry);
    auto [backward_carry, backward_out] = s("backward_rnn", backward, inputs, with_carry);
    Array merged = merge_fn ? merge_fn(forward_out, backward_out) : concatenate({forward_out, backward_out}, -1);
    return {{std::move(forward_carry), std::move(backward_carry)}, std::move(merged)};
  }
};

}  // namespace linum::nn

template <>
struct linum::pytree::Fields<linum::nn::LSTMCarry> {
  static auto of(linum::nn::LSTMCarry& carry) { return std::tie(carry.c, carry.h); }
};

