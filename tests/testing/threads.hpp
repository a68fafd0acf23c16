// Running a test's computation on an exact number of OpenMP threads, for tests that compare the
// bits one thread gives with those of two.
#pragma once

#include <linum/linum.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linum::testing {

// Runs f() on exactly `threads` OpenMP threads (adaptive teams off, which would give one thread on
// a busy machine) and restores both settings. Returns false, without running f, when built without
// OpenMP or when the team cannot have that size.
template <class F>
bool on_threads(int threads, F&& f) {
#ifdef _OPENMP
  struct Restore {
    int threads = omp_get_max_threads();
    bool adaptive = adaptive_threads();
    ~Restore() {
      omp_set_num_threads(threads);
      set_adaptive_threads(adaptive);
    }
  } restore;
  set_adaptive_threads(false);
  omp_set_num_threads(threads);
  if (team_size() != threads) return false;
  f();
  return true;
#else
  (void)threads;
  (void)f;
  return false;
#endif
}

}  // namespace linum::testing
