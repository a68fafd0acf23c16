#include <linum/core/storage/transfer_stats.hpp>

#include <atomic>
#include <chrono>

namespace linum::storage {

namespace {
struct Counter {
  std::atomic<std::int64_t> bytes{0};
  std::atomic<std::int64_t> nanoseconds{0};
};
Counter g_counters[4];  // indexed by detail::Transfer

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
double seconds_of(const Counter& c) { return static_cast<double>(c.nanoseconds.load()) * 1e-9; }
}  // namespace

TransferStats transfer_stats() {
  using detail::Transfer;
  auto& w = g_counters[static_cast<int>(Transfer::write)];
  auto& r = g_counters[static_cast<int>(Transfer::read)];
  auto& e = g_counters[static_cast<int>(Transfer::encode)];
  auto& d = g_counters[static_cast<int>(Transfer::decode)];
  return {w.bytes.load(), seconds_of(w), r.bytes.load(), seconds_of(r), e.bytes.load(), seconds_of(e), d.bytes.load(), seconds_of(d)};
}

namespace detail {

void on_transfer(Transfer kind, std::int64_t bytes, double seconds) {
  Counter& c = g_counters[static_cast<int>(kind)];
  c.bytes.fetch_add(bytes, std::memory_order_relaxed);
  c.nanoseconds.fetch_add(static_cast<std::int64_t>(seconds * 1e9), std::memory_order_relaxed);
}

TransferTimer::TransferTimer(Transfer kind, std::int64_t bytes) : kind_(kind), bytes_(bytes), start_ns_(now_ns()) {}
TransferTimer::~TransferTimer() {
  Counter& c = g_counters[static_cast<int>(kind_)];
  c.bytes.fetch_add(bytes_, std::memory_order_relaxed);
  c.nanoseconds.fetch_add(now_ns() - start_ns_, std::memory_order_relaxed);
}

}  // namespace detail
}  // namespace linum::storage
