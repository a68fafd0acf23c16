// FlatCall: one call of a function on stored arguments, seen as a flat list of output arrays. This
// is the form checkpoints, lifted transforms and call interceptors pass a call around in (and run
// again for recomputations); the first run's output gives the structure rebuild() restores.
//
//   pytree::FlatCall<Out, std::decay_t<Args>...> call(std::tuple(args...));
//   auto run = call.body<Scope&>([](Scope& s, const auto&... a) { return f(s, a...); });
//   std::vector<Array> flat = transform(run, call.argument_arrays());   // runs `run` once or more
//   Out out = call.rebuild(flat);
#pragma once

#include <linum/core/autodiff/pytree.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

namespace linum::pytree {

// The arrays among a stored call's arguments, which their holder can take out and put back: a
// checkpoint that keeps its inputs in the spill file takes them from its recomputation's arguments
// after the forward pass and puts them back (read from the file) just before it recomputes.
class StoredArguments {
 public:
  virtual ~StoredArguments() = default;
  // The argument arrays (in flatten order); the arguments then hold undefined arrays in their place.
  virtual std::vector<Array> take() = 0;
  // Puts arrays back, one per array take() returned, in the same order.
  virtual void put_back(std::span<const Array> arrays) = 0;
};

template <class Out, class... Args>
class FlatCall {
 public:
  explicit FlatCall(std::tuple<Args...> args) : state_(std::make_shared<State>(std::move(args))) {}

  // A body that calls f(context..., stored args...) and returns the output's arrays. Copies share
  // the stored arguments, so a recomputation may run long after the caller returned.
  template <class... Context, class F>
  std::function<std::vector<Array>(Context...)> body(F f) const {
    return [f = std::move(f), state = state_](Context... context) {
      Out out = std::apply([&](const auto&... a) -> Out { return f(context..., a...); }, *state->args);
      std::vector<Array> flat = pytree::flatten(out);
      if (state->first_run) {  // only the first run's structure is kept: a recomputation's output
        state->first_run = false;  // must not stay alive (it holds the recomputed graph)
        state->like.emplace(std::move(out));
      }
      return flat;
    };
  }

  // The arrays among the stored arguments (what a recomputation keeps alive).
  std::vector<Array> argument_arrays() const {
    std::vector<Array> out;
    std::apply([&](const auto&... a) { (pytree::flatten_into(a, out), ...); }, *state_->args);
    return out;
  }

  // The stored arguments, for a holder that keeps their arrays elsewhere between runs.
  std::shared_ptr<StoredArguments> arguments() const { return state_; }

  // The first run's output with its arrays replaced by `flat`; forgets that output.
  Out rebuild(std::span<const Array> flat) const {
    Out out = pytree::rebuild(*state_->like, flat);
    state_->like.reset();
    return out;
  }

 private:
  struct State final : StoredArguments {
    explicit State(std::tuple<Args...> a) : args(std::in_place, std::move(a)) {}
    std::vector<Array> take() override {
      std::vector<Array> out;
      pytree::flatten_into(*args, out);
      const std::vector<Array> holes(out.size());
      put_back(holes);
      return out;
    }
    void put_back(std::span<const Array> arrays) override {
      std::tuple<Args...> rebuilt = pytree::rebuild(*args, arrays);
      args.emplace(std::move(rebuilt));  // (emplace: argument types need not be assignable)
    }
    std::optional<std::tuple<Args...>> args;
    std::optional<Out> like;
    bool first_run = true;
  };
  std::shared_ptr<State> state_;
};

}  // namespace linum::pytree
