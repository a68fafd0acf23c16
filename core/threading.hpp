// Threads that survive a busy machine.
//
// Linum's parallel loops and oneDNN's kernels run on OpenMP (GNU libgomp). By default libgomp
// threads spin for a long while (about 300,000 iterations) at every barrier before they sleep.
// On a dedicated machine that saves a few microseconds per parallel region; on a machine where
// another process takes a core, it is a collapse: the spinning thread holds its core while the
// thread it waits for is descheduled, so every barrier costs a scheduler time slice, and a
// training step was measured 20x slower.
//
// So programs linked with Linum (as a static library, the default build) start with
// OMP_WAIT_POLICY=passive unless the environment already says how OpenMP threads should wait
// (OMP_WAIT_POLICY or GOMP_SPINCOUNT): idle threads sleep at once, and under load the scheduler can
// move a descheduled thread to the core they free. On a dedicated machine, set
// OMP_WAIT_POLICY=active to spin as before (linum-bench load measures both). The setting is made
// before any library initialises (an ELF pre-initialisation function), because libgomp reads it
// once at start-up; the process environment itself is left as it was (child processes and getenv
// do not see it).
//
// Sleeping threads are not enough: every parallel region still waits for its slowest thread, and a
// thread sharing its core with a CPU-bound process runs at half speed and wakes late. So Linum
// sizes each parallel region to the cores that are free: omp_get_max_threads(), less one for each
// core other processes keep busy (the kernel's count of runnable threads, read at most every
// 10 ms), at least 1. On a quiet machine that is every thread; with one of 2 cores taken, the step
// runs on the free core instead of waiting on the busy one. Results do not depend on it: Linum's
// kernels split work into pieces fixed by the shapes (not by the thread count), and oneDNN's matrix
// products give the same bits on 1 and 2 threads (tests/test_threading.cpp checks both).
// Convolutions keep the full team (oneDNN's weight gradient sums per thread). Turn adaptation off
// with set_adaptive_threads(false) or LINUM_ADAPTIVE_THREADS=0 (dedicated machines).
#pragma once

#include <string>

namespace linum {

// The wait policy OpenMP threads use in this process, as the environment gives it:
// "passive (Linum's default)", "passive", "active", or "GOMP_SPINCOUNT=N".
std::string openmp_wait_policy();

// The number of threads Linum's parallel regions use now (see above).
int team_size();
// Whether team_size() follows the free cores (default: true, unless LINUM_ADAPTIVE_THREADS=0).
bool adaptive_threads();
void set_adaptive_threads(bool on);

namespace detail {
void keep_threading_linked();
}  // namespace detail

}  // namespace linum
