// tabulate: a table of a model's submodules, as Flax's `Module.tabulate`.
//
//   std::cout << nn::tabulate(MLP{}, rng::Streams{{"params", rng::key(0)}, {"dropout", rng::key(1)}}, x, true);
//
// One row per module call: its path, type, output shape, the number of elements and bytes of the
// variables it owns directly, per collection ("params", "batch_stats", ...), and its activation
// bytes (the bytes of its output); then totals: every collection of the variable dict, and the
// activation bytes summed over the rows that call no submodule.
//
// It runs `init`, then applies the model once more with a module-call hook installed (see
// Scope), which sees every call with its path, type and output.
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
  std::string type;
  bool has_output = false;
  Shape output_shape;
  DType output_dtype = DType::f32;
};

// Observes the module calls on this thread while alive.
class Trace {
 public:
  Trace();
  ~Trace();
  Trace(const Trace&) = delete;
  Trace& operator=(const Trace&) = delete;
  // The module calls seen so far, in the order they started.
  const std::vector<Row>& rows() const;

 private:
  struct Observer;
  std::unique_ptr<Observer> observer_;
  std::unique_ptr<linum::detail::ModuleCallHookGuard> guard_;
};

// Formats the table. `root_output` is undefined when the root's output is not a single Array.
std::string render(const std::string& root_type, const Tree& variables, std::vector<Row> rows, const Array& root_output);

}  // namespace tabulate_detail

// The summary table of `module` run on `args` (see the file comment). `rngs` are the streams the
// model needs at init and in the traced call (as Flax's tabulate `rngs`).
template <class M, class... Args>
std::string tabulate(const M& module, const rng::Streams& rngs, const Args&... args) {
  Tree variables = init(module, rngs, args...);
  std::vector<tabulate_detail::Row> rows;
  Array root_output;
  {
    tabulate_detail::Trace trace;
    ApplyOptions options{.rngs = rngs, .all_mutable = true, .check_unused = false};
    auto result = apply(module, variables, options, args...);
    if constexpr (std::is_same_v<std::remove_cvref_t<decltype(result.first)>, Array>)
      root_output = result.first.detached();
    rows = trace.rows();
  }
  return tabulate_detail::render(module_type_name<M>(), variables, std::move(rows), root_output);
}

}  // namespace linum::nn
