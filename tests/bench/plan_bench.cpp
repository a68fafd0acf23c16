// linum-bench plan: lift::plan_remat on the deep MLP (L x (Dense(W) + GELU), loss mean(h * h)),
// against the uniform schedules a user would otherwise pick. The budget is the memory alive before
// a step (parameters, input) plus --budget-fraction of what a plain step adds on top (its
// activations and gradients). One JSON line: budget_bytes, predicted_peak_bytes,
// measured_peak_bytes (the planned step under the exact accounting), step_s_min,
// plain_step_s_min, plain_peak_bytes, uniform_schedule / uniform_step_s_min / uniform_peak_bytes
// (the fastest of: every layer rematted saving nothing, every layer saving its products, sqrt(L)
// rematted segments, that fits the same budget; null when none fits), uniform (all of them), and
// the plan's policy counts. --memory-plot FILE.svg overlays plain, the uniform schedules and the
// plan. Same flags as `linum-bench mlp` otherwise (--layers --width --batch --steps --threads).
#include "bench_util.hpp"

#include <nlohmann/json.hpp>

#include <cmath>
#include <functional>
#include <map>
#include <optional>

namespace linum_bench {
namespace {

struct Layer {
  std::int64_t width = 512;
  Array operator()(Scope& s, const Array& h) const { return gelu(s(nn::Dense{.features = width}, h)); }
};
struct Mlp {
  std::int64_t width = 512;
  int layers = 24;
  Array operator()(Scope& s, Array h) const {
    for (int i = 0; i < layers; ++i) h = s(Layer{width}, h);
    return h;
  }
};
// The same layers grouped into consecutive segments (for the sqrt(L) schedule).
struct Segment {
  std::int64_t width = 512;
  int layers = 5;
  Array operator()(Scope& s, Array h) const {
    for (int i = 0; i < layers; ++i) h = s(Layer{width}, h);
    return h;
  }
};
struct SegmentedMlp {
  std::int64_t width = 512;
  int layers = 24;
  Array operator()(Scope& s, Array h) const {
    const int per = static_cast<int>(std::ceil(static_cast<double>(layers) / std::floor(std::sqrt(static_cast<double>(layers)))));
    for (int first = 0; first < layers; first += per) h = s(Segment{width, std::min(per, layers - first)}, h);
    return h;
  }
};

struct Trial {
  std::string name;
  double step_s_min = 0;
  std::int64_t peak_bytes = 0;
  memory::Timeline timeline;
};

// Times `step` (min over `steps`), measures its exact peak and records its timeline, all under `plan`.
Trial run_trial(const std::string& name, const std::function<void()>& step, const lift::RematPlan* plan, long steps) {
  std::optional<lift::PlanScope> scope;
  if (plan != nullptr) scope.emplace(*plan);
  step();  // warm-up
  Trial t{name};
  t.step_s_min = 1e30;
  for (long s = 0; s < steps; ++s) {
    memory::PeakScope peak;
    const auto start = Clock::now();
    step();
    t.step_s_min = std::min(t.step_s_min, seconds_since(start));
    t.peak_bytes = std::max(t.peak_bytes, peak.peak_bytes());
  }
  memory::TimelineRecorder recorder(name);
  step();
  t.timeline = recorder.finish();
  return t;
}

// A plan that gives every call at depth 1 the same policy.
lift::RematPlan uniform_plan(const std::vector<std::string>& paths, lift::PlanPolicy p) {
  lift::RematPlan plan;
  for (const auto& path : paths) plan.calls.push_back({path, p, 0, 0.0});
  return plan;
}

}  // namespace

int bench_plan(const Flags& f) {
  const long L = f.get("layers", 24), W = f.get("width", 512), B = f.get("batch", 2048), steps = f.get("steps", 3);
  const double fraction = std::stod(f.text("budget-fraction", "0.5"));
  const int threads = static_cast<int>(f.get("threads", 2));
#ifdef _OPENMP
  omp_set_num_threads(threads);
#endif
  apply_engine_flag(f);
  const Mlp mlp{W, static_cast<int>(L)};
  const SegmentedMlp segmented{W, static_cast<int>(L)};
  const Array x = random_normal(Shape{B, W}, 7u, 1.0f);
  const Tree vars = init(mlp, rng::key(0), x);
  const Tree seg_vars = init(segmented, rng::key(0), x);
  auto step_of = [&](const auto& model, const Tree& v) {
    return std::function<void()>([&model, &v, &x] {
      (void)value_and_grad([&](const Tree& p) {
        const Array h = apply(model, Tree{{"params", p}}, x);
        return mean(h * h);
      })(v.at("params"));
    });
  };
  const std::function<void()> step = step_of(mlp, vars), seg_step = step_of(segmented, seg_vars);

  const Trial plain = run_trial("plain", step, nullptr, steps);
  step();
  const std::int64_t fixed = memory::stats().live_bytes;
  const std::int64_t budget = fixed + static_cast<std::int64_t>(fraction * static_cast<double>(plain.peak_bytes - fixed));

  std::vector<std::string> layer_paths, segment_paths;
  for (long i = 0; i < L; ++i) layer_paths.push_back("Layer_" + std::to_string(i));
  for (const auto& p : seg_vars.at("params").keys()) segment_paths.push_back(p);
  const lift::RematPlan every_full = uniform_plan(layer_paths, lift::PlanPolicy::full);
  const lift::RematPlan every_dots = uniform_plan(layer_paths, lift::PlanPolicy::dots);
  const lift::RematPlan sqrt_full = uniform_plan(segment_paths, lift::PlanPolicy::full);
  std::vector<Trial> uniform = {run_trial("every layer, full", step, &every_full, steps),
                                run_trial("every layer, dots", step, &every_dots, steps),
                                run_trial("sqrt(L) segments, full", seg_step, &sqrt_full, steps)};
  const Trial* best_uniform = nullptr;
  for (const Trial& t : uniform)
    if (t.peak_bytes <= budget && (best_uniform == nullptr || t.step_s_min < best_uniform->step_s_min)) best_uniform = &t;

  nlohmann::json out = {{"bench", "plan"},        {"layers", L},           {"width", W},
                        {"batch", B},             {"threads", threads},    {"steps", steps},
                        {"budget_fraction", fraction}, {"fixed_bytes", fixed}, {"budget_bytes", budget},
                        {"plain_peak_bytes", plain.peak_bytes}, {"plain_step_s_min", plain.step_s_min}};
  nlohmann::json uniform_json = nlohmann::json::array();
  for (const Trial& t : uniform)
    uniform_json.push_back({{"schedule", t.name}, {"step_s_min", t.step_s_min}, {"peak_bytes", t.peak_bytes},
                            {"fits", t.peak_bytes <= budget}});
  out["uniform"] = uniform_json;
  out["uniform_schedule"] = best_uniform ? nlohmann::json(best_uniform->name) : nlohmann::json(nullptr);
  out["uniform_step_s_min"] = best_uniform ? nlohmann::json(best_uniform->step_s_min) : nlohmann::json(nullptr);
  out["uniform_peak_bytes"] = best_uniform ? nlohmann::json(best_uniform->peak_bytes) : nlohmann::json(nullptr);
  std::vector<memory::Timeline> timelines = {plain.timeline};
  for (const Trial& t : uniform) timelines.push_back(t.timeline);
  try {
    const auto start = Clock::now();
    const lift::RematPlan plan = lift::plan_remat(step, budget, {});
    const double planning_s = seconds_since(start);
    const Trial planned = run_trial("planned", step, &plan, steps);
    std::map<std::string, int> counts;
    for (const auto& c : plan.calls) ++counts[lift::plan_policy_name(c.policy)];
    out["planning_s"] = planning_s;
    out["predicted_peak_bytes"] = plan.predicted_peak_bytes;
    out["measured_peak_bytes"] = planned.peak_bytes;
    out["within_budget"] = planned.peak_bytes <= budget;
    out["prediction_error"] = static_cast<double>(plan.predicted_peak_bytes - planned.peak_bytes) / static_cast<double>(planned.peak_bytes);
    out["step_s_min"] = planned.step_s_min;
    out["predicted_extra_s"] = plan.predicted_extra_s;
    out["plan"] = counts;
    timelines.push_back(planned.timeline);
  } catch (const ValueError& e) {
    out["error"] = e.what();
    out["measured_peak_bytes"] = nullptr;
    out["step_s_min"] = nullptr;
  }
  std::cout << out.dump() << std::endl;
  const std::string plot = f.text("memory-plot", "");
  if (!plot.empty()) {
    memory::save_svg(plot, timelines,
                     {.title = "Deep MLP (" + std::to_string(L) + " x Dense(" + std::to_string(W) + ") + GELU, batch " +
                               std::to_string(B) + "), budget " + std::to_string(budget >> 20) + " MiB: live memory over one step"});
    std::cerr << "wrote the memory timelines to " << plot << "\n";
  }
  return 0;
}

}  // namespace linum_bench
