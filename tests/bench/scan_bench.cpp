// linum-bench scan: the deep-MLP training step (L x (Dense(W) + GELU), loss mean(h * h)) written as
// one lift::scan over a block, under a checkpointing schedule (lift/schedule.hpp). One JSON line:
// layers, width, batch, schedule, snapshots, step_s_min, step_s_median (forward and backward with
// respect to the parameters), peak_activation_bytes (exact accounting, in a step differentiated
// with respect to the input only, so the parameters' per-layer gradients do not hide the
// activations; the scan hands each layer a view of its stacked parameters, no copy), recomputed_steps (block evaluations beyond the forward's L per
// step), griewank_min (binomial_extra_steps(L, S) for binomial), bitwise_equal_to_plain (the
// gradients against the same scan without a schedule, computed in the same run).
#include "bench_util.hpp"

#include <nlohmann/json.hpp>

namespace linum_bench {
namespace {

struct MlpBlock {
  std::int64_t width = 512;
  Array operator()(Scope& s, const Array& h) const { return gelu(s(nn::Dense{.features = width}, h)); }
};

struct ScannedMlp {
  std::int64_t width = 512;
  int layers = 24;
  lift::ScanSchedule schedule;
  Array operator()(Scope& s, const Array& x) const {
    return s(lift::scan<MlpBlock>{.body = {width}, .length = layers, .schedule = schedule}, x);
  }
};

lift::ScanSchedule parse_schedule(const std::string& name, int snapshots) {
  if (name == "none") return {};
  if (name == "every") return lift::ScanSchedule::every_step();
  if (name == "sqrt") return lift::ScanSchedule::sqrt_segments();
  if (name == "binomial") return lift::ScanSchedule::binomial(snapshots);
  throw ValueError("--schedule must be none, every, sqrt or binomial, got '" + name + "'");
}

}  // namespace

int bench_scan(const Flags& f) {
  const long L = f.get("layers", 24), W = f.get("width", 512), B = f.get("batch", 2048), steps = f.get("steps", 3);
  const int snapshots = static_cast<int>(f.get("snapshots", 4));
  const int threads = static_cast<int>(f.get("threads", 2));
#ifdef _OPENMP
  omp_set_num_threads(threads);
#endif
  apply_engine_flag(f);
  const lift::ScanSchedule schedule = parse_schedule(f.text("schedule", "binomial"), snapshots);
  const Array x = random_normal(Shape{B, W}, 7u, 1.0f);
  const ScannedMlp plain{.width = W, .layers = static_cast<int>(L)};
  const Tree params = init(plain, rng::key(0), x).at("params");
  auto step_with = [&](const lift::ScanSchedule& sch) {
    return value_and_grad([&](const Tree& p) {
      return mean(square(apply(ScannedMlp{.width = W, .layers = static_cast<int>(L), .schedule = sch}, Tree{{"params", p}}, x)));
    })(params);
  };
  const auto [v_ref, g_ref] = step_with({});  // also the warm-up
  const Tree no_params{{"params", params}};
  std::int64_t peak_activation = 0;
  {
    memory::PeakScope scope;
    auto gx = grad([&](const Array& in) {
      return mean(square(apply(ScannedMlp{.width = W, .layers = static_cast<int>(L), .schedule = schedule}, no_params, in)));
    })(x);
    peak_activation = scope.peak_growth() - static_cast<std::int64_t>(gx.nbytes());
  }
  std::vector<double> times;
  std::int64_t recomputed = 0;
  bool equal = true;
  for (long s = 0; s < steps; ++s) {
    lift::reset_step_evaluations();
    const auto t = Clock::now();
    auto [v, g] = step_with(schedule);
    times.push_back(seconds_since(t));
    const std::int64_t evaluations = lift::step_evaluations();
    recomputed = schedule.kind == lift::ScanSchedule::Kind::none ? 0 : evaluations - L;
    equal = equal && v.bitwise_equal(v_ref) && bitwise_equal(g, g_ref);
  }
  std::sort(times.begin(), times.end());
  nlohmann::json out = {
      {"bench", "scan"},
      {"layers", L},
      {"width", W},
      {"batch", B},
      {"threads", threads},
      {"steps", steps},
      {"schedule", schedule.name()},
      {"snapshots", schedule.kind == lift::ScanSchedule::Kind::binomial ? snapshots : 0},
      {"step_s_min", times.front()},
      {"step_s_median", times[times.size() / 2]},
      {"peak_activation_bytes", peak_activation},
      {"recomputed_steps", recomputed},
      {"bitwise_equal_to_plain", equal},
  };
  if (schedule.kind == lift::ScanSchedule::Kind::binomial) out["griewank_min"] = lift::binomial_extra_steps(L, snapshots);
  std::cout << out.dump() << std::endl;
  return 0;
}

}  // namespace linum_bench
