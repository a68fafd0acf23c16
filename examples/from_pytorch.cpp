// A PyTorch model's weights in a Linum model: the model of tests/oracles/make_torch_fixtures.py
// (Conv2d, BatchNorm2d, LSTM, MultiheadAttention, LayerNorm, Linear), saved by PyTorch with
// safetensors.torch.save_file, loaded with safetensors::load and mapped layer by layer with
// torch_layouts. The file also holds an input and PyTorch's output for it: the program prints both
// models' outputs and exits 1 if they differ by more than 1e-5.
//
//   build/examples/from_pytorch tests/oracles/fixtures/torch_layers.safetensors
#include <linum/linum.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

using namespace linum;

// The PyTorch model, written as Linum modules. Images are NHWC here (PyTorch's are NCHW).
struct FromTorch {
  Array operator()(Scope& s, const Array& x) const {
    Array h = s("conv", nn::Conv{.features = 4, .kernel_size = {3, 3}, .padding = 1}, x);
    h = relu(s("bn", nn::BatchNorm{.use_running_average = true}, h));  // PyTorch's eval mode
    // PyTorch: h.permute(0, 3, 1, 2).reshape(b, w, c * h), a sequence of columns.
    const std::int64_t b = h.dim(0), height = h.dim(1), w = h.dim(2), c = h.dim(3);
    const Array seq = reshape(transpose(h, {0, 2, 3, 1}), {b, w, c * height});
    const Array y = s("lstm", nn::RNN<nn::LSTMCell>{.cell = {.features = 16}}, seq);
    const Array a = s("attn", nn::MultiHeadDotProductAttention{.num_heads = 4}, y);
    const Array z = s("norm", nn::LayerNorm{.epsilon = 1e-5}, y + a);  // PyTorch's default eps
    return s("head", nn::Dense{.features = 5}, mean(z, {1}));
  }
};

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: from_pytorch FILE.safetensors (e.g. tests/oracles/fixtures/torch_layers.safetensors)\n");
    return 2;
  }
  const Tree sd = safetensors::load(argv[1]).tensors;  // PyTorch's names: "model.conv.weight", ...
  // Each PyTorch module's tensors become the variables of its Linum layer.
  Tree params, batch_stats;
  params.set("conv", torch_layouts::conv2d(sd, "model.conv").at("params"));
  const Tree bn = torch_layouts::batch_norm(sd, "model.bn");
  params.set("bn", bn.at("params"));
  batch_stats.set("bn", bn.at("batch_stats"));
  params.set("lstm", Tree{{"cell", torch_layouts::lstm(sd, "model.lstm").at("params")}});
  params.set("attn", torch_layouts::multihead_attention(sd, "model.attn", 4).at("params"));
  params.set("norm", torch_layouts::layer_norm(sd, "model.norm").at("params"));
  params.set("head", torch_layouts::linear(sd, "model.head").at("params"));
  const Tree variables{{"params", params}, {"batch_stats", batch_stats}};

  const Array x = sd.at("model.__x").array();  // NHWC [3, 6, 8, 1]
  // The mapped variables have the layout Linum's own init gives this model.
  if (auto diff = structure_difference(init(FromTorch{}, rng::key(0), x), variables, /*compare_leaves=*/false)) {
    std::fprintf(stderr, "the mapped variables differ from the model's layout: %s\n", diff->c_str());
    return 1;
  }
  const Array logits = apply(FromTorch{}, variables, x);
  const std::vector<float> ours = logits.to_vector(), theirs = sd.at("model.__y").array().to_vector();
  double worst = 0;
  for (std::size_t i = 0; i < ours.size(); ++i) {
    worst = std::max(worst, std::abs(double(ours[i]) - theirs[i]));
    std::printf("%s%9.5f (PyTorch %9.5f)%s", i % 5 == 0 ? "  " : " ", ours[i], theirs[i], i % 5 == 4 ? "\n" : "");
  }
  std::printf("{\"example\": \"from_pytorch\", \"outputs\": %zu, \"max_abs_diff\": %.3g}\n", ours.size(), worst);
  return worst <= 1e-5 ? 0 : 1;
}
