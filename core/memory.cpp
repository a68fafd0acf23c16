#include <linum/core/memory.hpp>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include <unistd.h>

namespace linum::memory {
namespace {

constexpr std::size_t kAlignment = 64;

std::atomic<std::int64_t> g_live{0};
std::atomic<std::int64_t> g_peak{0};
std::atomic<std::int64_t> g_buffers{0};
std::atomic<std::int64_t> g_allocations{0};
std::atomic<std::int64_t> g_high_water{0};  // the most live bytes ever (never reset)
std::atomic<std::int64_t> g_live_limit{0};  // set_live_limit; 0: none
std::atomic<std::int64_t> g_offloaded{0}, g_offloaded_peak{0}, g_written{0}, g_read{0}, g_compressed{0}, g_compressed_from{0};

// Freed large blocks by (rounded) size, for reuse. Never destroyed: buffers may be freed during
// static destruction, after any ordinary static object would be gone.
struct BlockCache {
  std::mutex mutex;
  std::unordered_map<std::size_t, std::vector<void*>> free_blocks;
  std::size_t cached = 0;
  std::size_t limit = default_limit();

  // A quarter of the machine's memory (1 GiB if it cannot be read).
  static std::size_t default_limit() {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    if (pages <= 0 || page <= 0) return std::size_t{1} << 30;
    return static_cast<std::size_t>(pages) / 4 * static_cast<std::size_t>(page);
  }
};
constexpr std::size_t kCacheMinBytes = std::size_t{1} << 16;

BlockCache& cache() {
  static BlockCache* c = new BlockCache;
  return *c;
}

// What the cache may hold for this workload: its high-water mark of live bytes and a quarter more.
// The mark alone was too tight: a step's sizes peak at different moments, so serving a whole step
// from the cache takes the sum over sizes of each one's own peak, a little more than the step's
// peak. The deep MLP's bf16 step (147 MB at its peak) needed 154 MB: with the mark as the bound,
// 6 MB of blocks were refused at the end of every step and allocated afresh in the next, 1540 page
// faults in each of the steps after the first until the C library's own thresholds settled.
std::size_t workload_bound() {
  const auto mark = static_cast<std::size_t>(std::max<std::int64_t>(g_high_water.load(std::memory_order_relaxed), 0));
  return mark + mark / 4;
}

void* take_cached(std::size_t rounded) {
  BlockCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  auto it = c.free_blocks.find(rounded);
  if (it == c.free_blocks.end() || it->second.empty()) return nullptr;
  void* p = it->second.back();
  it->second.pop_back();
  c.cached -= rounded;
  return p;
}

bool keep_cached(void* p, std::size_t rounded) noexcept {
  try {
    BlockCache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    // The cache follows the workload (workload_bound: a step's peak and room), within the limit.
    if (c.cached + rounded > std::min(c.limit, workload_bound())) return false;
    c.free_blocks[rounded].push_back(p);
    c.cached += rounded;
    return true;
  } catch (...) {
    return false;  // could not record it: the caller frees the block instead
  }
}

std::size_t rounded_size(std::size_t bytes) {
  return (std::max<std::size_t>(bytes, 1) + kAlignment - 1) / kAlignment * kAlignment;
}

void raise_to(std::atomic<std::int64_t>& counter, std::int64_t value) {
  std::int64_t current = counter.load(std::memory_order_relaxed);
  while (value > current && !counter.compare_exchange_weak(current, value, std::memory_order_relaxed)) {
  }
}

void raise_peak_to(std::int64_t value) { raise_to(g_peak, value); }

}  // namespace

Stats stats() {
  Stats s;
  s.live_bytes = g_live.load();
  s.peak_bytes = g_peak.load();
  s.live_buffers = g_buffers.load();
  s.allocations = g_allocations.load();
  {
    BlockCache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    s.cached_bytes = static_cast<std::int64_t>(c.cached);
    s.cache_limit_bytes = static_cast<std::int64_t>(std::min(c.limit, workload_bound()));
  }
  s.high_water_bytes = g_high_water.load();
  s.offloaded_bytes = g_offloaded.load();
  s.offloaded_peak_bytes = g_offloaded_peak.load();
  s.offload_written_bytes = g_written.load();
  s.offload_read_bytes = g_read.load();
  s.compressed_bytes = g_compressed.load();
  s.compressed_original_bytes = g_compressed_from.load();
  return s;
}

void set_cache_limit(std::int64_t bytes) {
  {
    BlockCache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    c.limit = static_cast<std::size_t>(std::max<std::int64_t>(bytes, 0));
  }
  release_cached();
}

void release_cached() {
  BlockCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  for (auto& [size, blocks] : c.free_blocks)
    for (void* p : blocks) std::free(p);
  c.free_blocks.clear();
  c.cached = 0;
}

void set_live_limit(std::int64_t bytes) { g_live_limit.store(std::max<std::int64_t>(bytes, 0)); }
std::int64_t live_limit() { return g_live_limit.load(std::memory_order_relaxed); }

void reset_peak() {
  g_peak.store(g_live.load());
  g_offloaded_peak.store(g_offloaded.load());
}

namespace detail {
void on_offloaded(std::int64_t delta) { raise_to(g_offloaded_peak, g_offloaded.fetch_add(delta) + delta); }
void on_offload_io(std::int64_t written, std::int64_t read) {
  g_written.fetch_add(written, std::memory_order_relaxed);
  g_read.fetch_add(read, std::memory_order_relaxed);
}
void on_compressed(std::int64_t compressed_delta, std::int64_t original_delta) {
  g_compressed.fetch_add(compressed_delta, std::memory_order_relaxed);
  g_compressed_from.fetch_add(original_delta, std::memory_order_relaxed);
}
}  // namespace detail

PeakScope::PeakScope() : start_live_(g_live.load()), outer_peak_(g_peak.load()) {
  g_peak.store(start_live_);
}

std::int64_t PeakScope::peak_bytes() const { return g_peak.load(); }

PeakScope::~PeakScope() { raise_peak_to(outer_peak_); }

namespace detail {

void* allocate(std::size_t bytes) {
  // aligned_alloc needs a size that is a multiple of the alignment; round up but account the
  // bytes the caller asked for, so that figures match shapes exactly.
  const std::int64_t limit = g_live_limit.load(std::memory_order_relaxed);
  if (limit > 0 && g_live.load(std::memory_order_relaxed) + static_cast<std::int64_t>(bytes) > limit)
    throw LiveLimitExceeded();
  const std::size_t rounded = rounded_size(bytes);
  void* p = rounded >= kCacheMinBytes ? take_cached(rounded) : nullptr;
  if (p == nullptr) p = std::aligned_alloc(kAlignment, rounded);
  if (p == nullptr) {
    release_cached();  // memory is short: give the cache back and try once more
    p = std::aligned_alloc(kAlignment, rounded);
  }
  if (p == nullptr) throw std::bad_alloc();
  std::int64_t live = g_live.fetch_add(static_cast<std::int64_t>(bytes)) + static_cast<std::int64_t>(bytes);
  raise_peak_to(live);
  raise_to(g_high_water, live);
  if (timeline_recording()) timeline_on_allocation(live);
  g_buffers.fetch_add(1, std::memory_order_relaxed);
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return p;
}

void deallocate(void* p, std::size_t bytes) noexcept {
  if (p == nullptr) return;
  const std::size_t rounded = rounded_size(bytes);
  if (rounded < kCacheMinBytes || !keep_cached(p, rounded)) std::free(p);
  g_live.fetch_sub(static_cast<std::int64_t>(bytes));
  g_buffers.fetch_sub(1, std::memory_order_relaxed);
}

}  // namespace detail
}  // namespace linum::memory
