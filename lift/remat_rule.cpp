#include <linum/lift/remat_rule.hpp>

#include <linum/lift/batch_split.hpp>
#include <linum/lift/remat.hpp>

namespace linum::lift::detail {

bool RematRuleHook::wants(const linum::detail::ModuleCall& call) const {
  if (call.kind != linum::detail::ModuleCall::Kind::child) return false;
  // Only the innermost rule counts.
  for (auto* e = linum::detail::ContextStack<linum::detail::ModuleCallHookContext>::innermost(); e != nullptr; e = e->below())
    if (dynamic_cast<const RematRuleHook*>(e->value()) != nullptr) {
      if (e->value() != this) return false;
      break;
    }
  pending_ = (*rule_)(call.path);
  return pending_.has_value();
}

std::vector<Array> RematRuleHook::around(Scope& scope, const linum::detail::ModuleCall& call,
                                         const linum::detail::ModuleCallBody& next, const linum::detail::ModuleCallBody& body) {
  RematDecision decision = pending_ ? std::move(*pending_) : RematDecision{};
  pending_.reset();
  // The recomputation runs the module alone with the same rule installed again, so nested calls
  // are decided as in the forward pass (which runs `next`: the hooks inside this one, then the
  // module, with this rule still installed).
  ScopedBody replay = [rule = rule_, body](Scope& s) {
    RematRuleHook again(rule);
    linum::detail::ModuleCallHookGuard installed(&again);
    return body(s);
  };
  if (decision.policy.batch_splits() > 1 && call.arguments) return run_batch_split(scope, call, next, replay, decision.policy);
  CheckpointOptions options;
  options.policy = std::move(decision.policy);
  return lifted_run(scope, next, std::move(replay), options, LiftFilters{}, {}, decision.keep_plain, call.arguments);
}

RematRuleScope::RematRuleScope(RematRule rule)
    : hook_(std::make_shared<const RematRule>(std::move(rule))), guard_(&hook_) {}

}  // namespace linum::lift::detail
