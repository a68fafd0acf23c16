// vmap: a function written for one example, run on a batch of them at once, as jax.vmap.
//
//   auto f = [](const Array& x, const Array& w) { return tanh(matmul(x, w)); };  // x: [K], one example
//   Array ys = linum::vmap(f, {.in_axes = {0, std::nullopt}})(xs, w);           // xs: [B, K] -> [B, N]
//   auto per_example = linum::vmap(linum::grad(loss), {.in_axes = {std::nullopt, 0, 0}});  // per-example gradients
//   Array g = linum::grad([&](const Array& w) { return sum(linum::vmap(f, {.in_axes = {0, std::nullopt}})(xs, w)); })(w);
//
// Arguments and results are pytrees (Array, Tree, std::vector/pair/tuple, registered structs);
// other arguments pass through unchanged. Inside, every mapped array shows one example's shape
// (core/batch_levels.hpp) while its buffer holds the batch, and each op applies its batching rule:
// the same computation on the whole batch (a batched product, the levels folded into a
// convolution's images, ...). An op without a rule runs once per example, stacked, and says so once;
// reading one example's value (item(), to_vector()) inside is a BatchingError, never a silent
// wrong result.
//
// Composes as JAX's: grad inside vmap differentiates each example on its own (per-example
// gradients), grad of vmap differentiates the batched computation, checkpoint/remat inside vmap
// recompute the batched block, and vmap nests (each level its own leading axis).
#pragma once

#include <linum/core/autodiff/pytree.hpp>
#include <linum/core/batch_levels.hpp>
#include <linum/core/error.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace linum {

struct VmapOptions {
  // The mapped axis of each argument (one entry per argument, or one for all; empty: 0 for all);
  // std::nullopt: the argument is the same for every example. Applies to every array in the
  // argument's pytree. Negative axes count from the end.
  std::vector<std::optional<int>> in_axes;
  // Where the batch axis goes in each result array (one entry for all, or one per array of the
  // result in flatten order; empty: 0). std::nullopt: the result must not depend on the example
  // (returned once).
  std::vector<std::optional<int>> out_axes;
  // The number of examples; required when no argument is mapped, checked against them otherwise.
  std::optional<std::int64_t> axis_size;
};

namespace transforms::detail {

// The arrays of argument `arg` of a vmapped call, each batched at `level` along `axis` (or left
// alone when `axis` is nullopt). Checks ranks and sizes; `size` is set by the first mapped array and
// checked against the others.
void batch_arguments(std::vector<Array>& arrays, std::optional<int> axis, std::size_t arg, std::optional<std::int64_t>& size);
// Makes `arrays` (batched at `level`, with `outer` the levels open outside) the vmapped function's
// results: the level's axis moved to each one's out axis.
void unbatch_results(std::vector<Array>& arrays, const std::vector<std::optional<int>>& out_axes, const BatchLevel& level);
// The batch level of one vmapped call.
BatchLevel open_level(std::int64_t size);
// `a` (validated by batch_arguments) batched at `level` along its axis `axis`.
Array batch_at(const Array& a, int axis, const BatchLevel& level);

template <class F>
struct Vmapped {
  F f;
  VmapOptions options;

  template <class... Args>
  auto operator()(const Args&... args) const {
    constexpr std::size_t n = sizeof...(Args);
    if (options.in_axes.size() > 1 && options.in_axes.size() != n)
      throw ValueError(linum::detail::cat("vmap: in_axes has ", options.in_axes.size(), " entries for ", n,
                                          " arguments; give one per argument or one for all"));
    auto axis_of = [&](std::size_t i) -> std::optional<int> {
      if (options.in_axes.empty()) return 0;
      return options.in_axes.size() == 1 ? options.in_axes[0] : options.in_axes[i];
    };
    std::optional<std::int64_t> size;
    std::array<std::vector<Array>, n> flat{pytree::flatten(args)...};
    for (std::size_t i = 0; i < n; ++i) batch_arguments(flat[i], axis_of(i), i, size);
    if (!size && !options.axis_size)
      throw ValueError("vmap: no argument is mapped (every in_axes entry is std::nullopt, or no array); give axis_size");
    if (size && options.axis_size && *size != *options.axis_size)
      throw BatchingError(linum::detail::cat("vmap: axis_size is ", *options.axis_size, " but the mapped arguments have ", *size,
                                             " examples"));
    const std::int64_t examples = size ? *size : *options.axis_size;
    const BatchLevel level = open_level(examples);
    // The arguments batched at the new level (their mapped axis moved behind the outer levels).
    auto batched = [&]<std::size_t... Is>(std::index_sequence<Is...>) {
      for (std::size_t i = 0; i < n; ++i)
        if (const std::optional<int> axis = axis_of(i))
          for (Array& a : flat[i])
            if (a.defined()) a = batch_at(a, *axis, level);
      return std::tuple<std::decay_t<Args>...>{pytree::rebuild(args, std::span<const Array>(flat[Is]))...};
    }(std::index_sequence_for<Args...>{});
    auto result = [&] {
      linum::detail::OpenBatchLevels::Entry open(level);
      return std::apply(f, batched);
    }();
    std::vector<Array> outs = pytree::flatten(result);
    unbatch_results(outs, options.out_axes, level);
    return pytree::rebuild(result, std::span<const Array>(outs));
  }
};

}  // namespace transforms::detail

// vmap(f, options)(args...): f mapped over a batch axis of its arguments (see the header comment).
template <class F>
auto vmap(F f, VmapOptions options = {}) {
  return transforms::detail::Vmapped<F>{std::move(f), std::move(options)};
}

}  // namespace linum
