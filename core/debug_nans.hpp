// JAX's debug_nans / debug_infs: find the op where a NaN or infinity first appears.
//
//   linum::set_debug_nans(true);             // for the whole process (or LINUM_DEBUG_NANS=1)
//   { linum::DebugNansScope on; ... }        // for a block (and debug_infs: DebugNansScope{true, true})
//
// While on, every op recorded while differentiating checks its output, and every backward rule
// checks the gradients it produces; the first non-finite value raises linum::FloatingPointError
// naming the op, the phase (forward, backward or the recomputation of a checkpointed block), the
// shapes and the first bad element. Inside a module the error also names the module path. Ops run
// outside differentiation (plain inference) are checked per module instead: the innermost module
// whose output holds the value is named (run the call under value_and_grad to name the op). Off
// (the default), the cost is one relaxed atomic load per recorded op and per module call.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/context.hpp>
#include <linum/core/error.hpp>

#include <atomic>
#include <initializer_list>
#include <span>

namespace linum {

void set_debug_nans(bool on);
void set_debug_infs(bool on);
bool debug_nans();
bool debug_infs();

// Turns the checks on for its lifetime (process-wide, as jax.config), restoring the previous
// settings afterwards.
class DebugNansScope {
 public:
  explicit DebugNansScope(bool nans = true, bool infs = false);
  ~DebugNansScope();
  DebugNansScope(const DebugNansScope&) = delete;
  DebugNansScope& operator=(const DebugNansScope&) = delete;

 private:
  bool previous_nans_, previous_infs_;
};

namespace detail {

// Bit 0: NaN checks, bit 1: infinity checks.
extern std::atomic<int> g_debug_nonfinite;

// What the current thread is computing, for the error message.
enum class Phase { forward, backward, recomputation };
Phase current_phase();
struct PhaseContext { using Value = Phase; };
// Sets the phase for its lifetime (core/context.hpp).
class PhaseScope {
 public:
  explicit PhaseScope(Phase p) : set_(p) {}

 private:
  ContextStack<PhaseContext>::Entry set_;
};

// Throws FloatingPointError if `out` holds a value the enabled checks forbid: the output of `op`
// (input_index < 0) or the gradient it produced for input `input_index`.
void check_finite(const Array& out, const char* op, int input_index, std::span<const Array* const> inputs);
inline void check_finite(const Array& out, const char* op, int input_index, std::initializer_list<const Array*> inputs) {
  check_finite(out, op, input_index, std::span<const Array* const>(inputs.begin(), inputs.size()));
}

// Throws FloatingPointError if a module's outputs hold a value the enabled checks forbid (Scope
// calls it when a module returns, so plain inference is checked per module).
void check_module_outputs(std::span<const Array> outs);

inline bool debug_checks_on() { return g_debug_nonfinite.load(std::memory_order_relaxed) != 0; }

}  // namespace detail
}  // namespace linum
