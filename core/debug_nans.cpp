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
thread_local Phase t_phase = Phase::forward;

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

Phase current_phase() { return t_phase; }
PhaseScope::PhaseScope(Phase p) : previous_(t_phase) { t_phase = p; }
PhaseScope::~PhaseScope() { t_phase = previous_; }

void check_finite(const Array& out, const char* op, int input_index, std::initializer_list<const Array*> inputs) {
  const int mode = g_debug_nonfinite.load(std::memory_order_relaxed);
  if (mode == 0 || !out.defined() || !is_floating(out.dtype())) return;
  const std::vector<float> v = out.to_vector();
  for (std::size_t i = 0; i < v.size(); ++i) {
    const bool nan = std::isnan(v[i]), inf = std::isinf(v[i]);
    if (!((nan && (mode & 1)) || (inf && (mode & 2)))) continue;
    std::string ins;
    for (const Array* a : inputs)
      if (a != nullptr && a->defined()) ins += (ins.empty() ? "" : ", ") + a->type_str();
    const std::string what = input_index < 0 ? cat("op '", op, "' produced ")
                                             : cat("the backward rule of op '", op, "' produced, as the gradient of its input ",
                                                   input_index, ", ");
    throw FloatingPointError(cat("debug_", nan ? "nans" : "infs", ": ", what, nan ? "NaN" : (v[i] > 0 ? "inf" : "-inf"),
                                 " in ", phase_name(t_phase), " (", out.type_str(), ", first at flat index ", i,
                                 ins.empty() ? std::string() : cat("; inputs ", ins),
                                 "). Look at that op's inputs; set_debug_nans(false) turns the check off"));
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
