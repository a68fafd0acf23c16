// checkpoint (alias remat): rematerialization of plain functions, as jax.checkpoint.
//
//   auto block = [](const Array& x, const Array& w) { return gelu(matmul(x, w)); };
//   auto remat_block = linum::checkpoint(block);                      // nothing_saveable
//   auto dots_block = linum::checkpoint(block, {.policy = policies::dots_saveable{}});
//   Array y = remat_block(x, w);                                      // same value as block(x, w)
//
// In the forward pass a checkpointed call keeps only its inputs (and what its policy saves); its
// intermediate values are freed when it returns. When the backward pass reaches it, it runs the
// function again on the same inputs, bit for bit as the first time, and differentiates that
// recomputation. Arrays the function captures (e.g. weights in a lambda) are found automatically
// and receive gradients too. Arguments may be Arrays, Trees, vectors/pairs/tuples of them, or any
// other value (passed through unchanged: non-array arguments are static by type).
//
// The recomputation runs during the backward pass, usually after the function that made the
// checkpointed call has returned: a lambda must capture the arrays it reads by value ([=], or
// [w] for a weight), never by reference to a local that is gone by then.
#pragma once

#include <linum/core/autodiff/graph.hpp>
#include <linum/core/autodiff/flat_call.hpp>
#include <linum/core/autodiff/pytree.hpp>
#include <linum/lift/policies.hpp>

#include <cstdint>
#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace linum::lift {

struct CheckpointOptions {
  // What may be kept instead of recomputed (default: nothing but the inputs).
  Policy policy;
  // Array arguments (counted from 0, the first argument) that are not differentiated: they are
  // treated as constants, like jax.checkpoint's static_argnums for arrays. Non-array arguments are
  // always static. Negative or out-of-range indices are an error.
  std::vector<int> static_argnums;
  // Parity with jax.checkpoint. prevent_cse guards against compiler common-subexpression
  // elimination of the recomputation; eager C++ has no such compiler, so it changes nothing.
  // (Flax's `concrete` has no counterpart: every value is concrete here, and JAX dropped it.)
  bool prevent_cse = true;
  // Check that the recomputation reproduces the original outputs bit for bit, and throw an
  // AutodiffError naming the block if not (catches non-deterministic user code).
  bool verify = false;
};

// Counters of rematerialization work (process-wide).
struct RecomputeStats {
  std::int64_t checkpointed_calls = 0;  // forward passes through a checkpoint
  std::int64_t recomputations = 0;      // backward passes that re-ran a checkpointed block
  std::int64_t ops_recomputed = 0;      // ops computed again during recomputations
  std::int64_t ops_replayed = 0;        // ops that reused their saved output instead of computing it
  std::int64_t ops_eliminated = 0;      // ops left out: only saved values needed them (dead code)
  std::int64_t values_saved = 0;        // values kept by policies in forward passes
  std::int64_t full_reruns = 0;         // recomputations run again in full because a left-out
                                        // value was read outside the graph (see below)
};
RecomputeStats recompute_stats();
void reset_recompute_stats();

namespace detail {

using Thunk = std::function<std::vector<Array>()>;

// Runs `forward` as a checkpointed block named `where` (a module path, or "checkpoint"). Returns
// its flattened outputs, attached to one checkpoint node whose backward pass calls `recompute` (which
// must compute the same outputs from the same inputs) and differentiates that. `held` lists the
// arrays the recomputation keeps alive (for saved_residuals).
// `keep_plain(outputs)`, if given and true after the forward pass, keeps the block's own graph
// (no checkpoint node: the block behaves as if it were not checkpointed). `arguments`, if given,
// are the stored arguments `recompute` reads: under a policy that offloads inputs
// (Policy::offloads_inputs) their arrays go to the spill file until the recomputation.
std::vector<Array> run_checkpointed(const Thunk& forward, Thunk recompute, const CheckpointOptions& options,
                                    std::string where, std::vector<Array> held,
                                    const std::function<bool(const std::vector<Array>&)>& keep_plain = nullptr,
                                    std::shared_ptr<pytree::StoredArguments> arguments = nullptr);

void check_static_argnums(const std::vector<int>& argnums, std::size_t num_args);

template <class T>
T as_static(const T& value) {
  if constexpr (std::is_same_v<T, Array>) return value.detached();
  else if constexpr (std::is_same_v<T, Tree>) return tree_map([](const Array& a) { return a.detached(); }, value);
  else return value;
}

template <class Tuple, std::size_t... Is>
Tuple make_static(Tuple t, const std::vector<int>& argnums, std::index_sequence<Is...>) {
  auto apply_one = [&](auto& v, std::size_t i) {
    if (std::find(argnums.begin(), argnums.end(), static_cast<int>(i)) != argnums.end()) v = as_static(v);
  };
  (apply_one(std::get<Is>(t), Is), ...);
  return t;
}

}  // namespace detail

// A checkpointed function (see checkpoint()).
template <class F>
class Checkpointed {
 public:
  Checkpointed(F f, CheckpointOptions options) : f_(std::move(f)), options_(std::move(options)) {}

  template <class... Args>
  auto operator()(const Args&... args) const {
    detail::check_static_argnums(options_.static_argnums, sizeof...(Args));
    using Stored = std::tuple<std::decay_t<Args>...>;
    using Out = std::decay_t<std::invoke_result_t<const F&, const std::decay_t<Args>&...>>;
    const pytree::FlatCall<Out, std::decay_t<Args>...> call(
        detail::make_static(Stored(args...), options_.static_argnums, std::index_sequence_for<Args...>{}));
    auto run = call.body([f = f_](const auto&... a) { return f(a...); });
    return call.rebuild(detail::run_checkpointed(run, run, options_, "checkpoint", call.argument_arrays(), nullptr, call.arguments()));
  }

 private:
  F f_;
  CheckpointOptions options_;
};

}  // namespace linum::lift

namespace linum {

// Wraps `f` so that calls to it are checkpointed (see the header comment of lift/checkpoint.hpp).
template <class F>
lift::Checkpointed<F> checkpoint(F f, lift::CheckpointOptions options = {}) {
  return lift::Checkpointed<F>(std::move(f), std::move(options));
}

// The same as checkpoint (JAX's and Flax's other name for it). For modules, see lift::remat<M>.
template <class F>
lift::Checkpointed<F> remat(F f, lift::CheckpointOptions options = {}) {
  return lift::Checkpointed<F>(std::move(f), std::move(options));
}

}  // namespace linum
