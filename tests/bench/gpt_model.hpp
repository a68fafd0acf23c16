// The GPT-style model of `linum-bench gpt` (and `linum-bench plan --model gpt`): token + position
// Embed, pre-LayerNorm blocks (causal multi-head self-attention, a 4x GELU MLP, residuals), a final
// LayerNorm and a Dense head; and a seeded batch of tokens.
#pragma once

#include "bench_util.hpp"

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace linum_bench {

struct GptBlock {
  std::int64_t heads = 4;
  std::optional<DType> dtype;
  // The MLP's GELU fused into its first Dense (one op); false: a separate op after it (what a
  // dots_saveable remat needs to save the product alone and recompute the GELU).
  bool fused_gelu = true;

  Array operator()(Scope& s, const Array& x) const {
    const std::int64_t d = x.dim(-1);
    const nn::LayerNorm ln{.epsilon = 1e-6, .dtype = dtype};
    const nn::MultiHeadDotProductAttention attention{.num_heads = heads, .dtype = dtype};
    Array h = x + s("attn", attention, s("ln1", ln, x), nn::AttentionArgs{.is_causal = true});
    const nn::Dense fc1{.features = 4 * d, .dtype = dtype, .activation = fused_gelu ? Activation::gelu : Activation::none};
    Array m = s("fc1", fc1, s("ln2", ln, h));
    if (!fused_gelu) m = gelu(m);
    return h + s("fc2", nn::Dense{.features = d, .dtype = dtype}, m);
  }
};

enum class Stack { plain, remat, dots, scan_remat };

struct Gpt {
  std::int64_t vocab = 256, dim = 256, heads = 4, layers = 8, seq = 256;
  std::optional<DType> dtype;
  Stack stack = Stack::plain;

  Array operator()(Scope& s, const Array& tokens) const {
    const std::int64_t t = tokens.dim(-1);
    const Initializer embed_init = initializers::normal(1.0f / std::sqrt(static_cast<float>(dim)));
    Array positions = astype(Array::arange(t), DType::i32);
    Array x = s("wte", nn::Embed{.num_embeddings = vocab, .features = dim, .embedding_init = embed_init, .dtype = dtype}, tokens) +
              s("wpe", nn::Embed{.num_embeddings = seq, .features = dim, .embedding_init = embed_init, .dtype = dtype}, positions);
    const GptBlock block{.heads = heads, .dtype = dtype};
    switch (stack) {
      case Stack::plain:
        for (std::int64_t l = 0; l < layers; ++l) x = s(block, x);
        break;
      case Stack::remat:
        for (std::int64_t l = 0; l < layers; ++l) x = s(lift::remat<GptBlock>{block}, x);
        break;
      case Stack::dots:
        for (std::int64_t l = 0; l < layers; ++l)
          x = s(lift::remat<GptBlock, lift::policy<policies::dots_saveable>>{GptBlock{.heads = heads, .dtype = dtype, .fused_gelu = false}}, x);
        break;
      case Stack::scan_remat:
        x = s(lift::scan<lift::remat<GptBlock>>{.body = {block}, .length = static_cast<int>(layers)}, x);
        break;
    }
    x = s("ln_f", nn::LayerNorm{.epsilon = 1e-6, .dtype = dtype}, x);
    return s("head", nn::Dense{.features = vocab, .use_bias = false, .dtype = dtype}, x);
  }
};

// Tokens [batch, seq + 1] from a seeded generator; inputs are the first seq, labels the last seq.
inline std::pair<Array, Array> make_batch(std::int64_t batch, std::int64_t seq, std::int64_t vocab, std::uint64_t seed) {
  std::vector<std::int32_t> in, out;
  std::uint64_t state = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (std::int64_t b = 0; b < batch; ++b) {
    std::vector<std::int32_t> row;
    for (std::int64_t i = 0; i <= seq; ++i) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      row.push_back(static_cast<std::int32_t>((state >> 33) % static_cast<std::uint64_t>(vocab)));
    }
    in.insert(in.end(), row.begin(), row.end() - 1);
    out.insert(out.end(), row.begin() + 1, row.end());
  }
  return {Array::from_i32(Shape{batch, seq}, in), Array::from_i32(Shape{batch, seq}, out)};
}

}  // namespace linum_bench
