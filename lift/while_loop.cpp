// lift::while_loop's state handling: the keys and variables of each iteration's cond and body, what
// carries over, and what the loop publishes.
#include <linum/lift/while_loop.hpp>

#include <linum/core/error.hpp>
#include <linum/rng/key.hpp>

#include <algorithm>
#include <cmath>

namespace linum::lift::detail {
namespace {

bool listed(const std::vector<std::string>& v, std::string_view x) { return std::find(v.begin(), v.end(), x) != v.end(); }

}  // namespace

WhileLoopRun::WhileLoopRun(Scope& s, WhileLoopOptions options) : path_(s.path()), options_(std::move(options)) {
  if (options_.max_steps < 0)
    fail(linum::detail::cat("max_steps is ", options_.max_steps, "; use 0 for no bound or a positive number of iterations"));
  pack_.emplace(s, LiftFilters{}, "lift::while_loop");
  creates_ = s.is_initializing();
  variables_ = pack_->variables();
  for (const std::string& stream : pack_->streams().names()) {
    bool split = options_.split_rngs.empty();
    if (!options_.split_rngs.empty()) {
      auto it = options_.split_rngs.find(stream);
      if (it == options_.split_rngs.end()) continue;  // not lifted into the loop
      split = it->second;
    }
    (split ? split_ : unchanged_).emplace_back(stream, pack_->streams().at(stream));
  }
  if (!options_.split_rngs.empty()) {
    visible_streams_.emplace();
    for (const auto& [stream, _] : options_.split_rngs) visible_streams_->insert(stream);
  }
  entry_counters_ = body_counters_ = end_counters_ = pack_->counters();
  caller_names_ = body_names_ = end_names_ = Pack::auto_names(s);
  streams_where_ = linum::detail::cat("lift::while_loop at '", linum::detail::join_module_path(path_), "' (split_rngs)");
  fix_read_only();
}

void WhileLoopRun::fail(const std::string& what) const {
  throw ValueError(linum::detail::cat("lift::while_loop at '", path_.empty() ? std::string("<root>") : linum::detail::join_module_path(path_),
                                      "': ", what));
}

void WhileLoopRun::take_created(const ScopeState& created) {
  variables_ = Pack::variables_of(pack_->replay_base(created));
  fix_read_only();
}

void WhileLoopRun::fix_read_only() {
  // Fixed for the loop unless a collection appears: computed here, not per iteration.
  cond_read_only_.clear();
  body_read_only_.clear();
  std::vector<std::string> fixed;
  for (const auto& [collection, _] : variables_) fixed.push_back(collection);
  if (!listed(fixed, "intermediates")) fixed.push_back("intermediates");  // sow skips it, as Flax's
  for (const std::string& c : fixed) {
    cond_read_only_.push_back(c);
    if (!listed(options_.carry_variables, c))
      body_read_only_.emplace_back(c, linum::detail::cat("lift::while_loop shares collection '", c,
                                                         "' read-only across its iterations; list it in carry_variables "
                                                         "for each iteration to see the previous one's writes"));
  }
}

ScopeState WhileLoopRun::iteration_state(std::int64_t i, bool cond, const RngCounters& counters) const {
  // Flax's keys: fold_in(K, i) for the body, fold_in(K, -i) for cond (as 32-bit data).
  const auto data = static_cast<std::uint32_t>(cond ? -i : i);
  rng::Streams streams;
  for (const auto& [stream, key] : split_) streams.set(stream, rng::fold_in(key, data));
  for (const auto& [stream, key] : unchanged_) streams.set(stream, key);
  ScopeState st = pack_->state_on(variables_, std::move(streams), counters, visible_streams_, streams_where_);
  Pack::stop_initializing(st);
  if (cond)
    Pack::make_read_only(st, cond_read_only_, "a lift::while_loop's cond may not write variables (it decides, the body acts)");
  else
    for (const auto& [c, why] : body_read_only_) Pack::make_read_only(st, {c}, why);
  return st;
}

ScopeState WhileLoopRun::cond_state(std::int64_t i) const { return iteration_state(i, true, entry_counters_); }
ScopeState WhileLoopRun::body_state(std::int64_t i) const { return iteration_state(i, false, body_counters_); }

void WhileLoopRun::name_cond(Scope& cond_scope) const { Pack::set_auto_names(cond_scope, caller_names_); }
void WhileLoopRun::name_body(Scope& body_scope) const { Pack::set_auto_names(body_scope, body_names_); }

void WhileLoopRun::after_cond(const Scope& cond_scope, const ScopeState& st) {
  Pack::add_reads(reads_, st);
  if (ran_cond_) return;
  ran_cond_ = true;
  body_counters_ = Pack::counters_of(st);
  body_names_ = Pack::auto_names(cond_scope);
}

void WhileLoopRun::after_body(const Scope& body_scope, const ScopeState& st, BodyRunKind kind) {
  if (kind == BodyRunKind::recompute) return;
  Pack::add_reads(reads_, st);
  if (!ran_body_) {
    ran_body_ = true;
    end_counters_ = Pack::counters_of(st);
    end_names_ = Pack::auto_names(body_scope);
  }
  bool appeared = false;
  for (const auto& [collection, tree] : Pack::variables_of(st)) {
    if (listed(options_.carry_variables, collection)) {
      if (kind != BodyRunKind::forward) continue;
      appeared = appeared || !variables_.contains(collection);
      variables_[collection] = tree;  // the next iteration starts from these
    } else if (!variables_.contains(collection)) {
      fail(linum::detail::cat("an iteration created collection '", collection,
                              "', which the loop does not carry; list it in carry_variables (its variables must "
                              "exist before the loop: init creates them in its first run of the body)"));
    }
  }
  if (appeared) fix_read_only();  // cond may not write it either
}

bool WhileLoopRun::holds(const Array& pred) const {
  if (!pred.defined()) fail("cond returned an undefined array");
  if (!pred.batch_levels().empty())
    fail(linum::detail::cat("cond returned a batched value (one per member of a lift::vmap, logical shape ", pred.shape(),
                            "); a loop decides once per call, so reduce it (e.g. any()) first"));
  if (pred.numel() != 1)
    fail(linum::detail::cat("cond returned an array of shape ", pred.shape(), "; return a bool or a scalar"));
  const double v = pred.dtype() == DType::i32 ? pred.data_i32()[0] : pred.item();
  if (std::isnan(v)) fail("cond returned NaN");
  return v != 0;
}

void WhileLoopRun::check_step(std::int64_t i) const {
  if (options_.max_steps > 0 && i >= options_.max_steps)
    fail(linum::detail::cat("cond still holds after max_steps = ", options_.max_steps,
                            " iterations; raise max_steps or check the condition"));
}

void WhileLoopRun::check_carry_leaves(std::int64_t i, const std::vector<Array>& before, const std::vector<Array>& after) const {
  if (before.size() != after.size())
    fail(linum::detail::cat("iteration ", i, " returned a carry with ", after.size(), " arrays instead of ", before.size(),
                            "; the body must keep the carry's structure"));
  for (std::size_t k = 0; k < before.size(); ++k)
    if (!(before[k].shape() == after[k].shape()) || before[k].dtype() != after[k].dtype())
      fail(linum::detail::cat("iteration ", i, " turned carry leaf ", k, " ", before[k].type_str(), " into ",
                              after[k].type_str(), "; the body must keep the carry's shapes and dtypes"));
}

void WhileLoopRun::finish(Scope& s) {
  pack_->publish(variables_, end_counters_, {&reads_});
  Pack::set_auto_names(s, end_names_);
}

}  // namespace linum::lift::detail
