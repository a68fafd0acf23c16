#include <linum/lift/plan.hpp>

#include <linum/core/memory.hpp>
#include <linum/core/memory_timeline.hpp>
#include <linum/core/serialization.hpp>
#include <linum/lift/remat.hpp>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <sstream>

namespace linum::lift {

const char* plan_policy_name(PlanPolicy p) {
  switch (p) {
    case PlanPolicy::none: return "none";
    case PlanPolicy::full: return "full";
    case PlanPolicy::dots: return "dots";
    case PlanPolicy::dots_no_batch: return "dots_no_batch";
  }
  return "none";
}

PlanPolicy plan_policy_from_name(const std::string& name) {
  for (PlanPolicy p : {PlanPolicy::none, PlanPolicy::full, PlanPolicy::dots, PlanPolicy::dots_no_batch})
    if (name == plan_policy_name(p)) return p;
  throw ValueError(linum::detail::cat("lift::RematPlan: unknown policy '", name, "' (none, full, dots, dots_no_batch)"));
}

namespace {

Policy to_policy(PlanPolicy p) {
  switch (p) {
    case PlanPolicy::dots: return policies::dots_saveable{};
    case PlanPolicy::dots_no_batch: return policies::dots_with_no_batch_dims_saveable{};
    default: return Policy{};  // nothing saveable
  }
}

// The policy for a call at `path` (nullopt or none: the call runs plainly).
using Rule = std::function<std::optional<PlanPolicy>(const std::vector<std::string>& path)>;

std::string prefix_at(const std::string& path, int depth) {
  if (path.empty() || depth <= 0) return {};
  std::size_t at = 0;
  for (int d = 0; d < depth; ++d) {
    const std::size_t slash = path.find('/', at);
    if (d + 1 == depth) return slash == std::string::npos ? path : path.substr(0, slash);
    if (slash == std::string::npos) return {};
    at = slash + 1;
  }
  return {};
}

}  // namespace

class PlanScope::Interceptor final : public linum::detail::CallInterceptor {
 public:
  explicit Interceptor(std::shared_ptr<const Rule> rule) : rule_(std::move(rule)) {}
  bool wants(const std::vector<std::string>& path, const std::string& /*type*/) const override {
    const auto p = (*rule_)(path);
    return p.has_value() && *p != PlanPolicy::none;
  }
  std::vector<Array> run(Scope& scope, const std::function<std::vector<Array>(Scope&)>& body) override {
    const PlanPolicy p = *(*rule_)(scope.path());
    // The body installs the same rule again, so its recomputation (which runs after this scope may
    // be gone) makes the same decisions for nested calls.
    detail::ScopedBody replayed = [rule = rule_, body](Scope& s) {
      Interceptor again(rule);
      linum::detail::CallInterceptorGuard installed(&again);
      return body(s);
    };
    CheckpointOptions options;
    options.policy = to_policy(p);
    return detail::lifted_run(scope, replayed, options, LiftFilters{}, {});
  }

 private:
  std::shared_ptr<const Rule> rule_;
};

namespace {

// A scope applying `rule` (the plan's, or a profiling run's uniform one).
class RuleScope {
 public:
  explicit RuleScope(Rule rule)
      : interceptor_(std::make_shared<const Rule>(std::move(rule))), guard_(&interceptor_) {}

 private:
  PlanScope::Interceptor interceptor_;
  linum::detail::CallInterceptorGuard guard_;
};

Rule plan_rule(const RematPlan& plan) {
  auto policies = std::make_shared<std::map<std::string, PlanPolicy>>();
  for (const auto& c : plan.calls) (*policies)[c.path] = c.policy;
  return [policies](const std::vector<std::string>& path) -> std::optional<PlanPolicy> {
    auto it = policies->find(linum::detail::join_module_path(path));
    if (it == policies->end()) return std::nullopt;
    return it->second;
  };
}

Rule uniform_rule(int depth, PlanPolicy p) {
  return [depth, p](const std::vector<std::string>& path) -> std::optional<PlanPolicy> {
    if (static_cast<int>(path.size()) != depth) return std::nullopt;
    return p;
  };
}

// What one profiling run (every candidate under one policy) says about each call.
struct RunProfile {
  std::vector<std::string> calls;    // candidate calls in forward order
  std::vector<std::int64_t> kept;    // per call
  std::vector<std::int64_t> own;     // per call: highest live bytes inside it minus earlier calls' kept
  std::vector<double> recompute;     // per call: recomputation time
  std::vector<std::int64_t> other;   // per j = 0..n: points between calls while calls < j keep their bytes
};

RunProfile analyse(const memory::Timeline& t, int depth) {
  RunProfile r;
  std::map<std::string, int> index;
  const auto& pts = t.points;
  std::vector<int> call_of(pts.size(), -1);
  for (std::size_t i = 0; i < pts.size(); ++i) {
    const std::string c = prefix_at(pts[i].path, depth);
    if (c.empty()) continue;
    auto it = index.find(c);
    if (it == index.end()) {
      if (pts[i].phase != "forward") continue;  // (only calls seen in the forward pass are candidates)
      it = index.emplace(c, static_cast<int>(r.calls.size())).first;
      r.calls.push_back(c);
    }
    call_of[i] = it->second;
  }
  const std::size_t n = r.calls.size();
  r.kept.assign(n, 0);
  r.own.assign(n, std::numeric_limits<std::int64_t>::min());
  r.recompute.assign(n, 0.0);
  r.other.assign(n + 1, std::numeric_limits<std::int64_t>::min());
  // kept: live bytes after the call's last forward point minus before its first.
  std::vector<std::ptrdiff_t> first(n, -1), last(n, -1);
  for (std::size_t i = 0; i < pts.size(); ++i)
    if (call_of[i] >= 0 && pts[i].phase == "forward") {
      const auto c = static_cast<std::size_t>(call_of[i]);
      if (first[c] < 0) first[c] = static_cast<std::ptrdiff_t>(i);
      last[c] = static_cast<std::ptrdiff_t>(i);
    }
  for (std::size_t c = 0; c < n; ++c)
    r.kept[c] = pts[static_cast<std::size_t>(last[c])].live_bytes - pts[static_cast<std::size_t>(first[c] - 1)].live_bytes;
  std::vector<std::int64_t> prefix(n + 1, 0);
  for (std::size_t c = 0; c < n; ++c) prefix[c + 1] = prefix[c] + r.kept[c];
  std::size_t forward_done = 0, backward_from = n;
  for (std::size_t i = 0; i < pts.size(); ++i) {
    const int c = call_of[i];
    const bool forward = pts[i].phase == "forward";
    std::size_t j;
    if (c >= 0) {
      j = static_cast<std::size_t>(c);
      if (forward) forward_done = std::max(forward_done, j + 1);
      else backward_from = std::min(backward_from, j);
    } else {
      j = forward ? forward_done : backward_from;
    }
    const std::int64_t own = pts[i].peak_bytes - prefix[j];
    if (c >= 0) {
      r.own[j] = std::max(r.own[j], own);
      if (pts[i].phase == "recomputation" && i > 0) r.recompute[j] += pts[i].seconds - pts[i - 1].seconds;
    } else {
      r.other[j] = std::max(r.other[j], own);
    }
  }
  return r;
}

struct Profile {
  int depth = 1;
  std::vector<PlanPolicy> policies;
  std::vector<RunProfile> runs;  // one per policy
  RunProfile other_source;       // the plain run (between-call points)
};

struct Solution {
  bool found = false;
  std::vector<PlanPolicy> choice;
  std::int64_t peak = 0;
  double time = 0;
};

// The DP over calls in order. States: Pareto front of (kept so far, time so far); the peak so far
// rides along (it only constrains, and later constraints depend on the kept bytes alone).
// `minimize_peak`: ignore the budget and find the smallest peak instead (for the error message).
Solution solve(const Profile& pr, std::int64_t budget, bool minimize_peak) {
  const std::size_t n = pr.other_source.calls.size();
  struct State {
    std::int64_t kept;
    double time;
    std::int64_t peak;
    int parent;
    int policy;
  };
  std::vector<std::vector<State>> layers(n + 1);
  const std::int64_t start_peak = pr.other_source.other[0];
  if (!minimize_peak && start_peak > budget) return {};
  layers[0].push_back({0, 0.0, start_peak, -1, -1});
  for (std::size_t c = 0; c < n; ++c) {
    std::vector<State> next;
    for (std::size_t si = 0; si < layers[c].size(); ++si) {
      const State& s = layers[c][si];
      for (std::size_t k = 0; k < pr.policies.size(); ++k) {
        const RunProfile& run = pr.runs[k];
        const std::int64_t kept = s.kept + run.kept[c];
        std::int64_t peak = std::max(s.peak, run.own[c] + s.kept);
        if (pr.other_source.other[c + 1] != std::numeric_limits<std::int64_t>::min())
          peak = std::max(peak, pr.other_source.other[c + 1] + kept);
        if (!minimize_peak && peak > budget) continue;
        next.push_back({kept, run.recompute[c] + s.time, peak, static_cast<int>(si), static_cast<int>(k)});
      }
    }
    // Pareto front: by kept ascending, keep a state only if it beats every state with fewer kept
    // bytes on the objective (time, or peak when minimizing the peak).
    auto objective = [&](const State& s) { return minimize_peak ? static_cast<double>(s.peak) : s.time; };
    std::sort(next.begin(), next.end(), [&](const State& a, const State& b) {
      if (a.kept != b.kept) return a.kept < b.kept;
      if (objective(a) != objective(b)) return objective(a) < objective(b);
      return a.peak < b.peak;
    });
    double best = std::numeric_limits<double>::infinity();
    for (const State& s : next)
      if (objective(s) < best) {
        layers[c + 1].push_back(s);
        best = objective(s);
      }
    if (layers[c + 1].empty()) return {};
  }
  const auto& last = layers[n];
  if (last.empty()) return {};
  std::size_t best = 0;
  for (std::size_t i = 1; i < last.size(); ++i) {
    const bool better = minimize_peak ? last[i].peak < last[best].peak
                                      : (last[i].time < last[best].time ||
                                         (last[i].time == last[best].time && last[i].peak < last[best].peak));
    if (better) best = i;
  }
  Solution sol{true, std::vector<PlanPolicy>(n), last[best].peak, last[best].time};
  int at = static_cast<int>(best);
  for (std::size_t c = n; c > 0; --c) {
    const State& s = layers[c][static_cast<std::size_t>(at)];
    sol.choice[c - 1] = pr.policies[static_cast<std::size_t>(s.policy)];
    at = s.parent;
  }
  return sol;
}

memory::Timeline record(const std::function<void()>& step, const Rule& rule, const std::string& label) {
  RuleScope scope(rule);
  memory::TimelineRecorder recorder(label);
  step();
  return recorder.finish();
}

Profile profile(const std::function<void()>& step, int depth, const PlanOptions& o) {
  Profile pr;
  pr.depth = depth;
  pr.policies = o.policies;
  if (std::find(pr.policies.begin(), pr.policies.end(), PlanPolicy::none) == pr.policies.end())
    pr.policies.insert(pr.policies.begin(), PlanPolicy::none);
  for (PlanPolicy p : pr.policies) {
    RunProfile best;
    for (int s = 0; s < std::max(1, o.profile_steps); ++s) {
      RunProfile r = analyse(record(step, uniform_rule(depth, p), plan_policy_name(p)), depth);
      if (s == 0) best = std::move(r);
      else
        for (std::size_t c = 0; c < best.recompute.size() && c < r.recompute.size(); ++c)
          best.recompute[c] = std::min(best.recompute[c], r.recompute[c]);
    }
    if (p == PlanPolicy::none) pr.other_source = best;
    else if (best.calls != pr.runs.front().calls)
      throw ValueError(linum::detail::cat("lift::plan_remat: the step made different module calls under policy ",
                                          plan_policy_name(p), " than without remat; the step must be deterministic"));
    pr.runs.push_back(std::move(best));
  }
  return pr;
}

RematPlan make_plan(const Profile& pr, const Solution& sol, std::int64_t budget) {
  RematPlan plan;
  plan.budget_bytes = budget;
  plan.depth = pr.depth;
  plan.predicted_peak_bytes = sol.peak;
  plan.predicted_extra_s = sol.time;
  for (std::size_t c = 0; c < sol.choice.size(); ++c) {
    const std::size_t k = static_cast<std::size_t>(
        std::find(pr.policies.begin(), pr.policies.end(), sol.choice[c]) - pr.policies.begin());
    plan.calls.push_back({pr.other_source.calls[c], sol.choice[c], pr.runs[k].kept[c], pr.runs[k].recompute[c]});
  }
  return plan;
}

std::int64_t measured_peak(const std::function<void()>& step, const Rule& rule) {
  RuleScope scope(rule);
  memory::PeakScope peak;
  step();
  return peak.peak_bytes();
}

}  // namespace

PlanScope::PlanScope(const RematPlan& plan)
    : interceptor_(std::make_unique<Interceptor>(std::make_shared<const Rule>(plan_rule(plan)))),
      guard_(std::make_unique<linum::detail::CallInterceptorGuard>(interceptor_.get())) {}
PlanScope::~PlanScope() = default;

RematPlan plan_remat(const std::function<void()>& step, std::int64_t budget_bytes, const PlanOptions& options) {
  if (budget_bytes <= 0) throw ValueError(linum::detail::cat("lift::plan_remat: budget_bytes must be positive, got ", budget_bytes));
  if (options.depths.empty()) throw ValueError("lift::plan_remat: options.depths is empty; give at least one depth (1: the top module's children)");
  step();  // warm-up: caches, lazily created state
  std::int64_t plain_peak = measured_peak(step, [](const std::vector<std::string>&) { return std::nullopt; });
  std::vector<Profile> profiles;
  for (int d : options.depths) {
    if (d < 1) throw ValueError(linum::detail::cat("lift::plan_remat: depth ", d, " is not >= 1"));
    profiles.push_back(profile(step, d, options));
    if (profiles.back().other_source.calls.empty()) profiles.pop_back();
  }
  if (profiles.empty())
    throw ValueError("lift::plan_remat: the step made no module calls at the given depths; nothing to remat (is the "
                     "model a module whose children are modules?)");
  std::int64_t target = budget_bytes;
  RematPlan best;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const Profile* chosen = nullptr;
    Solution sol;
    for (const Profile& pr : profiles) {
      Solution s = solve(pr, target, false);
      if (s.found && (!sol.found || s.time < sol.time || (s.time == sol.time && s.peak < sol.peak))) {
        sol = s;
        chosen = &pr;
      }
    }
    if (!sol.found) {
      std::int64_t smallest = std::numeric_limits<std::int64_t>::max();
      for (const Profile& pr : profiles) smallest = std::min(smallest, solve(pr, 0, true).peak);
      throw ValueError(linum::detail::cat(
          "lift::plan_remat: no plan keeps the step's peak within ", budget_bytes, " bytes (",
          static_cast<double>(budget_bytes) / 1048576.0, " MiB); the smallest peak a plan reaches is ", smallest,
          " bytes (", static_cast<double>(smallest) / 1048576.0, " MiB) against ", plain_peak,
          " without remat. Raise the budget, or let the planner remat finer or coarser calls (options.depths)"));
    }
    best = make_plan(*chosen, sol, budget_bytes);
    best.plain_peak_bytes = plain_peak;
    if (!options.verify) break;
    best.measured_peak_bytes = measured_peak(step, plan_rule(best));
    if (best.measured_peak_bytes <= budget_bytes) break;
    target -= best.measured_peak_bytes - budget_bytes;  // the model missed this much: plan with less
  }
  return best;
}

// ---- the plan as text and JSON -------------------------------------------------------------------

std::string RematPlan::str() const {
  std::ostringstream os;
  auto mib = [](std::int64_t b) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / 1048576.0);
    return std::string(buf);
  };
  os << "remat plan (depth " << depth << "): budget " << mib(budget_bytes) << ", predicted peak "
     << mib(predicted_peak_bytes);
  if (measured_peak_bytes > 0) os << ", measured " << mib(measured_peak_bytes);
  os << ", without remat " << mib(plain_peak_bytes) << ", predicted extra time " << predicted_extra_s * 1e3 << " ms\n";
  for (const auto& c : calls)
    os << "  " << c.path << ": " << plan_policy_name(c.policy) << " (keeps " << mib(c.kept_bytes)
       << (c.policy == PlanPolicy::none ? "" : ", recompute " + std::to_string(c.recompute_s * 1e3) + " ms") << ")\n";
  return os.str();
}

nlohmann::json RematPlan::to_json() const {
  nlohmann::json cs = nlohmann::json::array();
  for (const auto& c : calls)
    cs.push_back({{"path", c.path}, {"policy", plan_policy_name(c.policy)}, {"kept_bytes", c.kept_bytes},
                  {"recompute_s", c.recompute_s}});
  return {{"budget_bytes", budget_bytes},           {"predicted_peak_bytes", predicted_peak_bytes},
          {"measured_peak_bytes", measured_peak_bytes}, {"plain_peak_bytes", plain_peak_bytes},
          {"predicted_extra_s", predicted_extra_s}, {"depth", depth},
          {"calls", cs}};
}

RematPlan RematPlan::from_json(const nlohmann::json& j) {
  try {
    RematPlan p;
    p.budget_bytes = j.at("budget_bytes").get<std::int64_t>();
    p.predicted_peak_bytes = j.at("predicted_peak_bytes").get<std::int64_t>();
    p.measured_peak_bytes = j.value("measured_peak_bytes", std::int64_t{0});
    p.plain_peak_bytes = j.value("plain_peak_bytes", std::int64_t{0});
    p.predicted_extra_s = j.value("predicted_extra_s", 0.0);
    p.depth = j.value("depth", 1);
    for (const auto& c : j.at("calls"))
      p.calls.push_back({c.at("path").get<std::string>(), plan_policy_from_name(c.at("policy").get<std::string>()),
                         c.value("kept_bytes", std::int64_t{0}), c.value("recompute_s", 0.0)});
    return p;
  } catch (const nlohmann::json::exception& e) {
    throw ValueError(linum::detail::cat("lift::RematPlan::from_json: not a plan (", e.what(),
                                        "); expected {\"budget_bytes\", \"predicted_peak_bytes\", \"calls\": [{\"path\", "
                                        "\"policy\"}, ...]}"));
  }
}

void RematPlan::save_json(const std::filesystem::path& path) const {
  const std::string text = to_json().dump(1) + "\n";
  serialization::write_file_atomic(path, std::span(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()));
}

RematPlan RematPlan::load_json(const std::filesystem::path& path) {
  const auto bytes = serialization::read_file(path);
  const auto j = nlohmann::json::parse(bytes.begin(), bytes.end(), nullptr, false);
  if (j.is_discarded()) throw IoError(linum::detail::cat("lift::RematPlan::load_json: '", path.string(), "' is not JSON"));
  return from_json(j);
}

}  // namespace linum::lift
