// lift::plan_remat and lift::PlanScope: plans meet byte budgets (measured with the exact
// accounting), applying a plan leaves gradients bitwise unchanged, an impossible budget names the
// smallest peak any plan reaches, and a plan survives JSON.
#include <doctest/doctest.h>
#include <linum/linum.hpp>

#include <set>

#include "testing/errors.hpp"

#include <cmath>
#include <unistd.h>
#include <filesystem>
#include <functional>
#include <tuple>

using namespace linum;
using linum::testing::contains;
using linum::testing::error_of;

namespace {

struct Block {
  int width = 256;
  Array operator()(Scope& s, const Array& x) const {
    return gelu(s(nn::Dense{.features = x.dim(-1)}, gelu(s(nn::Dense{.features = width}, x))));
  }
};
struct Deep {
  int layers = 6;
  Array operator()(Scope& s, Array x) const {
    for (int i = 0; i < layers; ++i) x = s(Block{.width = 128 + 64 * (i % 3)}, x);  // blocks of three sizes
    return x;
  }
};
// Two levels: stages of blocks (candidates at depth 1 are stages, at depth 2 blocks).
struct Staged {
  Array operator()(Scope& s, Array x) const {
    for (int i = 0; i < 3; ++i) x = s(Deep{.layers = 2}, x);
    return x;
  }
};

template <class M>
struct Setup {
  M model;
  Array x = rng::normal(rng::key(1), Shape{512, 64});  // activations dominate the parameters
  Tree vars = init(model, rng::key(0), x);
  auto loss() const {
    return [this](const Tree& p) { return sum(apply(model, Tree{{"params", p}}, x)); };
  }
  // The step the planner profiles (the gradients are dropped, as an optimizer would consume them).
  void step() const { (void)value_and_grad(loss())(vars.at("params")); }
  std::function<void()> step_fn() const { return [this] { step(); }; }
  std::pair<std::int64_t, std::int64_t> fixed_and_plain_peak() const {
    step();
    const std::int64_t fixed = memory::stats().live_bytes;
    memory::PeakScope peak;
    step();
    return {fixed, peak.peak_bytes()};
  }
};

}  // namespace

TEST_CASE("plan_remat: plans meet budgets of 75% and 50% of the activation memory; gradients stay bitwise") {
  const Setup<Deep> m;
  const auto [loss0, plain_grads] = value_and_grad(m.loss())(m.vars.at("params"));
  std::int64_t fixed = 0, plain = 0;
  std::tie(fixed, plain) = m.fixed_and_plain_peak();  // (with plain_grads alive, as while planning)
  for (double fraction : {0.75, 0.5}) {
    CAPTURE(fraction);
    const std::int64_t budget = fixed + static_cast<std::int64_t>(fraction * static_cast<double>(plain - fixed));
    const lift::RematPlan plan = lift::plan_remat(m.step_fn(), budget);
    CAPTURE(plan.str());
    CHECK(plan.plain_peak_bytes == plain);
    CHECK(plan.measured_peak_bytes <= budget);
    CHECK(plan.calls.size() == 6);
    CHECK(std::any_of(plan.calls.begin(), plan.calls.end(), [](const auto& c) { return c.policy.has_value(); }));
    // Applying the plan: the measured peak of a real step is within the budget, and close to the
    // prediction; the gradients are bitwise those of the plain model.
    lift::PlanScope apply_plan(plan);
    memory::PeakScope peak;
    const auto [loss, grads] = value_and_grad(m.loss())(m.vars.at("params"));
    CHECK(peak.peak_bytes() <= budget);
    CHECK(std::abs(static_cast<double>(plan.predicted_peak_bytes - peak.peak_bytes())) <=
          0.05 * static_cast<double>(peak.peak_bytes()));
    CHECK(bitwise_equal(grads, plain_grads));
    CHECK(loss.item() == loss0.item());
  }
}

namespace {
// Blocks that draw dropout masks: a plan that remats them must replay each block's keys.
struct DropBlock {
  Array operator()(Scope& s, const Array& x) const {
    const Array h = s(nn::Dropout{.rate = 0.3, .deterministic = false}, gelu(s(nn::Dense{.features = 192}, x)));
    return s(nn::Dense{.features = x.dim(-1)}, h);
  }
};
struct DeepDrop {
  Array operator()(Scope& s, Array x) const {
    for (int i = 0; i < 6; ++i) x = s(DropBlock{}, x);
    return x;
  }
};
}  // namespace

TEST_CASE("plan_remat with dropout: rematted blocks redraw the same masks, so gradients stay bitwise") {
  // PyTorch's memory-budget partitioner redraws random numbers in the backward pass (pytorch#190758):
  // a plan here runs rematted calls through the lifted remat path, which replays the keys.
  const DeepDrop model;
  const Array x = rng::normal(rng::key(1), Shape{512, 64});
  const Tree vars = init(model, rng::Streams{{"params", rng::key(0)}, {"dropout", rng::key(5)}}, x);
  auto loss = [&](const Tree& p) {
    return sum(apply(model, Tree{{"params", p}}, {.rngs = {{"dropout", rng::key(7)}}}, x).first);
  };
  auto step = [&] { (void)value_and_grad(loss)(vars.at("params")); };
  const auto [loss0, plain_grads] = value_and_grad(loss)(vars.at("params"));
  // The masks are real: another dropout key gives other gradients.
  auto other_masks = [&](const Tree& p) {
    return sum(apply(model, Tree{{"params", p}}, {.rngs = {{"dropout", rng::key(8)}}}, x).first);
  };
  CHECK_FALSE(bitwise_equal(grad(other_masks)(vars.at("params")), plain_grads));
  step();
  const std::int64_t fixed = memory::stats().live_bytes;
  std::int64_t plain = 0;
  {
    memory::PeakScope peak;
    step();
    plain = peak.peak_bytes();
  }
  const std::int64_t budget = fixed + (plain - fixed) / 2;
  const lift::RematPlan plan = lift::plan_remat(step, budget);
  CAPTURE(plan.str());
  REQUIRE(std::any_of(plan.calls.begin(), plan.calls.end(), [](const auto& c) { return c.policy.has_value(); }));
  lift::PlanScope apply_plan(plan);
  memory::PeakScope peak;
  const auto [loss1, grads] = value_and_grad(loss)(vars.at("params"));
  CHECK(peak.peak_bytes() <= budget);
  CHECK(loss1.item() == loss0.item());
  CHECK(bitwise_equal(grads, plain_grads));
}

TEST_CASE("plan_remat: a generous budget remats nothing; an impossible one names the smallest peak") {
  const Setup<Deep> m;
  std::int64_t fixed = 0, plain = 0;
  std::tie(fixed, plain) = m.fixed_and_plain_peak();
  const lift::RematPlan loose = lift::plan_remat(m.step_fn(), plain + 1024);
  CHECK(std::all_of(loose.calls.begin(), loose.calls.end(), [](const auto& c) { return !c.policy.has_value(); }));
  CHECK(loose.predicted_extra_s == 0.0);
  const std::string msg = error_of<ValueError>([&] { lift::plan_remat(m.step_fn(), fixed + 1); });
  CHECK(contains(msg, "no plan keeps the step's peak within"));
  CHECK(contains(msg, "the smallest peak a plan reaches is"));
  CHECK(contains(msg, "reached in Block_"));  // where: a block's backward pass, whatever the plan
  CHECK(contains(error_of<ValueError>([&] { lift::plan_remat(m.model, m.vars, 0, {}, m.x); }), "budget_bytes must be positive"));
}

TEST_CASE("plan_remat over two levels: each stage rematted whole or planned block by block") {
  const Setup<Staged> m;
  std::int64_t fixed = 0, plain = 0;
  std::tie(fixed, plain) = m.fixed_and_plain_peak();
  const auto [loss0, plain_grads] = value_and_grad(m.loss())(m.vars.at("params"));
  const std::int64_t budget = fixed + (plain - fixed) * 45 / 100;
  const lift::RematPlan plan = lift::plan_remat(m.step_fn(), budget, {.depths = {1, 2}});
  CAPTURE(plan.str());
  CHECK(plan.measured_peak_bytes <= budget);
  CHECK(std::abs(static_cast<double>(plan.predicted_peak_bytes - plan.measured_peak_bytes)) <=
        0.05 * static_cast<double>(plan.measured_peak_bytes));
  // Each stage is planned whole, through its blocks, or both (nested remat: the stage rematted with
  // every block inside it rematted too): every block is covered, never half a stage.
  std::set<std::string> listed;
  for (const auto& c : plan.calls) listed.insert(c.path);
  for (const std::string stage : {"Deep_0", "Deep_1", "Deep_2"}) {
    CAPTURE(stage);
    const int blocks = static_cast<int>(listed.count(stage + "/Block_0") + listed.count(stage + "/Block_1"));
    CHECK((blocks == 2 || (blocks == 0 && listed.count(stage) == 1)));
  }
  lift::PlanScope apply_plan(plan);
  CHECK(bitwise_equal(value_and_grad(m.loss())(m.vars.at("params")).second, plain_grads));
}

TEST_CASE("a plan prints, survives JSON, and a file that is not a plan is refused") {
  const Setup<Deep> m;
  std::int64_t fixed = 0, plain = 0;
  std::tie(fixed, plain) = m.fixed_and_plain_peak();
  // The model overload: the gradient of sum(model(x)) (its step keeps a little more than ours).
  const lift::RematPlan plan = lift::plan_remat(m.model, m.vars, fixed + (plain - fixed) * 6 / 10, {}, m.x);
  CHECK(plan.measured_peak_bytes <= plan.budget_bytes);
  const std::string text = plan.str();
  CHECK(contains(text, "Block_0: "));
  CHECK(contains(text, "predicted peak"));
  // Per process: the suite runs this program twice at once (on oneDNN and on Eigen).
  const auto path = std::filesystem::temp_directory_path() / ("linum_test_plan_" + std::to_string(::getpid()) + ".json");
  plan.save_json(path);
  const lift::RematPlan back = lift::RematPlan::load_json(path);
  std::filesystem::remove(path);
  CHECK(back.to_json() == plan.to_json());
  CHECK(contains(error_of<ValueError>([] { lift::RematPlan::from_json({{"calls", 3}}); }), "not a plan"));
  CHECK(contains(error_of<ValueError>([] {
                   lift::RematPlan::from_json({{"budget_bytes", 1}, {"predicted_peak_bytes", 1},
                                               {"calls", {{{"path", "Block_0"}, {"policy", "sometimes"}}}}});
                 }),
                 "'sometimes' names none of the standard policies"));
}

TEST_CASE("plan_remat reaches the smallest peak it reports, nesting remat inside a rematted stage when needed") {
  const Setup<Staged> m;
  std::int64_t fixed = 0, plain = 0;
  std::tie(fixed, plain) = m.fixed_and_plain_peak();
  const std::string msg = error_of<ValueError>([&] { lift::plan_remat(m.step_fn(), fixed + 1, {.depths = {1, 2}}); });
  const std::string marker = "the smallest peak a plan reaches is ";
  REQUIRE(contains(msg, marker));
  const std::int64_t smallest = std::stoll(msg.substr(msg.find(marker) + marker.size()));
  CHECK(smallest < plain);
  // Stages alone (depth 1) cannot get as low as stages with their blocks.
  const std::string flat = error_of<ValueError>([&] { lift::plan_remat(m.step_fn(), fixed + 1, {.depths = {1}}); });
  CHECK(std::stoll(flat.substr(flat.find(marker) + marker.size())) >= smallest);
  const lift::RematPlan plan = lift::plan_remat(m.step_fn(), smallest, {.depths = {1, 2}});
  CAPTURE(plan.str());
  CHECK(plan.measured_peak_bytes <= smallest);
  CHECK(plan.predicted_peak_bytes == smallest);
  const bool nested = std::any_of(plan.calls.begin(), plan.calls.end(), [&](const auto& inner) {
    const auto slash = inner.path.find('/');
    return slash != std::string::npos && inner.policy.has_value() &&
           std::any_of(plan.calls.begin(), plan.calls.end(), [&](const auto& outer) {
             return outer.path == inner.path.substr(0, slash) && outer.policy.has_value();
           });
  });
  CHECK(nested);
  const auto plain_grads = value_and_grad(m.loss())(m.vars.at("params")).second;
  lift::PlanScope apply_plan(plan);
  CHECK(bitwise_equal(value_and_grad(m.loss())(m.vars.at("params")).second, plain_grads));
}

namespace {
// A block whose pre-activations are named, so a plan may save exactly those.
struct NamedBlock {
  Array operator()(Scope& s, const Array& x) const {
    const Array pre = checkpoint_name(s(nn::Dense{.features = 256}, x), "pre");
    return gelu(s(nn::Dense{.features = x.dim(-1)}, gelu(pre)));
  }
};
struct NamedDeep {
  Array operator()(Scope& s, Array x) const {
    for (int i = 0; i < 4; ++i) x = s(NamedBlock{}, x);
    return x;
  }
};
}  // namespace

TEST_CASE("plan_remat with a name policy: saves what checkpoint_name marked; the plan carries the policy") {
  const Setup<NamedDeep> m;
  const auto [loss0, plain_grads] = value_and_grad(m.loss())(m.vars.at("params"));
  std::int64_t fixed = 0, plain = 0;
  std::tie(fixed, plain) = m.fixed_and_plain_peak();
  const lift::PlanOptions options{.policies = {policies::nothing_saveable{}, policies::save_only_these_names({"pre"})}};
  const lift::RematPlan plan = lift::plan_remat(m.step_fn(), fixed + (plain - fixed) * 6 / 10, options);
  CAPTURE(plan.str());
  CHECK(plan.measured_peak_bytes <= plan.budget_bytes);
  CHECK(plan.predicted_peak_bytes == plan.measured_peak_bytes);
  // The JSON round trip keeps every call's policy (by its description).
  const lift::RematPlan back = lift::RematPlan::from_json(plan.to_json());
  REQUIRE(back.calls.size() == plan.calls.size());
  for (std::size_t i = 0; i < plan.calls.size(); ++i) {
    CHECK(back.calls[i].policy.has_value() == plan.calls[i].policy.has_value());
    if (plan.calls[i].policy) CHECK(back.calls[i].policy->description() == plan.calls[i].policy->description());
  }
  {
    lift::PlanScope apply_plan(back);
    CHECK(bitwise_equal(value_and_grad(m.loss())(m.vars.at("params")).second, plain_grads));
  }
  // A candidate made from a predicate of one's own cannot be stored in a plan: refused up front.
  const lift::Policy mine("big outputs", [](const lift::OpInfo& op) { return op.bytes > 1024; });
  CHECK(contains(error_of<ValueError>([&] { lift::plan_remat(m.step_fn(), plain, {.policies = {mine}}); }),
                 "cannot be restored from its description"));
  // Plans saved before policies were stored by description still load.
  const auto old = nlohmann::json::parse(R"({"budget_bytes": 1, "predicted_peak_bytes": 1, "saved_names": ["pre"],
      "calls": [{"path": "NamedBlock_0", "policy": "names"}, {"path": "NamedBlock_1", "policy": "full"},
                {"path": "NamedBlock_2", "policy": "none"}]})");
  const lift::RematPlan loaded = lift::RematPlan::from_json(old);
  CHECK(loaded.calls[0].policy->description() == "save_only_these_names(pre)");
  CHECK(loaded.calls[1].policy->description() == "nothing_saveable");
  CHECK(!loaded.calls[2].policy.has_value());
}

TEST_CASE("plan_remat places values beyond RAM or splits the batch when the policies allow it: offload, compression, split_batch") {
  // The spill file with its default I/O windows: the planner profiles with them closed and gives
  // the plan what the budget leaves, so the planned step stays within the budget whatever the timing.
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("linum-plan-spill-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  storage::set_spill_options({.directory = dir});
  const storage::SpillWindows defaults = storage::spill_file().windows();
  const Setup<Deep> m;
  const auto [loss0, plain_grads] = value_and_grad(m.loss())(m.vars.at("params"));
  std::int64_t fixed = 0, plain = 0;
  std::tie(fixed, plain) = m.fixed_and_plain_peak();
  const std::int64_t budget = fixed + (plain - fixed) / 2;
  for (const lift::Policy& option : {policies::offload(policies::dots_saveable{}),
                                     policies::offload(policies::nothing_saveable{}),
                                     policies::compress(storage::Codec::int8, policies::dots_saveable{}),
                                     policies::offload(policies::compress(storage::Codec::bf16, policies::dots_saveable{})),
                                     policies::residuals(policies::offload(policies::everything_saveable{})),
                                     policies::residuals(policies::compress(storage::Codec::int8, policies::everything_saveable{})),
                                     policies::split_batch(4, policies::residuals(policies::offload(policies::everything_saveable{})))}) {
    CAPTURE(option.description());
    const lift::RematPlan plan = lift::plan_remat(m.step_fn(), budget, {.policies = {option}});
    CAPTURE(plan.str());
    CHECK(plan.measured_peak_bytes <= budget);
    int placed = 0;
    for (const auto& c : plan.calls)
      if (c.policy) {
        CHECK(c.policy->description() == option.description());
        ++placed;
      }
    CHECK(placed > 0);  // the budget forces the option on some calls
    REQUIRE(plan.spill_windows.has_value());
    // The transfers it profiled, as rates: the disk's for offload, the codec's for compression.
    if (contains(option.description(), "offload")) CHECK(plan.transfer_rates.spill_write > 0);
    if (contains(option.description(), "compress")) CHECK(plan.transfer_rates.encode > 0);
    CHECK(plan.spill_windows->read_ahead_bytes + plan.spill_windows->write_behind_bytes <= budget - plan.measured_peak_bytes);
    CHECK(plan.spill_windows->read_ahead_bytes <= defaults.read_ahead_bytes);
    CHECK(storage::spill_file().windows().read_ahead_bytes == defaults.read_ahead_bytes);  // planning restored them
    // The plan survives its JSON form and applies: lossless options give the plain gradients bitwise.
    const lift::RematPlan back = lift::RematPlan::from_json(plan.to_json());
    REQUIRE(back.spill_windows.has_value());
    CHECK(back.spill_windows->write_behind_bytes == plan.spill_windows->write_behind_bytes);
    std::optional<lift::PlanScope> apply_plan(back);
    CHECK(storage::spill_file().windows().read_ahead_bytes == plan.spill_windows->read_ahead_bytes);
    Array loss;
    Tree grads;
    for (int step = 0; step < 3; ++step) {  // the I/O thread's timing varies: the bound holds each time
      loss = Array();
      grads = Tree();  // (the last step's gradients are not part of this one)
      memory::PeakScope peak;
      std::tie(loss, grads) = value_and_grad(m.loss())(m.vars.at("params"));
      CHECK(peak.peak_bytes() <= budget);
    }
    apply_plan.reset();
    CHECK(storage::spill_file().windows().write_behind_bytes == defaults.write_behind_bytes);
    CHECK(loss.item() == loss0.item());
    if (option.description() == "offload(dots_saveable)" || option.description() == "offload(nothing_saveable)" ||
        option.description() == "residuals(offload(everything_saveable))")
      CHECK(bitwise_equal(grads, plain_grads));
    else {
      const std::vector<Array> got = leaves(grads), want = leaves(plain_grads);
      for (std::size_t i = 0; i < got.size(); ++i)
        CHECK(max(abs(got[i] - want[i])).item() <= 0.05f * max(abs(want[i])).item() + 1e-6f);
    }
  }
  storage::set_spill_options({});
  std::filesystem::remove_all(dir);
}
