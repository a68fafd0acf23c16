#include <linum/core/debug_nans.hpp>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace linum {
namespace detail {

namespace {
int from_environment() {
  auto on = [](const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr && std::strcmp(v, "") != 0 && std::strcmp(v, "0") != 0;
  };
  return (on("LINUM_DEBUG_NANS") ? 1 : 0) | (on("LINUM_DEBUG_INFS") ? 2 : 0);
}

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::forward: return "the forward pass";
    case Phase::backward: return "the backward pass";
    case Phase::recomputation: return "the recomputation of a checkpointed block";
  }
  return "?";
}
}  // namespace

std::atomic<int> g_debug_nonfinite{from_environment()};

Phase current_phase() {
  const Phase* p = ContextStack<PhaseContext>::top();
  return p != nullptr ? *p : Phase::forward;
}

namespace {
// The index of the first value the enabled checks forbid, or -1.
std::int64_t first_forbidden(const Array& out, int mode) {
  if (mode == 0 || !out.defined() || !is_floating(out.dtype())) return -1;
  const std::vector<float> v = out.to_vector();
  for (std::size_t i = 0; i < v.size(); ++i)
    if ((std::isnan(v[i]) && (mode & 1)) || (std::isinf(v[i]) && (mode & 2))) return static_cast<std::int64_t>(i);
  return -1;
}
std::string bad_value(const Array& out, std::int64_t i) {
  const float v = out.to_vector()[static_cast<std::size_t>(i)];
  return std::isnan(v) ? "NaN" : (v > 0 ? "inf" : "-inf");
}
const char* check_name(const Array& out, std::int64_t i) {
  return std::isnan(out.to_vector()[static_cast<std::size_t>(i)]) ? "nans" : "infs";
}
}  // namespace

void check_finite(const Array& out, const char* op, int input_index, std::span<const Array* const> inputs) {
  const std::int64_t i = first_forbidden(out, g_debug_nonfinite.load(std::memory_order_relaxed));
  if (i < 0) return;
  std::string ins;
  for (const Array* a : inputs)
    if (a != nullptr && a->defined()) ins += (ins.empty() ? "" : ", ") + a->type_str();
  const std::string what = input_index < 0 ? cat("op '", op, "' produced ")
                                           : cat("the backward rule of op '", op, "' produced, as the gradient of its input ",
                                                 input_index, ", ");
  throw FloatingPointError(cat("debug_", check_name(out, i), ": ", what, bad_value(out, i), " in ", phase_name(current_phase()), " (",
                               out.type_str(), ", first at flat index ", i,
                               ins.empty() ? std::string() : cat("; inputs ", ins),
                               "). Look at that op's inputs; set_debug_nans(false) turns the check off"));
}

void check_module_outputs(std::span<const Array> outs) {
  const int mode = g_debug_nonfinite.load(std::memory_order_relaxed);
  for (std::size_t k = 0; k < outs.size(); ++k) {
    const std::int64_t i = first_forbidden(outs[k], mode);
    if (i < 0) continue;
    throw FloatingPointError(cat("debug_", check_name(outs[k], i), ": output ", k, " of this module holds ",
                                 bad_value(outs[k], i), " (", outs[k].type_str(), ", first at flat index ", i,
                                 "), and no module inside it returned one. Ops that run outside differentiation are "
                                 "checked per module, not per op: run the same call under value_and_grad to name the op"));
  }
}

}  // namespace detail

void set_debug_nans(bool on) {
  if (on) detail::g_debug_nonfinite.fetch_or(1);
  else detail::g_debug_nonfinite.fetch_and(~1);
}
void set_debug_infs(bool on) {
  if (on) detail::g_debug_nonfinite.fetch_or(2);
  else detail::g_debug_nonfinite.fetch_and(~2);
}
bool debug_nans() { return (detail::g_debug_nonfinite.load() & 1) != 0; }
bool debug_infs() { return (detail::g_debug_nonfinite.load() & 2) != 0; }

DebugNansScope::DebugNansScope(bool nans, bool infs) : previous_nans_(debug_nans()), previous_infs_(debug_infs()) {
  if (nans) set_debug_nans(true);
  if (infs) set_debug_infs(true);
}
DebugNansScope::~DebugNansScope() {
  set_debug_nans(previous_nans_);
  set_debug_infs(previous_infs_);
}

}  // namespace linum
