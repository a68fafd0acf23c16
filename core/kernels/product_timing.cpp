#include <linum/core/kernels/product_timing.hpp>
#include <linum/core/profiler.hpp>

#include <atomic>
#include <chrono>

namespace linum::kernels {
namespace {

std::atomic<int> g_scopes{0};  // ProductTimingScopes alive
std::atomic<std::int64_t> g_products{0};
std::atomic<std::int64_t> g_nanoseconds{0};
std::atomic<double> g_flops{0.0};

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

bool product_timing_on() { return g_scopes.load(std::memory_order_relaxed) > 0; }

ProductTiming product_timing() {
  return ProductTiming{.products = g_products.load(), .flops = g_flops.load(),
                       .seconds = static_cast<double>(g_nanoseconds.load()) * 1e-9};
}

ProductTimingScope::ProductTimingScope() : start_(product_timing()) { g_scopes.fetch_add(1); }

ProductTimingScope::~ProductTimingScope() { g_scopes.fetch_sub(1); }

ProductTiming ProductTimingScope::read() const {
  const ProductTiming now = product_timing();
  return ProductTiming{.products = now.products - start_.products, .flops = now.flops - start_.flops,
                       .seconds = now.seconds - start_.seconds};
}

namespace detail {

ProductClock::ProductClock(double flops) : flops_(flops) {
  profiler::detail::add_flops(flops);  // (the profiler's FLOP count: nothing unless it records)
  if (product_timing_on()) start_ns_ = now_ns();
}

ProductClock::~ProductClock() {
  if (start_ns_ < 0) return;
  g_nanoseconds.fetch_add(now_ns() - start_ns_, std::memory_order_relaxed);
  g_products.fetch_add(1, std::memory_order_relaxed);
  // (std::atomic<double>::fetch_add is C++20; a compare-exchange loop keeps older libstdc++ happy)
  double seen = g_flops.load(std::memory_order_relaxed);
  while (!g_flops.compare_exchange_weak(seen, seen + flops_, std::memory_order_relaxed)) {
  }
}

}  // namespace detail

}  // namespace linum::kernels
