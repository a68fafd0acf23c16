// tabulate: a table of a model's submodules, as Flax's `Module.tabulate`.
//
//   std::cout << nn::tabulate(MLP{}, rng::Streams{{"params", rng::key(0)}, {"dropout", rng::key(1)}}, x, true);
//
// One row per module call: its path, type, output shape, the number of elements and bytes of the
// variables it owns directly, per collection ("params", "batch_stats", ...), and its activation
// bytes (the bytes of its output); then totals: every collection of the variable dict, and the
// activation bytes summed over the rows that call no submodule.
//
// How it works (Scope has no hook for observing child calls): the model is initialised with
// `init`, then applied once more to those variables with every float32 variable and input made a
// differentiation leaf and an autodiff record hook installed. Each recorded op is attributed to
// the module whose body is running (detail::current_module_path()), and a module's output is the
// last value its body (or its children) computed before control returned to its parent. Limits
// that follow from this, and that a Scope hook would remove:
//   * a module that computes nothing from its inputs or variables (e.g. deterministic Dropout,
//     which returns its input) gets no row unless it owns variables, and its output is unknown;
//   * the type column is known for the root and inferred from auto-names ("Dense_0" -> Dense);
//     explicitly named children (e.g. "query", "layers_0") show no type;
//   * two calls of the same explicit name with nothing in between show as one row.
// The root's output is always exact.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/autodiff/graph.hpp>
#include <linum/core/tree.hpp>
#include <linum/modules/module.hpp>
#include <linum/modules/scope.hpp>
#include <linum/rng/streams.hpp>

#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace linum::nn {

namespace tabulate_detail {

// One traced module call.
struct Row {
  std::vector<std::string> path;
  bool has_output = false;
  Shape output_shape;
  DType output_dtype = DType::f32;
};

// Observes the ops recorded on this thread while alive and groups them into module calls.
class Trace {
 public:
  Trace();
  ~Trace();
  Trace(const Trace&) = delete;
  Trace& operator=(const Trace&) = delete;
  // The module calls seen so far, in the order they started.
  const std::vector<Row>& rows() const;

 private:
  struct Hook;
  std::unique_ptr<Hook> hook_;
};

// The float32 input arrays become differentiation leaves (so every op depending on them is
// recorded); other arguments pass through unchanged.
template <class T>
decltype(auto) track_arg(T&& arg) {
  if constexpr (std::is_same_v<std::remove_cvref_t<T>, Array>)
    return arg.dtype() == DType::f32 ? autodiff::make_leaf(arg) : arg;
  else
    return std::forward<T>(arg);
}

// Formats the table. `root_output` is undefined when the root's output is not a single Array.
std::string render(const std::string& root_type, const Tree& variables, std::vector<Row> rows, const Array& root_output);

}  // namespace tabulate_detail

// The summary table of `module` run on `args` (see the file comment). `rngs` are the streams the
// model needs at init and in the traced call (as Flax's tabulate `rngs`).
template <class M, class... Args>
std::string tabulate(const M& module, const rng::Streams& rngs, const Args&... args) {
  Tree variables = init(module, rngs, args...);
  Tree tracked = Differentiable<Tree>::track(variables);
  std::vector<tabulate_detail::Row> rows;
  Array root_output;
  {
    tabulate_detail::Trace trace;
    ApplyOptions options{.rngs = rngs, .all_mutable = true, .check_unused = false};
    auto result = apply(module, tracked, options, tabulate_detail::track_arg(args)...);
    if constexpr (std::is_same_v<std::remove_cvref_t<decltype(result.first)>, Array>)
      root_output = result.first.detached();
    rows = trace.rows();
  }
  return tabulate_detail::render(module_type_name<M>(), variables, std::move(rows), root_output);
}

}  // namespace linum::nn
