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
#include <tuple>
#include <type_traits>
#include <utility>
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

// What steps [a, b) produce: the carry after them and each step's output y (in step order). Steps
// that return only a carry have Y = std::tuple<> (no arrays).
template <class Carry, class Y>
struct RangeResult {
  Carry carry;
  std::vector<Y> ys;
};

// Runs steps [a, b) of `step` ((carry, y) = step(i, carry)) under `schedule` with `snapshots`
// carries.
template <class Carry, class Y, class Step>
RangeResult<Carry, Y> run_range(const std::shared_ptr<const Step>& step, const ScanSchedule& schedule, std::int64_t a,
                                std::int64_t b, int snapshots, const Carry& carry);

// Runs [a, b) as one checkpointed block whose body is run_range(a, b, snapshots): its outputs are
// the final carry and every step's y, its only saved input the carry it starts from.
template <class Carry, class Y, class Step>
RangeResult<Carry, Y> checkpointed_range(const std::shared_ptr<const Step>& step, const ScanSchedule& schedule,
                                         std::int64_t a, std::int64_t b, int snapshots, const Carry& carry) {
  // The ys' structure, taken from the forward run (the recomputations leave it alone, so no array
  // of theirs stays referenced here).
  struct Structure {
    bool taken = false;
    std::vector<Y> ys;
  };
  auto structure = std::make_shared<Structure>();
  auto body = [step, schedule, a, b, snapshots, carry, structure] {
    RangeResult<Carry, Y> r = run_range<Carry, Y, Step>(step, schedule, a, b, snapshots, carry);
    std::vector<Array> flat = pytree::flatten(r.carry);
    for (const Y& y : r.ys)
      for (Array& leaf : pytree::flatten(y)) flat.push_back(std::move(leaf));
    if (!structure->taken) {
      structure->taken = true;
      structure->ys = std::move(r.ys);
    }
    return flat;
  };
  std::vector<Array> flat = run_checkpointed(body, body, CheckpointOptions{}, linum::detail::cat("scan steps [", a, ", ", b, ")"),
                                             pytree::flatten(carry));
  const std::size_t carry_leaves = pytree::flatten(carry).size();
  RangeResult<Carry, Y> out{pytree::rebuild(carry, std::span<const Array>(flat.data(), carry_leaves)), {}};
  std::size_t at = carry_leaves;
  for (const Y& like : structure->ys) {
    const std::size_t leaves = pytree::flatten(like).size();
    out.ys.push_back(pytree::rebuild(like, std::span<const Array>(flat.data() + at, leaves)));
    at += leaves;
  }
  structure->ys.clear();
  return out;
}

template <class Carry, class Y, class Step>
RangeResult<Carry, Y> run_range(const std::shared_ptr<const Step>& step, const ScanSchedule& schedule, std::int64_t a,
                                std::int64_t b, int snapshots, const Carry& carry) {
  using Kind = ScanSchedule::Kind;
  const std::int64_t n = b - a;
  RangeResult<Carry, Y> out{carry, {}};
  auto append = [&out](RangeResult<Carry, Y>&& part) {
    out.carry = std::move(part.carry);
    for (Y& y : part.ys) out.ys.push_back(std::move(y));
  };
  if (n <= 0) return out;
  if (n == 1) {
    count_step_evaluation();
    auto [h, y] = (*step)(a, carry);
    out.carry = std::move(h);
    out.ys.push_back(std::move(y));
    return out;
  }
  switch (schedule.kind) {
    case Kind::none:
      break;
    case Kind::every:
    case Kind::sqrt: {  // segments of 1 or ceil(sqrt(n)) steps, each checkpointed, plain inside
      std::int64_t per = 1;
      if (schedule.kind == Kind::sqrt)
        while (per * per < n) ++per;
      for (std::int64_t i = a; i < b; i += per)
        append(checkpointed_range<Carry, Y, Step>(step, ScanSchedule{}, i, std::min(b, i + per), 0, out.carry));
      return out;
    }
    case Kind::binomial: {
      const std::int64_t m = binomial_split(n, snapshots);
      append(checkpointed_range<Carry, Y, Step>(step, schedule, a, a + m, snapshots, carry));
      append(run_range<Carry, Y, Step>(step, schedule, a + m, b, snapshots - 1, out.carry));
      return out;
    }
  }
  for (std::int64_t i = a; i < b; ++i) {  // plain: every step's activations kept
    count_step_evaluation();
    auto [h, y] = (*step)(i, out.carry);
    out.carry = std::move(h);
    out.ys.push_back(std::move(y));
  }
  return out;
}

}  // namespace detail

// carry = step(i, carry) for i = 0 .. steps - 1, checkpointed by `schedule`. `step` is copied and
// kept for the recomputations.
template <class Carry, class Step>
Carry run_steps(std::int64_t steps, const Carry& carry, Step step, const ScanSchedule& schedule) {
  detail::check_schedule(schedule, steps);
  auto with_no_y = [step = std::move(step)](std::int64_t i, const Carry& h) { return std::make_pair(step(i, h), std::tuple<>{}); };
  using Wrapped = decltype(with_no_y);
  auto shared = std::make_shared<const Wrapped>(std::move(with_no_y));
  return detail::run_range<Carry, std::tuple<>, Wrapped>(shared, schedule, 0, steps, schedule.snapshots, carry).carry;
}

// (carry, y_i) = step(i, carry) for i = 0 .. steps - 1, checkpointed by `schedule`: the final carry
// and the ys in step order. A checkpointed range of steps outputs its ys with its carry (they are
// the scan's results, kept anyway) and saves only the carry it starts from.
template <class Carry, class Step>
auto run_steps_with_ys(std::int64_t steps, const Carry& carry, Step step, const ScanSchedule& schedule) {
  using Y = typename std::decay_t<decltype(step(std::int64_t{0}, carry))>::second_type;
  detail::check_schedule(schedule, steps);
  auto shared = std::make_shared<const Step>(std::move(step));
  detail::RangeResult<Carry, Y> r = detail::run_range<Carry, Y, Step>(shared, schedule, 0, steps, schedule.snapshots, carry);
  return std::make_pair(std::move(r.carry), std::move(r.ys));
}

}  // namespace linum::lift
