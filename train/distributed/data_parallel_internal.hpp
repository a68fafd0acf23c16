// The pieces of data_parallel.cpp that sharded_data_parallel.cpp builds on: the batch split, the
// flat [loss, gradients, aux] vectors, layout checks and the communication thread.
#pragma once

#include <linum/train/distributed/data_parallel.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace linum::dist::internal {

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Throws DistError naming `call` unless `code` is MPI_SUCCESS (a no-op without MPI).
void check_mpi(int code, const char* call);

// The batch size: the leading dimension every leaf of the batch shares (ShapeError otherwise).
std::int64_t batch_rows(const Tree& batch);
// Rows [lo, hi) of every leaf.
Tree rows_of(const Tree& batch, std::int64_t lo, std::int64_t hi);
void require_float(const Tree& tree, const char* what);
void require_f32(const Tree& tree, const char* what);
// out += a * weight, elementwise (appended).
void append_scaled(std::vector<float>& out, const Array& a, float weight);
// out[i] = a[i] + b[i] (bits independent of the thread count).
void add(const float* a, const float* b, float* out, std::size_t n);
// Leaves of `structure` read from flat[offset...], each rounded once to its leaf's dtype.
Tree unflat(const Tree& structure, const float* flat, std::size_t& offset);
// The weight of rows [lo, hi) in a batch of `rows`.
float weight_of(std::int64_t lo, std::int64_t hi, std::int64_t rows);
// "path:dtype[shape];..." of every leaf, and a hash of it: ranks compare layouts before exchanging.
std::string layout_of(const Tree& tree);
void check_same_layout(const std::string& layout, const Communicator& comm, const char* what);

// A thread that runs communication jobs one at a time, in the order they were submitted (so every
// rank's collectives keep the order its program gave them). With MPI_THREAD_SERIALIZED the caller
// makes no MPI call of its own while jobs are pending (wait() first). A job that throws: the
// first failure is rethrown by the next wait().
class CommThread {
 public:
  CommThread();
  ~CommThread();  // waits for the pending jobs
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;
  void submit(std::function<void()> job);
  // Waits for every submitted job; returns the seconds the jobs ran since the last wait().
  double wait();
  // Whether the caller is blocked in wait() (a job may then wait the fast way: spinning costs
  // nothing the caller needs).
  bool caller_waiting() const { return waiting_.load(std::memory_order_relaxed) > 0; }

 private:
  std::thread worker_;
  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  std::deque<std::function<void()>> jobs_;
  int running_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  double busy_s_ = 0;
  std::atomic<int> waiting_{0};
};

#if LINUM_HAVE_MPI
// Waits for a nonblocking MPI request. On a communication thread (`thread`) it looks in between
// short sleeps while the computation goes on, since a blocking wait spins on a core the computation
// needs (Open MPI polls), and waits outright once the caller waits for the thread.
void wait_request(void* mpi_request, const CommThread* thread, const char* call);
#endif

}  // namespace linum::dist::internal
