// Threads that survive a busy machine.
//
// Linum's parallel loops and oneDNN's kernels run on OpenMP (GNU libgomp). Every parallel region
// waits for its slowest thread, and a thread sharing its core with a CPU-bound process runs at half
// speed and wakes late: with all threads in every region, a step slowed 2.5-3x (and 20x while
// libgomp's threads spun at barriers). So Linum sizes each parallel region to the cores that are
// free: omp_get_max_threads(), less one for each core other processes keep busy (the kernel's count
// of runnable threads in /proc/loadavg, less this process's own, read at most every 100 ms; a core
// counts as taken after two readings agree), at least 1. On a quiet machine that is every thread;
// with one of 2 cores taken, the step runs on the free core instead of waiting on the busy one
// (linum-bench load: about 2x instead of 3x). Results do not depend on it: Linum's kernels split
// work into pieces fixed by the shapes (not by the thread count), and oneDNN's matrix products give
// the same bits on 1 and 2 threads (tests/test_threading.cpp checks both). Large convolutions' weight
// gradients, which oneDNN would sum per thread, are cut into batch pieces fixed by the shape and
// summed in order, so they too give the same bits on any team (what data-parallel ranks with
// different thread counts rely on). Turn adaptation off with
// set_adaptive_threads(false) or LINUM_ADAPTIVE_THREADS=0 (dedicated machines).
//
// How idle OpenMP threads wait is the OpenMP runtime's business. GNU libgomp (GCC's) reads
// OMP_WAIT_POLICY / GOMP_SPINCOUNT once, before main. Unset, its threads spin about 300,000
// iterations and then sleep; with adaptive teams that costs nothing measurable under load
// (linum-bench load gives the same slowdown with OMP_WAIT_POLICY=passive). On a dedicated machine
// OMP_WAIT_POLICY=active with LINUM_ADAPTIVE_THREADS=0 is the spinning mode. LLVM's libomp
// (clang's) spins 200 ms by default, through the serial work between regions; unless
// KMP_BLOCKTIME or OMP_WAIT_POLICY is set, Linum sets it to 1 ms (kmp_set_blocktime) for each
// thread that starts its parallel regions: a short spin, then sleep, as libgomp does.
#pragma once

#include <string>

namespace linum {

// How idle OpenMP threads wait in this process, as its environment and runtime say: "passive",
// "active", "KMP_BLOCKTIME=N" or "unset (libomp spins 1 ms, then sleeps)" on libomp,
// "GOMP_SPINCOUNT=N" or "unset (libgomp spins, then sleeps)" on libgomp.
std::string openmp_wait_policy();

// The number of threads Linum's parallel regions use now (see above).
int team_size();
// Whether team_size() follows the free cores (default: true, unless LINUM_ADAPTIVE_THREADS=0).
bool adaptive_threads();
void set_adaptive_threads(bool on);


}  // namespace linum
