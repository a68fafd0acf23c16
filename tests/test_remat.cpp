// lift::remat on modules: every check runs the same model with and without remat and demands
// bitwise-equal outputs, variable updates and gradients.
#include <doctest/doctest.h>
#include <linum/linum.hpp>

#include "testing/gradcheck.hpp"

using namespace linum;
using linum::testing::random_array;

namespace {

int g_block_calls = 0;

// Dense -> GELU -> dropout (stream "dropout") -> subtract the batch mean, keeping a running mean in
// "batch_stats" (BatchNorm's pattern): params, a stream and a mutable collection in one block.
struct Block {
  int features = 8;
  float keep = 0.75f;
  Array operator()(Scope& s, const Array& x, bool train) const {
    ++g_block_calls;
    Array w = s.param("w", initializers::lecun_normal(), Shape{x.dim(-1), features});
    Array h = gelu(matmul(x, w));
    Variable running = s.variable("batch_stats", "mean", [&] { return Array::zeros(Shape{features}); });
    if (!train) return h - running.value();
    h = h * rng::bernoulli(s.make_rng("dropout"), keep, h.shape()) / keep;
    Array batch_mean = mean(h, {0});
    if (s.is_mutable_collection("batch_stats") && !s.is_initializing())
      running.set(running.value() * 0.9f + stop_gradient(batch_mean) * 0.1f);
    return h - batch_mean;
  }
};

template <class B>
struct Net {
  int depth = 3;
  Array operator()(Scope& s, Array x, bool train) const {
    for (int i = 0; i < depth; ++i) x = s(B{}, x, train);
    return s(B{}, x, train);  // one more, so blocks are Block_0..Block_3
  }
};

using RematBlock = lift::remat<Block>;

struct Result {
  Array loss;
  Tree updates, grads;
};

template <class M>
Result train_step(const M& model, const Tree& vars, const Array& x) {
  auto loss = [&](const Tree& params) {
    auto [y, updates] = apply(model, Tree{{"params", params}, {"batch_stats", vars.at("batch_stats")}},
                              {.rngs = {{"dropout", rng::key(7)}}, .mutable_collections = {"batch_stats"}}, x, true);
    return std::make_pair(mean(square(y)), updates);
  };
  auto [value, updates, grads] = value_and_grad(loss)(vars.at("params"));
  return {value, updates, grads};
}

}  // namespace

TEST_CASE("remat keeps names and parameters: the variable dicts are interchangeable") {
  const Array x = random_array(Shape{4, 6}, 1);
  Tree plain = init(Net<Block>{}, rng::key(0), x, false);
  Tree remat = init(Net<RematBlock>{}, rng::key(0), x, false);
  CHECK(plain.at("params").keys() == std::vector<std::string>{"Block_0", "Block_1", "Block_2", "Block_3"});
  CHECK(bitwise_equal(plain, remat));
  CHECK(module_type_name<RematBlock>() == "Block");
}

TEST_CASE("outputs, batch statistics and gradients are bitwise those of the plain model") {
  const Array x = random_array(Shape{4, 6}, 2);
  Tree vars = init(Net<Block>{}, rng::key(0), x, false);
  g_block_calls = 0;
  Result plain = train_step(Net<Block>{}, vars, x);
  CHECK(g_block_calls == 4);
  g_block_calls = 0;
  Result remat = train_step(Net<RematBlock>{}, vars, x);
  CHECK(g_block_calls == 8);  // each block once more in the backward pass
  CHECK(remat.loss.bitwise_equal(plain.loss));
  CHECK(bitwise_equal(remat.updates, plain.updates));  // batch statistics updated exactly once
  CHECK(bitwise_equal(remat.grads, plain.grads));      // same dropout masks, same gradients
  // The statistics really moved (the check above is not vacuous).
  CHECK_FALSE(bitwise_equal(remat.updates.at("batch_stats"), vars.at("batch_stats")));
  // Evaluation (no differentiation): no recomputation, same output.
  g_block_calls = 0;
  CHECK(apply(Net<RematBlock>{}, vars, x, false).bitwise_equal(apply(Net<Block>{}, vars, x, false)));
  CHECK(g_block_calls == 8);
}

TEST_CASE("policies on modules: dots_saveable skips the products when recomputing") {
  const Array x = random_array(Shape{4, 6}, 3);
  Tree vars = init(Net<Block>{}, rng::key(0), x, false);
  Result plain = train_step(Net<Block>{}, vars, x);
  lift::reset_recompute_stats();
  Result dots = train_step(Net<lift::remat<Block, lift::policy<policies::dots_saveable>>>{}, vars, x);
  CHECK(bitwise_equal(dots.grads, plain.grads));
  CHECK(lift::recompute_stats().ops_replayed == 4);  // one matmul per block
}

namespace nested {
struct Outer {
  Array operator()(Scope& s, Array x, bool train) const {
    x = s(RematBlock{}, x, train);
    return s(RematBlock{}, x, train);
  }
};
struct Top {
  Array operator()(Scope& s, Array x, bool train) const {
    x = s(lift::remat<Outer>{}, x, train);
    return s(Outer{}, x, train);
  }
};
struct PlainOuter {
  static constexpr std::string_view module_name = "Outer";
  Array operator()(Scope& s, Array x, bool train) const {
    x = s(Block{}, x, train);
    return s(Block{}, x, train);
  }
};
struct PlainTop {
  Array operator()(Scope& s, Array x, bool train) const {
    x = s(PlainOuter{}, x, train);
    return s(PlainOuter{}, x, train);
  }
};
}  // namespace nested

TEST_CASE("nested remat: a rematted module made of rematted blocks") {
  using nested::PlainTop;
  using nested::Top;
  const Array x = random_array(Shape{4, 6}, 4);
  Tree vars = init(PlainTop{}, rng::key(0), x, false);
  CHECK(bitwise_equal(vars, init(Top{}, rng::key(0), x, false)));
  Result plain = train_step(PlainTop{}, vars, x);
  g_block_calls = 0;
  Result nested = train_step(Top{}, vars, x);
  // Outer_0: forward 2, its recomputation 2, each inner block's recomputation 2 → 6;
  // Outer_1 (plain, rematted blocks): 2 + 2 → 4.
  CHECK(g_block_calls == 10);
  CHECK(nested.loss.bitwise_equal(plain.loss));
  CHECK(bitwise_equal(nested.updates, plain.updates));
  CHECK(bitwise_equal(nested.grads, plain.grads));
}

TEST_CASE("filters: a collection or stream that is not lifted is an error naming it") {
  const Array x = random_array(Shape{4, 6}, 5);
  Tree vars = init(Net<Block>{}, rng::key(0), x, false);
  using ParamsOnly = lift::remat<Block, lift::variables<"params">>;
  CHECK_THROWS_WITH_AS(train_step(Net<ParamsOnly>{}, vars, x),
                       doctest::Contains("uses collection 'batch_stats', which is not lifted into lift::remat at 'Block_0'"),
                       ValueError);
  using NoDropout = lift::remat<Block, lift::rngs<"noise">>;
  CHECK_THROWS_WITH_AS(train_step(Net<NoDropout>{}, vars, x),
                       doctest::Contains("draws from rng stream 'dropout', which is not lifted into lift::remat at 'Block_0'"),
                       ValueError);
  using Explicit = lift::remat<Block, lift::variables<"params", "batch_stats">, lift::rngs<"dropout">>;
  CHECK(bitwise_equal(train_step(Net<Explicit>{}, vars, x).grads, train_step(Net<Block>{}, vars, x).grads));
}

namespace {
int g_encode_calls = 0, g_decode_calls = 0;
struct Codec {
  Array encode(Scope& s, const Array& x) const {
    ++g_encode_calls;
    return tanh(matmul(x, s.param("we", initializers::lecun_normal(), Shape{x.dim(-1), 5})));
  }
  Array decode(Scope& s, const Array& z) const {
    ++g_decode_calls;
    return tanh(matmul(z, s.param("wd", initializers::lecun_normal(), Shape{z.dim(-1), 3})));
  }
  Array operator()(Scope& s, const Array& x) const { return decode(s, encode(s, x)); }
};
struct UsesCodec {
  template <class C>
  static Array run(Scope& s, const Array& x) {
    Array z = s.call("codec", &Codec::encode, C{}, x);
    return s.call("codec", &Codec::decode, C{}, z);
  }
};
struct PlainUser {
  Array operator()(Scope& s, const Array& x) const { return UsesCodec::run<Codec>(s, x); }
};
struct RematUser {
  Array operator()(Scope& s, const Array& x) const {
    return UsesCodec::run<lift::remat<Codec, lift::methods<&Codec::encode>>>(s, x);
  }
};
}  // namespace

TEST_CASE("methods: only the listed methods are checkpointed") {
  const Array x = random_array(Shape{2, 3}, 6);
  Tree vars = init(PlainUser{}, rng::key(0), x);
  CHECK(bitwise_equal(vars, init(RematUser{}, rng::key(0), x)));
  auto grads = [&](auto model) {
    return grad([&](const Tree& p) { return sum(apply(model, Tree{{"params", p}}, x)); })(vars.at("params"));
  };
  g_encode_calls = g_decode_calls = 0;
  Tree g_plain = grads(PlainUser{});
  CHECK(g_encode_calls == 1);
  g_encode_calls = g_decode_calls = 0;
  Tree g_remat = grads(RematUser{});
  CHECK(g_encode_calls == 2);  // checkpointed
  CHECK(g_decode_calls == 1);  // not listed: runs plainly
  CHECK(bitwise_equal(g_plain, g_remat));
  // operator() is not listed, so calling the module itself runs plainly.
  const Tree codec_params = init(Codec{}, rng::key(0), x).at("params");
  g_encode_calls = 0;
  (void)grad([&](const Tree& p) {
    return sum(apply(lift::remat<Codec, lift::methods<&Codec::encode>>{}, Tree{{"params", p}}, x));
  })(codec_params);
  CHECK(g_encode_calls == 1);
}

TEST_CASE("static_argnums on modules: the marked array gets no gradient") {
  struct Mix {
    Array operator()(Scope& s, const Array& a, const Array& b) const {
      return a * b * s.param("w", initializers::ones(), Shape{a.dim(-1)});
    }
  };
  const Array a = random_array(Shape{3}, 7), b = random_array(Shape{3}, 8);
  Tree vars = init(Mix{}, rng::key(0), a, b);
  auto run = [&](auto model) {
    return grad<0, 1>([&](const Array& a, const Array& b) { return sum(apply(model, vars, a, b)); })(a, b);
  };
  auto [ga, gb] = run(lift::remat<Mix, lift::static_argnums<1>>{});
  CHECK(ga.bitwise_equal(b));
  CHECK(gb.bitwise_equal(Array::zeros(Shape{3})));
  auto [pa, pb] = run(Mix{});
  CHECK(pb.bitwise_equal(a));
}

TEST_CASE("verify mode on a module names its path") {
  struct Flaky {
    Array operator()(Scope& s, const Array& x) const {
      static int calls = 0;
      return x * s.param("w", initializers::ones(), Shape{x.dim(-1)}) * static_cast<float>(++calls);
    }
  };
  struct Host {
    Array operator()(Scope& s, const Array& x) const { return s(lift::remat<Flaky, lift::verify>{}, x); }
  };
  const Array x = random_array(Shape{3}, 9);
  Tree vars = init(Host{}, rng::key(0), x);
  CHECK_THROWS_WITH_AS(grad([&](const Tree& p) { return sum(apply(Host{}, Tree{{"params", p}}, x)); })(vars.at("params")),
                       doctest::Contains("checkpoint 'Flaky_0': the recomputed forward pass differs"), AutodiffError);
}

TEST_CASE("memory: peak live bytes during a training step are the block inputs plus one block") {
  // Residual blocks Dense(4W)-GELU-Dense(W); no dropout, no statistics.
  struct Res {
    int width = 32;
    Array operator()(Scope& s, const Array& x) const {
      Array h = gelu(matmul(x, s.param("w1", initializers::lecun_normal(), Shape{width, 4 * width})));
      return x + matmul(h, s.param("w2", initializers::lecun_normal(), Shape{4 * width, width}));
    }
  };
  constexpr int kDepth = 8, kBatch = 512, kWidth = 32;  // activations dominate the weights
  struct PlainNet {
    Array operator()(Scope& s, Array x) const {
      for (int i = 0; i < kDepth; ++i) x = s(Res{}, x);
      return x;
    }
  };
  struct RematNet {
    Array operator()(Scope& s, Array x) const {
      for (int i = 0; i < kDepth; ++i) x = s(lift::remat<Res>{}, x);
      return x;
    }
  };
  const Array x = random_array(Shape{kBatch, kWidth}, 10);
  Tree vars = init(PlainNet{}, rng::key(0), x);
  auto peak = [&](auto model) {
    const Tree params = vars.at("params");
    memory::PeakScope scope;
    Tree g = grad([&](const Tree& p) { return sum(apply(model, Tree{{"params", p}}, x)); })(params);
    // Gradients are not activations (a slight understatement: they do not all coexist with the peak).
    return scope.peak_growth() - static_cast<std::int64_t>(byte_count(g));
  };
  const std::int64_t unit = kBatch * kWidth * 4;
  const std::int64_t plain = peak(PlainNet{}), remat = peak(RematNet{});
  MESSAGE("plain peak ", plain, " bytes, remat peak ", remat, " bytes, unit ", unit);
  // Plain keeps 9 units per block (the first block's input was alive before); remat keeps one per
  // block plus one block's internals while it is recomputed and differentiated (8 units and a few
  // gradient temporaries).
  const std::int64_t weights = 8 * kWidth * kWidth * 4 * kDepth;  // all weight gradients
  CHECK(plain >= (9 * kDepth - 1) * unit - weights);
  CHECK(remat <= (kDepth - 1) * unit + 8 * unit + 4 * unit);
  CHECK(remat * 4 < plain);
}

namespace {
// Creates a counter in the forward pass, uses it, then increments it in the same call.
struct Counting {
  Array operator()(Scope& s, const Array& x) const {
    Variable count = s.variable("counter", "n", [] { return Array::full(Shape{}, 1.0f); });
    Array w = s.param("w", initializers::ones(), Shape{x.dim(-1)});
    Array y = x * w * count.value();
    count.set(count.value() + 1.0f);
    return y;
  }
};
template <class C>
struct CountingNet {
  Array operator()(Scope& s, const Array& x) const { return s(C{}, x); }
};
}  // namespace

TEST_CASE("a variable created and updated inside a rematted call is recomputed at its created value") {
  const Array x = random_array(Shape{3, 4}, 5);
  Tree params = init(CountingNet<Counting>{}, rng::key(0), x).at("params");
  auto grads_of = [&](const auto& model) {
    // The counter is not in the dict: the forward pass creates it (mutable collection), then updates it.
    return grad<0, 1>([&](const Tree& p, const Array& in) {
      auto [y, updates] = apply(model, Tree{{"params", p}}, {.mutable_collections = {"counter"}}, in);
      CHECK(updates.at_path("counter/Counting_0/n").array().item() == 2.0f);
      return sum(square(y));
    })(params, x);
  };
  const auto plain = grads_of(CountingNet<Counting>{});
  const auto rematted = grads_of(CountingNet<lift::remat<Counting>>{});
  CHECK(bitwise_equal(std::get<0>(plain), std::get<0>(rematted)));
  CHECK(std::get<1>(plain).bitwise_equal(std::get<1>(rematted)));
}

TEST_CASE("verify mode names the first recomputed op that differs, with its module path") {
  // tanh and the first mul are deterministic; the mul by a global counter is not.
  struct Inner {
    Array operator()(Scope& s, const Array& x) const {
      static int calls = 0;
      Array h = tanh(x * s.param("w", initializers::ones(), Shape{x.dim(-1)}));
      return h * static_cast<float>(++calls) + 1.0f;
    }
  };
  struct Outer {
    Array operator()(Scope& s, const Array& x) const { return s("inner", Inner{}, x) * 2.0f; }
  };
  struct Host {
    Array operator()(Scope& s, const Array& x) const { return s(lift::remat<Outer, lift::verify>{}, x); }
  };
  const Array x = random_array(Shape{4}, 10);
  Tree vars = init(Host{}, rng::key(0), x);
  std::string message;
  try {
    grad([&](const Tree& p) { return sum(apply(Host{}, Tree{{"params", p}}, x)); })(vars.at("params"));
  } catch (const AutodiffError& e) {
    message = e.what();
  }
  CAPTURE(message);
  CHECK(message.find("checkpoint 'Outer_0': the recomputed forward pass differs from the original") != std::string::npos);
  CHECK(message.find("'mul' (f32[4]) in module 'Outer_0/inner' computed different values") != std::string::npos);
  // A deterministic block passes verification op by op.
  struct Steady {
    Array operator()(Scope& s, const Array& x) const { return tanh(x * s.param("w", initializers::ones(), Shape{x.dim(-1)})) * 3.0f; }
  };
  struct SteadyHost {
    Array operator()(Scope& s, const Array& x) const { return s(lift::remat<Steady, lift::verify>{}, x); }
  };
  Tree v2 = init(SteadyHost{}, rng::key(0), x);
  CHECK_NOTHROW(grad([&](const Tree& p) { return sum(apply(SteadyHost{}, Tree{{"params", p}}, x)); })(v2.at("params")));
}

TEST_CASE("a module called twice inside one rematted call: its shared param gets bitwise the plain gradient") {
  struct Twice {
    Array operator()(Scope& s, const Array& x) const {
      const nn::Dense d{.features = 16};
      Array h = tanh(s("shared", d, x));
      return s("shared", d, h) + x;  // the same params again
    }
  };
  struct Net {
    bool remat = false;
    Array operator()(Scope& s, Array x) const {
      for (int i = 0; i < 2; ++i) x = remat ? s(lift::remat<Twice>{}, x) : s(Twice{}, x);
      return x;
    }
  };
  for (const Shape& shape : {Shape{8, 16}, Shape{4, 8, 16}}) {
    const Array x = random_array(shape, 30);
    const Tree v = init(Net{}, rng::key(0), x);
    auto grads = [&](bool remat) {
      return grad([&](const Tree& p) { return sum(square(apply(Net{.remat = remat}, Tree{{"params", p}}, x))); })(v.at("params"));
    };
    CHECK(bitwise_equal(grads(false), grads(true)));
  }
}

TEST_CASE("a param used twice inside a checkpoint and again outside it gets bitwise the plain gradient") {
  // The block's two contributions reach the outer graph separately, so they are summed with the
  // outside ones in the plain graph's order (not pre-summed inside the checkpoint).
  auto block = [](const Array& h, const Array& w) { return matmul(tanh(matmul(h, w)), w) + h; };
  const Array x = random_array(Shape{8, 16}, 31);
  const Array w0 = random_array(Shape{16, 16}, 32, -0.3f, 0.3f);
  for (int arrangement = 0; arrangement < 3; ++arrangement) {
    CAPTURE(arrangement);
    auto loss = [&](auto&& f) {
      return grad([&](const Array& w) {
        Array h = x;
        if (arrangement != 1) h = gelu(matmul(h, w));  // used before the block
        h = f(h, w);
        if (arrangement != 0) h = gelu(matmul(h, w));  // and after it
        return sum(square(h));
      })(w0);
    };
    CHECK(loss(block).bitwise_equal(loss(checkpoint(block))));
    CHECK(loss(block).bitwise_equal(loss(checkpoint(block, {.policy = policies::dots_saveable{}}))));
  }
}

TEST_CASE("checkpoint_sequential: nn::Sequential's variables and bitwise gradients, segments checkpointed but the last") {
  auto act = [](const Array& a) { return tanh(a); };
  const nn::Sequential plain{nn::Dense{.features = 8}, act, nn::Dense{.features = 8}, act, nn::Dense{.features = 8}, act,
                             nn::Dense{.features = 4}};
  const lift::checkpoint_sequential segmented{3, nn::Dense{.features = 8}, act, nn::Dense{.features = 8}, act,
                                              nn::Dense{.features = 8}, act, nn::Dense{.features = 4}};
  const Array x = random_array(Shape{5, 8}, 40);
  const Tree vars = init(plain, rng::key(2), x);
  CHECK(bitwise_equal(vars, init(segmented, rng::key(2), x)));
  CHECK(vars.at("params").keys() == std::vector<std::string>{"layers_0", "layers_2", "layers_4", "layers_6"});
  auto grads = [&](const auto& model) {
    return grad([&](const Tree& p) { return sum(square(apply(model, Tree{{"params", p}}, x))); })(vars.at("params"));
  };
  const Tree g0 = grads(plain);
  lift::reset_recompute_stats();
  CHECK(bitwise_equal(grads(segmented), g0));
  CHECK(lift::recompute_stats().recomputations == 2);  // 7 layers in runs of 3: two checkpointed, the last plain
  CHECK_THROWS_AS(init(lift::checkpoint_sequential{0, nn::Dense{.features = 2}}, rng::key(0), x), ValueError);
}

namespace ergonomics {

// A block whose product is named, so a name policy (a value: it carries the names) can save it.
struct NamedBlock {
  int features = 8;
  Array operator()(Scope& s, const Array& x) const {
    Array w = s.param("w", initializers::lecun_normal(), Shape{x.dim(-1), features});
    return gelu(checkpoint_name(matmul(x, w), "h"));
  }
};

template <class B>
struct Stack {
  Array operator()(Scope& s, Array x) const {
    for (int i = 0; i < 3; ++i) x = s(B{NamedBlock{.features = 8}}, x);  // one initializer for both
    return x;
  }
};

struct ValuePolicyStack {
  Array operator()(Scope& s, Array x) const {
    for (int i = 0; i < 3; ++i)
      x = s(lift::remat<NamedBlock>{{.features = 8}, policies::save_only_these_names({"h"})}, x);
    return x;
  }
};

template <class M>
Tree grads_of(const M& model, const Tree& vars, const Array& x) {
  return grad([&](const Tree& p) { return mean(square(apply(model, Tree{{"params", p}}, x))); })(vars.at("params"));
}

}  // namespace ergonomics

TEST_CASE("a policy given as a value (save_only_these_names) is a remat option; remat_if switches remat with one initializer") {
  using namespace ergonomics;
  const Array x = random_array(Shape{4, 8}, 5);
  const Tree vars = init(Stack<NamedBlock>{}, rng::key(0), x);
  const Tree plain = grads_of(Stack<lift::remat_if<false, NamedBlock>>{}, vars, x);
  lift::reset_recompute_stats();
  const Tree full = grads_of(Stack<lift::remat_if<true, NamedBlock>>{}, vars, x);
  CHECK(bitwise_equal(full, plain));
  CHECK(lift::recompute_stats().ops_replayed == 0);  // nothing saved: every product recomputed
  lift::reset_recompute_stats();
  const Tree named = grads_of(ValuePolicyStack{}, vars, x);
  CHECK(bitwise_equal(named, plain));
  CHECK(lift::recompute_stats().ops_replayed == 3);  // the named product of each block was saved
  static_assert(std::is_same_v<lift::remat_if<false, NamedBlock>, NamedBlock>);
}

TEST_CASE("apply with options and nothing mutable gives the output alone, as Flax; with mutable collections, both") {
  const Array x = random_array(Shape{4, 6}, 3);
  const Tree vars = init(Net<Block>{}, rng::Streams{{"params", rng::key(0)}, {"dropout", rng::key(1)}}, x, false);
  const Array y = apply(Net<Block>{}, vars, {.rngs = {{"dropout", rng::key(7)}}}, x, false);
  auto [y2, updates] = apply(Net<Block>{}, vars, {.rngs = {{"dropout", rng::key(7)}}}, x, false);
  CHECK(y.bitwise_equal(y2));
  CHECK(updates.empty());
  auto with_stats = apply(Net<Block>{}, vars, {.rngs = {{"dropout", rng::key(7)}}, .mutable_collections = {"batch_stats"}}, x, true);
  CHECK(with_stats.second.contains("batch_stats"));
  CHECK_THROWS_WITH_AS((void)static_cast<Array>(with_stats), doctest::Contains("take both"), ValueError);
}
