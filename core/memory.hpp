// Exact accounting of array buffer memory.
//
// Every Array buffer is allocated and freed through this one point, so the figures below are exact
// byte counts of live array data (not estimates, and not the allocator's overhead). This is how
// users, tests and benchmarks see what rematerialization saves.
//
//   auto before = linum::memory::stats().live_bytes;
//   linum::memory::PeakScope scope;               // "peak bytes inside this block"
//   ... run a training step ...
//   std::int64_t extra = scope.peak_growth();     // peak live bytes minus live bytes at entry
#pragma once

#include <cstddef>
#include <cstdint>
#include <atomic>
#include <new>
#include <string>

namespace linum::memory {

struct Stats {
  std::int64_t live_bytes = 0;     // bytes of array buffers alive now
  std::int64_t peak_bytes = 0;     // highest live_bytes since start or the last reset_peak()
  std::int64_t live_buffers = 0;   // number of buffers alive now
  std::int64_t allocations = 0;    // buffers allocated since the program started
  std::int64_t cached_bytes = 0;   // freed large blocks kept for reuse (not live; see below)
  std::int64_t cache_limit_bytes = 0;  // what the cache may hold now: min(set_cache_limit, 1.25 x high_water_bytes)
  std::int64_t high_water_bytes = 0;   // the most live bytes ever, since the program started

  // Residuals kept outside RAM or in less of it (core/storage/, lift::policies::offload/compress).
  // Offloaded bytes sit in the spill file, not in live_bytes; compressed bytes are RAM (they count
  // in live_bytes too) unless they were also offloaded.
  std::int64_t offloaded_bytes = 0;            // bytes in the spill file now
  std::int64_t offloaded_peak_bytes = 0;       // highest offloaded_bytes since start or reset_peak()
  std::int64_t offload_written_bytes = 0;      // bytes written to the spill file since start
  std::int64_t offload_read_bytes = 0;         // bytes read back since start
  std::int64_t compressed_bytes = 0;           // compressed residuals now (their compressed size)
  std::int64_t compressed_original_bytes = 0;  // ... and what they took before compression
};

// Freed blocks of 64 KiB and more are kept and handed out again for buffers of the same size: a
// training step allocates the same sizes every time, and reusing warm memory saves the page faults
// of fresh allocations. The cache sizes itself to the workload: it holds at most the process's
// high-water mark of live bytes and a quarter more (a step's peak, with room for its sizes peaking
// at different moments, so a steady-state step is served entirely from it), and never more than
// the limit set here (default: a quarter of the machine's memory; 0 turns caching off). Cached
// blocks are not live bytes; they count in the process's RSS, which can therefore reach 2.25x the
// mark (live bytes at the mark, cached blocks at 1.25x it).
void set_cache_limit(std::int64_t bytes);
// Returns every cached block to the system.
void release_cached();

// A cap on live array bytes; 0 (the default) means none. An allocation that would take live bytes
// above the cap throws linum::MemoryError naming the array's shape and the cap, as a device with
// that much memory would fail: a service can bound what untrusted configurations allocate, and a
// remat plan can be run under its byte budget to prove it fits. Process-wide, like the counters.
void set_live_limit(std::int64_t bytes);
std::int64_t live_limit();

// Sets the live-byte cap while alive and restores the previous one.
class LiveLimitScope {
 public:
  explicit LiveLimitScope(std::int64_t bytes) : previous_(live_limit()) { set_live_limit(bytes); }
  ~LiveLimitScope() { set_live_limit(previous_); }
  LiveLimitScope(const LiveLimitScope&) = delete;
  LiveLimitScope& operator=(const LiveLimitScope&) = delete;

 private:
  std::int64_t previous_;
};

// A snapshot of the counters (thread-safe; the counters are process-wide).
Stats stats();

// Sets the peak to the current live bytes.
void reset_peak();

// Measures the peak of live bytes while it is alive. Scopes nest: an inner scope does not hide the
// peak from an outer one, and the process-wide peak is restored to include the scope's peak.
class PeakScope {
 public:
  PeakScope();
  ~PeakScope();
  PeakScope(const PeakScope&) = delete;
  PeakScope& operator=(const PeakScope&) = delete;

  std::int64_t start_bytes() const { return start_live_; }
  // Highest live bytes seen since this scope began.
  std::int64_t peak_bytes() const;
  // peak_bytes() - start_bytes(): what the block needed on top of what was already alive.
  std::int64_t peak_growth() const { return peak_bytes() - start_live_; }

 private:
  std::int64_t start_live_;
  std::int64_t outer_peak_;
};

namespace detail {
// Memory timeline hooks (core/memory_timeline.hpp). g_timeline_recording is set while a
// TimelineRecorder is alive; allocations and recorded ops read it (one relaxed load each).
extern std::atomic<bool> g_timeline_recording;
inline bool timeline_recording() { return g_timeline_recording.load(std::memory_order_relaxed); }
// Live bytes just after an allocation.
void timeline_on_allocation(std::int64_t live);
// `op` finished; `node` identifies its graph node, so a backward point can carry the module path
// of the forward op.
void timeline_on_op(const char* op, const void* node);
// A point for the return of the module call at `path` (modules/ marks calls this way).
void timeline_mark(const char* op, const std::string& path);
// Who is running: modules/ registers the current module path (core knows no modules).
using PathProvider = std::string (*)();
void set_timeline_path_provider(PathProvider provider);
// The current module path from that provider ("" outside modules or without one; the profiler reads it too).
std::string current_module_path();

// Residual storage (core/storage/) reports what it moves. Deltas may be negative.
void on_offloaded(std::int64_t delta);
void on_offload_io(std::int64_t written, std::int64_t read);
void on_compressed(std::int64_t compressed_delta, std::int64_t original_delta);

// Thrown by allocate when the live-byte cap would be exceeded (Array turns it into MemoryError).
struct LiveLimitExceeded : std::bad_alloc {
  const char* what() const noexcept override { return "linum: live-byte limit exceeded"; }
};
// The single allocation point: 64-byte aligned, accounted. Throws std::bad_alloc on failure.
void* allocate(std::size_t bytes);
void deallocate(void* p, std::size_t bytes) noexcept;
}  // namespace detail

}  // namespace linum::memory
