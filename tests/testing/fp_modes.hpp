// Running a test's computation in each of Linum's floating-point modes, for tests that check values
// computed once and reused (bf16 tables) in both.
#pragma once

#include <linum/linum.hpp>

namespace linum::testing {

// Runs f() with subnormals flushed (Linum's default), then with IEEE subnormals in every thread
// Linum computes in (set_flush_denormals(false)); the previous setting comes back even if f throws.
template <class F>
void in_both_fp_modes(F&& f) {
  struct Restore {
    bool was = flush_denormals();
    ~Restore() { set_flush_denormals(was); }
  } restore;
  set_flush_denormals(true);
  f();
  set_flush_denormals(false);
  f();
}

}  // namespace linum::testing
