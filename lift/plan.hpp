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
// What is solved. The candidates are module calls: those at path depth depths[0] (1: the top
// module's children) and, with more depths, the calls inside them (depths[1], ...), so each call is
// either run plainly, rematted whole with a policy, planned inside, or rematted with every call
// inside it rematted too (nested, which lowers the transient of its recomputation). The planner records a plain
// step and one step per policy and level with every call of that level under the policy
// (memory::TimelineRecorder), and cuts each into segments: the calls, and the ops between them.
// Per segment it reads kept (live bytes left until its backward), own (its highest live bytes,
// forward, recomputation or backward, minus what earlier segments keep) and its recomputation
// time. The peak of a plan is then max over segments s of own_s + sum of kept before s, and a
// dynamic program over the segments in order (at each level a Pareto front of bytes kept, time
// and peak so far; a call's options are its policies and the fronts of its inside) finds the plan
// of least recomputation time whose peak fits: exact for this model of the peak, not greedy. The
// plan is then run once under the exact accounting; if it exceeds the budget (the model missed
// something), the planner re-solves with the overshoot subtracted, at most twice. No plan
// fitting is a ValueError naming the smallest peak any plan reaches.
#pragma once

#include <linum/core/autodiff/grad.hpp>
#include <linum/core/storage/spill_file.hpp>
#include <linum/core/storage/transfer_stats.hpp>
#include <linum/core/ops/all.hpp>
#include <linum/lift/policies.hpp>
#include <linum/modules/module.hpp>

// Declarations only (nlohmann::json, ordered_json): the full json.hpp costs every includer
// about 2.8 s of compile time; the .cpp files that build or read JSON include it themselves.
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace linum::lift {

namespace detail {
class RematRuleScope;
}  // namespace detail

struct PlanOptions {
  // The policies a call may be rematted with (a call may always run plainly): the standard ones
  // by default (nothing_saveable is remat saving nothing), or any with a description
  // policies::from_description knows, e.g. policies::save_only_these_names({"pre"}).
  std::vector<Policy> policies = {policies::nothing_saveable{}, policies::dots_saveable{}};
  // Candidate calls: module paths with depths[0] components; with more depths, also the calls
  // inside them at depths[1] (and so on), so a call is either rematted whole or planned inside.
  std::vector<int> depths = {1};
  int profile_steps = 2;          // recorded steps per profiling run (times: the minimum)
  bool verify = true;             // run the plan once and re-solve if it exceeds the budget
  // Processes that plan one step together and must follow the same plan (sharded data parallelism:
  // dist::ShardedDataParallel::plan_remat sets it): called with every figure the solver reads
  // (bytes and seconds per profiled segment, the measured peaks) and `what`, a text naming the
  // profiled calls, it must replace each figure by its maximum over the processes. The plan then
  // fits every process's budget and is the same on all. Empty: one process.
  std::function<void(const std::string& what, std::vector<double>& figures)> agree;
};

struct PlannedCall {
  std::string path;                    // "Block_3"
  std::optional<Policy> policy;        // the remat policy; none: the call runs plainly
  std::int64_t kept_bytes = 0;         // live bytes the call leaves until its backward, under `policy`
  double recompute_s = 0;              // its recomputation time under `policy` (profiled alone, without
                                       // remat inside it; a nested plan's totals are in RematPlan)
};

struct RematPlan {
  std::int64_t budget_bytes = 0;
  std::int64_t predicted_peak_bytes = 0;
  std::string predicted_peak_in;         // the call where the predicted peak happens ("Block_3")
  std::int64_t measured_peak_bytes = 0;  // the plan run once under the exact accounting (0: not run)
  std::int64_t plain_peak_bytes = 0;     // the step without remat, measured
  double predicted_extra_s = 0;          // recomputation time the plan adds
  std::vector<int> depths = {1};         // the levels of candidate calls the planner considered
  std::vector<PlannedCall> calls;        // in call order (a call planned inside lists its children)
  // When the plan offloads or compresses: the spill file's I/O windows PlanScope sets. The planner
  // profiles and verifies with both windows 0 (RAM use independent of the I/O thread's timing),
  // then gives the windows what the budget leaves above the measured peak (up to the windows set
  // before planning), since windows W and R add at most W + R to a step's peak.
  std::optional<storage::SpillWindows> spill_windows;
  // Measured while profiling, bytes per second (0: nothing of the kind happened): the spill
  // directory's write and read bandwidth and the codecs' throughput. A placing option is charged
  // the step time it adds, and at least the time its transfers took at these rates.
  struct TransferRates {
    double spill_write = 0, spill_read = 0, encode = 0, decode = 0;
  };
  TransferRates transfer_rates;

  std::string str() const;
  nlohmann::json to_json() const;
  static RematPlan from_json(const nlohmann::json& j);
  void save_json(const std::filesystem::path& path) const;  // atomic
  static RematPlan load_json(const std::filesystem::path& path);
};

// Applies a plan to the module calls made on this thread while alive: a call whose path the plan
// gives a remat policy runs as lift::remat with that policy (all collections and streams lifted).
// Calls the plan does not name run plainly. Nests like RematScope (the innermost scope counts).
// A plan with spill_windows also sets those on the process's spill file while alive.
class PlanScope {
 public:
  explicit PlanScope(const RematPlan& plan);
  ~PlanScope();
  PlanScope(const PlanScope&) = delete;
  PlanScope& operator=(const PlanScope&) = delete;

 private:
  std::unique_ptr<detail::RematRuleScope> scope_;  // the plan's rule (remat_rule.hpp), as RematScope's
  std::optional<storage::SpillWindowsScope> windows_;
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
