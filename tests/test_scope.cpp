// Scope, init and apply: naming, sharing, variables and collections, streams, errors.
#include <doctest/doctest.h>
#include <linum/linum.hpp>

#include "testing/gradcheck.hpp"

#include <cmath>

using namespace linum;
using linum::testing::max_abs;

namespace {

Initializer fill(float v) {
  return [v](rng::Key, const Shape& s) { return Array::full(s, v); };
}
Initializer from_key() {  // deterministic in the key: lets tests see which key a param got
  return [](rng::Key k, const Shape& s) { return rng::uniform(k, s); };
}

struct Affine {  // y = x * w + b with w, b of the input's last dimension
  static constexpr std::string_view module_name = "Affine";
  Array operator()(Scope& s, const Array& x) const {
    Array w = s.param("w", from_key(), Shape{x.dim(-1)});
    Array b = s.param("b", fill(0.5f), Shape{x.dim(-1)});
    return x * w + b;
  }
};

struct Counter {  // a mutable "stats" collection
  Array operator()(Scope& s, const Array& x) const {
    Variable n = s.variable("stats", "calls", [] { return Array::zeros(Shape{}); });
    if (s.is_mutable_collection("stats")) n.set(n.value() + 1.0f);
    return x;
  }
};

struct Net {
  Array operator()(Scope& s, const Array& x) const {
    Array h = s(Affine{}, x);        // Affine_0
    h = s(Affine{}, h);              // Affine_1
    h = s("shared", Affine{}, h);    // explicit name
    h = s("shared", Affine{}, h);    // same variables again
    h = s(Counter{}, h);
    s.sow("intermediates", "h", h);
    return h;
  }
};

struct Noisy {
  Array operator()(Scope& s, const Array& x) const {
    return x + rng::uniform(s.make_rng("noise"), x.shape()) + rng::uniform(s.make_rng("noise"), x.shape());
  }
};

}  // namespace

TEST_CASE("init creates params under auto and explicit names; a reused name shares them") {
  Array x = Array::from(Shape{2, 3}, {1, 2, 3, 4, 5, 6});
  Tree vars = init(Net{}, rng::key(0), x);
  CHECK(vars.keys() == std::vector<std::string>{"params", "stats"});
  CHECK(vars.at("params").keys() == std::vector<std::string>{"Affine_0", "Affine_1", "shared"});
  CHECK(vars.at_path("params/Affine_0/w").array().shape() == Shape{3});
  CHECK(vars.at_path("stats/Counter_0/calls").array().item() == 1.0f);  // init may write everything
  CHECK_FALSE(vars.contains("intermediates"));                         // not kept by init (as Flax)
  // Different modules got different keys; the same seed gives the same values.
  CHECK_FALSE(vars.at_path("params/Affine_0/w").array().bitwise_equal(vars.at_path("params/Affine_1/w").array()));
  CHECK(bitwise_equal(vars, init(Net{}, rng::key(0), x)));
  CHECK_FALSE(bitwise_equal(vars, init(Net{}, rng::key(1), x)));
}

TEST_CASE("param keys follow Flax's derivation from the stream, the path and the count") {
  Tree vars = init(Affine{}, rng::key(0), Array::zeros(Shape{4}));
  // The root module's first draw from "params": path (), count 1.
  rng::Streams streams(rng::key(0));
  std::vector<std::string> root;
  CHECK(vars.at_path("params/w").array().bitwise_equal(rng::uniform(streams.derive("params", root, 1), Shape{4})));
}

TEST_CASE("apply is pure and reads the variables it is given") {
  Array x = Array::from(Shape{2, 3}, {1, 2, 3, 4, 5, 6});
  Tree vars = init(Net{}, rng::key(0), x);
  Array y1 = apply(Net{}, vars, x);
  Array y2 = apply(Net{}, vars, x);
  CHECK(y1.bitwise_equal(y2));
  // Setting every w to 1 and b to 0 makes the net the identity.
  Tree ident = tree_map_with_path([](const std::string& path, const Array& a) {
    return path.ends_with("/w") ? Array::ones(a.shape()) : Array::zeros(a.shape());
  }, vars);
  CHECK(apply(Net{}, ident, x).bitwise_equal(x));
}

TEST_CASE("mutable collections: updated only when asked, returned next to the output") {
  Array x = Array::ones(Shape{1, 3});
  Tree vars = init(Net{}, rng::key(0), x);
  auto [y, updates] = apply(Net{}, vars, {.mutable_collections = {"stats", "intermediates"}}, x);
  CHECK(updates.keys() == std::vector<std::string>{"stats", "intermediates"});
  CHECK(updates.at_path("stats/Counter_0/calls").array().item() == 2.0f);
  CHECK(updates.at_path("intermediates/h/0").array().bitwise_equal(y));
  // Not mutable: the module sees is_mutable_collection false and does not write.
  CHECK(apply(Net{}, vars, x).bitwise_equal(y));
}

TEST_CASE("writing to a collection that is not mutable is an error") {
  struct Writer {
    Array operator()(Scope& s, const Array& x) const {
      s.variable("stats", "v", [] { return Array::zeros(Shape{}); }).set(Array::ones(Shape{}));
      return x;
    }
  };
  Tree vars = init(Writer{}, rng::key(0), Array::zeros(Shape{1}));
  CHECK_THROWS_WITH_AS(apply(Writer{}, vars, Array::zeros(Shape{1})),
                       doctest::Contains("collection 'stats' is not mutable"), ValueError);
}

TEST_CASE("streams: each make_rng call draws a new key; same key every run; missing stream is an error") {
  Array x = Array::zeros(Shape{3});
  Tree vars = init(Noisy{}, rng::Streams{{"params", rng::key(0)}, {"noise", rng::key(1)}}, x);
  auto run = [&](int seed) { return apply(Noisy{}, vars, {.rngs = {{"noise", rng::key(seed)}}}, x).first; };
  CHECK(run(1).bitwise_equal(run(1)));
  CHECK_FALSE(run(1).bitwise_equal(run(2)));
  CHECK_THROWS_WITH_AS(apply(Noisy{}, vars, x), doctest::Contains("noise"), ValueError);
}

TEST_CASE("errors name the module path and the shapes") {
  Array x = Array::from(Shape{2, 3}, {1, 2, 3, 4, 5, 6});
  Tree vars = init(Net{}, rng::key(0), x);
  // Wrong input size for existing params.
  CHECK_THROWS_WITH_AS(apply(Net{}, vars, Array::zeros(Shape{2, 4})),
                       doctest::Contains("in module 'Affine_0' (Affine): param 'params/Affine_0/w' has shape (3,) in the "
                                         "variable dict but the module asks for (4,)"),
                       ShapeError);
  // Missing params.
  Tree partial = vars;
  partial.at("params").erase("Affine_1");
  CHECK_THROWS_WITH_AS(apply(Net{}, partial, x), doctest::Contains("param 'params/Affine_1/w' of shape (3,) is missing"),
                       ValueError);
  // ... and what is there instead: the dict's entries, or an array where a dict belongs.
  CHECK_THROWS_WITH_AS(apply(Net{}, partial, x), doctest::Contains("('params' has no entry 'Affine_1'; its entries are 'Affine_0'"),
                       ValueError);
  Tree flattened = vars;
  flattened.at("params").set("Affine_1", Tree(Array::zeros(Shape{3})));
  CHECK_THROWS_WITH_AS(apply(Net{}, flattened, x),
                       doctest::Contains("('params/Affine_1' is an array of shape (3,) where a dict is expected)"), ValueError);
  // Missing collection.
  Tree no_stats = vars;
  no_stats.erase("stats");
  CHECK_THROWS_WITH_AS(apply(Net{}, no_stats, x), doctest::Contains("the dict has no \"stats\" collection"), ValueError);
  // Extra entries are listed.
  Tree extra = vars;
  extra.at("params").set("Stray_0", Tree{{"w", Array::zeros(Shape{1})}});
  CHECK_THROWS_WITH_AS(apply(Net{}, extra, x), doctest::Contains("did not use: params/Stray_0/w"), ValueError);
  // An op error deep inside a module names that module.
  struct Bad {
    Array operator()(Scope& s, const Array& x) const { return s(Affine{}, x) + Array::zeros(Shape{7}); }
  };
  CHECK_THROWS_WITH_AS(init(Bad{}, rng::key(0), x), doctest::Contains("in module '<root>' (Bad): add: shapes (2, 3) and (7,)"),
                       ShapeError);
}

TEST_CASE("gradients with respect to the params dict") {
  Array x = Array::from(Shape{1, 3}, {1, 2, 3});
  Tree vars = init(Affine{}, rng::key(0), x);
  auto loss = [&](const Tree& params) { return sum(apply(Affine{}, Tree{{"params", params}}, x)); };
  auto [v, g] = value_and_grad(loss)(vars.at("params"));
  CHECK(g.at("w").array().to_vector() == std::vector<float>{1, 2, 3});
  CHECK(g.at("b").array().to_vector() == std::vector<float>{1, 1, 1});
}

struct Encoder {
  Array encode(Scope& s, const Array& x) const { return s(Affine{}, x); }
  Array decode(Scope& s, const Array& z) const { return s("dec", Affine{}, z); }
  Array operator()(Scope& s, const Array& x) const { return decode(s, encode(s, x)); }
};

TEST_CASE("other methods run in the module's scope (init_method / apply_method / Scope::call)") {
  Array x = Array::from(Shape{1, 2}, {1, 2});
  Tree full = init(Encoder{}, rng::key(0), x);
  Tree only_encode = init_method(&Encoder::encode, Encoder{}, rng::Streams(rng::key(0)), x);
  CHECK(only_encode.at("params").keys() == std::vector<std::string>{"Affine_0"});
  auto [z, _] = apply_method(&Encoder::encode, Encoder{}, full, {}, x);
  CHECK(z.bitwise_equal(apply(Affine{}, Tree{{"params", full.at_path("params/Affine_0")}}, x)));
  struct Outer {
    Array operator()(Scope& s, const Array& x) const { return s.call("enc", &Encoder::encode, Encoder{}, x); }
  };
  Tree outer = init(Outer{}, rng::key(0), x);
  CHECK(outer.contains_path("params/enc/Affine_0/w"));
}

TEST_CASE("a dict from another model: every missing param and every unused entry in one error") {
  Array x = Array::from(Shape{2, 3}, {1, 2, 3, 4, 5, 6});
  Tree vars = init(Net{}, rng::key(0), x);
  Tree other{{"params", Tree{{"Stray_0", Tree{{"w", Array::zeros(Shape{3})}}}, {"Stray_1", Tree{{"w", Array::zeros(Shape{2})}}}}}};
  for (const auto& [name, collection] : vars)
    if (name != "params") other.set(name, collection);
  std::string message;
  try {
    apply(Net{}, other, x);
  } catch (const ValueError& e) {
    message = e.what();
  }
  CAPTURE(message);
  CHECK(message.find("param 'params/Affine_0/w' of shape (3,) is missing from the variable dict ('params' has no entry "
                     "'Affine_0'; its entries are 'Stray_0', 'Stray_1')") != std::string::npos);
  CHECK(message.find("also missing: params/Affine_0/b (3,), params/Affine_1/w (3,), params/Affine_1/b (3,), "
                     "params/shared/w (3,), params/shared/b (3,);") != std::string::npos);  // shared params once
  CHECK(message.find("entries the model did not use: params/Stray_0/w (3,), params/Stray_1/w (2,)") != std::string::npos);
}

namespace {
template <class E>
struct Raise {
  Array operator()(Scope&, const Array& x) const { throw E("something failed"); return x; }
};
template <class E>
struct Outer {
  Array operator()(Scope& s, const Array& x) const { return s(Raise<E>{}, x); }
};
template <class E>
void check_error_kept(const std::string& type) {
  CAPTURE(type);
  const Array x = Array::zeros(Shape{2});
  try {
    (void)init(Outer<E>{}, rng::key(0), x);
    FAIL("no exception");
  } catch (const E& e) {  // the same type as thrown, not a plain Error
    CHECK(std::string(e.what()).rfind("in module 'Raise_0' (Raise", 0) == 0);  // the innermost module, once
    CHECK(std::string(e.what()).find("in module", 5) == std::string::npos);
    CHECK(e.in_module());
    CHECK(e.module_path() == "Raise_0");
  }
}
}  // namespace

TEST_CASE("an error raised inside a module keeps its type and names the innermost module once") {
  check_error_kept<ShapeError>("ShapeError");
  check_error_kept<ValueError>("ValueError");
  check_error_kept<IoError>("IoError");
  check_error_kept<AutodiffError>("AutodiffError");
  check_error_kept<MemoryError>("MemoryError");
  check_error_kept<FloatingPointError>("FloatingPointError");
  check_error_kept<dist::DistError>("DistError");  // was re-thrown as a plain Error
  check_error_kept<Error>("Error");
  // Outside modules nothing is added.
  try {
    throw ValueError("plain");
  } catch (const Error& e) {
    CHECK(!e.in_module());
    CHECK(e.module_path().empty());
    CHECK(std::string(e.what()) == "plain");
  }
}

TEST_CASE("nn::with_partitioning: logical axis names on the init dict's leaves, through lifted transforms") {
  struct Inner {
    Array operator()(Scope& s, const Array& x) const {
      return s(nn::Dense{.features = 3, .kernel_init = nn::with_partitioning(initializers::lecun_normal(), {"embed", "mlp"}),
                         .bias_init = nn::with_partitioning(initializers::zeros(), {"mlp"})},
               x);
    }
  };
  struct Outer {
    Array operator()(Scope& s, const Array& x) const { return s(lift::remat<Inner>{}, s(Inner{}, x)); }
  };
  const Array x = Array::ones(Shape{2, 3});
  const Tree vars = init(Outer{}, rng::key(0), x);
  CHECK(vars.at_path("params/Inner_0/Dense_0/kernel").axis_names() == std::vector<std::string>{"embed", "mlp"});
  CHECK(vars.at_path("params/Inner_0/Dense_0/bias").axis_names() == std::vector<std::string>{"mlp"});
  CHECK(vars.at_path("params/Inner_1/Dense_0/kernel").axis_names() == std::vector<std::string>{"embed", "mlp"});  // under remat
  CHECK(nn::logical_axes(vars).size() == 4);
  // The values are the wrapped initializer's, bit for bit.
  struct Plain {
    Array operator()(Scope& s, const Array& x) const { return s(nn::Dense{.features = 3}, x); }
  };
  struct Named {
    Array operator()(Scope& s, const Array& x) const {
      return s(nn::Dense{.features = 3, .kernel_init = nn::with_partitioning(initializers::lecun_normal(), {"a", "b"})}, x);
    }
  };
  CHECK(bitwise_equal(init(Plain{}, rng::key(1), x), init(Named{}, rng::key(1), x)));
  // Copies keep the names; a leaf rebuilt from its array has none; wrong counts are errors.
  const Tree copy = vars;
  CHECK(copy.at_path("params/Inner_0/Dense_0/kernel").axis_names().size() == 2);
  CHECK(Tree(vars.at_path("params/Inner_0/Dense_0/kernel").array()).axis_names().empty());
  CHECK_THROWS_AS(Tree(x).with_axis_names({"a"}), ShapeError);
  CHECK_THROWS_AS(vars.with_axis_names({"a", "b"}), ShapeError);
}

namespace {
struct TwoOut {  // a module with a tuple output
  std::pair<Array, Array> operator()(Scope& s, const Array& x) const { return {s(Affine{}, x), x * 2.0f}; }
};
struct Probe {  // Flax's perturb after a layer, then a nonlinearity
  Array operator()(Scope& s, const Array& x) const {
    Array h = s.perturb("h", s(Affine{}, x));
    return sum(gelu(h));
  }
};
}  // namespace

TEST_CASE("capture_intermediates sows every module call's output under its path; a filter picks calls") {
  Array x = Array::from(Shape{2, 3}, {1, 2, 3, 4, 5, 6});
  Tree vars = init(Net{}, rng::key(0), x);
  auto [y, updates] = apply(Net{}, vars, {.mutable_collections = {"stats"}, .capture_intermediates = true}, x);
  const Tree& inter = updates.at("intermediates");
  CHECK(inter.keys() == std::vector<std::string>{"Affine_0", "Affine_1", "shared", "Counter_0", "h", "__call__"});
  const Array a0 = apply(Affine{}, Tree{{"params", vars.at_path("params/Affine_0")}}, x);
  CHECK(inter.at_path("Affine_0/__call__/0").array().bitwise_equal(a0));
  CHECK(inter.at("shared").at("__call__").keys() == std::vector<std::string>{"0", "1"});  // called twice
  CHECK(inter.at_path("__call__/0").array().bitwise_equal(y));                             // the root's output
  CHECK(inter.at_path("h/0").array().bitwise_equal(y));                                    // the model's own sow
  // A filter: only the Affine calls at "Affine_1".
  auto [y2, only] = apply(Net{}, vars, {.mutable_collections = {"stats"}, .capture_intermediates = true,
                                        .capture_filter = [](const std::string& path, const std::string& type) {
                                          return type == "Affine" && path == "Affine_1";
                                        }}, x);
  CHECK(only.at("intermediates").keys() == std::vector<std::string>{"Affine_1", "h"});
  CHECK(y2.bitwise_equal(y));
  // Without mutable collections the call still returns (output, updates): the intermediates.
  auto [y3, captured] = apply(Net{}, vars, {.capture_intermediates = true}, x);
  CHECK(captured.keys() == std::vector<std::string>{"intermediates"});
  // A tuple output: its arrays under __call__/0/0, __call__/0/1.
  Tree tv = init(TwoOut{}, rng::key(1), x);
  auto [out, tu] = apply(TwoOut{}, tv, {.capture_intermediates = true}, x);
  CHECK(tu.at_path("intermediates/__call__/0/0").array().bitwise_equal(out.first));
  CHECK(tu.at_path("intermediates/__call__/0/1").array().bitwise_equal(out.second));
  // Under remat the outputs are captured once, and the gradients are unchanged.
  using RA = lift::remat<Affine>;
  Tree rv = init(RA{}, rng::key(2), x);
  auto loss = [&](const Tree& p, bool capture) {
    return sum(square(apply(RA{}, Tree{{"params", p}}, {.capture_intermediates = capture}, x).first));
  };
  CHECK(bitwise_equal(grad([&](const Tree& p) { return loss(p, true); })(rv.at("params")),
                      grad([&](const Tree& p) { return loss(p, false); })(rv.at("params"))));
  auto [ry, ru] = apply(RA{}, rv, {.capture_intermediates = true}, x);
  CHECK(ru.at_path("intermediates/__call__").keys() == std::vector<std::string>{"0"});
}

TEST_CASE("perturb: init makes zero 'perturbations'; their gradient is the gradient with respect to the intermediate") {
  Array x = Array::from(Shape{2, 3}, {1, -2, 3, 0.5f, 5, -1});
  Tree vars = init(Probe{}, rng::key(0), x);
  CHECK(vars.keys() == std::vector<std::string>{"params", "perturbations"});
  CHECK(vars.at_path("perturbations/h").array().bitwise_equal(Array::zeros(Shape{2, 3})));
  // d sum(gelu(h)) / dh, with h = Affine(x).
  const Array h = apply(Affine{}, Tree{{"params", vars.at_path("params/Affine_0")}}, x);
  const Array want = grad([](const Array& v) { return sum(gelu(v)); })(h);
  const Array got = grad([&](const Tree& z) {
                      return apply(Probe{}, Tree{{"params", vars.at("params")}, {"perturbations", z}}, x);
                    })(vars.at("perturbations")).at("h").array();
  CHECK(got.bitwise_equal(want));
  // Without the collection the value passes unchanged; a collection without the entry is an error.
  CHECK(apply(Probe{}, Tree{{"params", vars.at("params")}}, x).bitwise_equal(apply(Probe{}, vars, x)));
  CHECK_THROWS_WITH_AS(apply(Probe{}, Tree{{"params", vars.at("params")}, {"perturbations", Tree{{"other", Array::zeros(Shape{1})}}}}, x),
                       doctest::Contains("no entry 'h'"), ValueError);
  CHECK_THROWS_WITH_AS(apply(Probe{}, Tree{{"params", vars.at("params")}, {"perturbations", Tree{{"h", Array::zeros(Shape{3})}}}}, x),
                       doctest::Contains("perturb"), ShapeError);
}

TEST_CASE("sow with reduce and init keeps one running value, as Flax's reduce_fn / init_fn") {
  struct AuxLosses {
    Array operator()(Scope& s, const Array& x) const {
      auto add = [](const Array& acc, const Array& v) { return acc + v; };
      auto zero = [] { return Array::zeros(Shape{}); };
      for (float w : {1.0f, 2.0f, 3.0f}) s.sow("losses", "aux", sum(x) * w, add, zero);
      s.sow("losses", "count", Array::ones(Shape{}), add, zero);
      return x;
    }
  };
  const Array x = Array::from(Shape{2}, {1.0f, 2.0f});
  auto [y, updates] = apply(AuxLosses{}, Tree{}, {.mutable_collections = {"losses"}}, x);
  CHECK(updates.at_path("losses/aux").array().item() == 18.0f);  // 3 * (1 + 2 + 3)
  CHECK(updates.at_path("losses/count").array().item() == 1.0f);
  // Not mutable: nothing stored, as the appending sow.
  CHECK(apply(AuxLosses{}, Tree{}, x).bitwise_equal(x));
}

namespace {
struct WithMethod {
  Array operator()(Scope& s, const Array& x) const { return s.call(&WithMethod::half, *this, s(Affine{}, x)); }
  Array half(Scope&, const Array& x) const { return x * 0.5f; }
};
}  // namespace

TEST_CASE("InterceptMethods sees every module call, may change inputs and outputs; gradients follow; misuse is an error") {
  const Array x = Array::from(Shape{2, 3}, {1, 2, 3, 4, 5, 6});
  const Tree vars = init(Net{}, rng::key(0), x);
  const Array plain = apply(Net{}, vars, x);
  {  // A spy: calls in order, innermost returning first; the output unchanged.
    std::vector<std::string> seen;
    InterceptMethods spy([&](MethodCall& call, const auto& next) {
      std::vector<Array> out = next();
      seen.push_back(call.path_str() + ":" + call.type() + (call.is_call() ? "" : "(method)"));
      return out;
    });
    CHECK(apply(Net{}, vars, x).bitwise_equal(plain));
    CHECK(seen == std::vector<std::string>{"Affine_0:Affine", "Affine_1:Affine", "shared:Affine", "shared:Affine",
                                           "Counter_0:Counter", ":Net"});
    const Tree wv = init(WithMethod{}, rng::key(0), x);  // (init runs through the interceptor too)
    seen.clear();
    (void)apply(WithMethod{}, wv, x);
    CHECK(seen == std::vector<std::string>{"Affine_0:Affine", "WithMethod_0:WithMethod(method)", ":WithMethod"});
  }
  CHECK(apply(Net{}, vars, x).bitwise_equal(plain));  // uninstalled with the scope
  const Tree av = init(Affine{}, rng::key(4), x);
  const Array w = av.at_path("params/w").array(), b = av.at_path("params/b").array();
  {  // Inputs doubled, outputs plus one: the layer computes (2x) w + b + 1, and gradients see it.
    InterceptMethods edit([](MethodCall& call, const auto& next) {
      std::vector<Array> in = call.arguments();
      REQUIRE(in.size() == 1);
      in[0] = in[0] * 2.0f;
      call.set_arguments(in);
      std::vector<Array> out = next();
      out[0] = out[0] + 1.0f;
      return out;
    });
    CHECK(apply(Affine{}, av, x).bitwise_equal((x * 2.0f) * w + b + 1.0f));
    const Tree g = grad([&](const Tree& p) { return sum(apply(Affine{}, Tree{{"params", p}}, x)); })(av.at("params"));
    CHECK(g.at("w").array().bitwise_equal(sum(x * 2.0f, {0})));
  }
  {  // An interceptor must run the call once and return as many arrays.
    InterceptMethods skip([](MethodCall&, const auto&) { return std::vector<Array>{Array::zeros(Shape{1})}; });
    CHECK_THROWS_WITH_AS(apply(Affine{}, av, x), doctest::Contains("without running the call"), ValueError);
  }
  {
    InterceptMethods extra([](MethodCall&, const auto& next) {
      std::vector<Array> out = next();
      out.push_back(out[0]);
      return out;
    });
    CHECK_THROWS_WITH_AS(apply(Affine{}, av, x), doctest::Contains("returns 1 arrays but the interceptor returned 2"), ValueError);
  }
  {
    InterceptMethods bad_args([](MethodCall& call, const auto& next) {
      call.set_arguments(std::vector<Array>{});
      return next();
    });
    CHECK_THROWS_WITH_AS(apply(Affine{}, av, x), doctest::Contains("takes 1 input arrays"), ValueError);
  }
}

// ---- lift::cond / lift::switch_ ------------------------------------------------------------------

namespace {

struct Scale {  // y = x * w, w of the input's last dimension (distinct per instance through its key)
  float bias = 0.0f;
  Array operator()(Scope& s, const Array& x) const { return x * s.param("w", from_key(), Shape{x.dim(-1)}) + bias; }
};

struct CondNet {  // two branches, then a sibling whose name must not depend on the branch
  Array operator()(Scope& s, const Array& x, bool pred) const {
    Array h = lift::cond(s, pred, Affine{}, Scale{.bias = 1.0f}, x);
    return s(Affine{}, h);
  }
};

struct SwitchNet {
  Array operator()(Scope& s, const Array& x, const Array& index, bool train) const {
    auto noisy = lift::branch("noisy", [train](Scope& in, const Array& v) {
      return in(nn::Dropout{.rate = 0.5}, in(Scale{}, v), !train);
    });
    return lift::switch_(s, index, std::tuple{Scale{}, nn::BatchNorm{.use_running_average = false}, noisy}, x);
  }
};

}  // namespace

TEST_CASE("lift::cond: init makes both branches' variables whichever runs; apply runs the chosen one; names and keys do not depend on it") {
  const Array x = Array::from(Shape{2, 3}, {1, 2, 3, 4, 5, 6});
  const Tree on_true = init(CondNet{}, rng::key(0), x, true);
  const Tree on_false = init(CondNet{}, rng::key(0), x, false);
  CHECK(on_true.at("params").keys() == std::vector<std::string>{"Affine_0", "Scale_0", "Affine_1"});
  CHECK(on_true.at_path("params/Scale_0/w").array().shape() == Shape{3});
  for (const auto& entry : flatten(on_true)) {
    const std::string& path = entry.first;  // named: clang 14 cannot capture a structured binding
    const Array& value = entry.second;
    CAPTURE(path);
    CHECK(value.bitwise_equal(on_false.at_path(path).array()));  // the same dict whichever branch init took
  }
  // A dict made on one branch applies on the other (no unused-entry error); each branch's result is
  // the module's own.
  const Tree& p = on_false.at("params");
  const Array after_true = apply(Affine{}, Tree{{"params", p.at("Affine_1")}},
                                 apply(Affine{}, Tree{{"params", p.at("Affine_0")}}, x));
  const Array after_false = apply(Affine{}, Tree{{"params", p.at("Affine_1")}},
                                  apply(Scale{.bias = 1.0f}, Tree{{"params", p.at("Scale_0")}}, x));
  CHECK(apply(CondNet{}, on_false, x, true).bitwise_equal(after_true));
  CHECK(apply(CondNet{}, on_true, x, false).bitwise_equal(after_false));
  // Gradients reach the chosen branch only, bitwise those of calling it directly.
  auto loss = [&](bool pred) {
    return [&, pred](const Tree& params) { return sum(square(apply(CondNet{}, Tree{{"params", params}}, x, pred))); };
  };
  const Tree g = grad(loss(false))(p);
  CHECK(max_abs(g.at_path("Affine_0/w").array()) == 0.0f);
  CHECK(max_abs(g.at_path("Scale_0/w").array()) > 0.0f);
  struct Direct {
    Array operator()(Scope& s, const Array& x) const { return s("Affine_1", Affine{}, s("Scale_0", Scale{.bias = 1.0f}, x)); }
  };
  Tree direct_params;
  direct_params["Scale_0"] = p.at("Scale_0");
  direct_params["Affine_1"] = p.at("Affine_1");
  const Tree gd = grad([&](const Tree& q) { return sum(square(apply(Direct{}, Tree{{"params", q}}, x))); })(direct_params);
  CHECK(g.at_path("Scale_0/w").array().bitwise_equal(gd.at_path("Scale_0/w").array()));
  CHECK(g.at_path("Affine_1/b").array().bitwise_equal(gd.at_path("Affine_1/b").array()));
  // Under lift::remat the recomputation takes the same branch: gradients bitwise the plain ones.
  struct Rematted {
    Array operator()(Scope& s, const Array& x, bool pred) const { return s("CondNet_0", lift::remat<CondNet>{}, x, pred); }
  };
  Tree nested;
  nested["CondNet_0"] = p;
  const Tree gr = grad([&](const Tree& q) { return sum(square(apply(Rematted{}, Tree{{"params", q}}, x, false))); })(nested);
  for (const auto& entry : flatten(g)) {
    const std::string& path = entry.first;  // named: clang 14 cannot capture a structured binding
    const Array& value = entry.second;
    CAPTURE(path);
    CHECK(value.bitwise_equal(gr.at_path("CondNet_0/" + path).array()));
  }
}

TEST_CASE("lift::switch_: every branch initialized (params, batch_stats), an array index picks one, named branches, errors") {
  const Array x = Array::from(Shape{4, 2}, {1, 2, 3, 4, 5, 6, 7, 9});
  const rng::Streams streams{{"params", rng::key(1)}, {"dropout", rng::key(2)}};
  const Tree vars = init(SwitchNet{}, streams, x, Array::from_i32(Shape{}, {0}), false);
  CHECK(vars.at("params").keys() == std::vector<std::string>{"Scale_0", "BatchNorm_0", "noisy"});
  CHECK(vars.contains_path("batch_stats/BatchNorm_0/mean"));
  CHECK(vars.contains_path("params/noisy/Scale_0/w"));
  // Index 1: BatchNorm in training mode updates its statistics; the others are untouched.
  auto [y1, updates] = apply(SwitchNet{}, vars, {.mutable_collections = {"batch_stats"}}, x, Array::from_i32(Shape{}, {1}), false);
  CHECK(y1.bitwise_equal(apply(nn::BatchNorm{.use_running_average = false}, Tree{{"params", vars.at_path("params/BatchNorm_0")},
                                                       {"batch_stats", vars.at_path("batch_stats/BatchNorm_0")}},
                               {.mutable_collections = {"batch_stats"}}, x).first));
  CHECK_FALSE(updates.at_path("batch_stats/BatchNorm_0/mean").array().bitwise_equal(vars.at_path("batch_stats/BatchNorm_0/mean").array()));
  // Index 2 (a lambda under an explicit name) draws dropout keys at its own path, as a direct call would.
  const Array y2 = apply(SwitchNet{}, vars, {.rngs = {{"dropout", rng::key(7)}}}, x, Array::from_i32(Shape{}, {2}), true);
  struct Noisy2 {
    Array operator()(Scope& s, const Array& v) const {
      return s("noisy", [](Scope& in, const Array& u) { return in(nn::Dropout{.rate = 0.5}, in(Scale{}, u), false); }, v);
    }
  };
  Tree noisy_params;
  noisy_params["noisy"] = vars.at_path("params/noisy");
  CHECK(y2.bitwise_equal(apply(Noisy2{}, Tree{{"params", noisy_params}}, {.rngs = {{"dropout", rng::key(7)}}}, x)));
  // Errors: out of range, a non-scalar or a NaN selector, a batched selector under lift::vmap.
  auto message = [&](const Array& index) {
    try {
      (void)apply(SwitchNet{}, vars, x, index, false);
    } catch (const ValueError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string out_of_range = message(Array::from_i32(Shape{}, {3}));
  CHECK(out_of_range.find("lift::switch_ at '<root>'") != std::string::npos);
  CHECK(out_of_range.find("index 3 is out of range for 3 branches") != std::string::npos);
  CHECK(message(Array::from_i32(Shape{2}, {0, 1})).find("pass a scalar") != std::string::npos);
  CHECK(message(Array::full(Shape{}, std::nanf(""))).find("NaN") != std::string::npos);
  struct PerMember {
    Array operator()(Scope& s, const Array& v, const Array& index) const {
      return lift::switch_(s, index, std::tuple{Scale{}, Affine{}}, v);
    }
  };
  const lift::vmap<PerMember> mapped{.variable_axes = {{"params", 0}}, .split_rngs = {{"params", true}}};
  const Array per_member = Array::from_i32(Shape{4}, {0, 1, 0, 1});
  const Tree mapped_vars = init(mapped, rng::key(0), x, per_member);  // init runs member by member: fine
  CHECK_THROWS_WITH_AS((void)apply(mapped, mapped_vars, x, per_member), doctest::Contains("the selector is batched"),
                       ValueError);
}

// ---- lift::map_variables -------------------------------------------------------------------------

namespace {

Array upper_triangle(const Shape& shape) {  // 1 on and above the diagonal, 0 below
  std::vector<float> m(static_cast<std::size_t>(shape.numel()));
  for (std::int64_t i = 0; i < shape[0]; ++i)
    for (std::int64_t j = 0; j < shape[1]; ++j) m[static_cast<std::size_t>(i * shape[1] + j)] = j >= i ? 1.0f : 0.0f;
  return Array::from(shape, m);
}

Tree masked_kernel(const Tree& vars) {
  Tree out = vars;
  const Array k = vars.at_path("params/kernel").array();
  out.set_path("params/kernel", Tree(k * upper_triangle(k.shape())));
  return out;
}

struct CausalDense {  // Flax's map_variables example
  Array operator()(Scope& s, const Array& x) const {
    return s(lift::map_variables<nn::Dense>{.body = {.features = 3}, .trans_in = masked_kernel}, x);
  }
};

struct PlainMapped {  // the same module through an identity map
  Array operator()(Scope& s, const Array& x) const { return s(lift::map_variables<nn::Dense>{.body = {.features = 3}}, x); }
};

struct WeightNormDense {  // weight normalization: kernel / |kernel| per output, times a learned scale
  Array operator()(Scope& s, const Array& x) const {
    auto normalize = [&s](const Tree& vars) {
      Tree out = vars;
      const Array k = vars.at_path("params/kernel").array();
      const Array scale = s.param("scale", initializers::ones(), Shape{k.dim(1)});
      out.set_path("params/kernel", Tree(k * rsqrt(sum(k * k, {0}, true) + 1e-12f) * scale));
      return out;
    };
    return s(lift::map_variables<nn::Dense>{.body = {.features = 3}, .trans_in = normalize}, x);
  }
};

struct AlwaysCount {  // writes its "stats" counter on every call, mutable or not
  Array operator()(Scope& s, const Array& x) const {
    Variable n = s.variable("stats", "calls", [] { return Array::zeros(Shape{}); });
    n.set(n.value() + 1.0f);
    return x;
  }
};

struct StatsDoubled {  // a mapped mutable collection
  bool write_back = false;
  Array operator()(Scope& s, const Array& x) const {
    auto doubled = [](const Tree& vars) {
      return tree_map([](const Array& a) { return a * 2.0f; }, vars);
    };
    return s(lift::map_variables<AlwaysCount>{.collections = {"stats"}, .trans_in = doubled, .mutable_ = write_back}, x);
  }
};

}  // namespace

TEST_CASE("lift::map_variables: the body computes with trans_in of its variables; init stores them mapped, as Flax's") {
  const Array x = testing::random_array(Shape{2, 3}, 5);
  const Tree plain = init(PlainMapped{}, rng::key(3), x);
  const Tree vars = init(CausalDense{}, rng::key(3), x);
  CHECK(vars.at("params").keys() == std::vector<std::string>{"Map_variablesDense_0"});
  const Array created = plain.at_path("params/Map_variablesDense_0/kernel").array();
  const Array stored = vars.at_path("params/Map_variablesDense_0/kernel").array();
  CHECK(stored.bitwise_equal(created * upper_triangle(created.shape())));  // trans_out(trans_in(created)) is stored
  // Apply on a full kernel computes with its upper triangle; the gradient below the diagonal is zero.
  const Tree full = Tree{{"Map_variablesDense_0", plain.at_path("params/Map_variablesDense_0")}};
  const Tree masked{{"kernel", Tree(created * upper_triangle(created.shape()))},
                    {"bias", plain.at_path("params/Map_variablesDense_0/bias")}};
  CHECK(apply(CausalDense{}, Tree{{"params", full}}, x).bitwise_equal(apply(nn::Dense{.features = 3}, Tree{{"params", masked}}, x)));
  auto loss_mapped = [&](const Tree& p) { return sum(square(apply(CausalDense{}, Tree{{"params", p}}, x))); };
  auto loss_direct = [&](const Tree& p) { return sum(square(apply(nn::Dense{.features = 3}, Tree{{"params", p}}, x))); };
  const Tree g = grad(loss_mapped)(full);
  const Tree gd = grad(loss_direct)(masked);
  const Array gk = g.at_path("Map_variablesDense_0/kernel").array();
  CHECK(gk.bitwise_equal(gd.at("kernel").array() * upper_triangle(created.shape())));
  CHECK(g.at_path("Map_variablesDense_0/bias").array().bitwise_equal(gd.at("bias").array()));
  // Under lift::remat: bitwise the same gradients.
  struct Rematted {
    Array operator()(Scope& s, const Array& x) const { return s("CausalDense_0", lift::remat<CausalDense>{}, x); }
  };
  const Tree gr = grad([&](const Tree& p) { return sum(square(apply(Rematted{}, Tree{{"params", p}}, x))); })(
      Tree{{"CausalDense_0", full}});
  CHECK(gr.at_path("CausalDense_0/Map_variablesDense_0/kernel").array().bitwise_equal(gk));
}

TEST_CASE("lift::map_variables: a map that creates params of its own (weight norm) has finite-difference gradients") {
  const Array x = testing::random_array(Shape{4, 5}, 9);
  const Tree vars = init(WeightNormDense{}, rng::key(1), x);
  CHECK(vars.at("params").keys() == std::vector<std::string>{"scale", "Map_variablesDense_0"});
  // The stored kernel is normalized per output (the default trans_out stores what trans_in gave).
  const Array k = vars.at_path("params/Map_variablesDense_0/kernel").array();
  CHECK(testing::max_abs_diff(sum(k * k, {0}), Array::full(Shape{3}, 1.0f)) < 1e-5f);
  const Array k0 = testing::random_array(Shape{5, 3}, 10);
  const Array s0 = testing::random_array(Shape{3}, 11, 0.5f, 2.0f);
  const Array b0 = testing::random_array(Shape{3}, 12);
  testing::check_gradients(
      "weight-normalized Dense",
      [&](const std::vector<Array>& in) {
        Tree p{{"scale", Tree(in[1])}, {"Map_variablesDense_0", Tree{{"kernel", Tree(in[0])}, {"bias", Tree(in[2])}}}};
        return sum(square(apply(WeightNormDense{}, Tree{{"params", p}}, x)));
      },
      {k0, s0, b0});
}

TEST_CASE("lift::map_variables: mapped mutable collections are written back through trans_out only with mutable_") {
  const Array x = Array::from(Shape{1, 2}, {1, 2});
  const Tree vars = init(StatsDoubled{}, rng::key(0), x);
  // init, as Flax's: the creating run counts 0 -> 1; the second run counts trans_in(1) = 2 -> 3, stored.
  CHECK(vars.at_path("stats/Map_variablesAlwaysCount_0/calls").array().item() == 3.0f);
  CHECK_THROWS_WITH_AS((void)apply(StatsDoubled{}, vars, {.mutable_collections = {"stats"}}, x),
                       doctest::Contains("does not write it back"), ValueError);
  auto [y, updates] = apply(StatsDoubled{.write_back = true}, vars, {.mutable_collections = {"stats"}}, x);
  CHECK(updates.at_path("stats/Map_variablesAlwaysCount_0/calls").array().item() == 7.0f);  // 2 * 3 + 1
  // A map returning a collection that is not mapped is an error naming it.
  struct Stray {
    Array operator()(Scope& s, const Array& x) const {
      auto stray = [](const Tree& vars) {
        Tree out = vars;
        out.set("cache", Tree());
        return out;
      };
      return s(lift::map_variables<nn::Dense>{.body = {.features = 2}, .trans_in = stray}, x);
    }
  };
  CHECK_THROWS_WITH_AS((void)init(Stray{}, rng::key(0), x), doctest::Contains("trans_in returned collection 'cache'"),
                       ValueError);
}
