// lift::RematScope: run-time remat of module calls (keras.RematScope's modes), bitwise the plain
// model's results.
#include <doctest/doctest.h>
#include <linum/linum.hpp>

#include <memory>

#include "testing/gradcheck.hpp"

#include <map>

using namespace linum;
using linum::testing::random_array;

namespace {

std::map<std::string, int> g_calls;  // calls per module path

struct Wide {  // output 4x wider than its input
  Array operator()(Scope& s, const Array& x, bool train) const {
    ++g_calls[linum::detail::join_module_path(*linum::detail::current_module_path())];
    Array h = gelu(s(nn::Dense{.features = 4 * x.dim(-1)}, x));
    return s(nn::Dropout{.rate = 0.5}, h, !train);
  }
};
struct Narrow {
  Array operator()(Scope& s, const Array& x, bool /*train*/) const {
    ++g_calls[linum::detail::join_module_path(*linum::detail::current_module_path())];
    Variable n = s.variable("stats", "n", [] { return Array::zeros(Shape{}); });
    if (s.is_mutable_collection("stats") && !s.is_initializing()) n.set(n.value() + 1.0f);
    return tanh(s(nn::Dense{.features = x.dim(-1) / 4}, x));
  }
};
struct Model {
  Array operator()(Scope& s, Array x, bool train) const {
    for (int i = 0; i < 2; ++i) {
      x = s(Wide{}, x, train);
      x = s(Narrow{}, x, train);
    }
    return x;
  }
};

struct Step {
  Array loss;
  Tree updates, grads;
};

Step step(const Tree& vars, const Array& x) {
  auto [loss, updates, grads] = value_and_grad([&](const Tree& p) {
    auto [y, u] = apply(Model{}, Tree{{"params", p}, {"stats", vars.at("stats")}},
                        {.rngs = {{"dropout", rng::key(3)}}, .mutable_collections = {"stats"}}, x, true);
    return std::make_pair(sum(square(y)), u);
  })(vars.at("params"));
  return {loss, updates, grads};
}

}  // namespace

TEST_CASE("RematScope modes: which calls are checkpointed; results bitwise those of the plain model") {
  const Array x = random_array(Shape{4, 8}, 1);  // Wide outputs 4x32 = 128 elements, Narrow 4x8 = 32
  Tree vars = init(Model{}, rng::Streams{{"params", rng::key(0)}, {"dropout", rng::key(1)}}, x, false);
  g_calls.clear();
  const Step plain = step(vars, x);
  CHECK(g_calls["Wide_0"] == 1);

  auto check_same = [&](const Step& s) {
    CHECK(s.loss.bitwise_equal(plain.loss));
    CHECK(bitwise_equal(s.grads, plain.grads));
    CHECK(bitwise_equal(s.updates, plain.updates));  // statistics updated once
  };
  SUBCASE("full: every call recomputed once") {
    g_calls.clear();
    lift::reset_recompute_stats();
    {
      lift::RematScope remat({.mode = lift::RematMode::full});
      check_same(step(vars, x));
    }
    CHECK(g_calls["Wide_0"] == 2);
    CHECK(g_calls["Narrow_1"] == 2);
    // Dense and Dropout inside are checkpointed too (nested, as Keras): 4 outer + 6 inner calls.
    CHECK(lift::recompute_stats().checkpointed_calls == 4 + 6 + 6);
  }
  SUBCASE("larger_than: only calls with bigger outputs") {
    g_calls.clear();
    {
      lift::RematScope remat({.mode = lift::RematMode::larger_than, .output_size_threshold = 100});
      check_same(step(vars, x));
    }
    CHECK(g_calls["Wide_0"] == 2);
    CHECK(g_calls["Wide_1"] == 2);
    CHECK(g_calls["Narrow_0"] == 1);  // 32 elements: kept as is
  }
  SUBCASE("list_of_layers: by name or path") {
    g_calls.clear();
    {
      lift::RematScope remat({.mode = lift::RematMode::list_of_layers, .layer_names = {"Narrow_1", "Wide_0/Dense_0"}});
      check_same(step(vars, x));
    }
    CHECK(g_calls["Wide_0"] == 1);  // only its Dense_0 (listed by path) is checkpointed
    CHECK(g_calls["Wide_1"] == 1);
    CHECK(g_calls["Narrow_0"] == 1);
    CHECK(g_calls["Narrow_1"] == 2);
  }
  SUBCASE("list_of_layers: names that match no call are reported, and warned about when the scope ends") {
    std::vector<std::string> warnings;
    const WarningHandler previous = set_warning_handler([&](const std::string& m) { warnings.push_back(m); });
    {
      lift::RematScope remat({.mode = lift::RematMode::list_of_layers, .layer_names = {"Narrow_1", "Narow_0", "Wide_9"}});
      check_same(step(vars, x));
      CHECK(remat.unmatched_layer_names() == std::vector<std::string>{"Narow_0", "Wide_9"});
    }
    {
      lift::RematScope unused({.mode = lift::RematMode::list_of_layers, .layer_names = {"Nothing"}});  // no calls: quiet
    }
    set_warning_handler(previous);
    REQUIRE(warnings.size() == 1);
    CHECK(warnings[0].find("'Narow_0', 'Wide_9' matched none of the") != std::string::npos);
    CHECK(warnings[0].find("Wide_0") != std::string::npos);  // what was called instead
  }
  SUBCASE("none shadows an enclosing scope; the scope ends with its block") {
    g_calls.clear();
    {
      lift::RematScope outer({.mode = lift::RematMode::full});
      lift::RematScope inner({.mode = lift::RematMode::none});
      check_same(step(vars, x));
    }
    check_same(step(vars, x));
    CHECK(g_calls["Wide_0"] == 2);  // two plain steps, no recomputation
  }
}

TEST_CASE("RematScopes destroyed out of order leave no dangling interceptor") {
  const Array x = random_array(Shape{4, 8}, 1);
  Tree vars = init(Model{}, rng::Streams{{"params", rng::key(0)}, {"dropout", rng::key(1)}}, x, false);
  const Step plain = step(vars, x);
  auto outer = std::make_unique<lift::RematScope>(lift::RematScopeOptions{.mode = lift::RematMode::full});
  auto inner = std::make_unique<lift::RematScope>(lift::RematScopeOptions{.mode = lift::RematMode::none});
  outer.reset();  // the outer scope first: the inner one ("none") stays active
  g_calls.clear();
  CHECK(bitwise_equal(step(vars, x).grads, plain.grads));
  CHECK(g_calls["Wide_0"] == 1);  // none: nothing recomputed
  inner.reset();
  g_calls.clear();
  CHECK(bitwise_equal(step(vars, x).grads, plain.grads));  // no scope at all now; no crash
  CHECK(g_calls["Wide_0"] == 1);
}

TEST_CASE("RematScope refuses options that cannot mean what the user wants") {
  using lift::RematMode;
  CHECK_THROWS_WITH_AS(lift::RematScope({.mode = RematMode::list_of_layers}), doctest::Contains("needs layer_names"), ValueError);
  CHECK_THROWS_WITH_AS(lift::RematScope({.mode = RematMode::full, .layer_names = {"Dense_0"}}),
                       doctest::Contains("only used with mode = list_of_layers"), ValueError);
  CHECK_THROWS_WITH_AS(lift::RematScope({.mode = RematMode::larger_than, .output_size_threshold = -1}),
                       doctest::Contains("output_size_threshold must be >= 0"), ValueError);
  CHECK_THROWS_WITH_AS(lift::RematScope({.mode = static_cast<RematMode>(42)}), doctest::Contains("is not a RematMode"), ValueError);
  CHECK_NOTHROW(lift::RematScope({.mode = RematMode::list_of_layers, .layer_names = {"Wide_0"}}));
}
