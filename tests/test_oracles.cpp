// Linum against the real JAX, Flax and optax: the values tests/oracles/make_fixtures.py computed
// with the pinned versions (jax 0.10.2, flax 0.12.8, optax 0.2.8) and committed as MessagePack
// files in tests/oracles/fixtures/. Where the two may round differently (XLA's kernels sum in
// another order than oneDNN's or Eigen's) a comparison has a tolerance, and says so; everything
// that is exact by construction (PRNG bits, samplers, initializers from normal/uniform draws,
// serialized bytes, variable names, shapes and dtypes) is compared bit for bit.
#include <doctest/doctest.h>
#include <linum/linum.hpp>
#include <linum/train/io/serialization.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

using namespace linum;
namespace ser = linum::serialization;

namespace {

const std::filesystem::path kFixtures = LINUM_ORACLE_DIR;

const Tree& fixture(const std::string& name) {
  static std::map<std::string, Tree> cache;
  auto it = cache.find(name);
  if (it == cache.end()) it = cache.emplace(name, ser::load_msgpack(kFixtures / name)).first;
  return it->second;
}

// How far `got` is from `want`: the largest |got - want| / (atol + rtol |want|) (<= 1 passes), with
// NaNs equal to NaNs and infinities to the same infinity. Both as float32 (bf16 widened exactly).
struct Closeness {
  double worst_ratio = 0;  // <= 1: within tolerance
  double max_abs = 0;      // largest |got - want|
  bool bitwise = true;
};

Closeness closeness(const Array& got, const Array& want, double rtol, double atol) {
  Closeness c;
  const Array g = got.dtype() == DType::i32 ? got : astype(got, DType::f32);
  const Array w = want.dtype() == DType::i32 ? want : astype(want, DType::f32);
  c.bitwise = got.dtype() == want.dtype() && got.bitwise_equal(want);
  if (g.dtype() == DType::i32 || w.dtype() == DType::i32) {
    c.worst_ratio = c.bitwise ? 0 : 2;
    return c;
  }
  const std::vector<float> gv = g.to_vector(), wv = w.to_vector();
  for (std::size_t i = 0; i < gv.size(); ++i) {
    const double a = gv[i], b = wv[i];
    if (std::isnan(a) && std::isnan(b)) continue;
    if (std::isinf(b) || std::isnan(a) || std::isnan(b)) {
      if (a != b) c.worst_ratio = 2;
      continue;
    }
    const double d = std::abs(a - b);
    c.max_abs = std::max(c.max_abs, d);
    c.worst_ratio = std::max(c.worst_ratio, d / (atol + rtol * std::abs(b)));
  }
  return c;
}

// Every comparison made, for the summary the suite prints (what matched bit for bit, what within
// which tolerance).
struct Summary {
  int bitwise = 0, close = 0, failed = 0;
  double max_abs_close = 0;
  std::string worst;
  std::vector<std::string> inexact;  // within tolerance, not bitwise
};
std::map<std::string, Summary>& summaries() {
  static std::map<std::string, Summary> s;
  return s;
}

// Checks one array against the oracle's; `what` names the case and path.
void check_array(const std::string& group, const std::string& what, const Array& got, const Array& want, double rtol,
                 double atol) {
  INFO(what);
  REQUIRE(got.defined());
  CHECK(got.shape() == want.shape());
  CHECK(dtype_name(got.dtype()) == dtype_name(want.dtype()));
  if (got.shape() != want.shape()) return;
  const Closeness c = closeness(got, want, rtol, atol);
  Summary& s = summaries()[group];
  if (c.bitwise) {
    ++s.bitwise;
  } else if (c.worst_ratio <= 1) {
    ++s.close;
    s.inexact.push_back(what);
    if (c.max_abs > s.max_abs_close) {
      s.max_abs_close = c.max_abs;
      s.worst = what;
    }
  } else {
    ++s.failed;
  }
  INFO("max |got - want| = " << c.max_abs << ", tolerance ratio " << c.worst_ratio << " (rtol " << rtol << ", atol "
                             << atol << ")");
  CHECK(c.worst_ratio <= 1);
}

// Both trees have the same paths, and each leaf is close.
// `tolerance_of(path)` gives (rtol, atol) per leaf; the overload below one pair for all.
void check_tree(const std::string& group, const std::string& what, const Tree& got, const Tree& want,
                const std::function<std::pair<double, double>(const std::string&)>& tolerance_of) {
  std::map<std::string, Array> g, w;
  for (auto& [p, a] : flatten(got)) g.emplace(p, a);
  for (auto& [p, a] : flatten(want)) w.emplace(p, a);
  std::string missing, extra;
  for (auto& [p, a] : w)
    if (!g.count(p)) missing += " " + p;
  for (auto& [p, a] : g)
    if (!w.count(p)) extra += " " + p;
  INFO(what << ": missing" << missing << "; not in the oracle" << extra);
  CHECK(missing.empty());
  CHECK(extra.empty());
  for (auto& [p, a] : w)
    if (g.count(p)) {
      const auto [rtol, atol] = tolerance_of(p);
      check_array(group, what + "/" + p, g.at(p), a, rtol, atol);
    }
}

void check_tree(const std::string& group, const std::string& what, const Tree& got, const Tree& want, double rtol,
                double atol) {
  check_tree(group, what, got, want, [&](const std::string&) { return std::make_pair(rtol, atol); });
}

// Whether a parameter path is a recurrent cell's recurrent kernel ("h", "hi", "hr", ... /kernel):
// Flax initializes those orthogonally, through a QR.
bool orthogonal_kernel(const std::string& path) {
  const auto last = path.rfind('/');
  if (last == std::string::npos || path.substr(last + 1) != "kernel") return false;
  const auto before = path.rfind('/', last - 1);
  const std::string module = path.substr(before == std::string::npos ? 0 : before + 1, last - (before + 1));
  return !module.empty() && module[0] == 'h' && module.size() <= 2;
}

std::vector<Array> leaves_of(const Tree& t) { return leaves(t); }

Array key_words(const rng::Key& k) {
  return Array::from_i32(Shape{2}, {static_cast<std::int32_t>(k.hi), static_cast<std::int32_t>(k.lo)});
}
Array key_words(const std::vector<rng::Key>& ks) {
  std::vector<std::int32_t> v;
  for (const auto& k : ks) {
    v.push_back(static_cast<std::int32_t>(k.hi));
    v.push_back(static_cast<std::int32_t>(k.lo));
  }
  return Array::from_i32(Shape{static_cast<std::int64_t>(ks.size()), 2}, v);
}
Array u32_words(const std::vector<std::uint32_t>& w) {
  std::vector<std::int32_t> v(w.begin(), w.end());
  return Array::from_i32(Shape{static_cast<std::int64_t>(w.size())}, v);
}

}  // namespace

// ---- jax.random ---------------------------------------------------------------------------------

TEST_CASE("jax.random: keys, split, fold_in, bits and every sampler equal JAX's bit for bit, in both threefry modes") {
  const std::vector<std::pair<std::string, std::int64_t>> seeds = {
      {"seed_0", 0}, {"seed_42", 42}, {"seed_m7", -7}, {"seed_1099511627779", (std::int64_t{1} << 40) + 3}};
  for (const rng::Mode mode : {rng::Mode::partitionable, rng::Mode::legacy}) {
    const Tree& m = fixture("prng.msgpack").at(rng::mode_name(mode));
    const Array logits = m.at("categorical_logits_4x5").array();
    for (const auto& entry : seeds) {
      const auto& name = entry.first;
      const auto& seed = entry.second;
      const std::string mode_name = rng::mode_name(mode);
      CAPTURE(mode_name);
      CAPTURE(name);
      const Tree& c = m.at(name);
      // jax.random.key(seed) with JAX's default jax_enable_x64=False is key_x32 (the seed taken
      // modulo 2^32); with x64 enabled it is rng::key (all 64 bits). The draws use the default.
      const rng::Key k = rng::key_x32(seed);
      const std::string g = "prng";
      auto same = [&](const char* what, const Array& got, double rtol = 0) {
        check_array(g, name + "/" + what, got, c.at(what).array(), rtol, 0);
      };
      same("key", key_words(k));
      same("key_x64", key_words(rng::key(seed)));
      same("split3", key_words(rng::split(k, 3, mode)));
      same("split2", key_words(rng::split(k, 2, mode)));
      same("fold_in_7", key_words(rng::fold_in(k, 7)));
      same("fold_in_big", key_words(rng::fold_in(k, 0xDEADBEEFu)));
      same("bits_u32_13", u32_words(rng::bits_u32(k, 13, mode)));
      same("bits_u32_2x3", rng::bits(k, Shape{2, 3}, mode));
      same("uniform_7", rng::uniform(k, Shape{7}, 0.0f, 1.0f, mode));
      same("uniform_m2_3_2x5", rng::uniform(k, Shape{2, 5}, -2.0f, 3.0f, mode));
      // normal and truncated_normal: sqrt(2) erf_inv(u), with XLA's erf, erf_inv and log1p.
      same("normal_9", rng::normal(k, Shape{9}, mode));
      same("normal_3x4", rng::normal(k, Shape{3, 4}, mode));
      same("truncated_normal_m2_2_9", rng::truncated_normal(k, -2.0f, 2.0f, Shape{9}, mode));
      same("truncated_normal_m1_3_9", rng::truncated_normal(k, -1.0f, 3.0f, Shape{9}, mode));
      same("bernoulli_03_17", astype(rng::bernoulli(k, 0.3f, Shape{17}, mode), DType::i32));
      same("randint_m5_9_11", astype(rng::randint(k, Shape{11}, -5, 9, mode), DType::i32));
      same("permutation_10", astype(rng::permutation(k, 10, mode), DType::i32));
      // -log(-log(u)) with XLA's float32 log.
      same("gumbel_6", rng::gumbel(k, Shape{6}, mode));
      same("categorical_4x5", astype(rng::categorical(k, logits, -1, mode), DType::i32));
    }
  }
}

// ---- jax.nn.initializers ------------------------------------------------------------------------

TEST_CASE("jax.nn.initializers from one key equal JAX's (bitwise; orthogonal within float32 rounding of its QR)") {
  namespace I = initializers;
  const std::vector<std::pair<std::string, Initializer>> cases = {
      {"lecun_normal", I::lecun_normal()},   {"lecun_uniform", I::lecun_uniform()},
      {"he_normal", I::he_normal()},         {"he_uniform", I::he_uniform()},
      {"glorot_normal", I::glorot_normal()}, {"glorot_uniform", I::glorot_uniform()},
      {"normal_002", I::normal(0.02f)},      {"uniform_005", I::uniform(0.05f)},
      {"truncated_normal_01", I::truncated_normal(0.1f)},
      {"orthogonal", I::orthogonal()},       {"orthogonal_2", I::orthogonal(2.0f)},
  };
  const Tree& f = fixture("initializers.msgpack");
  const rng::Key k = rng::key(3);
  for (const auto& entry : cases) {
    const auto& name = entry.first;
    const auto& init = entry.second;
    CAPTURE(name);
    // QR in another library: orthogonal matrices agree to float32 rounding, not bit for bit.
    const bool qr = name.rfind("orthogonal", 0) == 0;
    const double rtol = qr ? 2e-6 : 0, atol = qr ? 2e-6 : 0;
    check_array("initializers", name + "/5x7", init(k, Shape{5, 7}), f.at(name).at("shape_5x7").array(), rtol, atol);
    check_array("initializers", name + "/3x3x4x6", init(k, Shape{3, 3, 4, 6}), f.at(name).at("shape_3x3x4x6").array(),
                rtol, atol);
  }
  check_array("initializers", "embed_default", nn::default_embed_init()(k, Shape{10, 4}),
              f.at("embed_default").at("shape_10x4").array(), 0, 0);
}

// ---- flax.linen layers --------------------------------------------------------------------------

namespace {

// A layer case: how Linum initializes and applies the same layer, on the fixture's inputs (the
// arrays of its "inputs" dict, flattened: an LSTM carry {"0": c, "1": h} is two arrays).
struct LayerCase {
  std::string name;
  std::function<Tree(const std::vector<Array>&)> init;
  // (variables, inputs) -> (output arrays flattened, updated mutable collections)
  std::function<std::pair<std::vector<Array>, Tree>(const Tree&, const std::vector<Array>&)> apply;
  bool bf16 = false;
};

// A layer of one array input, one pytree output.
template <class M>
LayerCase one_input(std::string name, M m, ApplyOptions options = {}, rng::Streams init_rngs = rng::Streams(rng::key(0))) {
  const bool bf16 = name.size() > 5 && name.substr(name.size() - 5) == "_bf16";
  return {std::move(name), [m, init_rngs](const std::vector<Array>& x) { return init(m, init_rngs, x.at(0)); },
          [m, options](const Tree& vars, const std::vector<Array>& x) {
            auto [y, upd] = apply(m, vars, options, x.at(0));
            return std::make_pair(pytree::flatten(y), Tree(upd));
          },
          bf16};
}

// An LSTM cell: inputs (carry {c, h}, x).
template <class Cell>
LayerCase lstm_cell(std::string name, Cell cell) {
  const bool bf16 = name.size() > 5 && name.substr(name.size() - 5) == "_bf16";
  return {std::move(name),
          [cell](const std::vector<Array>& x) { return init(cell, rng::key(0), nn::LSTMCarry{x.at(0), x.at(1)}, x.at(2)); },
          [cell](const Tree& vars, const std::vector<Array>& x) {
            return std::make_pair(pytree::flatten(apply(cell, vars, nn::LSTMCarry{x.at(0), x.at(1)}, x.at(2))), Tree{});
          },
          bf16};
}

// A cell whose carry is one array: inputs (carry, x).
template <class Cell>
LayerCase array_cell(std::string name, Cell cell) {
  return {std::move(name), [cell](const std::vector<Array>& x) { return init(cell, rng::key(0), x.at(0), x.at(1)); },
          [cell](const Tree& vars, const std::vector<Array>& x) {
            return std::make_pair(pytree::flatten(apply(cell, vars, x.at(0), x.at(1))), Tree{});
          }};
}

// nn::RNN with seq_lengths and return_carry: inputs (x, lengths), outputs (carry..., ys).
template <class M>
LayerCase rnn_with_lengths(std::string name, M m) {
  auto options = [](const std::vector<Array>& x) { return nn::RNNOptions{.return_carry = true, .seq_lengths = x.at(1)}; };
  return {std::move(name), [m, options](const std::vector<Array>& x) { return init(m, rng::key(0), x.at(0), options(x)); },
          [m, options](const Tree& vars, const std::vector<Array>& x) {
            return std::make_pair(pytree::flatten(apply(m, vars, x.at(0), options(x))), Tree{});
          }};
}

// A wrapper called from a parent module (the fixture's InParent): the wrapped layer stays bound to
// the parent, beside the wrapper.
template <class Wrapper>
struct InParent {
  Wrapper wrapper;
  Array operator()(Scope& s, const Array& x) const { return s(wrapper, x); }
};
// The same for nn::SpectralNorm, whose call takes update_stats first.
template <class Wrapper>
struct InParentUpdating {
  Wrapper wrapper;
  bool update_stats = true;
  Array operator()(Scope& s, const Array& x) const { return s(wrapper, update_stats, x); }
};

std::vector<LayerCase> layer_cases() {
  const rng::Streams dropout_init{{"params", rng::key(0)}, {"dropout", rng::key(1)}};
  return {
      one_input("dense", nn::Dense{.features = 3}),
      one_input("dense_no_bias", nn::Dense{.features = 5, .use_bias = false}),
      one_input("dense_general", nn::DenseGeneral{.features = {2, 3}, .axis = {-1}}),
      one_input("dense_general_axes", nn::DenseGeneral{.features = {4}, .axis = {-2, -1}}),
      one_input("conv_same", nn::Conv{.features = 4, .kernel_size = {3, 3}}),
      one_input("conv_valid_strided", nn::Conv{.features = 5, .kernel_size = {3, 2}, .strides = {2, 1}, .padding = "VALID"}),
      one_input("conv_dilated_pairs",
                nn::Conv{.features = 2, .kernel_size = {2, 2}, .padding = {{1, 2}, {0, 1}}, .kernel_dilation = {2, 1}}),
      one_input("conv_grouped", nn::Conv{.features = 6, .kernel_size = {3, 3}, .feature_group_count = 3, .use_bias = false}),
      one_input("conv1d_causal", nn::Conv{.features = 3, .kernel_size = {3}, .padding = "CAUSAL"}),
      one_input("conv_transpose", nn::ConvTranspose{.features = 3, .kernel_size = {3, 3}, .strides = {2, 2}}),
      one_input("conv_transpose_valid",
                nn::ConvTranspose{.features = 2, .kernel_size = {2, 3}, .strides = {2, 1}, .padding = "VALID"}),
      one_input("embed", nn::Embed{.num_embeddings = 10, .features = 4}),
      one_input("layer_norm", nn::LayerNorm{}),
      one_input("rms_norm", nn::RMSNorm{}),
      one_input("group_norm", nn::GroupNorm{.num_groups = 3}),
      one_input("batch_norm_train", nn::BatchNorm{.use_running_average = false}, {.mutable_collections = {"batch_stats"}}),
      one_input("batch_norm_eval", nn::BatchNorm{.use_running_average = true}),
      one_input("attention", nn::MultiHeadDotProductAttention{.num_heads = 2, .qkv_features = 8}),
      LayerCase{"attention_cross",
                [](const std::vector<Array>& x) {
                  return init(nn::MultiHeadDotProductAttention{.num_heads = 3, .qkv_features = 6, .out_features = 5},
                              rng::key(0), x.at(0), x.at(1));
                },
                [](const Tree& vars, const std::vector<Array>& x) {
                  const nn::MultiHeadDotProductAttention m{.num_heads = 3, .qkv_features = 6, .out_features = 5};
                  return std::make_pair(std::vector<Array>{apply(m, vars, x.at(0), x.at(1))}, Tree{});
                }},
      lstm_cell("lstm_cell", nn::LSTMCell{.features = 5}),
      lstm_cell("optimized_lstm_cell", nn::OptimizedLSTMCell{.features = 5}),
      array_cell("gru_cell", nn::GRUCell{.features = 5}),
      array_cell("simple_cell", nn::SimpleCell{.features = 5}),
      one_input("rnn_lstm", nn::RNN<nn::LSTMCell>{.cell = {.features = 4}}),
      one_input("rnn_gru_reverse", nn::RNN<nn::GRUCell>{.cell = {.features = 3}, .reverse = true, .keep_order = true}),
      rnn_with_lengths("rnn_lstm_lengths", nn::RNN<nn::LSTMCell>{.cell = {.features = 4}}),
      rnn_with_lengths("rnn_gru_reverse_lengths",
                       nn::RNN<nn::GRUCell>{.cell = {.features = 3}, .reverse = true, .keep_order = true}),
      one_input("dropout", nn::Dropout{.rate = 0.5, .deterministic = false}, {.rngs = {{"dropout", rng::key(1)}}},
                dropout_init),
      one_input("dropout_broadcast", nn::Dropout{.rate = 0.3, .broadcast_dims = {0}, .deterministic = false},
                {.rngs = {{"dropout", rng::key(2)}}}, dropout_init),
      one_input("dense_bf16", nn::Dense{.features = 3, .dtype = DType::bf16}),
      one_input("conv_bf16", nn::Conv{.features = 4, .kernel_size = {3, 3}, .dtype = DType::bf16}),
      one_input("layer_norm_bf16", nn::LayerNorm{.dtype = DType::bf16}),
      one_input("attention_bf16", nn::MultiHeadDotProductAttention{.num_heads = 2, .qkv_features = 8, .dtype = DType::bf16}),
      lstm_cell("lstm_cell_bf16", nn::LSTMCell{.features = 5, .dtype = DType::bf16}),
      one_input("rnn_lstm_bf16", nn::RNN<nn::LSTMCell>{.cell = {.features = 4, .dtype = DType::bf16}}),
      one_input("rnn_gru_bf16", nn::RNN<nn::GRUCell>{.cell = {.features = 3, .dtype = DType::bf16}}),
      // more layers
      one_input("instance_norm", nn::InstanceNorm{}),
      one_input("instance_norm_bf16", nn::InstanceNorm{.dtype = DType::bf16}),
      one_input("einsum", nn::Einsum{.shape = {6, 2, 3}, .einsum_str = "btd,dhk->bthk"}),
      one_input("einsum_ellipsis", nn::Einsum{.shape = {6, 4}, .einsum_str = "...d,dk->...k"}),
      one_input("einsum_bf16", nn::Einsum{.shape = {6, 2, 3}, .einsum_str = "btd,dhk->bthk", .dtype = DType::bf16}),
      array_cell("mgu_cell", nn::MGUCell{.features = 5}),
      array_cell("mgu_cell_no_reset", nn::MGUCell{.features = 5, .reset_gate = false}),
      one_input("rnn_mgu", nn::RNN<nn::MGUCell>{.cell = {.features = 3}}),
      lstm_cell("conv_lstm_cell", nn::ConvLSTMCell{.features = 3, .kernel_size = {3, 3}}),
      one_input("rnn_conv_lstm", nn::RNN<nn::ConvLSTMCell>{.cell = {.features = 2, .kernel_size = {3, 3}}}),
      one_input("bidirectional", nn::Bidirectional<nn::RNN<nn::LSTMCell>, nn::RNN<nn::GRUCell>>{
                                     .forward_rnn = {.cell = {.features = 4}}, .backward_rnn = {.cell = {.features = 3}}}),
      rnn_with_lengths("bidirectional_lengths", nn::Bidirectional<nn::RNN<nn::GRUCell>, nn::RNN<nn::MGUCell>>{
                                                    .forward_rnn = {.cell = {.features = 3}},
                                                    .backward_rnn = {.cell = {.features = 2}}}),
      // locally connected (unshared) convolutions
      one_input("conv_local", nn::ConvLocal{.features = 3, .kernel_size = {3, 3}}),
      one_input("conv_local_strided_valid",
                nn::ConvLocal{.features = 2, .kernel_size = {2, 3}, .strides = {2, 1}, .padding = "VALID"}),
      one_input("conv_local_1d_dilated", nn::ConvLocal{.features = 4, .kernel_size = {3}, .kernel_dilation = {2}}),
      // weight reparametrizations
      one_input("weight_norm", InParent<nn::WeightNorm<nn::Dense>>{{.layer = {.features = 4}}}),
      one_input("weight_norm_every_variable",
                InParent<nn::WeightNorm<nn::Dense>>{{.layer = {.features = 4}, .variable_filter = {}}}),
      one_input("weight_norm_conv_one_scale", InParent<nn::WeightNorm<nn::Conv>>{
                                                  {.layer = {.features = 3, .kernel_size = {3, 3}}, .feature_axes = std::nullopt}}),
      one_input("spectral_norm", InParentUpdating<nn::SpectralNorm<nn::Dense>>{{.layer = {.features = 4}}},
                ApplyOptions{.mutable_collections = {"batch_stats"}}),
      one_input("spectral_norm_conv_3_steps",
                InParentUpdating<nn::SpectralNorm<nn::Conv>>{{.layer = {.features = 3, .kernel_size = {3, 3}}, .n_steps = 3}},
                ApplyOptions{.mutable_collections = {"batch_stats"}}),
      one_input("spectral_norm_eval", InParentUpdating<nn::SpectralNorm<nn::Dense>>{{.layer = {.features = 4}}, false}),
  };
}

Tree with_params(const Tree& variables, const Tree& params) {
  Tree v = variables;
  if (variables.contains("params")) v.set("params", params);
  return v;
}

}  // namespace

namespace {

// init from the same keys: Flax's variables (names, shapes, dtypes, values). Orthogonal recurrent
// kernels come from a QR: within 2e-6; everything else bitwise (the summary lists what is not).
void check_init(const std::string& file, const std::vector<LayerCase>& cases) {
  const Tree& f = fixture(file);
  for (const LayerCase& c : cases) {
    CAPTURE(c.name);
    const Tree& want = f.at(c.name);
    const std::vector<Array> inputs = leaves_of(want.at("inputs"));
    // The weight wrappers store normalized kernels and power-iteration vectors: sums, which XLA
    // and Linum add in different orders (an ulp or two).
    const bool normalized = c.name.rfind("weight_norm", 0) == 0 || c.name.rfind("spectral_norm", 0) == 0;
    check_tree("init", c.name, c.init(inputs), want.at("variables"), [normalized](const std::string& path) {
      return orthogonal_kernel(path) || normalized ? std::make_pair(2e-6, 2e-6) : std::make_pair(0.0, 0.0);
    });
  }
}

// apply on Flax's variables: Flax's outputs, mutable updates, and gradients of
// sum(output_i * cotangent_i) with respect to the params and the float inputs.
void check_apply(const std::string& file, const std::vector<LayerCase>& cases) {
  const Tree& f = fixture(file);
  for (const LayerCase& c : cases) {
    CAPTURE(c.name);
    const Tree& want = f.at(c.name);
    const Tree& variables = want.at("variables");
    const std::vector<Array> inputs = leaves_of(want.at("inputs"));
    const std::vector<Array> cots = leaves_of(want.at("cotangents"));
    // float32: XLA and oneDNN/Eigen sum products in different orders (a few float32 ulps of the
    // largest terms). bf16 computation: outputs within a bf16 rounding or two (2^-8 relative each)
    // of either side's value; gradients pass several bf16 roundings, which Flax places after each
    // op and Linum after each fused kernel (attention's softmax and its products): 5%.
    const double rtol = c.bf16 ? 2e-2 : 1e-4, atol = c.bf16 ? 2e-2 : 1e-5;
    const double grad_tol = c.bf16 ? 5e-2 : 1e-4, grad_atol = c.bf16 ? 5e-2 : 1e-5;
    const std::string group = c.bf16 ? "apply bf16" : "apply f32";

    auto [outputs, updates] = c.apply(variables, inputs);
    const std::vector<Array> want_out = leaves_of(want.at("outputs"));
    REQUIRE(outputs.size() == want_out.size());
    for (std::size_t i = 0; i < outputs.size(); ++i)
      check_array(group, c.name + "/output_" + std::to_string(i), outputs[i], want_out[i], rtol, atol);
    if (want.contains("updates")) check_tree(group, c.name + "/updates", updates, want.at("updates"), rtol, atol);

    std::vector<std::size_t> float_at;
    std::vector<Array> float_inputs;
    for (std::size_t i = 0; i < inputs.size(); ++i)
      if (is_floating(inputs[i].dtype())) {
        float_at.push_back(i);
        float_inputs.push_back(inputs[i]);
      }
    const Tree params = variables.contains("params") ? variables.at("params") : Tree{};
    auto loss = [&](const Tree& p, const std::vector<Array>& fx) {
      std::vector<Array> xs = inputs;
      for (std::size_t j = 0; j < float_at.size(); ++j) xs[float_at[j]] = fx[j];
      const std::vector<Array> out = c.apply(with_params(variables, p), xs).first;
      Array total = Array::zeros(Shape{});
      for (std::size_t i = 0; i < out.size(); ++i) total = total + sum(astype(out[i], DType::f32) * cots[i]);
      return total;
    };
    auto [gp, gx] = grad<0, 1>(loss)(params, float_inputs);
    if (want.contains("grad_params") && !want.at("grad_params").empty())
      check_tree(group, c.name + "/grad_params", gp, want.at("grad_params"), grad_tol, grad_atol);
    const std::vector<Array> want_gx = leaves_of(want.at("grad_inputs"));
    REQUIRE(gx.size() == want_gx.size());
    for (std::size_t j = 0; j < gx.size(); ++j)
      check_array(group, c.name + "/grad_input_" + std::to_string(j), gx[j], want_gx[j], grad_tol, grad_atol);
  }
}

}  // namespace

TEST_CASE("flax.linen layers: init from the same key gives Flax's variables (names, shapes, dtypes, values)") {
  check_init("layers.msgpack", layer_cases());
}

TEST_CASE("flax.linen layers: Linum's init lists the variables in Flax's order (so their files are Flax's bytes)") {
  for (const LayerCase& c : layer_cases()) {
    CAPTURE(c.name);
    const std::vector<std::int32_t> words = fixture("flax_bytes.msgpack").at(c.name).array().to_vector_i32();
    const Tree flax_init = ser::from_msgpack(std::vector<std::uint8_t>(words.begin(), words.end()), c.name);
    const Tree ours = c.init(leaves_of(fixture("layers.msgpack").at(c.name).at("inputs")));
    std::vector<std::string> ours_paths, flax_paths;
    for (const auto& [path, a] : flatten(ours)) ours_paths.push_back(path);
    for (const auto& [path, a] : flatten(flax_init)) flax_paths.push_back(path);
    // Known difference: variables created inside Flax's lifted transforms (nn.RNN is an nn.scan) come
    // out in sorted key order (JAX's pytrees sort dict keys); lift::scan keeps creation order.
    if (c.name.rfind("rnn_", 0) == 0) {
      std::sort(ours_paths.begin(), ours_paths.end());
      CHECK(std::is_sorted(flax_paths.begin(), flax_paths.end()));
    }
    // Bidirectional: forward_rnn then backward_rnn in both, each RNN's variables as above.
    if (c.name.rfind("bidirectional", 0) == 0) {
      auto by_rnn = [](const std::string& a, const std::string& b) {
        const bool fa = a.find("/forward_rnn/") != std::string::npos, fb = b.find("/forward_rnn/") != std::string::npos;
        return fa != fb ? fa : a < b;
      };
      std::sort(ours_paths.begin(), ours_paths.end(), by_rnn);
      CHECK(std::is_sorted(flax_paths.begin(), flax_paths.end(), by_rnn));
    }
    // The weight wrappers: Flax's map_variables is a lifted transform too (the layer's variables in
    // sorted key order), and Flax keeps the wrapper's variable names as one key with slashes
    // ("Dense_0/kernel/scale") where Linum nests dicts (the same paths), so their files differ.
    const bool slash_keys = c.name.rfind("weight_norm", 0) == 0 || c.name.rfind("spectral_norm", 0) == 0;
    if (slash_keys) {
      std::sort(ours_paths.begin(), ours_paths.end());
      std::sort(flax_paths.begin(), flax_paths.end());
    }
    CHECK(ours_paths == flax_paths);
    // Where the values are bitwise too, the file Linum writes is the file Flax writes.
    if (!slash_keys && bitwise_equal(ours, flax_init)) CHECK(ser::to_msgpack(ours) == std::vector<std::uint8_t>(words.begin(), words.end()));
  }
}

TEST_CASE("flax.linen layers: apply on Flax's variables gives Flax's outputs, mutable updates and gradients") {
  check_apply("layers.msgpack", layer_cases());
}

// ---- lifted transforms with dropout -------------------------------------------------------------

namespace {

// carry, x -> (tanh(h), h) with h = dropout(Dense(carry) + x): keys drawn inside the lift.
struct DropBlock {
  std::pair<Array, Array> operator()(Scope& s, const Array& c, const Array& x) const {
    Array h = s(nn::Dense{.features = 5}, c) + x;
    h = s(nn::Dropout{.rate = 0.5, .deterministic = false}, h);
    return {tanh(h), h};
  }
};

struct ScanStacked {
  auto operator()(Scope& s, const Array& c, const Array& xs) const {
    return s(lift::scan<DropBlock>{.variable_axes = {{"params", 0}}, .split_rngs = {{"params", true}, {"dropout", true}}}, c,
             lift::scanned(xs));
  }
};

struct ScanShared {
  auto operator()(Scope& s, const Array& c, const Array& xs) const {
    return s(lift::scan<DropBlock>{.variable_broadcast = {"params"}, .split_rngs = {{"params", false}, {"dropout", true}}},
             c, lift::scanned(xs));
  }
};

struct ScanReverse {
  auto operator()(Scope& s, const Array& c, const Array& xs) const {
    return s(lift::scan<DropBlock>{.reverse = true, .variable_axes = {{"params", 0}},
                                   .split_rngs = {{"params", true}, {"dropout", true}}},
             c, lift::scanned(xs));
  }
};

// Flax names a class-form nn.remat(DropBlock) instance CheckpointDropBlock_<n>; lift::remat keeps
// the body's name (so remat and plain dicts are interchangeable). A port of a Flax model names
// them as Flax did, and then the layout, the masks and the gradients are Flax's.
struct RematBlocks {
  std::pair<Array, Array> operator()(Scope& s, const Array& c, const Array& x) const {
    auto [c1, h1] = s("CheckpointDropBlock_0", lift::remat<DropBlock>{}, c, x);
    auto [c2, h2] = s("CheckpointDropBlock_1", lift::remat<DropBlock>{}, c1, x);
    auto [c3, h3] = s(DropBlock{}, c2, x);
    return {c3, h1 + h2 + h3};
  }
};

// carry -> carry + dropout(tanh(Dense(carry))).
struct ResBlock {
  Array operator()(Scope& s, const Array& c) const {
    return c + s(nn::Dropout{.rate = 0.25, .deterministic = false}, tanh(s(nn::Dense{.features = 5}, c)));
  }
};

struct RematScan {
  Array operator()(Scope& s, const Array& c) const { return s(lift::remat_scan<ResBlock>{.lengths = {2, 3}}, c); }
};

// Flax's nn.while_loop of three iterations over h -> dropout(tanh(Dense(h))) + h, dropout split per
// iteration (make_fixtures.py's WhileDrop; Flax's init runs the body once, as lift::while_loop's).
struct WhileDrop {
  Array operator()(Scope& s, const Array& c) const {
    using Carry = std::pair<Array, Array>;  // (h, iterations so far)
    auto cond = [](Scope&, const Carry& k) { return k.second.item() < 3.0f; };
    auto body = [](Scope& s, const Carry& k) {
      const Array h = s(nn::Dropout{.rate = 0.5, .deterministic = false}, tanh(s(nn::Dense{.features = 5}, k.first)));
      return Carry{h + k.first, k.second + 1.0f};
    };
    return lift::while_loop(s, cond, body, Carry{c, Array::zeros(Shape{})}, {.split_rngs = {{"dropout", true}}}).first;
  }
};

// A model of one or two array inputs, initialized with params key 0 and dropout key 8, applied with
// dropout key 7 (as make_fixtures.py's lifted cases).
template <class M>
LayerCase lifted_case(std::string name, M m) {
  const rng::Streams init_rngs{{"params", rng::key(0)}, {"dropout", rng::key(8)}};
  const ApplyOptions options{.rngs = {{"dropout", rng::key(7)}}};
  return {std::move(name),
          [m, init_rngs](const std::vector<Array>& x) {
            if constexpr (std::invocable<const M&, Scope&, const Array&>) return init(m, init_rngs, x.at(0));
            else return init(m, init_rngs, x.at(0), x.at(1));
          },
          [m, options](const Tree& vars, const std::vector<Array>& x) {
            if constexpr (std::invocable<const M&, Scope&, const Array&>) {
              auto [y, upd] = apply(m, vars, options, x.at(0));
              return std::make_pair(pytree::flatten(y), Tree(upd));
            } else {
              auto [y, upd] = apply(m, vars, options, x.at(0), x.at(1));
              return std::make_pair(pytree::flatten(y), Tree(upd));
            }
          }};
}

std::vector<LayerCase> lifted_cases() {
  return {lifted_case("scan_stacked", ScanStacked{}), lifted_case("scan_shared", ScanShared{}),
          lifted_case("scan_reverse", ScanReverse{}), lifted_case("remat_blocks", RematBlocks{}),
          lifted_case("remat_scan", RematScan{}), lifted_case("while_loop", WhileDrop{})};
}

}  // namespace

TEST_CASE("nn.scan, nn.remat, nn.remat_scan, nn.while_loop with dropout: Flax's variable layouts, masks drawn inside the lift, gradients") {
  check_init("lifted.msgpack", lifted_cases());
  check_apply("lifted.msgpack", lifted_cases());
}

// ---- jax.checkpoint policies --------------------------------------------------------------------

TEST_CASE("jax.checkpoint policies save what JAX's saved_residuals lists: arguments, named values, products") {
  const Tree& f = fixture("residuals.msgpack");
  const std::vector<Array> in = leaves_of(f.at("inputs"));
  // make_fixtures.py's residual_block: two plain products, a named value, a batched product.
  auto block = [](const Array& x, const Array& w1, const Array& w2, const Array& w3) {
    const Array h = checkpoint_name(tanh(matmul(x, w1)), "h");
    const Array g = sin(matmul(h, w2));
    return exp(einsum("bij,bjk->bik", reshape(g, {2, 2, 3}), w3));
  };
  const std::vector<std::pair<std::string, lift::Policy>> cases = {
      {"nothing_saveable", policies::nothing_saveable{}},
      {"dots_saveable", policies::dots_saveable{}},
      {"dots_with_no_batch_dims_saveable", policies::dots_with_no_batch_dims_saveable{}},
      {"save_only_these_names_h", policies::save_only_these_names({"h"})},
      {"save_any_names_but_these_h", policies::save_any_names_but_these({"h"})},
  };
  // Each residual as (kind, shape): 0 an argument, 1 a named value, 2 a product's output, 3 other.
  auto key_of = [](int kind, const Shape& shape) {
    std::ostringstream os;
    os << kind << " " << shape;
    return os.str();
  };
  for (const auto& entry : cases) {
    const auto& name = entry.first;
    const auto& policy = entry.second;
    CAPTURE(name);
    const auto loss = [&](const Array& x, const Array& w1, const Array& w2, const Array& w3) {
      return sum(checkpoint(block, {.policy = policy})(x, w1, w2, w3));
    };
    std::multiset<std::string> got, want;
    std::string listing;
    for (const lift::Residual& r : lift::saved_residuals(loss, in[0], in[1], in[2], in[3])) {
      const int kind = r.kind == "argument" ? 0 : r.name == "h" ? 1 : (r.op == "matmul" || r.op == "batched_matmul" || r.op == "linear" || r.op == "dot_general") ? 2 : 3;
      got.insert(key_of(kind, r.shape));
      listing += "\n  " + r.str();
    }
    for (const auto& [i, e] : f.at(name)) {
      const std::vector<std::int32_t> dims = e.at("shape").array().to_vector_i32();
      want.insert(key_of(e.at("kind").array().to_vector_i32().at(0), Shape(std::vector<std::int64_t>(dims.begin(), dims.end()))));
    }
    INFO("Linum saves:" << listing);
    CHECK(got == want);
  }
}

// ---- optax --------------------------------------------------------------------------------------

TEST_CASE("optax: every optimizer and wrapper: parameters over 5 steps and the final state tree equal optax's") {
  const Tree& f = fixture("optax.msgpack");
  const optim::Mask only_w = [](const std::string& path, const Array&) { return path == "w"; };
  const std::vector<std::pair<std::string, optim::GradientTransformation>> cases = {
      {"sgd", optim::sgd(0.1)},
      {"sgd_momentum", optim::sgd(0.1, 0.9)},
      {"sgd_nesterov", optim::sgd(0.1, 0.9, true)},
      {"adam", optim::adam(1e-2)},
      {"adam_eps_root", optim::adam(1e-2, 0.8, 0.95, 1e-6, 1e-8)},
      {"adamw", optim::adamw(1e-2, 0.9, 0.999, 1e-8, 0.1)},
      {"rmsprop", optim::rmsprop(1e-2)},
      {"rmsprop_centered", optim::rmsprop(1e-2, 0.9, 1e-8, 0.0, true)},
      {"rmsprop_eps_outside", optim::rmsprop(1e-2, 0.9, 1e-8, 0.0, false, 0.0, false, false)},
      {"adagrad", optim::adagrad(0.1)},
      {"lion", optim::lion(1e-2)},
      {"lamb", optim::lamb(1e-2)},
      {"adabelief", optim::adabelief(1e-2)},
      {"adafactor", optim::adafactor(1e-2)},
      {"clip_adam", optim::chain(optim::clip_by_global_norm(0.5), optim::adam(1e-2))},
      {"adam_schedule", optim::adam(optim::warmup_cosine_decay_schedule(0.0f, 1e-2f, 2, 5))},
      // the toolbox
      {"trace_nesterov", optim::chain(optim::trace(0.9, true), optim::scale(-0.1))},
      {"scale_by_rss", optim::chain(optim::scale_by_rss(), optim::scale(-0.1))},
      {"scale_by_stddev", optim::chain(optim::scale_by_stddev(), optim::scale(-0.01))},
      {"trust_ratio", optim::chain(optim::scale_by_adam(), optim::scale_by_trust_ratio(), optim::scale(-0.01))},
      {"adafactor_factored", optim::adafactor(1e-2, 2)},
      {"clip_by_block_rms", optim::chain(optim::clip_by_block_rms(0.5), optim::scale(-0.1))},
      {"param_block_rms", optim::chain(optim::scale_by_param_block_rms(), optim::scale(-0.1))},
      {"ema", optim::chain(optim::ema(0.9), optim::scale(-0.1))},
      {"ema_no_debias", optim::chain(optim::ema(0.8, false), optim::scale(-0.1))},
      {"masked_adam", optim::masked(optim::adam(1e-2), only_w)},
      {"decay_masked", optim::chain(optim::add_decayed_weights(0.1, only_w), optim::sgd(0.1))},
      {"scale_by_schedule", optim::chain(optim::scale_by_schedule(optim::linear_schedule(-0.1f, -0.01f, 4)))},
      {"apply_if_finite", optim::apply_if_finite(optim::adam(1e-2), 2)},
      {"multi_steps", optim::multi_steps(optim::adam(1e-2), 2)},
      {"dpsgd", optim::dpsgd(0.1, 1.0, 0.5, 3)},
      // the other adaptive optimizers
      {"nadam", optim::nadam(1e-2)},
      {"nadamw", optim::nadamw(1e-2, 0.9, 0.999, 1e-8, 0.1)},
      {"amsgrad", optim::amsgrad(1e-2)},
      {"amsgrad_no_bias_correction", optim::amsgrad(1e-2, 0.9, 0.999, 1e-8, 0.0, false, false)},
      {"adamax", optim::adamax(1e-2)},
      {"radam", optim::radam(1e-2)},
      {"radam_rectified", optim::radam(1e-2, 0.9, 0.9, 1e-8, 0.0, 4.0)},
      {"radam_rectified_nesterov", optim::radam(1e-2, 0.9, 0.9, 1e-8, 0.0, 4.0, true)},
      {"yogi", optim::yogi(1e-2)},
      {"adadelta", optim::adadelta(0.5)},
      {"adadelta_decay_masked", optim::adadelta(0.5, 0.9, 1e-6, 0.1, only_w)},
      {"novograd", optim::novograd(1e-2, 0.9, 0.25, 1e-6, 0.0, 0.01)},
      {"lars", optim::lars(0.1, 0.01)},
      {"lars_masked", optim::lars(0.1, 0.01, only_w, 0.001, 0.0, only_w, 0.9, true)},
      // more of optax's optimizers
      {"adan", optim::adan(1e-2)},
      {"adan_decay_masked", optim::adan(1e-2, 0.98, 0.92, 0.99, 1e-8, 1e-8, 0.1, only_w)},
      {"adamaxw", optim::adamaxw(1e-2)},
      {"sign_sgd", optim::sign_sgd(0.1)},
      {"sm3", optim::sm3(0.1)},
      {"fromage", optim::fromage(0.1)},
      // clipping, constraints, noise, optimistic gradients
      {"clip", optim::chain(optim::clip(0.5), optim::scale(-0.1))},
      {"adaptive_grad_clip", optim::chain(optim::adaptive_grad_clip(0.1), optim::sgd(0.1))},
      {"centralize", optim::chain(optim::centralize(), optim::sgd(0.1))},
      {"keep_params_nonnegative", optim::chain(optim::sgd(0.5), optim::keep_params_nonnegative())},
      {"zero_nans", optim::chain(optim::zero_nans(), optim::sgd(0.1))},
      {"frozen_w", optim::chain(optim::sgd(0.1), optim::masked(optim::set_to_zero(), only_w))},
      {"noisy_sgd", optim::noisy_sgd(0.1, 0.01, 0.55, 3)},
      {"optimistic_gd", optim::optimistic_gradient_descent(0.1)},
      {"optimistic_gd_ab", optim::optimistic_gradient_descent(0.1, 0.5, 0.3)},
      {"multi_transform", optim::multi_transform({{"adam", optim::adam(1e-2)}, {"sgd", optim::sgd(0.1, 0.9)}},
                                                 [](const std::string& path, const Array&) { return path == "w" ? "adam" : "sgd"; })},
  };
  for (const auto& entry : cases) {
    const auto& name = entry.first;
    const auto& opt = entry.second;
    CAPTURE(name);
    // apply_if_finite's and zero_nans' trajectories have a NaN in the gradients of step 2; DP-SGD takes per-example ones.
    const Tree& grads =
        f.at(name == "apply_if_finite" || name == "zero_nans" ? "grads_nan" : name == "dpsgd" ? "grads_per_example" : "grads");
    const Tree& want = f.at("optimizers").at(name);
    Tree params = f.at("params0");
    Tree state = opt.init(params);
    for (std::size_t s = 0; s < grads.size(); ++s) {
      auto [updates, next] = opt.update(grads.at(std::to_string(s)), state, params);
      params = optim::apply_updates(params, updates);
      state = next;
      // optax evaluates the same float32 formulas; XLA may fuse a multiply-add where Linum rounds
      // twice (or the reverse): a few ulps, growing slowly over the steps.
      check_tree("optax", name + "/params_" + std::to_string(s), params, want.at("params").at(std::to_string(s)), 1e-5,
                 1e-6);
    }
    check_tree("optax", name + "/state", state, want.at("state"), 1e-5, 1e-6);
  }
}

TEST_CASE("optax: the optimizers that read the objective (polyak_sgd, lbfgs, backtracking linesearch) follow optax's trajectory") {
  const Tree& f = fixture("optax.msgpack");
  const Tree& o = f.at("objective");
  // f(p) = sum over the leaves of 0.5 a (p - t)^2 + 0.1 p^4, as make_fixtures.py's.
  const Tree a = o.at("a"), t = o.at("t");
  auto objective = [a, t](const Tree& p) {
    Array total = Array::full(Shape{}, 0.0f);
    for (const char* k : {"b", "w"}) {
      const Array& x = p.at(k).array();
      const Array d = x - t.at(k).array();
      total = total + sum(0.5f * a.at(k).array() * d * d + 0.1f * (x * x) * (x * x));
    }
    return total;
  };
  auto value_fn = [objective](const Tree& p) { return objective(p).item(); };
  const std::vector<std::pair<std::string, optim::GradientTransformation>> cases = {
      {"polyak_sgd", optim::polyak_sgd()},
      {"polyak_sgd_plus", optim::polyak_sgd(0.5, 0.8, 0.5, 1e-3, optim::PolyakVariant::sps_plus)},
      {"lbfgs_lr", optim::lbfgs(0.1, 10, true, optim::identity())},
      {"lbfgs_unscaled_lr", optim::lbfgs(0.05, 3, false, optim::identity())},
      {"lbfgs_backtracking", optim::lbfgs()},
      {"lbfgs_memory_2", optim::lbfgs(std::nullopt, 2)},
      {"sgd_backtracking",
       optim::chain(optim::sgd(1.0), optim::scale_by_backtracking_linesearch(15, 0.3, 0.5, 2.0, 4.0))},
  };
  for (const auto& entry : cases) {
    const std::string& name = entry.first;
    const optim::GradientTransformation& opt = entry.second;
    CAPTURE(name);
    CHECK(opt.uses_extra_args() == (name.find("_lr") == std::string::npos));
    const Tree& want = o.at(name);
    Tree params = f.at("params0");
    Tree state = opt.init(params);
    const std::vector<float> values = want.at("values").array().to_vector();
    for (int s = 0; s < static_cast<int>(values.size()); ++s) {
      auto [value, grads] = value_and_grad(objective)(params);
      auto [updates, next] = opt.update(grads, state, params, {.value = value.item(), .value_fn = value_fn});
      params = optim::apply_updates(params, updates);
      state = next;
      // The inner products are summed in another order than XLA's, and the linesearch's trial
      // values come from Linum's ops: a few ulps, which the quasi-Newton steps amplify mildly.
      check_tree("optax", name + "/params_" + std::to_string(s), params, want.at("params").at(std::to_string(s)), 1e-4, 1e-5);
      CHECK(value_fn(params) == doctest::Approx(values[static_cast<std::size_t>(s)]).epsilon(1e-5));
    }
    check_tree("optax", name + "/state", state, want.at("state"), 1e-4, 1e-5);
  }
}

TEST_CASE("optax schedules at steps 0..14 equal optax's") {
  const Tree& f = fixture("optax.msgpack").at("schedules");
  const std::vector<std::pair<std::string, optim::Schedule>> cases = {
      {"constant", optim::constant_schedule(0.3f)},
      {"linear", optim::linear_schedule(1.0f, 0.1f, 7, 2)},
      {"cosine_decay", optim::cosine_decay_schedule(0.5f, 9, 0.1f)},
      {"warmup_cosine_decay", optim::warmup_cosine_decay_schedule(0.0f, 1.0f, 3, 10, 0.05f)},
      {"exponential_decay", optim::exponential_decay(1.0f, 3, 0.5f)},
      {"exponential_decay_staircase", optim::exponential_decay(1.0f, 3, 0.5f, 1, true, 0.2f)},
      {"piecewise_constant", optim::piecewise_constant_schedule(1.0f, {{3, 0.5f}, {7, 0.1f}})},
      {"polynomial", optim::polynomial_schedule(1.0f, 0.01f, 2.0, 8, 1)},
      {"join", optim::join_schedules({optim::constant_schedule(0.1f), optim::linear_schedule(0.1f, 1.0f, 5)}, {4})},
      {"cosine_onecycle", optim::cosine_onecycle_schedule(12, 1.0f)},
  };
  for (const auto& entry : cases) {
    const auto& name = entry.first;
    const auto& schedule = entry.second;
    CAPTURE(name);
    std::vector<float> got;
    for (std::int64_t s = 0; s < 15; ++s) got.push_back(schedule(s));
    // Schedules are evaluated in double and rounded once; JAX evaluates them in float32.
    check_array("schedules", name, Array::from(Shape{15}, got), f.at(name).array(), 1e-6, 1e-7);
  }
}

// ---- flax.serialization -------------------------------------------------------------------------

TEST_CASE("flax.serialization: a file Flax wrote loads, and Linum writes it back byte for byte") {
  std::ifstream in(kFixtures / "serialization.msgpack", std::ios::binary);
  const std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  REQUIRE(!bytes.empty());
  const Tree t = ser::from_msgpack(bytes, "serialization.msgpack");
  CHECK(ser::to_msgpack(t) == bytes);
  CHECK(t.at_path("params/Embed_0/embedding").array().dtype() == DType::bf16);
  CHECK(t.at("step").array().dtype() == DType::i32);
  CHECK(t.at("step").array().shape() == Shape{});
  CHECK(t.at("ids").array().to_vector_i32() == std::vector<std::int32_t>{1, -2, 2147483647, -2147483647 - 1});
  const std::vector<float> specials = t.at("specials").array().to_vector();
  CHECK(std::isinf(specials[0]));
  CHECK(std::isnan(specials[2]));
  CHECK(std::signbit(specials[3]));
  std::uint32_t subnormal_bits = 0;
  std::memcpy(&subnormal_bits, t.at("specials").array().data() + 4, 4);
  CHECK(subnormal_bits == 1u);  // the smallest subnormal survives (compared as bits: Linum flushes denormals in arithmetic)
  CHECK(t.at("empty").array().shape() == Shape{0, 3});
  // flax.serialization.to_bytes of Flax's own init output, every layer case: Linum reads the bytes
  // to the variables the layer fixture holds and writes the same bytes back.
  for (const auto& entry : fixture("flax_bytes.msgpack")) {
    const auto& name = entry.first;
    const auto& b = entry.second;
    CAPTURE(name);
    const std::vector<std::int32_t> words = b.array().to_vector_i32();
    const std::vector<std::uint8_t> flax_bytes(words.begin(), words.end());
    const Tree variables = ser::from_msgpack(flax_bytes, name);
    // The same leaves bit for bit (to_state_dict orders keys its own way; the bytes keep that order).
    auto sorted_leaves = [](const Tree& t) {
      auto items = flatten(t);
      std::sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      return items;
    };
    const auto got = sorted_leaves(variables), want = sorted_leaves(fixture("layers.msgpack").at(name).at("variables"));
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      CHECK(got[i].first == want[i].first);
      CHECK(got[i].second.bitwise_equal(want[i].second));
    }
    // Flax's weight wrappers name variables by paths in one key ("Dense_0/kernel/scale"); Linum
    // reads them nested (the same paths, checked above) and writes nested dicts.
    const bool slash_keys = name.rfind("weight_norm", 0) == 0 || name.rfind("spectral_norm", 0) == 0;
    if (!slash_keys) CHECK(ser::to_msgpack(variables) == flax_bytes);
  }
}

TEST_CASE("oracle summary: what matched bit for bit and what within tolerance") {
  // Runs last (doctest orders test cases by file and line): prints one line per group.
  for (const auto& [group, s] : summaries()) {
    MESSAGE(group << ": " << s.bitwise << " arrays bitwise, " << s.close << " within tolerance (largest difference "
                  << s.max_abs_close << (s.worst.empty() ? "" : " at " + s.worst) << "), " << s.failed << " failed");
    // Where the exact groups are not exact (PRNG, initializers, init): each array, to see why.
    if (group.rfind("apply", 0) != 0 && group != "optax" && group != "schedules") {
      std::string list;
      for (const std::string& w : s.inexact) list += " " + w;
      if (!list.empty()) MESSAGE(group << " within tolerance:" << list);
    }
  }
}
