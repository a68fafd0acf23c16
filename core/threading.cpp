#include <linum/core/threading.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#endif

// LLVM's OpenMP runtime (libomp, what clang's -fopenmp links) sets how long its idle threads spin
// with kmp_set_blocktime. GNU libgomp has no such function: the weak reference is then null.
extern "C" void kmp_set_blocktime(int milliseconds) __attribute__((weak));

namespace linum {
namespace {

// How long libomp's idle threads spin before they sleep, unless its environment says otherwise.
// libomp's own default is 200 ms: in a program that alternates parallel regions with serial work,
// every worker then spins through the serial parts, taking the cores other processes (and, on a
// busy machine, this one's own next region) need. libgomp spins about 300,000 iterations (its
// GOMP_SPINCOUNT default; not timed here) and then sleeps; 1 ms gives libomp a short spin too. Measured on the Zen 3 with clang
// 14, the sanitizer build's fashion_mnist example test alone: 236 s of user and 59 s of system time
// for 149 s of wall time at 200 ms, 160 s and 9 s for 139 s at 1 ms.
constexpr int kLibompBlocktimeMs = 1;

// libomp's blocktime is a setting of the calling thread's teams: set once per thread that starts
// parallel regions, before its first, unless KMP_BLOCKTIME or OMP_WAIT_POLICY says otherwise.
[[maybe_unused]] void use_short_spin_on_libomp() {
  if (kmp_set_blocktime == nullptr) return;
  static const bool environment_decides = std::getenv("KMP_BLOCKTIME") != nullptr || std::getenv("OMP_WAIT_POLICY") != nullptr;
  thread_local bool done = false;
  if (done || environment_decides) return;
  done = true;
  kmp_set_blocktime(kLibompBlocktimeMs);
}

}  // namespace

namespace {

std::atomic<int> g_adaptive{-1};  // -1: not yet read from LINUM_ADAPTIVE_THREADS
[[maybe_unused]] std::atomic<std::int64_t> g_last_check_ns{std::numeric_limits<std::int64_t>::min() / 2};
[[maybe_unused]] std::atomic<int> g_free_cores{1 << 20};
[[maybe_unused]] std::atomic<int> g_previous_reading{1 << 20};
// A reading (free_cores) takes 75-150 us of /proc reads on the thread about to start a parallel
// region, while the rest of the team waits (5-7 us per product on average at one reading every
// 25 ms). Every 100 ms the bf16 deep-MLP step (linum-bench mlp, 2 cores, AMD EPYC Zen 5) ran
// 0.8-1.7% faster by its best step, binaries alternating; a team still shrinks within about 0.2 s
// of another process taking a core, and linum-bench load's loaded step is unchanged.
[[maybe_unused]] constexpr std::int64_t kCheckIntervalNs = 100'000'000;

// A small /proc file (`path`, relative to the directory `dir` or absolute) into buf as a C string,
// with plain system calls (no stdio buffer to allocate); its length, or -1.
long read_small_file(int dir, const char* path, char* buf, std::size_t size) {
  const int fd = openat(dir, path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  const ssize_t n = read(fd, buf, size - 1);
  close(fd);
  if (n < 0) return -1;
  buf[n] = '\0';
  return static_cast<long>(n);
}

// Threads runnable on the whole machine right now (the 4th field of /proc/loadavg, "3/456"),
// including the caller; -1 if it cannot be read.
int runnable_threads() {
  char buf[128];
  if (read_small_file(AT_FDCWD, "/proc/loadavg", buf, sizeof(buf)) < 0) return -1;
  double a, b, c;
  int running = -1, total = 0;
  if (std::sscanf(buf, "%lf %lf %lf %d/%d", &a, &b, &c, &running, &total) != 5) running = -1;
  return running;
}

int cores_online() {
  static const int n = [] {
    const long v = sysconf(_SC_NPROCESSORS_ONLN);
    return v > 0 ? static_cast<int>(v) : 1;
  }();
  return n;
}

int cores_allowed() {
  static const int n = [] {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return cores_online();
    return std::max(1, CPU_COUNT(&set));
  }();
  return n;
}

// This process's threads that are running or runnable now (state R in /proc/self/task/*/stat),
// at least 1 (the caller).
int own_runnable_threads() {
  const int fd = open("/proc/self/task", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return 1;
  DIR* dir = fdopendir(fd);  // (owns fd from here on)
  if (dir == nullptr) {
    close(fd);
    return 1;
  }
  int count = 0;
  char path[272], buf[256];  // path: a name of up to 255 bytes + "/stat", relative to the directory
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    std::snprintf(path, sizeof(path), "%s/stat", e->d_name);
    if (read_small_file(fd, path, buf, sizeof(buf)) < 0) continue;
    const char* close_paren = std::strrchr(buf, ')');  // "tid (name) S ...": the state follows the name
    if (close_paren != nullptr && close_paren[1] == ' ' && close_paren[2] == 'R') ++count;
  }
  closedir(dir);
  return std::max(count, 1);
}

// Cores of ours not taken by other processes: our cores, less the runnable threads that are not
// ours and do not fit on the cores outside our affinity mask.
[[maybe_unused]] int free_cores() {
  // Our threads are counted before and after the machine-wide count, so that one of ours going
  // to sleep (or waking) in between is not mistaken for another process.
  const int own_before = own_runnable_threads();
  const int running = runnable_threads();
  const int own_after = own_runnable_threads();
  if (running < 0) return cores_allowed();
  const int own = std::max(own_before, own_after);
  const int others = std::max(0, running - own - (cores_online() - cores_allowed()));
  return std::max(1, cores_allowed() - others);
}

}  // namespace

bool adaptive_threads() {
  int a = g_adaptive.load(std::memory_order_relaxed);
  if (a < 0) {
    const char* env = std::getenv("LINUM_ADAPTIVE_THREADS");
    a = env != nullptr && std::strcmp(env, "0") == 0 ? 0 : 1;
    g_adaptive.store(a, std::memory_order_relaxed);
  }
  return a == 1;
}

void set_adaptive_threads(bool on) { g_adaptive.store(on ? 1 : 0, std::memory_order_relaxed); }

int team_size() {
#ifdef _OPENMP
  use_short_spin_on_libomp();
  const int max = omp_get_max_threads();
  if (max <= 1 || !adaptive_threads()) return max;
  const std::int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                               std::chrono::steady_clock::now().time_since_epoch()).count();
  std::int64_t last = g_last_check_ns.load(std::memory_order_relaxed);
  if (now - last >= kCheckIntervalNs && g_last_check_ns.compare_exchange_strong(last, now, std::memory_order_relaxed)) {
    // Shrink only when two readings in a row agree (a process that ran for an instant does not
    // halve the next 10 ms); grow back at once.
    const int reading = free_cores();
    const int previous = g_previous_reading.exchange(reading, std::memory_order_relaxed);
    g_free_cores.store(std::max(reading, std::min(previous, g_free_cores.load(std::memory_order_relaxed))),
                       std::memory_order_relaxed);
  }
  return std::clamp(g_free_cores.load(std::memory_order_relaxed), 1, max);
#else
  return 1;
#endif
}

std::string openmp_wait_policy() {
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  if (policy != nullptr) return policy;
  if (kmp_set_blocktime != nullptr) {
    const char* blocktime = std::getenv("KMP_BLOCKTIME");
    if (blocktime != nullptr) return std::string("KMP_BLOCKTIME=") + blocktime;
    return "unset (libomp spins " + std::to_string(kLibompBlocktimeMs) + " ms, then sleeps)";
  }
  const char* spin = std::getenv("GOMP_SPINCOUNT");
  if (spin != nullptr) return std::string("GOMP_SPINCOUNT=") + spin;
  return "unset (libgomp spins, then sleeps)";
}

}  // namespace linum
