// lift::RematScope: remat chosen at run time for module calls, without changing the model's code
// (the counterpart of keras.RematScope).
//
//   {
//     lift::RematScope remat({.mode = lift::RematMode::larger_than, .output_size_threshold = 1 << 16});
//     auto [loss, grads] = value_and_grad(loss_fn)(params);   // big-output modules are checkpointed
//   }
//
// While a RematScope is alive on a thread, every child module call (s(module, ...)) it selects runs
// as if wrapped in lift::remat (all collections and streams lifted, with the scope's policy):
//   full            every module call (nested calls too, as Keras: inner modules are checkpointed
//                   inside their checkpointed parents);
//   larger_than     calls whose outputs hold more than output_size_threshold elements in all
//                   (Keras counts elements, not bytes); decided after the call's forward pass;
//   list_of_layers  calls whose module name (e.g. "Dense_1") or path (e.g. "Block_0/Dense_1") is
//                   listed;
//   none            no remat (shadows an enclosing scope).
// Only the innermost scope counts. The decisions are replayed when a call is recomputed, so the
// recomputation is the original, bit for bit. Keras's "activations" mode has no counterpart here:
// activations are plain functions in Linum; wrap one with linum::checkpoint if you want that.
#pragma once

#include <linum/lift/policies.hpp>
#include <linum/modules/scope.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace linum::lift {

namespace detail {
struct LayerMatches;
class RematRuleScope;
}  // namespace detail

enum class RematMode { none, full, larger_than, list_of_layers };

struct RematScopeOptions {
  RematMode mode = RematMode::full;
  std::int64_t output_size_threshold = 1024;  // elements, summed over a call's outputs (larger_than)
  std::vector<std::string> layer_names;       // module names or paths (list_of_layers)
  Policy policy;                              // what checkpointed calls may save (default: nothing)
};

class RematScope {
 public:
  explicit RematScope(RematScopeOptions options = {});
  ~RematScope();
  RematScope(const RematScope&) = delete;
  RematScope& operator=(const RematScope&) = delete;

  const RematScopeOptions& options() const;
  // list_of_layers: the listed names that have matched no module call so far. When the scope ends
  // after module calls with names still unmatched, a warning (core/warnings.hpp) names them.
  std::vector<std::string> unmatched_layer_names() const;

 private:
  std::shared_ptr<const RematScopeOptions> options_;
  std::shared_ptr<detail::LayerMatches> matches_;
  std::unique_ptr<detail::RematRuleScope> scope_;  // the rule these options make (remat_rule.hpp)
};

}  // namespace linum::lift
