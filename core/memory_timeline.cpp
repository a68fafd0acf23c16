#include <linum/core/memory_timeline.hpp>

#include <linum/core/debug_nans.hpp>
#include <linum/core/error.hpp>
#include <linum/core/memory.hpp>
#include <linum/core/files.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <span>
#include <unordered_map>
#include <nlohmann/json.hpp>

namespace linum::memory {

namespace {

std::atomic<std::int64_t> g_max_since_boundary{0};
std::atomic<detail::PathProvider> g_path_provider{nullptr};

struct Recording {
  std::mutex mutex;
  std::chrono::steady_clock::time_point start;
  Timeline timeline;
  std::unordered_map<const void*, std::size_t> node_points;  // forward op's node -> its point, for backward points
};
Recording& recording() {
  static Recording r;
  return r;
}

const char* phase_str(linum::detail::Phase p) {
  switch (p) {
    case linum::detail::Phase::forward: return "forward";
    case linum::detail::Phase::backward: return "backward";
    case linum::detail::Phase::recomputation: return "recomputation";
  }
  return "forward";
}

void raise_max(std::int64_t live) {
  std::int64_t seen = g_max_since_boundary.load(std::memory_order_relaxed);
  while (live > seen && !g_max_since_boundary.compare_exchange_weak(seen, live, std::memory_order_relaxed)) {
  }
}

// A point for what happened since the previous boundary (caller holds the mutex).
void add_point(Recording& r, std::string op, std::string path, std::string phase) {
  const std::int64_t live = stats().live_bytes;
  const std::int64_t peak = std::max(g_max_since_boundary.exchange(live), live);
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - r.start).count();
  r.timeline.points.push_back({std::move(op), std::move(path), std::move(phase), live, peak, t, -1, stats().offloaded_bytes});
}

}  // namespace

// ---- Timeline -----------------------------------------------------------------------------------

const TimelinePoint* Timeline::peak_point() const {
  const TimelinePoint* best = nullptr;
  for (const auto& p : points)
    if (best == nullptr || p.peak_bytes > best->peak_bytes) best = &p;
  return best;
}

std::int64_t Timeline::offloaded_peak_bytes() const {
  std::int64_t m = 0;
  for (const auto& p : points) m = std::max(m, p.offloaded_bytes);
  return m;
}

std::int64_t Timeline::peak_bytes() const {
  const TimelinePoint* p = peak_point();
  return p == nullptr ? 0 : p->peak_bytes;
}

nlohmann::json Timeline::to_json() const {
  nlohmann::json pts = nlohmann::json::array();
  for (const auto& p : points)
    pts.push_back({{"op", p.op}, {"path", p.path}, {"phase", p.phase}, {"live_bytes", p.live_bytes}, {"peak_bytes", p.peak_bytes},
                   {"seconds", p.seconds}, {"forward_point", p.forward_point}, {"offloaded_bytes", p.offloaded_bytes}});
  return {{"label", label}, {"peak_bytes", peak_bytes()}, {"points", pts}};
}

Timeline Timeline::from_json(const nlohmann::json& j) {
  try {
    Timeline t;
    t.label = j.at("label").get<std::string>();
    for (const auto& p : j.at("points"))
      t.points.push_back({p.at("op").get<std::string>(), p.at("path").get<std::string>(), p.at("phase").get<std::string>(),
                          p.at("live_bytes").get<std::int64_t>(), p.at("peak_bytes").get<std::int64_t>(),
                          p.value("seconds", 0.0), p.value("forward_point", std::int64_t{-1}),
                          p.value("offloaded_bytes", std::int64_t{0})});
    return t;
  } catch (const nlohmann::json::exception& e) {
    throw IoError(linum::detail::cat("memory::Timeline::from_json: not a timeline (", e.what(),
                                     "); expected {\"label\": ..., \"points\": [{\"op\", \"path\", \"phase\", "
                                     "\"live_bytes\", \"peak_bytes\"}, ...]}"));
  }
}

void Timeline::save_json(const std::filesystem::path& path) const {
  const std::string text = to_json().dump(1) + "\n";
  files::write_file_atomic(path, std::span(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()));
}

// ---- recording ----------------------------------------------------------------------------------

TimelineRecorder::TimelineRecorder(std::string label) {
  Recording& r = recording();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (detail::g_timeline_recording.load())
    throw ValueError("memory::TimelineRecorder: another recorder is active; finish() it first (one timeline at a time)");
  r.timeline = Timeline{std::move(label), {}};
  r.start = std::chrono::steady_clock::now();
  r.node_points.clear();
  g_max_since_boundary.store(stats().live_bytes);
  add_point(r, "start", "", "forward");
  detail::g_timeline_recording.store(true);
}

TimelineRecorder::~TimelineRecorder() {
  if (active_) (void)finish();
}

Timeline TimelineRecorder::finish() {
  Recording& r = recording();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!active_) throw ValueError("memory::TimelineRecorder::finish: already finished");
  active_ = false;
  detail::g_timeline_recording.store(false);
  if (g_max_since_boundary.load() > stats().live_bytes) add_point(r, "", "", "forward");  // work after the last op
  r.node_points.clear();
  return std::move(r.timeline);
}

namespace detail {

std::atomic<bool> g_timeline_recording{false};

void timeline_on_allocation(std::int64_t live) {
  if (g_timeline_recording.load(std::memory_order_relaxed)) raise_max(live);
}

void timeline_on_op(const char* op, const void* node) {
  Recording& r = recording();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!g_timeline_recording.load()) return;
  const linum::detail::Phase phase = linum::detail::current_phase();
  std::string path;
  std::int64_t forward_point = -1;
  if (phase == linum::detail::Phase::backward) {
    if (auto it = r.node_points.find(node); it != r.node_points.end()) {
      path = r.timeline.points[it->second].path;
      forward_point = static_cast<std::int64_t>(it->second);
    }
  } else {
    path = current_module_path();
    if (node != nullptr) r.node_points[node] = r.timeline.points.size();
  }
  add_point(r, op, std::move(path), phase_str(phase));
  r.timeline.points.back().forward_point = forward_point;
}

void timeline_mark(const char* op, const std::string& path) {
  Recording& r = recording();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!g_timeline_recording.load()) return;
  add_point(r, op, path, phase_str(linum::detail::current_phase()));
}

void set_timeline_path_provider(PathProvider provider) { g_path_provider.store(provider); }

std::string current_module_path() {
  const PathProvider provider = g_path_provider.load();
  return provider != nullptr ? provider() : std::string();
}

}  // namespace detail

// ---- SVG ----------------------------------------------------------------------------------------

namespace {

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string fmt(double v, int decimals = 1) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

std::string mib(std::int64_t bytes) { return fmt(static_cast<double>(bytes) / (1024.0 * 1024.0), 1) + " MiB"; }

// A "nice" tick step (1, 2 or 5 times a power of ten) giving about `want` ticks over `range`.
double tick_step(double range, int want) {
  const double raw = range / want;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) return m * mag;
  return 10.0 * mag;
}

const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"};
const char* phase_color(const std::string& phase) {
  if (phase == "backward") return "#a1d99b";
  if (phase == "recomputation") return "#fdae6b";
  return "#9ecae1";
}

}  // namespace

std::string render_svg(const std::vector<Timeline>& runs, const SvgOptions& o) {
  const int n_runs = static_cast<int>(runs.size());
  const double left = 78, right = 24, top = 46;
  const double legend_h = 18.0 * (n_runs + 1) + 8, strip_h = 9, axis_label_h = 34;
  const double height = std::max<double>(o.height, top + 160 + axis_label_h + strip_h * n_runs + legend_h);
  const double plot_h = height - top - axis_label_h - strip_h * n_runs - legend_h - 14;
  const double plot_w = o.width - left - right;
  // With above_start, each run's bytes are drawn above its first point's live bytes.
  auto base_of = [&](const Timeline& t) -> std::int64_t {
    return o.above_start && !t.points.empty() ? t.points.front().live_bytes : 0;
  };
  std::size_t max_points = 1;
  std::int64_t max_bytes = 1;
  for (const auto& t : runs) {
    max_points = std::max(max_points, t.points.size());
    max_bytes = std::max({max_bytes, t.peak_bytes() - base_of(t), t.offloaded_peak_bytes()});
  }
  const double y_max_mib = static_cast<double>(max_bytes) / (1024.0 * 1024.0) * 1.08;
  const double y_step = tick_step(y_max_mib, 6);
  auto x_of = [&](std::size_t i) { return left + plot_w * (max_points > 1 ? static_cast<double>(i) / static_cast<double>(max_points - 1) : 0.0); };
  auto y_of = [&](std::int64_t bytes) { return top + plot_h - plot_h * (static_cast<double>(bytes) / (1024.0 * 1024.0)) / y_max_mib; };

  std::string s;
  s += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + std::to_string(o.width) + "\" height=\"" + fmt(height, 0) +
       "\" viewBox=\"0 0 " + std::to_string(o.width) + " " + fmt(height, 0) +
       "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"12\">\n";
  s += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s += "<text x=\"" + fmt(left, 0) + "\" y=\"24\" font-size=\"15\" font-weight=\"bold\">" + xml_escape(o.title) + "</text>\n";
  // Grid and y axis.
  for (double v = 0; v <= y_max_mib + 1e-9; v += y_step) {
    const double y = top + plot_h - plot_h * v / y_max_mib;
    s += "<line x1=\"" + fmt(left) + "\" y1=\"" + fmt(y) + "\" x2=\"" + fmt(left + plot_w) + "\" y2=\"" + fmt(y) +
         "\" stroke=\"#e5e5e5\"/>\n";
    s += "<text x=\"" + fmt(left - 6) + "\" y=\"" + fmt(y + 4) + "\" text-anchor=\"end\">" +
         fmt(v, y_step < 1 ? 1 : 0) + "</text>\n";
  }
  s += "<text transform=\"translate(18," + fmt(top + plot_h / 2) +
       ") rotate(-90)\" text-anchor=\"middle\">" + std::string(o.above_start ? "array memory above the start (MiB)" : "live array memory (MiB)") +
       "</text>\n";
  s += "<rect x=\"" + fmt(left) + "\" y=\"" + fmt(top) + "\" width=\"" + fmt(plot_w) + "\" height=\"" + fmt(plot_h) +
       "\" fill=\"none\" stroke=\"#888\"/>\n";
  // x ticks.
  const double x_step = tick_step(static_cast<double>(max_points), 8);
  for (double v = 0; v < static_cast<double>(max_points); v += x_step) {
    const double x = x_of(static_cast<std::size_t>(v));
    s += "<line x1=\"" + fmt(x) + "\" y1=\"" + fmt(top + plot_h) + "\" x2=\"" + fmt(x) + "\" y2=\"" + fmt(top + plot_h + 4) +
         "\" stroke=\"#888\"/>\n";
    s += "<text x=\"" + fmt(x) + "\" y=\"" + fmt(top + plot_h + 16) + "\" text-anchor=\"middle\">" + fmt(v, 0) + "</text>\n";
  }
  // Phase strips, one per run, under the axis.
  const double strip_top = top + plot_h + 22;
  for (int r = 0; r < n_runs; ++r) {
    const auto& pts = runs[static_cast<std::size_t>(r)].points;
    const double y = strip_top + strip_h * r;
    std::size_t start = 0;
    for (std::size_t i = 1; i <= pts.size(); ++i) {
      if (i < pts.size() && pts[i].phase == pts[start].phase) continue;
      const double x0 = x_of(start), x1 = x_of(i == pts.size() ? i - 1 : i);
      s += "<rect x=\"" + fmt(x0) + "\" y=\"" + fmt(y) + "\" width=\"" + fmt(std::max(x1 - x0, 0.5)) + "\" height=\"" +
           fmt(strip_h - 2) + "\" fill=\"" + phase_color(pts[start].phase) + "\"><title>" +
           xml_escape(runs[static_cast<std::size_t>(r)].label + ": " + pts[start].phase) + "</title></rect>\n";
      start = i;
    }
    s += "<rect x=\"" + fmt(left - 10) + "\" y=\"" + fmt(y) + "\" width=\"6\" height=\"" + fmt(strip_h - 2) + "\" fill=\"" +
         kColors[r % 8] + "\"/>\n";
  }
  s += "<text x=\"" + fmt(left + plot_w / 2) + "\" y=\"" + fmt(strip_top + strip_h * n_runs + 14) +
       "\" text-anchor=\"middle\">op index (strips: forward, recomputation, backward)</text>\n";
  // Curves and peak markers.
  for (int r = 0; r < n_runs; ++r) {
    const auto& t = runs[static_cast<std::size_t>(r)];
    const std::int64_t base = base_of(t);
    std::string pts;
    for (std::size_t i = 0; i < t.points.size(); ++i) pts += fmt(x_of(i)) + "," + fmt(y_of(t.points[i].peak_bytes - base)) + " ";
    s += "<polyline data-label=\"" + xml_escape(t.label) + "\" data-peak-bytes=\"" + std::to_string(t.peak_bytes() - base) +
         "\" fill=\"none\" stroke=\"" + std::string(kColors[r % 8]) + "\" stroke-width=\"1.6\" points=\"" + pts + "\"/>\n";
    if (t.offloaded_peak_bytes() > 0) {  // the spill file, dashed
      std::string off;
      for (std::size_t i = 0; i < t.points.size(); ++i) off += fmt(x_of(i)) + "," + fmt(y_of(t.points[i].offloaded_bytes)) + " ";
      s += "<polyline data-label=\"" + xml_escape(t.label) + " (spill file)\" data-peak-bytes=\"" +
           std::to_string(t.offloaded_peak_bytes()) + "\" fill=\"none\" stroke=\"" + std::string(kColors[r % 8]) +
           "\" stroke-width=\"1.4\" stroke-dasharray=\"5,3\" points=\"" + off + "\"/>\n";
    }
    if (const TimelinePoint* p = t.peak_point()) {
      const std::size_t i = static_cast<std::size_t>(p - t.points.data());
      s += "<circle cx=\"" + fmt(x_of(i)) + "\" cy=\"" + fmt(y_of(p->peak_bytes - base)) + "\" r=\"4.5\" fill=\"" + kColors[r % 8] +
           "\" stroke=\"white\"/>\n";
    }
  }
  // Legend: each run's peak and what caused it, then the phase colours.
  double ly = strip_top + strip_h * n_runs + 34;
  for (int r = 0; r < n_runs; ++r, ly += 18) {
    const auto& t = runs[static_cast<std::size_t>(r)];
    const TimelinePoint* p = t.peak_point();
    std::string text = t.label + ": peak " + mib(t.peak_bytes() - base_of(t));
    if (p != nullptr && !p->op.empty())
      text += " at " + (p->path.empty() ? std::string() : p->path + " / ") + p->op + " (" + p->phase + ")";
    s += "<rect x=\"" + fmt(left) + "\" y=\"" + fmt(ly - 10) + "\" width=\"14\" height=\"4\" fill=\"" + kColors[r % 8] + "\"/>\n";
    if (t.offloaded_peak_bytes() > 0) text += "; spill file (dashed): peak " + mib(t.offloaded_peak_bytes());
    s += "<text x=\"" + fmt(left + 20) + "\" y=\"" + fmt(ly - 4) + "\">" + xml_escape(text) + "</text>\n";
  }
  double lx = left;
  for (const char* phase : {"forward", "recomputation", "backward"}) {
    s += "<rect x=\"" + fmt(lx) + "\" y=\"" + fmt(ly - 12) + "\" width=\"12\" height=\"9\" fill=\"" + phase_color(phase) + "\"/>\n";
    s += "<text x=\"" + fmt(lx + 16) + "\" y=\"" + fmt(ly - 4) + "\">" + phase + "</text>\n";
    lx += 120;
  }
  s += "</svg>\n";
  return s;
}

void save_svg(const std::filesystem::path& path, const std::vector<Timeline>& runs, const SvgOptions& options) {
  const std::string text = render_svg(runs, options);
  files::write_file_atomic(path, std::span(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()));
}

}  // namespace linum::memory
