// The one primitive path (core/autodiff/primitive.hpp): every op family keeps remat's promises
// (a saved output is not computed again, values feeding only saved values are left out of the
// replay, gradients bitwise the plain ones, verify mode passes), user-defined ops join through
// custom_vjp, every float leaf of any pytree gets its gradient in its dtype, and saved-value hooks
// see every residual.
#include <doctest/doctest.h>
#include <linum/core/autodiff/custom_vjp.hpp>
#include <linum/core/autodiff/saved_hooks.hpp>
#include <linum/linum.hpp>

#include "testing/gradcheck.hpp"
#include "testing/op_cases.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>

using namespace linum;
using linum::testing::random_array;
using linum::testing::swish;
using Case = linum::testing::OpCase;

namespace {

using linum::testing::max_abs;
using linum::testing::max_abs_diff;

lift::Policy saving_op(const std::string& op) {
  return lift::Policy("save " + op, [op](const lift::OpInfo& info) { return info.op == op; });
}

struct Run {
  Array value, dx, dw;
  lift::RecomputeStats stats;
};

Run run_case(const Case& c, const std::optional<lift::Policy>& policy, bool verify = false) {
  const Array x = random_array(c.x_shape, 11) * 0.5f, w = random_array(c.w_shape, 12);
  auto block = [&c](const Array& x, const Array& w) { return c.apply(x * 1.5f, w); };
  lift::reset_recompute_stats();
  auto loss = [&](const Array& x, const Array& w) {
    Array y = policy ? checkpoint(block, {.policy = *policy, .verify = verify})(x, w) : block(x, w);
    return sum(square(astype(y, DType::f32)));
  };
  auto [v, gx, gw] = value_and_grad<0, 1>(loss)(x, w);
  return {v, gx, gw, lift::recompute_stats()};
}

}  // namespace

TEST_CASE("every op family: a saved output is not computed again, what feeds only it is left out, gradients are bitwise") {
  for (const Case& c : linum::testing::op_cases()) {
    const std::string family = c.family, op = c.op;
    CAPTURE(family);
    CAPTURE(op);
    const Run plain = run_case(c, std::nullopt);
    const Run nothing = run_case(c, lift::Policy(policies::nothing_saveable{}));
    const Run saved = run_case(c, saving_op(c.op));
    // The policy saw the op and kept its output; the replay took it instead of computing it.
    CHECK(saved.stats.values_saved >= 1);
    CHECK(saved.stats.ops_replayed == saved.stats.values_saved);
    CHECK(nothing.stats.ops_replayed == 0);
    CHECK(saved.stats.ops_recomputed + saved.stats.ops_replayed + saved.stats.ops_eliminated == nothing.stats.ops_recomputed);
    CHECK(saved.stats.full_reruns == 0);
    // The product feeding it is left out exactly when the op's rule does not keep its input.
    CHECK((saved.stats.ops_eliminated >= 1) == c.input_left_out);
    // Gradients are those of the plain function, bit for bit, whatever was saved or left out.
    for (const Run* r : {&nothing, &saved}) {
      CHECK(r->value.bitwise_equal(plain.value));
      CHECK(r->dx.bitwise_equal(plain.dx));
      CHECK(r->dw.bitwise_equal(plain.dw));
    }
    // Verify mode replays the block op by op and finds it the same.
    const Run verified = run_case(c, saving_op(c.op), /*verify=*/true);
    CHECK(verified.dx.bitwise_equal(plain.dx));
    CHECK(verified.dw.bitwise_equal(plain.dw));
  }
}

TEST_CASE("every op family in bfloat16: saved outputs replayed, gradients bitwise") {
  for (const Case& c : linum::testing::op_cases()) {
    const std::string op = c.op;
    CAPTURE(op);
    auto bf16_case = c;
    bf16_case.apply = [&c](const Array& z, const Array& w) { return c.apply(astype(z, DType::bf16), astype(w, DType::bf16)); };
    if (std::string(c.op) == "astype") continue;  // its own case is the cast
    const Run plain = run_case(bf16_case, std::nullopt);
    const Run saved = run_case(bf16_case, saving_op(c.op));
    CHECK(saved.stats.ops_replayed >= 1);
    CHECK(saved.dx.bitwise_equal(plain.dx));
    CHECK(saved.dw.bitwise_equal(plain.dw));
  }
}

TEST_CASE("dots_saveable saves the fused attention's output, as JAX's dot_general-based attention") {
  const Array q = random_array(Shape{2, 6, 2, 4}, 1), k = random_array(Shape{2, 6, 2, 4}, 2), v = random_array(Shape{2, 6, 2, 4}, 3);
  auto block = [](const Array& q, const Array& k, const Array& v) { return tanh(scaled_dot_product_attention(q, k, v)); };
  auto grads = [&](const lift::Policy& p) {
    lift::reset_recompute_stats();
    auto g = grad<0, 1, 2>([&](const Array& q, const Array& k, const Array& v) {
      return sum(checkpoint(block, {.policy = p})(q, k, v));
    })(q, k, v);
    return std::make_pair(g, lift::recompute_stats());
  };
  auto [g_dots, s_dots] = grads(policies::dots_saveable{});
  CHECK(s_dots.values_saved == 1);
  CHECK(s_dots.ops_replayed == 1);
  auto [g_nb, s_nb] = grads(policies::dots_with_no_batch_dims_saveable{});
  CHECK(s_nb.values_saved == 0);  // its products have batch (and head) axes
  auto plain = grad<0, 1, 2>([&](const Array& q, const Array& k, const Array& v) { return sum(block(q, k, v)); })(q, k, v);
  CHECK(std::get<0>(g_dots).bitwise_equal(std::get<0>(plain)));
  CHECK(std::get<1>(g_dots).bitwise_equal(std::get<1>(plain)));
  CHECK(std::get<2>(g_dots).bitwise_equal(std::get<2>(plain)));
}

TEST_CASE("custom_vjp: its backward rule is the gradient, over pytrees, with clear errors") {
  const Array x = random_array(Shape{3, 4}, 5);
  // The rule is what differentiation uses (here deliberately not the true derivative).
  auto twice_grad = custom_vjp(
      "double_grad", [](const Array& a) { return std::make_pair(a * 1.0f, 0); },
      [](int, const Array& g) { return g * 2.0f; });
  Array g = grad([&](const Array& a) { return sum(twice_grad(a)); })(x);
  CHECK(g.bitwise_equal(Array::full(x.shape(), 2.0f)));
  // swish equals silu's gradient (the same formula) and finite differences.
  Array g_swish = grad([](const Array& a) { return sum(swish(a)); })(x);
  Array g_silu = grad([](const Array& a) { return sum(silu(a)); })(x);
  CHECK(max_abs_diff(g_swish, g_silu) < 1e-6f);
  CHECK(linum::testing::check_gradients("swish", [](const std::vector<Array>& v) { return swish(v[0]); }, {x}));

  // Pytrees in and out: (Tree, Array, int) -> (pair of arrays); an unused output's cotangent is zeros.
  Tree params = Tree{{"a", Array::from(Shape{2}, {1, 2})}, {"b", Array::from(Shape{2}, {3, 4})}};
  auto f = custom_vjp(
      "pair_op",
      [](const Tree& p, const Array& y, int scale) {
        Array s = p.at("a").array() * y * static_cast<float>(scale);
        return std::make_pair(std::make_pair(s, p.at("b").array() + y), std::make_tuple(p, y, scale));
      },
      [](const std::tuple<Tree, Array, int>& res, const std::pair<Array, Array>& ct) {
        const auto& [p, y, scale] = res;
        const Array ga = ct.first * y * static_cast<float>(scale);
        const Array gy = ct.first * p.at("a").array() * static_cast<float>(scale) + ct.second;
        Tree gp = Tree{{"a", ga}, {"b", ct.second}};
        return std::make_tuple(gp, gy, 0);
      });
  const Array y = Array::from(Shape{2}, {5, 6});
  auto [gp, gy] = grad<0, 1>([&](const Tree& p, const Array& y) { return sum(f(p, y, 3).first); })(params, y);
  CHECK(gp.at("a").array().to_vector() == std::vector<float>{15, 18});
  CHECK(gp.at("b").array().to_vector() == std::vector<float>{0, 0});
  CHECK(gy.to_vector() == std::vector<float>{3, 6});

  // A backward that returns the wrong number of cotangents names the op.
  auto wrong = custom_vjp("wrong_arity", [](const Array& a) { return std::make_pair(a * 1.0f, 0); },
                          [](int, const Array& g) { return std::vector<Array>{g, g}; });
  CHECK_THROWS_WITH_AS(grad([&](const Array& a) { return sum(wrong(a)); })(x),
                       doctest::Contains("custom_vjp 'wrong_arity': its backward returned 2 arrays"), AutodiffError);
}

TEST_CASE("custom_vjp under remat, scan and debug_nans") {
  const Array x = random_array(Shape{4, 6}, 7), w = random_array(Shape{6, 6}, 8);
  auto block = [](const Array& x, const Array& w) { return swish(matmul(x, w)); };
  auto plain = grad<0, 1>([&](const Array& x, const Array& w) { return sum(block(x, w)); })(x, w);
  for (const lift::Policy& p : {lift::Policy(policies::nothing_saveable{}), saving_op("swish")}) {
    CAPTURE(p.description());
    auto g = grad<0, 1>([&](const Array& x, const Array& w) { return sum(checkpoint(block, {.policy = p})(x, w)); })(x, w);
    CHECK(std::get<0>(g).bitwise_equal(std::get<0>(plain)));
    CHECK(std::get<1>(g).bitwise_equal(std::get<1>(plain)));
  }
  // A direct witness: the forward of a saved custom op runs once (the replay takes its output);
  // under nothing_saveable it runs again in the backward pass.
  int forward_runs = 0;
  auto counted = custom_vjp(
      "counted",
      [&forward_runs](const Array& a) {
        ++forward_runs;
        Array y = tanh(a);
        return std::make_pair(y, y);
      },
      [](const Array& y, const Array& g) { return g * (1.0f - y * y); });
  auto counted_block = [&counted](const Array& x, const Array& w) { return counted(matmul(x, w)) * 2.0f; };
  for (const auto& policy_runs : {std::pair{saving_op("counted"), 1}, std::pair{lift::Policy(policies::nothing_saveable{}), 2}}) {
    const lift::Policy& policy = policy_runs.first;  // (not a structured binding: clang 14 cannot capture those)
    const int runs = policy_runs.second;
    CAPTURE(policy.description());
    forward_runs = 0;
    (void)grad<0, 1>([&](const Array& x, const Array& w) { return sum(checkpoint(counted_block, {.policy = policy})(x, w)); })(x, w);
    CHECK(forward_runs == runs);
  }
  // In the steps of a scan under every checkpointing schedule: bitwise the plain loop.
  auto scanned = [&](const Array& c0, const Array& w, const lift::ScanSchedule& schedule) {
    auto step = [w](std::int64_t, const Array& carry) { return swish(matmul(carry, w)) * 0.5f; };
    return sum(lift::run_steps(6, c0, step, schedule));
  };
  auto g_plain = grad<0, 1>([&](const Array& c, const Array& w) {
    Array h = c;
    for (int t = 0; t < 6; ++t) h = swish(matmul(h, w)) * 0.5f;
    return sum(h);
  })(x, w);
  for (const lift::ScanSchedule& schedule : {lift::ScanSchedule::every_step(), lift::ScanSchedule::sqrt_segments(),
                                             lift::ScanSchedule::binomial(2)}) {
    auto g = grad<0, 1>([&](const Array& c, const Array& w) { return scanned(c, w, schedule); })(x, w);
    CHECK(std::get<0>(g).bitwise_equal(std::get<0>(g_plain)));
    CHECK(std::get<1>(g).bitwise_equal(std::get<1>(g_plain)));
  }
  // debug_nans names the custom op, forward and backward.
  auto bad_forward = custom_vjp("bad_forward", [](const Array& a) { return std::make_pair(log(a - 10.0f), 0); },
                                [](int, const Array& g) { return g; });
  auto bad_backward = custom_vjp("bad_backward", [](const Array& a) { return std::make_pair(a * 1.0f, 0); },
                                 [](int, const Array& g) { return log(g - 10.0f); });
  set_debug_nans(true);
  CHECK_THROWS_WITH_AS(grad([&](const Array& a) { return sum(bad_forward(a)); })(x),
                       doctest::Contains("op 'bad_forward' produced NaN in the forward pass"), FloatingPointError);
  CHECK_THROWS_WITH_AS(grad([&](const Array& a) { return sum(bad_backward(a)); })(x),
                       doctest::Contains("the backward rule of op 'bad_backward' produced"), FloatingPointError);
  set_debug_nans(false);
}

namespace {
struct TrainState {
  Array w;
  Tree extra;
  Array step;  // int32: a constant
  int tag = 7;
};
}  // namespace

template <>
struct linum::pytree::Fields<TrainState> {
  static auto of(TrainState& s) { return std::tie(s.w, s.extra, s.step); }
};

TEST_CASE("one differentiation protocol: every float leaf of any pytree, gradients in the leaf's dtype") {
  const Array w32 = random_array(Shape{3}, 1), w16 = astype(random_array(Shape{3}, 2), DType::bf16);
  auto loss_of = [](const std::vector<Array>& leaves) {
    Array total = Array::scalar(0.0f);
    for (const Array& a : leaves)
      if (is_floating(a.dtype())) total = total + sum(square(astype(a, DType::f32)));
    return total;
  };
  // Tree with f32, bf16 and int32 leaves.
  Tree t = Tree{{"a", w32}, {"b", w16}, {"n", Array::from_i32(Shape{2}, {1, 2})}};
  Tree gt = grad([&](const Tree& t) { return loss_of(leaves(t)); })(t);
  CHECK(gt.at("a").array().dtype() == DType::f32);
  CHECK(gt.at("b").array().dtype() == DType::bf16);
  CHECK(gt.at("n").array().dtype() == DType::i32);
  CHECK(gt.at("n").array().to_vector_i32() == std::vector<std::int32_t>{0, 0});
  CHECK(max_abs_diff(gt.at("a").array(), w32 * 2.0f) == 0.0f);
  CHECK(max_abs_diff(astype(gt.at("b").array(), DType::f32), astype(w16 * 2.0f, DType::f32)) == 0.0f);
  // The same rules for a vector, a pair, a tuple and a registered struct.
  auto gv = grad([&](const std::vector<Array>& v) { return loss_of(v); })(std::vector<Array>{w32, w16});
  CHECK(gv[1].dtype() == DType::bf16);
  CHECK(gv[1].bitwise_equal(gt.at("b").array()));
  auto gp = grad([&](const std::pair<Array, Array>& p) { return loss_of({p.first, p.second}); })(std::make_pair(w32, w16));
  CHECK(gp.second.bitwise_equal(gt.at("b").array()));
  auto gtup = grad([&](const std::tuple<Array, Array>& p) { return loss_of({std::get<0>(p), std::get<1>(p)}); })(
      std::make_tuple(w32, w16));
  CHECK(std::get<1>(gtup).bitwise_equal(gt.at("b").array()));
  TrainState s{w32, Tree{{"b", w16}}, Array::from_i32(Shape{}, {3}), 9};
  TrainState gs = grad([&](const TrainState& s) { return loss_of({s.w, s.extra.at("b").array(), s.step}); })(s);
  CHECK(gs.w.bitwise_equal(gt.at("a").array()));
  CHECK(gs.extra.at("b").array().bitwise_equal(gt.at("b").array()));
  CHECK(gs.step.dtype() == DType::i32);
  CHECK(gs.tag == 9);
  // vjp over a registered struct too.
  auto [out, pullback] = vjp([&](const TrainState& s) { return s.w * 3.0f; }, s);
  TrainState ct = pullback(Array::ones(Shape{3}));
  CHECK(ct.w.to_vector() == std::vector<float>{3, 3, 3});
}

namespace {
// BatchNorm normalizing with its stored statistics (training mode needs a mutable batch_stats).
struct StoredStatsBatchNorm {
  DType t = DType::f32;
  Array operator()(Scope& s, const Array& x) const {
    return s(nn::BatchNorm{.use_running_average = true, .dtype = t, .param_dtype = t}, x);
  }
};
// A weight wrapper called from a parent (the wrapped layer is bound to the caller); SpectralNorm
// without updating its statistics (apply's collections are not mutable here).
template <class Wrapper>
struct FromParent {
  Wrapper wrapper;
  Array operator()(Scope& s, const Array& x) const {
    if constexpr (requires { wrapper.n_steps; }) return s(wrapper, false, x);
    else return s(wrapper, x);
  }
};
}  // namespace

TEST_CASE("param_dtype=bf16: every layer's parameters get non-zero bf16 gradients close to the float32 ones") {
  const Array x = random_array(Shape{2, 4, 4, 3}, 3);
  auto check_layer = [&](const std::string& name, auto make, const Array& input) {
    CAPTURE(name);
    auto m16 = make(DType::bf16);
    auto m32 = make(DType::f32);
    Tree v16 = init(m16, rng::key(0), input);
    Tree v32 = tree_map([](const Array& a) { return is_floating(a.dtype()) ? astype(a, DType::f32) : a; }, v16);
    // Differentiated with respect to the params; other collections (batch_stats) ride along.
    auto loss = [&](const auto& m, const Tree& vars) {
      return [&m, &vars, &input](const Tree& p) {
        Tree with_params = vars;
        with_params.set("params", p);
        Array y = apply(m, with_params, input);
        return mean(square(astype(y, DType::f32)));
      };
    };
    Tree g16 = grad(loss(m16, v16))(v16.at("params"));
    Tree g32 = grad(loss(m32, v32))(v32.at("params"));
    const auto l16 = leaves(g16), l32 = leaves(g32);
    REQUIRE(l16.size() == l32.size());
    for (std::size_t i = 0; i < l16.size(); ++i) {
      CHECK(l16[i].dtype() == DType::bf16);
      const Array a = astype(l16[i], DType::f32);
      const float scale = max_abs(l32[i]);
      CHECK(scale > 0.0f);
      CHECK(max_abs(a) > 0.0f);
      CHECK(max_abs_diff(a, l32[i]) <= 0.05f * scale + 1e-3f);
    }
  };
  check_layer("Dense", [](DType t) { return nn::Dense{.features = 5, .dtype = t, .param_dtype = t}; }, x);
  check_layer("Conv", [](DType t) { return nn::Conv{.features = 4, .kernel_size = {3, 3}, .dtype = t, .param_dtype = t}; }, x);
  check_layer("LayerNorm", [](DType t) { return nn::LayerNorm{.dtype = t, .param_dtype = t}; }, x);
  check_layer("RMSNorm", [](DType t) { return nn::RMSNorm{.dtype = t, .param_dtype = t}; }, x);
  const Array seq = random_array(Shape{2, 5, 8}, 4);
  check_layer("MultiHeadDotProductAttention", [](DType t) {
    return nn::MultiHeadDotProductAttention{.num_heads = 2, .dtype = t, .param_dtype = t};
  }, seq);
  check_layer("DenseGeneral", [](DType t) { return nn::DenseGeneral{.features = {2, 3}, .dtype = t, .param_dtype = t}; }, x);
  check_layer("ConvTranspose", [](DType t) {
    return nn::ConvTranspose{.features = 2, .kernel_size = {3, 3}, .strides = {2, 2}, .dtype = t, .param_dtype = t};
  }, x);
  check_layer("GroupNorm", [](DType t) { return nn::GroupNorm{.num_groups = 3, .dtype = t, .param_dtype = t}; },
              random_array(Shape{2, 4, 4, 6}, 5));
  check_layer("BatchNorm", [](DType t) { return StoredStatsBatchNorm{t}; }, x);
  check_layer("Embed", [](DType t) { return nn::Embed{.num_embeddings = 7, .features = 4, .dtype = t, .param_dtype = t}; },
              Array::from_i32(Shape{2, 3}, {0, 3, 6, 1, 1, 5}));
  check_layer("RNN<LSTMCell>", [](DType t) { return nn::RNN<nn::LSTMCell>{.cell = {.features = 4, .dtype = t, .param_dtype = t}}; }, seq);
  check_layer("RNN<OptimizedLSTMCell>", [](DType t) {
    return nn::RNN<nn::OptimizedLSTMCell>{.cell = {.features = 4, .dtype = t, .param_dtype = t}};
  }, seq);
  check_layer("RNN<GRUCell>", [](DType t) { return nn::RNN<nn::GRUCell>{.cell = {.features = 4, .dtype = t, .param_dtype = t}}; }, seq);
  check_layer("RNN<SimpleCell>", [](DType t) { return nn::RNN<nn::SimpleCell>{.cell = {.features = 4, .dtype = t, .param_dtype = t}}; }, seq);
  check_layer("RNN<MGUCell>", [](DType t) { return nn::RNN<nn::MGUCell>{.cell = {.features = 4, .dtype = t, .param_dtype = t}}; }, seq);
  check_layer("RNN<ConvLSTMCell>", [](DType t) {
    return nn::RNN<nn::ConvLSTMCell>{.cell = {.features = 2, .kernel_size = {3, 3}, .dtype = t, .param_dtype = t}};
  }, random_array(Shape{2, 3, 4, 4, 3}, 6));
  check_layer("Bidirectional", [](DType t) {
    return nn::Bidirectional<nn::RNN<nn::GRUCell>>{.forward_rnn = {.cell = {.features = 3, .dtype = t, .param_dtype = t}},
                                                   .backward_rnn = {.cell = {.features = 2, .dtype = t, .param_dtype = t}}};
  }, seq);
  check_layer("InstanceNorm", [](DType t) { return nn::InstanceNorm{.dtype = t, .param_dtype = t}; },
              random_array(Shape{2, 4, 4, 6}, 5));
  check_layer("Einsum", [](DType t) {
    return nn::Einsum{.shape = {8, 2, 3}, .einsum_str = "btd,dhk->bthk", .dtype = t, .param_dtype = t};
  }, seq);
  check_layer("ConvLocal", [](DType t) {
    return nn::ConvLocal{.features = 2, .kernel_size = {3, 3}, .dtype = t, .param_dtype = t};
  }, x);
  check_layer("WeightNorm<Dense>", [](DType t) {
    return FromParent<nn::WeightNorm<nn::Dense>>{{.layer = {.features = 5, .dtype = t, .param_dtype = t}, .param_dtype = t}};
  }, x);
  check_layer("SpectralNorm<Conv>", [](DType t) {
    return FromParent<nn::SpectralNorm<nn::Conv>>{
        {.layer = {.features = 4, .kernel_size = {3, 3}, .dtype = t, .param_dtype = t}, .param_dtype = t}};
  }, x);
}

TEST_CASE("saved-value hooks see every residual; gradients through them are bitwise") {
  const Array x = random_array(Shape{4, 6}, 1), w = random_array(Shape{6, 5}, 2);
  auto loss = [](const Array& x, const Array& w) { return sum(square(gelu(matmul(x, w)))) + sum(softmax(x)); };
  auto plain = grad<0, 1>(loss)(x, w);
  int packed = 0, unpacked = 0;
  std::size_t bytes = 0;
  {
    // Pack into a plain float vector (as an offload store would) and back.
    autodiff::SavedValueHooksGuard hooks({
        .pack = [&](const Array& a) -> std::any {
          ++packed;
          bytes += a.nbytes();
          return std::make_pair(a.shape(), a.to_vector());
        },
        .unpack = [&](const std::any& p) {
          ++unpacked;
          const auto& [shape, values] = std::any_cast<const std::pair<Shape, std::vector<float>>&>(p);
          return Array::from(shape, values);
        }});
    auto hooked = grad<0, 1>(loss)(x, w);
    CHECK(std::get<0>(hooked).bitwise_equal(std::get<0>(plain)));
    CHECK(std::get<1>(hooked).bitwise_equal(std::get<1>(plain)));
  }
  // matmul keeps x and w, gelu its input, square its input, softmax its output.
  CHECK(packed == 5);
  CHECK(unpacked == packed);
  CHECK(bytes == (24 + 30 + 20 + 20 + 24) * sizeof(float));
  // A hook that gives back something else is refused, naming the op.
  autodiff::SavedValueHooksGuard bad({.pack = [](const Array& a) -> std::any { return a; },
                                      .unpack = [](const std::any&) { return Array::zeros(Shape{1}); }});
  CHECK_THROWS_WITH_AS(grad([](const Array& a) { return sum(exp(a)); })(x),
                       doctest::Contains("saved-value hooks: unpack returned f32[1] for residual 0 of op 'exp'"), AutodiffError);
}
