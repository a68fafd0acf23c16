// The one implementation of run-time remat for module calls: lift::RematScope (Keras's modes) and
// lift::PlanScope (a planner's per-path policies) are both a rule from a call's module path to a
// decision, installed as a module-call hook.
//
//   RematRuleScope scope([](const std::vector<std::string>& path) -> std::optional<RematDecision> {
//     if (path.size() == 1) return RematDecision{.policy = policies::dots_saveable{}};
//     return std::nullopt;                    // plain
//   });
//
// A call the rule selects runs as lift::remat would run it (all collections and streams lifted,
// with the decision's policy). Its body installs the same rule again, so a recomputation (which
// runs when the scope may be long gone) makes the same decisions for nested calls, bit for bit.
#pragma once

#include <linum/lift/policies.hpp>
#include <linum/modules/scope.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace linum::lift::detail {

// What a rule decides for a module call: checkpoint it with `policy`; `keep_plain`, when set, looks
// at the call's outputs after its forward pass and may decide that it stays plain after all.
struct RematDecision {
  Policy policy;
  std::function<bool(const std::vector<Array>& outputs)> keep_plain;
};

// The decision for the call at `path` (nullopt: the call runs plainly). Called once per call.
using RematRule = std::function<std::optional<RematDecision>(const std::vector<std::string>& path)>;

// The module-call hook (modules/scope.hpp) a rule makes: it takes over the child calls the rule
// selects. Only the innermost rule hook of a thread decides (an inner RematScope shadows an outer
// one, as Keras's).
class RematRuleHook final : public linum::detail::ModuleCallHook {
 public:
  explicit RematRuleHook(std::shared_ptr<const RematRule> rule) : rule_(std::move(rule)) {}
  bool wants(const linum::detail::ModuleCall& call) const override;
  std::vector<Array> around(Scope& scope, const linum::detail::ModuleCall& call, const linum::detail::ModuleCallBody& next,
                            const linum::detail::ModuleCallBody& body) override;

 private:
  std::shared_ptr<const RematRule> rule_;
  // wants() decides, around() (called later for the same call) uses the decision.
  mutable std::optional<RematDecision> pending_;
};

// Installs a rule for the module calls of this thread while alive (the innermost scope counts).
class RematRuleScope {
 public:
  explicit RematRuleScope(RematRule rule);
  RematRuleScope(const RematRuleScope&) = delete;
  RematRuleScope& operator=(const RematRuleScope&) = delete;

 private:
  RematRuleHook hook_;
  linum::detail::ModuleCallHookGuard guard_;
};

}  // namespace linum::lift::detail
