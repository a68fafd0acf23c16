#include <linum/lift/remat_rule.hpp>

#include <linum/lift/remat.hpp>

namespace linum::lift::detail {

bool RematRuleInterceptor::wants(const std::vector<std::string>& path, const std::string& /*type*/) const {
  pending_ = (*rule_)(path);
  return pending_.has_value();
}

std::vector<Array> RematRuleInterceptor::run(Scope& scope, const std::function<std::vector<Array>(Scope&)>& body) {
  RematDecision decision = pending_ ? std::move(*pending_) : RematDecision{};
  pending_.reset();
  ScopedBody replayed = [rule = rule_, body](Scope& s) {
    RematRuleInterceptor again(rule);
    linum::detail::CallInterceptorGuard installed(&again);
    return body(s);
  };
  CheckpointOptions options;
  options.policy = std::move(decision.policy);
  return lifted_run(scope, replayed, options, LiftFilters{}, {}, decision.keep_plain);
}

RematRuleScope::RematRuleScope(RematRule rule)
    : interceptor_(std::make_shared<const RematRule>(std::move(rule))), guard_(&interceptor_) {}

}  // namespace linum::lift::detail
