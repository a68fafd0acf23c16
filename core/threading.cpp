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
#include <sched.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linum {
namespace {

}  // namespace

namespace {

std::atomic<int> g_adaptive{-1};  // -1: not yet read from LINUM_ADAPTIVE_THREADS
[[maybe_unused]] std::atomic<std::int64_t> g_last_check_ns{std::numeric_limits<std::int64_t>::min() / 2};
[[maybe_unused]] std::atomic<int> g_free_cores{1 << 20};
[[maybe_unused]] std::atomic<int> g_previous_reading{1 << 20};
[[maybe_unused]] constexpr std::int64_t kCheckIntervalNs = 25'000'000;

// Threads runnable on the whole machine right now (the 4th field of /proc/loadavg, "3/456"),
// including the caller; -1 if it cannot be read.
int runnable_threads() {
  std::FILE* f = std::fopen("/proc/loadavg", "r");
  if (f == nullptr) return -1;
  double a, b, c;
  int running = -1, total = 0;
  if (std::fscanf(f, "%lf %lf %lf %d/%d", &a, &b, &c, &running, &total) != 5) running = -1;
  std::fclose(f);
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
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return 1;
  int count = 0;
  char path[288], buf[256];  // path: "/proc/self/task/" + a name of up to 255 bytes + "/stat"
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    std::snprintf(path, sizeof(path), "/proc/self/task/%s/stat", e->d_name);
    std::FILE* f = std::fopen(path, "r");
    if (f == nullptr) continue;
    const std::size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
    std::fclose(f);
    buf[n] = '\0';
    const char* close = std::strrchr(buf, ')');  // "tid (name) S ...": the state follows the name
    if (close != nullptr && close[1] == ' ' && close[2] == 'R') ++count;
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
  const char* spin = std::getenv("GOMP_SPINCOUNT");
  if (policy != nullptr) return policy;
  if (spin != nullptr) return std::string("GOMP_SPINCOUNT=") + spin;
  return "unset (libgomp spins, then sleeps)";
}

}  // namespace linum
