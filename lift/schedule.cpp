#include <linum/lift/schedule.hpp>

#include <atomic>
#include <limits>
#include <map>
#include <mutex>

namespace linum::lift {
namespace {

std::atomic<std::int64_t> g_evaluations{0};

// Griewank's recurrence T(l, s) = min_m [m + T(m, s) + T(l - m, s - 1)], T(1, s) = 0,
// T(l, 1) = l (l - 1) / 2, with the minimizing m, for l <= steps (computed once per (steps, s)).
struct Table {
  std::vector<std::vector<std::int64_t>> cost, split;  // [s][l]
};

const Table& table_for(std::int64_t steps, int snapshots) {
  static std::mutex mutex;
  static std::map<std::pair<std::int64_t, int>, Table> tables;
  std::lock_guard<std::mutex> lock(mutex);
  auto key = std::make_pair(steps, snapshots);
  if (auto it = tables.find(key); it != tables.end()) return it->second;
  Table t;
  t.cost.assign(static_cast<std::size_t>(snapshots) + 1, std::vector<std::int64_t>(static_cast<std::size_t>(steps) + 1, 0));
  t.split = t.cost;
  for (std::int64_t l = 1; l <= steps; ++l) {
    t.cost[1][static_cast<std::size_t>(l)] = l * (l - 1) / 2;
    t.split[1][static_cast<std::size_t>(l)] = l - 1;
  }
  for (int s = 2; s <= snapshots; ++s)
    for (std::int64_t l = 2; l <= steps; ++l) {
      std::int64_t best = std::numeric_limits<std::int64_t>::max(), arg = 1;
      for (std::int64_t m = 1; m < l; ++m) {
        const std::int64_t c = m + t.cost[static_cast<std::size_t>(s)][static_cast<std::size_t>(m)] +
                               t.cost[static_cast<std::size_t>(s - 1)][static_cast<std::size_t>(l - m)];
        if (c < best) best = c, arg = m;
      }
      t.cost[static_cast<std::size_t>(s)][static_cast<std::size_t>(l)] = best;
      t.split[static_cast<std::size_t>(s)][static_cast<std::size_t>(l)] = arg;
    }
  return tables.emplace(key, std::move(t)).first->second;
}

std::int64_t choose(std::int64_t n, std::int64_t k) {  // C(n, k), exact for the sizes used here
  if (k < 0 || k > n) return 0;
  std::int64_t r = 1;
  for (std::int64_t i = 1; i <= k; ++i) r = r * (n - k + i) / i;
  return r;
}

}  // namespace

std::string ScanSchedule::name() const {
  switch (kind) {
    case Kind::none: return "none";
    case Kind::every: return "every";
    case Kind::sqrt: return "sqrt";
    case Kind::binomial: return "binomial";
  }
  return "?";
}

std::int64_t binomial_extra_steps(std::int64_t steps, int snapshots) {
  if (steps <= 1) return 0;
  std::int64_t r = 1;
  while (choose(snapshots + r, snapshots) < steps) ++r;
  return r * steps - choose(snapshots + r, snapshots + 1);
}

std::int64_t step_evaluations() { return g_evaluations.load(); }
void reset_step_evaluations() { g_evaluations = 0; }

namespace detail {

void count_step_evaluation() { g_evaluations.fetch_add(1, std::memory_order_relaxed); }

std::int64_t binomial_split(std::int64_t steps, int snapshots) {
  if (snapshots <= 1) return steps - 1;
  return table_for(steps, snapshots).split[static_cast<std::size_t>(snapshots)][static_cast<std::size_t>(steps)];
}

void check_schedule(const ScanSchedule& schedule, std::int64_t steps) {
  if (schedule.kind == ScanSchedule::Kind::binomial && schedule.snapshots < 1)
    throw ValueError(linum::detail::cat("scan schedule binomial: snapshots must be at least 1, got ", schedule.snapshots,
                                        " (the carries kept alive at once)"));
  if (schedule.kind == ScanSchedule::Kind::binomial && steps > 100000)
    throw ValueError(linum::detail::cat("scan schedule binomial: ", steps, " steps is more than this planner handles (100000)"));
}

}  // namespace detail
}  // namespace linum::lift
