// Checkpointing schedules for a chain of steps (a scan): which steps keep their input carry, and
// which are recomputed when the backward pass reaches them.
//
//   none       every step's activations kept (fastest, memory grows with the length L);
//   every      each step checkpointed: L carries kept, one extra forward per step;
//   sqrt       sqrt(L) segments checkpointed (Chen et al. 2016): about 2 sqrt(L) carries;
//   binomial   Griewank & Walther's binomial checkpointing (Revolve) with `snapshots` carries: at
//              most that many carries alive at once, and the minimal number of extra step
//              evaluations for that budget, t(L, s) = r L - C(s + r, s + 1) with r the smallest
//              integer such that L <= C(s + r, s).
//
// The schedule is realised with nested checkpoints: a range of steps [a, b) with s snapshots runs
// [a, m) as a checkpoint (recursively, with s snapshots when it is recomputed) and [m, b) with s - 1,
// m chosen by Griewank's recurrence T(l, s) = min_m [m + T(m, s) + T(l - m, s - 1)]. Gradients are
// bitwise those of the plain chain.
#pragma once

#include <linum/core/autodiff/pytree.hpp>
#include <linum/lift/checkpoint.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace linum::lift {

struct ScanSchedule {
  enum class Kind { none, every, sqrt, binomial };
  Kind kind = Kind::none;
  int snapshots = 0;  // binomial: carries alive at once (at least 1)

  static ScanSchedule every_step() { return {Kind::every, 0}; }
  static ScanSchedule sqrt_segments() { return {Kind::sqrt, 0}; }
  static ScanSchedule binomial(int snapshots) { return {Kind::binomial, snapshots}; }
  std::string name() const;
};

// Griewank's minimal number of extra step evaluations to reverse `steps` steps with `snapshots`
// carries (beyond the one forward pass): t(l, s) = r l - C(s + r, s + 1).
std::int64_t binomial_extra_steps(std::int64_t steps, int snapshots);

// Step evaluations so far by run_steps (process-wide): the forward pass's and the recomputations'.
std::int64_t step_evaluations();
void reset_step_evaluations();

namespace detail {

// For `steps` steps and `snapshots` carries: the length of the first part, the one checkpointed.
std::int64_t binomial_split(std::int64_t steps, int snapshots);
void count_step_evaluation();
void check_schedule(const ScanSchedule& schedule, std::int64_t steps);

// Runs steps [a, b) of `step` (carry = step(i, carry)) under `schedule` with `snapshots` carries.
template <class Carry, class Step>
Carry run_range(const std::shared_ptr<const Step>& step, const ScanSchedule& schedule, std::int64_t a, std::int64_t b,
                int snapshots, const Carry& carry);

// Runs [a, b) as one checkpointed block whose body is run_range(a, b, snapshots).
template <class Carry, class Step>
Carry checkpointed_range(const std::shared_ptr<const Step>& step, const ScanSchedule& schedule, std::int64_t a,
                         std::int64_t b, int snapshots, const Carry& carry) {
  auto body = [step, schedule, a, b, snapshots, carry] {
    return pytree::flatten(run_range<Carry, Step>(step, schedule, a, b, snapshots, carry));
  };
  std::vector<Array> flat = run_checkpointed(body, body, CheckpointOptions{}, linum::detail::cat("scan steps [", a, ", ", b, ")"),
                                             pytree::flatten(carry));
  return pytree::rebuild(carry, std::span<const Array>(flat));
}

template <class Carry, class Step>
Carry run_range(const std::shared_ptr<const Step>& step, const ScanSchedule& schedule, std::int64_t a, std::int64_t b,
                int snapshots, const Carry& carry) {
  using Kind = ScanSchedule::Kind;
  const std::int64_t n = b - a;
  if (n <= 0) return carry;
  if (n == 1) {
    count_step_evaluation();
    return (*step)(a, carry);
  }
  switch (schedule.kind) {
    case Kind::none:
      break;
    case Kind::every:
    case Kind::sqrt: {  // segments of 1 or ceil(sqrt(n)) steps, each checkpointed, plain inside
      std::int64_t per = 1;
      if (schedule.kind == Kind::sqrt)
        while (per * per < n) ++per;
      Carry h = carry;
      for (std::int64_t i = a; i < b; i += per) h = checkpointed_range(step, ScanSchedule{}, i, std::min(b, i + per), 0, h);
      return h;
    }
    case Kind::binomial: {
      const std::int64_t m = binomial_split(n, snapshots);
      Carry h = checkpointed_range(step, schedule, a, a + m, snapshots, carry);
      return run_range(step, schedule, a + m, b, snapshots - 1, h);
    }
  }
  Carry h = carry;  // plain: every step's activations kept
  for (std::int64_t i = a; i < b; ++i) {
    count_step_evaluation();
    h = (*step)(i, h);
  }
  return h;
}

}  // namespace detail

// carry = step(i, carry) for i = 0 .. steps - 1, checkpointed by `schedule`. `step` is copied and
// kept for the recomputations.
template <class Carry, class Step>
Carry run_steps(std::int64_t steps, const Carry& carry, Step step, const ScanSchedule& schedule) {
  detail::check_schedule(schedule, steps);
  auto shared = std::make_shared<const Step>(std::move(step));
  return detail::run_range<Carry, Step>(shared, schedule, 0, steps, schedule.snapshots, carry);
}

}  // namespace linum::lift
