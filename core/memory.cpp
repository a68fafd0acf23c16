#include <linum/core/memory.hpp>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <new>

namespace linum::memory {
namespace {

constexpr std::size_t kAlignment = 64;

std::atomic<std::int64_t> g_live{0};
std::atomic<std::int64_t> g_peak{0};
std::atomic<std::int64_t> g_buffers{0};
std::atomic<std::int64_t> g_allocations{0};

void raise_peak_to(std::int64_t value) {
  std::int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (value > peak && !g_peak.compare_exchange_weak(peak, value, std::memory_order_relaxed)) {
  }
}

}  // namespace

Stats stats() {
  Stats s;
  s.live_bytes = g_live.load();
  s.peak_bytes = g_peak.load();
  s.live_buffers = g_buffers.load();
  s.allocations = g_allocations.load();
  return s;
}

void reset_peak() { g_peak.store(g_live.load()); }

PeakScope::PeakScope() : start_live_(g_live.load()), outer_peak_(g_peak.load()) {
  g_peak.store(start_live_);
}

std::int64_t PeakScope::peak_bytes() const { return g_peak.load(); }

PeakScope::~PeakScope() { raise_peak_to(outer_peak_); }

namespace detail {

void* allocate(std::size_t bytes) {
  // aligned_alloc needs a size that is a multiple of the alignment; round up but account the
  // bytes the caller asked for, so that figures match shapes exactly.
  std::size_t rounded = (std::max<std::size_t>(bytes, 1) + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (p == nullptr) throw std::bad_alloc();
  std::int64_t live = g_live.fetch_add(static_cast<std::int64_t>(bytes)) + static_cast<std::int64_t>(bytes);
  raise_peak_to(live);
  g_buffers.fetch_add(1, std::memory_order_relaxed);
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return p;
}

void deallocate(void* p, std::size_t bytes) noexcept {
  if (p == nullptr) return;
  std::free(p);
  g_live.fetch_sub(static_cast<std::int64_t>(bytes));
  g_buffers.fetch_sub(1, std::memory_order_relaxed);
}

}  // namespace detail
}  // namespace linum::memory
