// policies::split_batch(n, p) at run time: a module call run on n consecutive slices of its batch,
// each slice a lifted call under p, the outputs joined along axis 0 (lift/remat_rule.cpp calls it
// for the calls a RematScope or PlanScope gives such a policy).
#pragma once

#include <linum/lift/checkpoint.hpp>
#include <linum/lift/remat.hpp>

#include <memory>
#include <vector>

namespace linum::lift::detail {

// `next` runs the call (forward pass), `replay` the module alone (recomputations); both read the
// arguments in `call.arguments`, which this swaps for each slice's.
std::vector<Array> run_batch_split(Scope& scope, const linum::detail::ModuleCall& call, const ScopedBody& next,
                                   const ScopedBody& replay, const Policy& policy);

}  // namespace linum::lift::detail
