#include <linum/nn/recurrent.hpp>
#include <linum/nn/dense.hpp>
#include <linum/nn/dtypes.hpp>
#include <linum/core/ops/all.hpp>
#include <linum/core/ops/batching.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace linum::nn {

namespace {

Shape carry_shape(const Shape& input_shape, std::int64_t features, const char* cell) {
  if (features <= 0) throw ValueError(std::string(cell) + ": features must be positive");
  if (input_shape.rank() < 1)
    throw ShapeError(std::string(cell) + ".initialize_carry: the input shape needs a feature axis, got " + input_shape.str());
  std::vector<std::int64_t> dims = input_shape.vec();
  dims.back() = features;
  return Shape(dims);
}

void check_carry(const Array& h, const Array& x, std::int64_t features, const char* cell) {
  if (h.rank() < 1 || h.dim(-1) != features || x.rank() != h.rank())
    throw ShapeError(std::string(cell) + ": carry " + h.type_str() + " does not fit " + std::to_string(features) +
                     " features and input " + x.type_str() + " ([..., features] with the input's batch axes)");
}

// The kernel (and bias) of a Dense layer, made in the child scope `name`, not applied
// (flax.linen.recurrent.DenseParams).
struct DenseParams {
  std::int64_t features = 0;
  bool use_bias = true;
  Initializer kernel_init;
  Initializer bias_init;
  DType param_dtype = DType::f32;
  std::vector<Array> operator()(Scope& s, const Array& inputs) const {
    // Created in param_dtype, as Flax's DenseParams (they were float32 in the dict, cast on use).
    std::vector<Array> out{
        astype(s.param("kernel", initializer_in(kernel_init, param_dtype), Shape{inputs.dim(-1), features}), param_dtype)};
    if (use_bias) out.push_back(astype(s.param("bias", initializer_in(bias_init, param_dtype), Shape{features}), param_dtype));
    return out;
  }
};

Array cast(const Array& a, const std::optional<DType>& dtype) { return dtype ? astype(a, *dtype) : a; }

}  // namespace

std::pair<LSTMCell::Carry, Array> LSTMCell::operator()(Scope& s, const Carry& carry, const Array& x) const {
  const Array& c = carry.c;  // (not a structured binding: the lambda below captures h, which clang 14 refuses)
  const Array& h = carry.h;
  check_carry(h, x, features, "nn::LSTMCell");
  const Dense in{.features = features, .use_bias = false, .kernel_init = kernel_init, .dtype = dtype, .param_dtype = param_dtype};
  const Dense rec{.features = features, .use_bias = true, .kernel_init = recurrent_kernel_init, .bias_init = bias_init,
                  .dtype = dtype, .param_dtype = param_dtype};
  // One statement per product: the parameters are created in Flax's order (ii, hi, if, hf, ...),
  // which C++'s unsequenced operands of + would not guarantee.
  auto both = [&](const char* input_name, const char* recurrent_name) {
    Array a = s(input_name, in, x);
    Array b = s(recurrent_name, rec, h);
    return a + b;
  };
  const Array i = gate_fn(both("ii", "hi"));
  const Array f = gate_fn(both("if", "hf"));
  const Array g = activation_fn(both("ig", "hg"));
  const Array o = gate_fn(both("io", "ho"));
  const Array new_c = f * c + i * g;
  const Array new_h = o * activation_fn(new_c);
  return {{new_c, new_h}, new_h};
}

LSTMCell::Carry LSTMCell::initialize_carry(const Shape& input_shape) const {
  const Shape shape = carry_shape(input_shape, features, "nn::LSTMCell");
  return {Array::zeros(shape, param_dtype), Array::zeros(shape, param_dtype)};
}

std::pair<OptimizedLSTMCell::Carry, Array> OptimizedLSTMCell::operator()(Scope& s, const Carry& carry, const Array& x) const {
  const auto& [c, h] = carry;
  check_carry(h, x, features, "nn::OptimizedLSTMCell");
  std::vector<Array> in_kernels, rec_kernels, rec_biases;
  for (const char* gate : {"i", "f", "g", "o"}) {
    in_kernels.push_back(s(std::string("i") + gate,
                           DenseParams{features, false, kernel_init, bias_init, param_dtype}, x)[0]);
    auto hp = s(std::string("h") + gate, DenseParams{features, true, recurrent_kernel_init, bias_init, param_dtype}, h);
    rec_kernels.push_back(hp[0]);
    rec_biases.push_back(hp[1]);
  }
  // Two products instead of eight: [x] x [ii | if | ig | io] and [h] x [hi | hf | hg | ho] + biases.
  const Array yi = matmul(cast(x, dtype), cast(concatenate(in_kernels, -1), dtype));
  const Array yh = matmul(cast(h, dtype), cast(concatenate(rec_kernels, -1), dtype)) + cast(concatenate(rec_biases, -1), dtype);
  const Array z = yh + yi;
  auto gate = [&](int k) { return slice_axis(z, -1, k * features, (k + 1) * features); };
  const Array i = gate_fn(gate(0)), f = gate_fn(gate(1)), g = activation_fn(gate(2)), o = gate_fn(gate(3));
  const Array new_c = f * c + i * g;
  const Array new_h = o * activation_fn(new_c);
  return {{new_c, new_h}, new_h};
}

OptimizedLSTMCell::Carry OptimizedLSTMCell::initialize_carry(const Shape& input_shape) const {
  const Shape shape = carry_shape(input_shape, features, "nn::OptimizedLSTMCell");
  return {Array::zeros(shape, param_dtype), Array::zeros(shape, param_dtype)};
}

std::pair<GRUCell::Carry, Array> GRUCell::operator()(Scope& s, const Carry& h, const Array& x) const {
  check_carry(h, x, features, "nn::GRUCell");
  const Dense in{.features = features, .use_bias = true, .kernel_init = kernel_init, .bias_init = bias_init, .dtype = dtype,
                 .param_dtype = param_dtype};
  const Dense rec{.features = features, .use_bias = false, .kernel_init = recurrent_kernel_init, .bias_init = bias_init,
                  .dtype = dtype, .param_dtype = param_dtype};
  Dense rec_n = rec;
  rec_n.use_bias = true;
  Array ir = s("ir", in, x);
  const Array r = gate_fn(ir + s("hr", rec, h));
  Array iz = s("iz", in, x);
  const Array z = gate_fn(iz + s("hz", rec, h));
  Array in_n = s("in", in, x);
  const Array n = activation_fn(in_n + r * s("hn", rec_n, h));
  const Array new_h = (1.0f - z) * n + z * h;
  return {new_h, new_h};
}

GRUCell::Carry GRUCell::initialize_carry(const Shape& input_shape) const {
  return Array::zeros(carry_shape(input_shape, features, "nn::GRUCell"), param_dtype);
}

std::pair<SimpleCell::Carry, Array> SimpleCell::operator()(Scope& s, const Carry& h, const Array& x) const {
  check_carry(h, x, features, "nn::SimpleCell");
  const Dense in{.features = features, .use_bias = true, .kernel_init = kernel_init, .bias_init = bias_init, .dtype = dtype,
                 .param_dtype = param_dtype};
  const Dense rec{.features = features, .use_bias = false, .kernel_init = recurrent_kernel_init, .dtype = dtype,
                  .param_dtype = param_dtype};
  Array next = s("i", in, x);
  next = next + s("h", rec, h);
  if (residual) next = next + h;
  next = activation_fn(next);
  return {next, next};
}

SimpleCell::Carry SimpleCell::initialize_carry(const Shape& input_shape) const {
  return Array::zeros(carry_shape(input_shape, features, "nn::SimpleCell"), param_dtype);
}

std::pair<MGUCell::Carry, Array> MGUCell::operator()(Scope& s, const Carry& h, const Array& x) const {
  check_carry(h, x, features, "nn::MGUCell");
  const Dense forget_in{.features = features, .use_bias = true, .kernel_init = kernel_init, .bias_init = forget_bias_init,
                        .dtype = dtype, .param_dtype = param_dtype};
  Dense activation_in = forget_in;
  activation_in.bias_init = activation_bias_init;
  const Dense rec{.features = features, .use_bias = false, .kernel_init = recurrent_kernel_init,
                  .bias_init = activation_bias_init, .dtype = dtype, .param_dtype = param_dtype};
  Dense rec_n = rec;
  rec_n.use_bias = reset_gate;
  // Flax's creation order: if, hf, hn, in.
  Array if_x = s("if", forget_in, x);
  const Array f = gate_fn(if_x + s("hf", rec, h));
  Array hn = s("hn", rec_n, h);
  if (reset_gate) hn = hn * f;
  Array in_x = s("in", activation_in, x);
  const Array n = activation_fn(in_x + hn);
  const Array new_h = (1.0f - f) * n + f * h;
  return {new_h, new_h};
}

MGUCell::Carry MGUCell::initialize_carry(const Shape& input_shape) const {
  return Array::zeros(carry_shape(input_shape, features, "nn::MGUCell"), param_dtype);
}

std::pair<ConvLSTMCell::Carry, Array> ConvLSTMCell::operator()(Scope& s, const Carry& carry, const Array& x) const {
  const Array& c = carry.c;
  const Array& h = carry.h;
  check_carry(h, x, features, "nn::ConvLSTMCell");
  if (c.shape() != h.shape())
    throw ShapeError("nn::ConvLSTMCell: the carry's c " + c.type_str() + " and h " + h.type_str() +
                     " must have one shape (initialize_carry gives it)");
  const Conv conv{.features = 4 * features, .kernel_size = kernel_size, .strides = strides, .padding = padding,
                  .use_bias = use_bias, .dtype = dtype, .param_dtype = param_dtype};
  Array gates = s("ih", conv, x);
  gates = gates + s("hh", conv, h);
  const std::vector<Array> parts = split(gates, 4, -1);  // i, g, f, o
  const Array f = sigmoid(parts[2] + 1.0f);
  const Array new_c = f * c + sigmoid(parts[0]) * tanh(parts[1]);
  const Array new_h = sigmoid(parts[3]) * tanh(new_c);
  return {{new_c, new_h}, new_h};
}

ConvLSTMCell::Carry ConvLSTMCell::initialize_carry(const Shape& input_shape) const {
  const Shape shape = carry_shape(input_shape, features, "nn::ConvLSTMCell");
  return {Array::zeros(shape, param_dtype), Array::zeros(shape, param_dtype)};
}

namespace recurrent_detail {

std::vector<Array> LSTMWeights::operator()(Scope& s, const Array& inputs) const {
  std::vector<Array> in_kernels, rec_kernels, rec_biases;
  const Array h_example = Array::zeros(Shape{1, features}, param_dtype);  // only its shape is read
  for (const char* gate : {"i", "f", "g", "o"}) {
    in_kernels.push_back(s(std::string("i") + gate, DenseParams{features, false, kernel_init, bias_init, param_dtype}, inputs)[0]);
    auto hp = s(std::string("h") + gate, DenseParams{features, true, recurrent_kernel_init, bias_init, param_dtype}, h_example);
    rec_kernels.push_back(hp[0]);
    rec_biases.push_back(hp[1]);
  }
  std::vector<Array> out;
  for (const auto* group : {&in_kernels, &rec_kernels, &rec_biases})
    for (const Array& a : *group) out.push_back(a);
  return out;
}

std::vector<Array> GRUWeights::operator()(Scope& s, const Array& inputs) const {
  std::vector<Array> in_kernels, in_biases, rec_kernels;
  Array hn_bias;
  const Array h_example = Array::zeros(Shape{1, features}, param_dtype);  // only its shape is read
  for (const char* gate : {"r", "z", "n"}) {
    auto ip = s(std::string("i") + gate, DenseParams{features, true, kernel_init, bias_init, param_dtype}, inputs);
    in_kernels.push_back(ip[0]);
    in_biases.push_back(ip[1]);
    const bool n = std::string(gate) == "n";
    auto hp = s(std::string("h") + gate, DenseParams{features, n, recurrent_kernel_init, bias_init, param_dtype}, h_example);
    rec_kernels.push_back(hp[0]);
    if (n) hn_bias = hp[1];
  }
  const Array zero = Array::zeros(Shape{features}, hn_bias.dtype());
  std::vector<Array> out;
  for (const auto* group : {&in_kernels, &in_biases, &rec_kernels})
    for (const Array& a : *group) out.push_back(a);
  for (const Array& a : {zero, zero, hn_bias}) out.push_back(a);
  return out;
}

LayerRows::LayerRows(const Array& x, std::int64_t f) : dims(x.shape().vec()), features(f) {
  for (std::size_t k = 1; k + 1 < dims.size(); ++k) rows *= dims[k];
}

Array LayerRows::carry(const Array& c, const char* cell, const char* name) const {
  std::vector<std::int64_t> want(dims.begin() + 1, dims.end());
  want.back() = features;
  if (!(c.shape() == Shape(want)))
    throw ShapeError(std::string("nn::RNN: the ") + cell + " carry's " + name + " must be " + Shape(want).str() +
                     " for inputs of shape " + Shape(dims).str() + " (time-major here), got " + c.type_str());
  return reshape(c, {rows, features});
}

Array LayerRows::inputs(const Array& x, bool reverse) const {
  Array x3 = reshape(x, {dims.front(), rows, dims.back()});
  return reverse ? flip(x3, {0}) : x3;
}

Array LayerRows::outputs(Array ys, bool reverse) const {
  if (reverse) ys = flip(ys, {0});  // in input order, as the scan's
  std::vector<std::int64_t> y_dims = dims;
  y_dims.back() = features;
  return reshape(ys, y_dims);
}

bool fusable_cell(const CellFunction& gate_fn, const CellFunction& activation_fn) {
  using Fn = Array (*)(const Array&);
  auto is = [](const CellFunction& f, auto named, Fn fn) {
    if (f.target<decltype(named)>() != nullptr) return true;
    const Fn* p = f.target<Fn>();
    return p != nullptr && *p == fn;
  };
  return is(gate_fn, Sigmoid{}, static_cast<Fn>(&linum::sigmoid)) && is(activation_fn, Tanh{}, static_cast<Fn>(&linum::tanh));
}

Array flip_sequences(const Array& xs, const Array& lengths) {
  const std::int64_t T = xs.dim(0), B = xs.dim(1);
  if (lengths.batched())
    throw ValueError("nn::RNN: reverse with seq_lengths batched by vmap is not supported: give each example's lengths "
                     "unbatched, or flip the rows yourself and run forwards");
  if (T == 0) return xs;
  // One gather of xs' [time * batch] rows: row (t, b) reads step (T - 1 - t + lengths[b]) mod T of row b.
  std::vector<std::int32_t> index(static_cast<std::size_t>(T * B));
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t b = 0; b < B; ++b)
      index[static_cast<std::size_t>(t * B + b)] =
          static_cast<std::int32_t>(((T - 1 - t + lengths.data_i32()[b]) % T) * B + b);
  const std::vector<std::int64_t> dims = xs.shape().vec();
  const Array rows = reshape(xs, {T * B, xs.numel() / std::max<std::int64_t>(1, T * B)});
  return reshape(take(rows, Array::from_i32(Shape{T * B}, index), 0), dims);
}

Array checked_lengths(const Array& lengths, std::int64_t batch, std::int64_t steps) {
  if (!lengths.defined() || lengths.dtype() != DType::i32 || !(lengths.shape() == Shape{batch}))
    throw ShapeError("nn::RNN: seq_lengths must be int32 [batch] with batch = " + std::to_string(batch) + ", got " +
                     (lengths.defined() ? lengths.type_str() : std::string("an undefined array")));
  // Under vmap, every example's lengths (the physical array's leading axes are the examples).
  const Array values =
      lengths.batched() ? ops::batching::materialized(lengths, ops::batching::levels_of({&lengths}, "nn::RNN")) : lengths;
  for (std::int64_t i = 0; i < values.numel(); ++i) {
    const std::int32_t len = values.data_i32()[i];
    if (len < 0 || len > steps)
      throw ValueError("nn::RNN: seq_lengths[" + std::to_string(batch == 0 ? 0 : i % batch) + "] = " + std::to_string(len) +
                       " is not a number of steps in [0, " + std::to_string(steps) + "] (the inputs have " +
                       std::to_string(steps) + " time steps)");
  }
  return lengths;
}

Array lengths_per_row(const Array& lengths, std::int64_t rows) {
  const std::int64_t batch = lengths.dim(0);
  if (rows == batch) return lengths;
  // Inputs with more batch axes: the layer's rows are [batch, rest...] flattened, one length per batch entry.
  const std::int64_t rest = batch == 0 ? 0 : rows / batch;
  return reshape(broadcast_to(reshape(lengths, {batch, 1}), Shape{batch, rest}), {rows});
}

std::int64_t lstm_recompute_segment(bool remat, const lift::ScanSchedule& schedule, std::int64_t steps) {
  constexpr std::int64_t chunk = kLSTMLayerChunk;
  switch (schedule.kind) {
    case lift::ScanSchedule::Kind::none:
      return remat ? chunk : 0;
    case lift::ScanSchedule::Kind::every:
      return chunk;
    case lift::ScanSchedule::Kind::sqrt:
      return chunk * std::max<std::int64_t>(1, std::llround(std::sqrt(static_cast<double>(steps)) / chunk));
    case lift::ScanSchedule::Kind::binomial: {
      const std::int64_t s = std::max(1, schedule.snapshots);
      return chunk * std::max<std::int64_t>(1, (steps + chunk * s - 1) / (chunk * s));
    }
  }
  return chunk;
}

}  // namespace recurrent_detail

}  // namespace linum::nn
