// lift::remat's lifted call: the module runs on the state lift::Pack selects, as a checkpointed
// block whose recomputations start from the state on entry; its writes are published once.
#include <linum/lift/remat.hpp>

namespace linum::lift::detail {

std::vector<Array> lifted_run(Scope& s, const ScopedBody& body, const CheckpointOptions& options,
                              const LiftFilters& filters, std::vector<Array> held,
                              const std::function<bool(const std::vector<Array>&)>& keep_plain,
                              std::shared_ptr<pytree::StoredArguments> arguments) {
  return lifted_run(s, body, body, options, filters, std::move(held), keep_plain, std::move(arguments));
}

std::vector<Array> lifted_run(Scope& s, const ScopedBody& body_once, ScopedBody body, const CheckpointOptions& options,
                              const LiftFilters& filters, std::vector<Array> held,
                              const std::function<bool(const std::vector<Array>&)>& keep_plain,
                              std::shared_ptr<pytree::StoredArguments> arguments) {
  const Pack pack(s, filters, "lift::remat");
  ScopeState forward_state = pack.fresh();
  auto base = std::make_shared<ScopeState>();
  auto forward = [&] {
    Scope inner(forward_state, pack.path());
    return body_once(inner);
  };
  auto recompute = [body = std::move(body), base, path = pack.path()] {
    ScopeState state = *base;  // a fresh copy each time: writes made while recomputing are dropped
    Scope inner(state, path);
    linum::detail::ModulePathGuard where(&inner.path());
    return body(inner);
  };
  for (const Array& v : pack.variable_leaves()) held.push_back(v);
  std::vector<Array> flat = run_checkpointed(forward, recompute, options, s.path_str(), std::move(held), keep_plain, std::move(arguments));
  *base = pack.replay_base(forward_state);
  pack.publish(forward_state);
  return flat;
}

}  // namespace linum::lift::detail
