// lift::scan over layers: stacked variables, per-layer keys, the same results as an explicit loop
// over the layer slices, remat inside the scan, batch statistics stacked and updated once.
#include <doctest/doctest.h>
#include <linum/linum.hpp>

#include "testing/gradcheck.hpp"

using namespace linum;
using linum::testing::random_array;

namespace {

struct Layer {
  std::int64_t width = 6;
  Array operator()(Scope& s, const Array& x, bool train) const {
    Array h = gelu(s(nn::Dense{.features = width}, x));
    h = s(nn::Dropout{.rate = 0.25}, h, !train);
    Variable calls = s.variable("stats", "calls", [] { return Array::zeros(Shape{}); });
    if (train && s.is_mutable_collection("stats") && !s.is_initializing()) calls.set(calls.value() + 1.0f);
    return x + h;
  }
};

template <class Body>
struct Net {
  int depth = 4;
  Array operator()(Scope& s, const Array& x, bool train) const {
    return s(lift::scan<Body>{.length = depth}, x, train);
  }
};

// The same computation written as a loop over the layer slices of the stacked variables.
Array manual(const Tree& vars, const Array& x, int depth, rng::Key dropout, bool train) {
  // Keys: the scan draws one key per stream in its own scope (path ScanLayer_0, count 1).
  const rng::Streams streams{{"dropout", dropout}};
  const std::vector<std::string> path{"ScanLayer_0"};
  const rng::Key base = streams.derive("dropout", path, 1);
  Array h = x;
  for (int i = 0; i < depth; ++i) {
    Tree layer = tree_map([i](const Array& a) { return unstack(a)[static_cast<std::size_t>(i)]; },
                          vars.at("params").at("ScanLayer_0"));
    // Apply one layer at the root with the layer's variables and key, mirroring the scan's state.
    detail::ScopeState st;
    st.variables = Tree{{"params", Tree{{"ScanLayer_0", layer}}}};
    st.rngs.set("dropout", rng::fold_in(base, static_cast<std::uint32_t>(i)));
    st.mutable_collections = {"stats"};
    Scope scope(st, path);
    h = Layer{}(scope, h, train);
  }
  return h;
}

}  // namespace

TEST_CASE("scan stacks the variables of its layers along a leading axis") {
  const Array x = random_array(Shape{3, 6}, 1);
  Tree vars = init(Net<Layer>{}, rng::key(0), x, false);
  CHECK(vars.at("params").keys() == std::vector<std::string>{"ScanLayer_0"});
  CHECK(vars.at_path("params/ScanLayer_0/Dense_0/kernel").array().shape() == Shape{4, 6, 6});
  CHECK(vars.at_path("params/ScanLayer_0/Dense_0/bias").array().shape() == Shape{4, 6});
  CHECK(vars.at_path("stats/ScanLayer_0/calls").array().shape() == Shape{4});
  // Each layer got its own initial values.
  auto layers = unstack(vars.at_path("params/ScanLayer_0/Dense_0/kernel").array());
  CHECK_FALSE(layers[0].bitwise_equal(layers[1]));
}

TEST_CASE("scan equals a loop over the layer slices, forward and gradients") {
  const Array x = random_array(Shape{3, 6}, 2);
  Tree vars = init(Net<Layer>{}, rng::key(0), x, false);
  auto run_scan = [&](const Tree& params) {
    return apply(Net<Layer>{}, Tree{{"params", params}, {"stats", vars.at("stats")}},
                 {.rngs = {{"dropout", rng::key(5)}}, .mutable_collections = {"stats"}}, x, true)
        .first;
  };
  Array y = run_scan(vars.at("params"));
  CHECK(y.bitwise_equal(manual(vars, x, 4, rng::key(5), true)));
  // Gradients w.r.t. the stacked params: against finite differences through the whole scan.
  const Array kernel = vars.at_path("params/ScanLayer_0/Dense_0/kernel").array();
  CHECK(linum::testing::check_gradients("scan kernel", [&](const std::vector<Array>& v) {
    Tree p = vars.at("params");
    p.set_path("ScanLayer_0/Dense_0/kernel", Tree(v[0]));
    return run_scan(p);
  }, {kernel}, {.eps = 1e-3, .rtol = 5e-2}));
}

TEST_CASE("remat inside scan: bitwise the gradients of the plain scan; statistics updated once") {
  const Array x = random_array(Shape{3, 6}, 3);
  Tree vars = init(Net<Layer>{}, rng::key(0), x, false);
  CHECK(bitwise_equal(vars, init(Net<lift::remat<Layer>>{}, rng::key(0), x, false)));
  auto step = [&](auto model) {
    return value_and_grad([&](const Tree& params) {
      auto [y, updates] = apply(model, Tree{{"params", params}, {"stats", vars.at("stats")}},
                                {.rngs = {{"dropout", rng::key(9)}}, .mutable_collections = {"stats"}}, x, true);
      return std::make_pair(sum(square(y)), updates);
    })(vars.at("params"));
  };
  auto [v1, u1, g1] = step(Net<Layer>{});
  auto [v2, u2, g2] = step(Net<lift::remat<Layer>>{});
  CHECK(v1.bitwise_equal(v2));
  CHECK(bitwise_equal(g1, g2));
  CHECK(bitwise_equal(u1, u2));
  CHECK(u1.at_path("stats/ScanLayer_0/calls").array().to_vector() == std::vector<float>{1, 1, 1, 1});
}

TEST_CASE("scan errors: a dict from a scan of another length names the variable") {
  const Array x = random_array(Shape{3, 6}, 4);
  Tree vars = init(Net<Layer>{.depth = 4}, rng::key(0), x, false);
  CHECK_THROWS_WITH_AS(apply(Net<Layer>{.depth = 3}, vars, x, false),
                       doctest::Contains("needs a leading axis of 3"), ShapeError);
}
