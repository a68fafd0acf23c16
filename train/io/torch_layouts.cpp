// PyTorch state-dict tensors to Linum's layouts (see torch_layouts.hpp).
#include <linum/train/io/torch_layouts.hpp>

#include <linum/core/error.hpp>
#include <linum/core/ops/all.hpp>

#include <string>
#include <vector>

namespace linum::torch_layouts {

namespace {

std::string name_of(std::string_view prefix, std::string_view tensor) {
  return prefix.empty() ? std::string(tensor) : std::string(prefix) + "." + std::string(tensor);
}

// The tensor `prefix.tensor` (in the dtype the file holds), of rank `rank`.
Array get(const Tree& sd, std::string_view prefix, std::string_view tensor, int rank, const char* what) {
  const std::string name = name_of(prefix, tensor);
  if (!sd.is_dict() || !sd.contains(name) || !sd.at(name).is_leaf())
    throw ValueError(linum::detail::cat("torch_layouts::", what, ": the state dict has no tensor '", name,
                                        "'; pass the PyTorch module's name as the prefix (\"features.0\" for "
                                        "\"features.0.weight\")"));
  Array a = sd.at(name).array();
  if (a.rank() != rank)
    throw ValueError(linum::detail::cat("torch_layouts::", what, ": '", name, "' has shape ", a.shape(), "; a ", what,
                                        " tensor of rank ", rank, " was expected"));
  return a;
}

bool has(const Tree& sd, std::string_view prefix, std::string_view tensor) {
  return sd.is_dict() && sd.contains(name_of(prefix, tensor));
}

Tree params_of(std::initializer_list<std::pair<const char*, Array>> entries) {
  Tree p;
  for (const auto& [k, v] : entries) p.set(k, Tree(v));
  return Tree{{"params", p}};
}

void require(bool ok, const std::string& message) {
  if (!ok) throw ValueError("torch_layouts::" + message);
}

// Rows [i * n, (i + 1) * n) of a gate-stacked [G * n, ...] tensor.
Array gate(const Array& stacked, int i, std::int64_t n) { return slice_axis(stacked, 0, i * n, (i + 1) * n); }

}  // namespace

Tree linear(const Tree& sd, std::string_view prefix) {
  const Array w = get(sd, prefix, "weight", 2, "linear");
  Tree p = params_of({{"kernel", transpose(w, {1, 0})}});
  if (has(sd, prefix, "bias")) p.at("params").set("bias", Tree((get(sd, prefix, "bias", 1, "linear"))));
  return p;
}

Tree conv2d(const Tree& sd, std::string_view prefix) {
  const Array w = get(sd, prefix, "weight", 4, "conv2d");  // [O, I/g, kh, kw]
  Tree p = params_of({{"kernel", transpose(w, {2, 3, 1, 0})}});
  if (has(sd, prefix, "bias")) p.at("params").set("bias", Tree((get(sd, prefix, "bias", 1, "conv2d"))));
  return p;
}

Tree conv_transpose2d(const Tree& sd, std::string_view prefix) {
  const Array w = get(sd, prefix, "weight", 4, "conv_transpose2d");  // [I, O, kh, kw]: the forward conv's [out, in, kh, kw]
  Tree p = params_of({{"kernel", transpose(w, {2, 3, 1, 0})}});       // [kh, kw, O, I]
  if (has(sd, prefix, "bias")) p.at("params").set("bias", Tree((get(sd, prefix, "bias", 1, "conv_transpose2d"))));
  return p;
}

namespace {
Tree affine_norm(const Tree& sd, std::string_view prefix, const char* what) {
  Tree p{{"params", Tree{}}};
  if (has(sd, prefix, "weight")) p.at("params").set("scale", Tree((get(sd, prefix, "weight", 1, what))));
  if (has(sd, prefix, "bias")) p.at("params").set("bias", Tree((get(sd, prefix, "bias", 1, what))));
  return p;
}
}  // namespace

Tree layer_norm(const Tree& sd, std::string_view prefix) { return affine_norm(sd, prefix, "layer_norm"); }
Tree group_norm(const Tree& sd, std::string_view prefix) { return affine_norm(sd, prefix, "group_norm"); }

Tree batch_norm(const Tree& sd, std::string_view prefix) {
  Tree v = affine_norm(sd, prefix, "batch_norm");
  v.set("batch_stats", Tree{{"mean", Tree((get(sd, prefix, "running_mean", 1, "batch_norm")))},
                            {"var", Tree((get(sd, prefix, "running_var", 1, "batch_norm")))}});
  return v;
}

Tree embedding(const Tree& sd, std::string_view prefix) {
  return params_of({{"embedding", get(sd, prefix, "weight", 2, "embedding")}});
}

namespace {
// One layer of a PyTorch RNN: its input and recurrent weights, `gates` stacked on axis 0, the
// hidden size, and its two biases (zeros where the module has none).
struct RecurrentWeights {
  Array wi, wh, bi, bh;
  std::int64_t hidden = 0;
};

RecurrentWeights recurrent_weights(const Tree& sd, std::string_view prefix, int layer, int gates, const char* what) {
  const std::string l = std::to_string(layer);
  RecurrentWeights r;
  r.wi = get(sd, prefix, "weight_ih_l" + l, 2, what);
  r.wh = get(sd, prefix, "weight_hh_l" + l, 2, what);
  r.hidden = r.wh.dim(1);
  require(r.wi.dim(0) == gates * r.hidden && r.wh.dim(0) == gates * r.hidden,
          linum::detail::cat(what, ": weight_ih_l", l, " ", r.wi.shape(), " and weight_hh_l", l, " ", r.wh.shape(), " are not ",
                             gates == 4 ? "four" : "three", " gates of hidden size ", r.hidden));
  auto bias = [&](const std::string& name) {
    return has(sd, prefix, name + l) ? get(sd, prefix, name + l, 1, what) : Array::zeros(Shape{gates * r.hidden});
  };
  r.bi = bias("bias_ih_l");
  r.bh = bias("bias_hh_l");
  return r;
}
}  // namespace

Tree lstm(const Tree& sd, std::string_view prefix, int layer) {
  const RecurrentWeights r = recurrent_weights(sd, prefix, layer, 4, "lstm");
  const std::int64_t h = r.hidden;
  const Array bias = r.bi + r.bh;
  Tree p;
  const char* gates[] = {"i", "f", "g", "o"};  // PyTorch's order
  for (int g = 0; g < 4; ++g) {
    p.set(std::string("i") + gates[g], Tree{{"kernel", Tree(transpose(gate(r.wi, g, h), {1, 0}))}});
    p.set(std::string("h") + gates[g], Tree{{"kernel", Tree(transpose(gate(r.wh, g, h), {1, 0}))},
                                            {"bias", Tree(gate(bias, g, h))}});
  }
  return Tree{{"params", p}};
}

Tree gru(const Tree& sd, std::string_view prefix, int layer) {
  const RecurrentWeights r = recurrent_weights(sd, prefix, layer, 3, "gru");
  const std::int64_t h = r.hidden;
  const Array &wi = r.wi, &wh = r.wh, &bi = r.bi, &bh = r.bh;
  auto kernel = [&](const Array& w, int g) { return Tree(transpose(gate(w, g, h), {1, 0})); };
  Tree p;
  // r and z: one bias each (input and recurrent biases add); n keeps them apart (r multiplies b_hn).
  p.set("ir", Tree{{"kernel", kernel(wi, 0)}, {"bias", Tree(gate(bi, 0, h) + gate(bh, 0, h))}});
  p.set("hr", Tree{{"kernel", kernel(wh, 0)}});
  p.set("iz", Tree{{"kernel", kernel(wi, 1)}, {"bias", Tree(gate(bi, 1, h) + gate(bh, 1, h))}});
  p.set("hz", Tree{{"kernel", kernel(wh, 1)}});
  p.set("in", Tree{{"kernel", kernel(wi, 2)}, {"bias", Tree(gate(bi, 2, h))}});
  p.set("hn", Tree{{"kernel", kernel(wh, 2)}, {"bias", Tree(gate(bh, 2, h))}});
  return Tree{{"params", p}};
}

Tree multihead_attention(const Tree& sd, std::string_view prefix, std::int64_t num_heads) {
  const Array out_w = get(sd, prefix, "out_proj.weight", 2, "multihead_attention");
  const std::int64_t e = out_w.dim(0);
  require(num_heads > 0 && e % num_heads == 0,
          linum::detail::cat("multihead_attention: embed dim ", e, " is not divisible by num_heads ", num_heads));
  const std::int64_t hd = e / num_heads;
  // Packed in_proj_weight [3E, E] (q, k, v), or separate q/k/v_proj_weight when kdim/vdim differ.
  std::vector<Array> w(3), b(3);
  const char* names[] = {"q", "k", "v"};
  if (has(sd, prefix, "in_proj_weight")) {
    const Array in_w = get(sd, prefix, "in_proj_weight", 2, "multihead_attention");
    require(in_w.dim(0) == 3 * e, linum::detail::cat("multihead_attention: in_proj_weight ", in_w.shape(), " is not [3 * ", e, ", ", e, "]"));
    for (int i = 0; i < 3; ++i) w[i] = gate(in_w, i, e);
  } else {
    for (int i = 0; i < 3; ++i) w[i] = get(sd, prefix, std::string(names[i]) + "_proj_weight", 2, "multihead_attention");
  }
  const bool biased = has(sd, prefix, "in_proj_bias");
  if (biased) {
    const Array in_b = get(sd, prefix, "in_proj_bias", 1, "multihead_attention");
    for (int i = 0; i < 3; ++i) b[i] = gate(in_b, i, e);
  }
  Tree p;
  const char* flax_names[] = {"query", "key", "value"};
  for (int i = 0; i < 3; ++i) {
    Tree dense{{"kernel", Tree((reshape(transpose(w[i], {1, 0}), {w[i].dim(1), num_heads, hd})))}};
    if (biased) dense.set("bias", Tree((reshape(b[i], {num_heads, hd}))));
    p.set(flax_names[i], dense);
  }
  Tree out{{"kernel", Tree((reshape(transpose(out_w, {1, 0}), {num_heads, hd, e})))}};
  if (has(sd, prefix, "out_proj.bias")) out.set("bias", Tree((get(sd, prefix, "out_proj.bias", 1, "multihead_attention"))));
  p.set("out", out);
  return Tree{{"params", p}};
}

}  // namespace linum::torch_layouts
