// lift::plan_remat: choose, for each module call of a training step, whether to remat it and with
// which policy, so that the exact peak of live array bytes stays within a budget at the least
// recomputation time; and lift::PlanScope, which applies such a plan without touching the model.
//
//   lift::RematPlan plan = lift::plan_remat(model, variables, budget_bytes, {}, x);
//   std::cout << plan.str();                       // which path gets which policy, predicted peak
//   plan.save_json("plan.json");
//   {
//     lift::PlanScope apply_plan(plan);            // module calls of this thread follow the plan
//     auto [loss, grads] = value_and_grad(loss_fn)(params);
//   }
//
// What is solved. The candidates are the module calls at a path depth (1: the top module's
// children; several depths may be tried, the best plan wins). The planner records one training
// step per policy with every candidate under that policy (memory::TimelineRecorder), and reads
// from each, per call c: kept_c(P), the live bytes c leaves behind until its backward; own_c(P),
// the highest live bytes during c's forward, recomputation or backward minus what earlier calls
// keep; and recompute_c(P), the time of c's recomputation. The peak of a plan (P_1..P_n) is then
//   max( max_c own_c(P_c) + sum_{c'<c} kept_c'(P_c'),  max_j other_j + sum_{c'<j} kept_c'(P_c') )
// where other_j are the points between calls (the loss, the start of the backward pass). A dynamic
// program over the calls in order, whose states are the Pareto front of (bytes kept so far, time
// so far), finds the plan of least total recompute time whose peak fits: exact for this model of
// the peak, not greedy. The plan is then run once under the exact accounting; if it exceeds the
// budget (the model missed something), the planner re-solves with the overshoot subtracted, at
// most twice. No plan fitting is a ValueError naming the smallest peak any plan reaches.
#pragma once

#include <linum/core/autodiff/grad.hpp>
#include <linum/core/ops.hpp>
#include <linum/modules/module.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace linum::lift {

// What a planned call does: nothing (keeps its activations), or remat saving nothing (full),
// saving matrix products (dots), or saving products without batch dimensions (dots_no_batch).
enum class PlanPolicy { none, full, dots, dots_no_batch };
const char* plan_policy_name(PlanPolicy p);
PlanPolicy plan_policy_from_name(const std::string& name);

struct PlanOptions {
  std::vector<PlanPolicy> policies = {PlanPolicy::none, PlanPolicy::full, PlanPolicy::dots};
  std::vector<int> depths = {1};  // candidate calls: module paths with this many components
  int profile_steps = 2;          // recorded steps per profiling run (times: the minimum)
  bool verify = true;             // run the plan once and re-solve if it exceeds the budget
};

struct PlannedCall {
  std::string path;                    // "Block_3"
  PlanPolicy policy = PlanPolicy::none;
  std::int64_t kept_bytes = 0;         // live bytes the call leaves until its backward, under `policy`
  double recompute_s = 0;              // predicted recomputation time under `policy`
};

struct RematPlan {
  std::int64_t budget_bytes = 0;
  std::int64_t predicted_peak_bytes = 0;
  std::int64_t measured_peak_bytes = 0;  // the plan run once under the exact accounting (0: not run)
  std::int64_t plain_peak_bytes = 0;     // the step without remat, measured
  double predicted_extra_s = 0;          // recomputation time the plan adds
  int depth = 1;
  std::vector<PlannedCall> calls;        // in call order

  std::string str() const;
  nlohmann::json to_json() const;
  static RematPlan from_json(const nlohmann::json& j);
  void save_json(const std::filesystem::path& path) const;  // atomic
  static RematPlan load_json(const std::filesystem::path& path);
};

// Applies a plan to the module calls made on this thread while alive: a call whose path the plan
// gives a remat policy runs as lift::remat with that policy (all collections and streams lifted).
// Calls the plan does not name run plainly. Nests like RematScope (the innermost scope counts).
class PlanScope {
 public:
  explicit PlanScope(const RematPlan& plan);
  ~PlanScope();
  PlanScope(const PlanScope&) = delete;
  PlanScope& operator=(const PlanScope&) = delete;
  class Interceptor;

 private:
  std::unique_ptr<Interceptor> interceptor_;
  std::unique_ptr<linum::detail::CallInterceptorGuard> guard_;
};

// Plans for `step`, a function that runs one training step (it is run several times).
RematPlan plan_remat(const std::function<void()>& step, std::int64_t budget_bytes, const PlanOptions& options = {});

// Plans for the gradient of sum(model(inputs...)) with respect to variables["params"] (other
// collections mutable, a "dropout" stream given), the step most models train with.
template <class M, class... Args>
RematPlan plan_remat(const M& model, const Tree& variables, std::int64_t budget_bytes, const PlanOptions& options,
                     const Args&... inputs) {
  auto step = [&] {
    (void)value_and_grad([&](const Tree& params) {
      Tree vars = variables;
      vars.set("params", params);
      return sum(apply(model, vars, {.rngs = {{"dropout", rng::key(0)}}, .all_mutable = true}, inputs...).first);
    })(variables.at("params"));
  };
  return plan_remat(std::function<void()>(step), budget_bytes, options);
}

}  // namespace linum::lift
