#include <linum/lift/batch_split.hpp>

#include <linum/core/ops/shape_ops.hpp>
#include <linum/lift/pack.hpp>

#include <algorithm>

namespace linum::lift::detail {
namespace {

// One slice's arguments. The call's stored arguments hold one set at a time: a slice installs
// its own before its body runs (the forward pass, and each recomputation), and a checkpoint that
// offloads its inputs takes and puts back these, not the call's.
class SliceArguments final : public pytree::StoredArguments {
 public:
  SliceArguments(std::shared_ptr<pytree::StoredArguments> call, std::vector<Array> arrays)
      : call_(std::move(call)), arrays_(std::move(arrays)) {}
  std::vector<Array> take() override {
    std::vector<Array> out = std::move(arrays_);
    arrays_.assign(out.size(), Array());
    (void)call_->take();  // the call's arguments hold this slice's only while it runs
    return out;
  }
  void put_back(std::span<const Array> arrays) override { arrays_.assign(arrays.begin(), arrays.end()); }
  void install() const { call_->put_back(arrays_); }

 private:
  std::shared_ptr<pytree::StoredArguments> call_;
  std::vector<Array> arrays_;
};

std::string where(const linum::detail::ModuleCall& call) { return linum::detail::join_module_path(call.path); }

// What only a whole batch may do, seen from the call's scope: the collections it may update other
// than params (batch statistics), by buffer, and the random-number counters (dropout masks).
struct BatchEffects {
  std::vector<const void*> updatable;
  RngCounters counters;
  bool operator==(const BatchEffects&) const = default;
};
BatchEffects effects_at(Scope& scope) {
  const Pack pack(scope, LiftFilters{}, "policies::split_batch");
  BatchEffects e;
  for (const auto& [collection, sub] : pack.variables())
    if (collection != "params" && pack.is_mutable(collection))
      for (const Array& a : leaves(sub)) e.updatable.push_back(a.buffer_identity());
  e.counters = pack.counters();
  return e;
}

}  // namespace

std::vector<Array> run_batch_split(Scope& scope, const linum::detail::ModuleCall& call, const ScopedBody& next,
                                   const ScopedBody& replay, const Policy& policy) {
  const Policy& each = *policy.split_policy();
  CheckpointOptions options;
  options.policy = each;
  // The slicing and joining belong to the call (memory timelines and the planner charge them to it).
  const linum::detail::ModulePathGuard at_call(&call.path);
  const std::vector<Array> all = call.arguments->take();
  // The batch: the rows of the first array argument; arguments with as many rows are sliced, the
  // others (masks, positions) reach every slice whole.
  std::int64_t rows = -1;
  for (const Array& a : all)
    if (a.defined() && a.rank() >= 1) {
      rows = a.dim(0);
      break;
    }
  const std::int64_t n = std::min<std::int64_t>(policy.batch_splits(), std::max<std::int64_t>(rows, 1));
  if (rows < 0 || n <= 1) {  // nothing to split: the call runs under `each` whole
    call.arguments->put_back(all);
    return lifted_run(scope, next, replay, options, LiftFilters{}, {}, nullptr, call.arguments);
  }
  const BatchEffects before = effects_at(scope);
  std::vector<std::vector<Array>> outs;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t lo = rows * i / n, hi = rows * (i + 1) / n;
    std::vector<Array> slice(all.size());
    for (std::size_t j = 0; j < all.size(); ++j)
      slice[j] = all[j].defined() && all[j].rank() >= 1 && all[j].dim(0) == rows ? slice_axis(all[j], 0, lo, hi) : all[j];
    auto args = std::make_shared<SliceArguments>(call.arguments, std::move(slice));
    args->install();
    const ScopedBody slice_replay = [replay, args](Scope& s) {
      args->install();
      return replay(s);
    };
    outs.push_back(lifted_run(scope, next, slice_replay, options, LiftFilters{}, {}, nullptr, args));
    if (i == 0 && !(effects_at(scope) == before)) {
      call.arguments->put_back(all);
      throw ValueError(linum::detail::cat("policies::split_batch: the call at '", where(call),
                                          "' updates a collection other than params (batch statistics) or draws random "
                                          "numbers (dropout); on slices of the batch those would not be the whole batch's. "
                                          "Give this call a policy without split_batch"));
    }
  }
  call.arguments->put_back(all);
  std::vector<Array> joined(outs.front().size());
  for (std::size_t k = 0; k < joined.size(); ++k) {
    std::vector<Array> parts;
    for (std::int64_t i = 0; i < n; ++i) {
      const Array& o = outs[static_cast<std::size_t>(i)][k];
      const std::int64_t want = rows * (i + 1) / n - rows * i / n;
      if (!o.defined() || o.rank() < 1 || o.dim(0) != want)
        throw ValueError(linum::detail::cat("policies::split_batch: output ", k, " of the call at '", where(call), "' has shape ",
                                            o.defined() ? o.shape() : Shape{}, " for a slice of ", want, " of its ", rows,
                                            " rows; only calls whose outputs have a row per example can be split (give this "
                                            "call another policy)"));
      parts.push_back(o);
    }
    joined[k] = concatenate(parts, 0);
  }
  return joined;
}

}  // namespace linum::lift::detail
