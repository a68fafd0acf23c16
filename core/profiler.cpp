#include <linum/core/profiler.hpp>

#include <linum/core/debug_nans.hpp>
#include <linum/core/error.hpp>
#include <linum/core/files.hpp>
#include <linum/core/memory.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <nlohmann/json.hpp>

namespace linum::profiler {

namespace detail {
std::atomic<bool> g_profiling{false};
}  // namespace detail

namespace {

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// What a Profiler collects. Every field is guarded by `mutex`, except the flags the spans read.
struct Session {
  std::mutex mutex;
  std::int64_t start_ns = 0;
  std::uint64_t generation = 0;  // which Profiler: a span opened under an earlier one is dropped
  int threads = 0;               // threads seen so far (their index)
  std::vector<Event> events;
  std::unordered_map<const void*, std::string> node_paths;  // recorded node -> module path
};
Session& session() {
  static Session s;
  return s;
}
std::atomic<std::uint64_t> g_generation{0};
std::atomic<bool> g_record_shapes{false};

// A span open on this thread.
struct Open {
  const char* name = nullptr;
  std::string owned_name;  // a Range's name
  detail::SpanKind kind = detail::SpanKind::op;
  linum::detail::Phase phase = linum::detail::Phase::forward;
  std::string path, shapes;
  std::int64_t start_ns = 0, children_ns = 0;
  double flops = 0;
  std::uint64_t generation = 0;  // the profiler it was opened under
};

struct ThreadState {
  std::uint64_t generation = 0;  // the profiler this thread's index belongs to
  int index = 0;
  std::vector<Open> stack;
};
ThreadState& thread_state() {
  thread_local ThreadState t;
  return t;
}

const char* kind_name(detail::SpanKind k) {
  switch (k) {
    case detail::SpanKind::op: return "op";
    case detail::SpanKind::rule: return "rule";
    case detail::SpanKind::range: return "range";
  }
  return "op";
}

const char* phase_name(linum::detail::Phase p) {
  switch (p) {
    case linum::detail::Phase::forward: return "forward";
    case linum::detail::Phase::backward: return "backward";
    case linum::detail::Phase::recomputation: return "recomputation";
  }
  return "forward";
}

std::string shapes_of(std::span<const Array* const> inputs) {
  std::string s;
  for (const Array* a : inputs) {
    if (!s.empty()) s += ' ';
    s += a->defined() ? a->shape().str() : std::string("-");
  }
  return s;
}

void open(Open o) {
  ThreadState& t = thread_state();
  const std::uint64_t generation = g_generation.load(std::memory_order_relaxed);
  if (t.generation != generation) {  // this thread's first span under this profiler: its index
    Session& s = session();
    std::lock_guard<std::mutex> lock(s.mutex);
    t.generation = generation;
    t.index = s.threads++;
  }
  o.generation = generation;
  o.start_ns = now_ns();
  t.stack.push_back(std::move(o));
}

std::string format_seconds(double s) {
  char buf[32];
  if (s >= 1.0) std::snprintf(buf, sizeof buf, "%.3f s", s);
  else if (s >= 1e-3) std::snprintf(buf, sizeof buf, "%.3f ms", s * 1e3);
  else std::snprintf(buf, sizeof buf, "%.3f us", s * 1e6);
  return buf;
}

}  // namespace

bool profiling() { return detail::profiling_now(); }

namespace detail {

bool open_span(const char* name, SpanKind kind, std::span<const Array* const> inputs, const void* node) {
  Open o;
  o.name = name;
  o.kind = kind;
  o.phase = kind == SpanKind::rule ? linum::detail::Phase::backward : linum::detail::current_phase();
  if (g_record_shapes.load(std::memory_order_relaxed)) o.shapes = shapes_of(inputs);
  if (kind == SpanKind::rule) {
    Session& s = session();
    std::lock_guard<std::mutex> lock(s.mutex);
    if (auto it = s.node_paths.find(node); it != s.node_paths.end()) o.path = it->second;
  } else {
    o.path = memory::detail::current_module_path();
  }
  open(std::move(o));
  return true;
}

void close_span() {
  const std::int64_t end = now_ns();
  ThreadState& t = thread_state();
  if (t.stack.empty()) return;
  Open o = std::move(t.stack.back());
  t.stack.pop_back();
  const std::int64_t total = end - o.start_ns;
  if (!t.stack.empty()) t.stack.back().children_ns += total;
  Session& s = session();
  std::lock_guard<std::mutex> lock(s.mutex);
  // (a span opened under a profiler that has finished since is dropped)
  if (!g_profiling.load(std::memory_order_relaxed) || o.generation != s.generation) return;
  Event e;
  e.name = o.name != nullptr ? std::string(o.name) : std::move(o.owned_name);
  e.kind = kind_name(o.kind);
  e.phase = phase_name(o.phase);
  e.path = std::move(o.path);
  e.shapes = std::move(o.shapes);
  e.thread = t.index;
  e.depth = static_cast<int>(t.stack.size());
  e.start_s = static_cast<double>(o.start_ns - s.start_ns) * 1e-9;
  e.total_s = static_cast<double>(total) * 1e-9;
  e.self_s = static_cast<double>(total - o.children_ns) * 1e-9;
  e.flops = o.flops;
  s.events.push_back(std::move(e));
}

void add_flops_open(double flops) {
  ThreadState& t = thread_state();
  if (!t.stack.empty()) t.stack.back().flops += flops;
}

void on_record(const void* node) {
  if (!profiling_now()) return;
  std::string path = memory::detail::current_module_path();
  Session& s = session();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (path.empty()) s.node_paths.erase(node);  // (an earlier node at this address had one)
  else s.node_paths[node] = std::move(path);
}

}  // namespace detail

// ---- Profiler, Range ------------------------------------------------------------------------------

Profiler::Profiler(Options options) {
  Session& s = session();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (detail::g_profiling.load())
    throw ValueError("profiler::Profiler: another profiler is recording; finish() it first (one profiler at a time)");
  s.events.clear();
  s.node_paths.clear();
  s.threads = 0;
  s.generation = g_generation.fetch_add(1) + 1;
  g_record_shapes.store(options.record_shapes);
  s.start_ns = now_ns();
  detail::g_profiling.store(true);
}

Profiler::~Profiler() {
  if (active_) (void)finish();
}

Profile Profiler::finish() {
  Session& s = session();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!active_) throw ValueError("profiler::Profiler::finish: already finished");
  active_ = false;
  detail::g_profiling.store(false);
  Profile p;
  p.wall_s = static_cast<double>(now_ns() - s.start_ns) * 1e-9;
  p.events = std::move(s.events);
  s.events.clear();
  s.node_paths.clear();
  return p;
}

Range::Range(std::string_view name) {
  if (!detail::profiling_now()) return;
  Open o;
  o.owned_name = std::string(name);
  o.kind = detail::SpanKind::range;
  o.phase = linum::detail::current_phase();
  o.path = memory::detail::current_module_path();
  open(std::move(o));
  open_ = true;
}

Range::~Range() {
  if (open_) detail::close_span();
}

// ---- Profile --------------------------------------------------------------------------------------

std::vector<OpStats> Profile::key_averages(bool group_by_shapes) const {
  std::map<std::tuple<std::string, std::string, std::string, std::string>, OpStats> rows;
  for (const Event& e : events) {
    OpStats& r = rows[{e.name, e.kind, e.phase, group_by_shapes ? e.shapes : std::string()}];
    if (r.calls == 0) r = OpStats{e.name, e.kind, e.phase, group_by_shapes ? e.shapes : std::string(), 0, 0, 0, 0};
    ++r.calls;
    r.total_s += e.total_s;
    r.self_s += e.self_s;
    r.flops += e.flops;
  }
  std::vector<OpStats> out;
  out.reserve(rows.size());
  for (auto& [key, r] : rows) out.push_back(std::move(r));
  std::stable_sort(out.begin(), out.end(), [](const OpStats& a, const OpStats& b) { return a.self_s > b.self_s; });
  return out;
}

std::string Profile::table(const TableOptions& options) const {
  std::vector<OpStats> rows = key_averages(options.group_by_shapes);
  const std::string& by = options.sort_by;
  auto order = [&](auto key) {
    std::stable_sort(rows.begin(), rows.end(), [&](const OpStats& a, const OpStats& b) { return key(a) > key(b); });
  };
  if (by == "self") order([](const OpStats& r) { return r.self_s; });
  else if (by == "total") order([](const OpStats& r) { return r.total_s; });
  else if (by == "calls") order([](const OpStats& r) { return static_cast<double>(r.calls); });
  else if (by == "flops") order([](const OpStats& r) { return r.flops; });
  else if (by == "name")
    std::stable_sort(rows.begin(), rows.end(), [](const OpStats& a, const OpStats& b) { return a.name < b.name; });
  else
    throw ValueError(linum::detail::cat("Profile::table: sort_by \"", by, "\" is not one of self, total, calls, flops, name"));
  double all_self = 0, outermost = 0;
  for (const Event& e : events) {
    all_self += e.self_s;
    if (e.depth == 0) outermost += e.total_s;
  }
  std::size_t name_width = 4;
  for (const OpStats& r : rows) name_width = std::max(name_width, r.name.size());
  name_width = std::min<std::size_t>(name_width, 40);
  std::string out;
  char line[512];
  std::snprintf(line, sizeof line, "%-*s  %-5s  %-13s  %7s  %12s  %6s  %12s  %12s  %9s  %8s%s\n", static_cast<int>(name_width),
                "Name", "Kind", "Phase", "Calls", "Self", "Self%", "Total", "Self/call", "GFLOP", "GFLOP/s",
                options.group_by_shapes ? "  Shapes" : "");
  out += line;
  out += std::string(name_width + 103 + (options.group_by_shapes ? 8 : 0), '-') + "\n";
  const std::size_t shown =
      options.row_limit <= 0 ? rows.size() : std::min(rows.size(), static_cast<std::size_t>(options.row_limit));
  for (std::size_t i = 0; i < shown; ++i) {
    const OpStats& r = rows[i];
    std::string name = r.name.size() > name_width ? r.name.substr(0, name_width - 3) + "..." : r.name;
    char gflop[32] = "", rate[32] = "";
    if (r.flops > 0) {
      std::snprintf(gflop, sizeof gflop, "%.3f", r.flops * 1e-9);
      if (r.self_s > 0) std::snprintf(rate, sizeof rate, "%.1f", r.flops * 1e-9 / r.self_s);
    }
    std::snprintf(line, sizeof line, "%-*s  %-5s  %-13s  %7lld  %12s  %5.1f%%  %12s  %12s  %9s  %8s%s%s\n",
                  static_cast<int>(name_width), name.c_str(), r.kind.c_str(), r.phase.c_str(), static_cast<long long>(r.calls),
                  format_seconds(r.self_s).c_str(), all_self > 0 ? 100.0 * r.self_s / all_self : 0.0,
                  format_seconds(r.total_s).c_str(), format_seconds(r.self_s / static_cast<double>(r.calls)).c_str(), gflop,
                  rate, options.group_by_shapes ? "  " : "", options.group_by_shapes ? r.shapes.c_str() : "");
    out += line;
  }
  if (shown < rows.size()) out += linum::detail::cat("... ", rows.size() - shown, " more rows (row_limit)\n");
  out += linum::detail::cat("Wall time ", format_seconds(wall_s), "; in the outermost spans ", format_seconds(outermost),
                            " (all threads), ", events.size(), " events\n");
  return out;
}

nlohmann::json Profile::chrome_trace() const {
  nlohmann::json trace = nlohmann::json::array();
  int threads = 0;
  for (const Event& e : events) threads = std::max(threads, e.thread + 1);
  for (int t = 0; t < threads; ++t)
    trace.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 1}, {"tid", t},
                     {"args", {{"name", linum::detail::cat("linum thread ", t)}}}});
  for (const Event& e : events) {
    nlohmann::json args = {{"phase", e.phase}, {"self_us", e.self_s * 1e6}};
    if (!e.path.empty()) args["path"] = e.path;
    if (!e.shapes.empty()) args["shapes"] = e.shapes;
    if (e.flops > 0) args["flops"] = e.flops;
    trace.push_back({{"name", e.name}, {"cat", e.kind}, {"ph", "X"}, {"pid", 1}, {"tid", e.thread},
                     {"ts", e.start_s * 1e6}, {"dur", e.total_s * 1e6}, {"args", std::move(args)}});
  }
  return {{"traceEvents", std::move(trace)}, {"displayTimeUnit", "ms"}};
}

void Profile::save_chrome_trace(const std::filesystem::path& path) const {
  const std::string text = chrome_trace().dump() + "\n";
  files::write_file_atomic(path, std::span(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()));
}

}  // namespace linum::profiler
