// A time profiler: how long every op, backward rule and user range took, how many floating-point
// operations its products and convolutions did, as a table and as a trace for Perfetto or
// chrome://tracing (as torch.profiler's key_averages().table() and export_chrome_trace, or
// jax.profiler's trace and TraceAnnotation).
//
//   linum::profiler::Profiler prof;                    // records while alive (every thread's ops)
//   { linum::profiler::Range r("train step"); auto [loss, grads] = step(params, x); }
//   linum::profiler::Profile p = prof.finish();
//   std::cout << p.table({.sort_by = "self", .row_limit = 15});
//   p.save_chrome_trace("step.json");                  // open in https://ui.perfetto.dev
//
// What is timed: every op that goes through the primitive path (core/autodiff/primitive.hpp: the
// built-in ops and linum::custom_vjp ops, differentiated or not, in the forward pass, in a
// checkpoint's recomputation and inside backward rules), every node's backward rule in a backward
// sweep, and the user's Ranges. Spans nest per thread: an op called by another op's kernel or by a
// backward rule is its child, so each event has a total time and a self time (total minus its
// children's totals), and the self times of a thread's events add up to the time covered by its
// outermost ones.
//
// FLOPs: 2 * m * n * k per matrix product (matmul, dot_general, einsum, linear and their rules) and
// 2 * N * OH * OW * O * (C / groups) * KH * KW per convolution pass (forward, input gradient,
// kernel gradient; conv2d and conv_transpose2d alike), credited to the innermost open span of the
// thread that runs it. Products inside fused kernels (attention's blocks, the recurrent layers'
// steps) are not counted.
//
// Module paths: ops recorded inside a module carry its path ("Block_0/Dense_1"); a backward rule
// carries the path of the op that recorded its node (when that op was recorded while profiling).
//
// Cost: not profiling, one relaxed atomic load per op; profiling, two clock reads, a lock and an
// event of about 100 bytes per span (plus the input shapes formatted when record_shapes is on).
// One Profiler at a time in a process.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <linum/core/array.hpp>

// Declarations only (nlohmann::json, ordered_json): the full json.hpp costs every includer
// about 2.8 s of compile time; the .cpp files that build or read JSON include it themselves.
#include <nlohmann/json_fwd.hpp>

namespace linum::profiler {

// One timed span.
struct Event {
  std::string name;    // the op's name ("matmul"), or the Range's
  std::string kind;    // "op", "rule" (a node's backward rule) or "range"
  std::string phase;   // "forward", "recomputation" or "backward" (what the thread was doing)
  std::string path;    // module path ("" outside modules)
  std::string shapes;  // the inputs' shapes, "(2048, 512) (512, 512)" (only with record_shapes)
  int thread = 0;      // 0 for the first thread seen, 1 for the next, ...
  int depth = 0;       // spans open around it on its thread
  double start_s = 0;  // since the profiler started
  double total_s = 0;  // its duration
  double self_s = 0;   // total_s minus its children's total_s
  double flops = 0;    // products and convolutions run in it directly (not in its children)
};

// The events of one name, kind and phase (and shapes, when grouped by them), summed.
struct OpStats {
  std::string name, kind, phase, shapes;
  std::int64_t calls = 0;
  double total_s = 0, self_s = 0, flops = 0;
};

struct TableOptions {
  std::string sort_by = "self";  // "self", "total", "calls", "flops" (largest first) or "name"
  int row_limit = 30;            // rows shown (<= 0: all)
  bool group_by_shapes = false;  // one row per distinct input shapes too
};

class Profile {
 public:
  std::vector<Event> events;  // in the order they ended
  double wall_s = 0;          // from the profiler's start to finish()

  // The events grouped by name, kind and phase (and input shapes); ordered by self time, largest first.
  std::vector<OpStats> key_averages(bool group_by_shapes = false) const;
  // key_averages as a text table: calls, self and total time, self time's share of all self time,
  // GFLOP and GFLOP/s (over the self time), with the profile's wall time and the time in spans.
  std::string table(const TableOptions& options = {}) const;
  // Chrome's trace-event format ("X" events in microseconds, a track per thread, the phase, module
  // path, shapes and FLOPs as arguments): Perfetto and chrome://tracing open it.
  nlohmann::json chrome_trace() const;
  // Atomically writes chrome_trace() to `path`.
  void save_chrome_trace(const std::filesystem::path& path) const;
};

struct Options {
  bool record_shapes = false;  // format every op's input shapes (costs a string per op)
};

// Records while alive; one at a time in a process (a second one throws ValueError).
class Profiler {
 public:
  explicit Profiler(Options options = {});
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  // Stops recording and returns what was recorded. Spans still open are not in it.
  Profile finish();

 private:
  bool active_ = true;
};

// A span of the user's own (data loading, a train step, an evaluation), timed while alive when a
// Profiler is recording; ops inside it are its children. Destroy it on the thread that made it.
class Range {
 public:
  explicit Range(std::string_view name);
  ~Range();
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;

 private:
  bool open_ = false;
};

// Whether a Profiler is recording now.
bool profiling();

namespace detail {

// Set while a Profiler records; the primitive path reads it once per op.
extern std::atomic<bool> g_profiling;
inline bool profiling_now() { return g_profiling.load(std::memory_order_relaxed); }

enum class SpanKind { op, rule, range };

// Opens a span on this thread (only call while profiling_now()); returns whether it did. `node`:
// for a rule, its graph node (the module path of the op that recorded it).
bool open_span(const char* name, SpanKind kind, std::span<const Array* const> inputs, const void* node = nullptr);
void close_span();

// An op's span for its lifetime (the dispatcher and the backward sweep open one per op / rule).
class Span {
 public:
  Span(const char* name, SpanKind kind, std::span<const Array* const> inputs, const void* node = nullptr) {
    if (profiling_now()) [[unlikely]]
      open_ = open_span(name, kind, inputs, node);
  }
  ~Span() {
    if (open_) [[unlikely]]
      close_span();
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  bool open_ = false;
};

// Credits `flops` floating-point operations to this thread's innermost open span (a product or a
// convolution pass calls it; nothing when not profiling or no span is open).
void add_flops_open(double flops);
inline void add_flops(double flops) {
  if (profiling_now()) [[unlikely]]
    add_flops_open(flops);
}

// The graph node `node` was recorded now (graph.cpp): its backward rule's span gets this module path.
void on_record(const void* node);

}  // namespace detail

}  // namespace linum::profiler
