// A memory timeline: live array bytes after every op of a training step (forward, recomputation of
// checkpointed blocks, backward), each point tagged with the op, the module path and the phase.
//
//   linum::memory::TimelineRecorder rec("remat");       // records while alive (every thread's ops)
//   ... one training step ...
//   linum::memory::Timeline t = rec.finish();
//   t.peak_bytes();                                       // == the exact accounting's peak in the step
//   linum::memory::save_svg("step.svg", {plain, t});      // the runs overlaid, the peaks marked
//   t.save_json("step.json");
//
// Points are op boundaries: `live_bytes` is what is alive when the op has finished, `peak_bytes`
// the highest live bytes at any allocation since the previous boundary (inside the op), so the
// highest point of a timeline is the step's exact peak. Ops that are not differentiated (plain
// inference) have no boundary of their own: their allocations count in the next point. Not
// recording, the cost is one relaxed atomic load per allocation and per recorded op.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <linum/core/memory.hpp>

// Declarations only (nlohmann::json, ordered_json): the full json.hpp costs every includer
// about 2.8 s of compile time; the .cpp files that build or read JSON include it themselves.
#include <nlohmann/json_fwd.hpp>

namespace linum::memory {

struct TimelinePoint {
  std::string op;           // "matmul", "gelu", ... ("" for allocations after the last op)
  std::string path;         // module path, "Block_0/Dense_1" ("" outside modules)
  std::string phase;        // "forward", "backward" or "recomputation"
  std::int64_t live_bytes = 0;  // live array bytes when the op finished
  std::int64_t peak_bytes = 0;  // highest live array bytes during the op
  double seconds = 0;           // when the op finished, since the recorder started
  // For a backward point: the index of the point that recorded its op in the forward pass (or the
  // recomputation), so analyses can charge backward work to the forward op; -1 otherwise.
  std::int64_t forward_point = -1;
  // Bytes in the spill file when the op finished (offloaded residuals; not part of live_bytes).
  std::int64_t offloaded_bytes = 0;
};

struct Timeline {
  std::string label;                  // "plain", "remat", ... (the legend of a plot)
  std::vector<TimelinePoint> points;  // in execution order

  // The highest peak_bytes of any point (0 for an empty timeline), and the point that reached it.
  std::int64_t peak_bytes() const;
  const TimelinePoint* peak_point() const;
  // The highest offloaded_bytes of any point.
  std::int64_t offloaded_peak_bytes() const;

  nlohmann::json to_json() const;
  static Timeline from_json(const nlohmann::json& j);
  // Atomically writes to_json() to `path`.
  void save_json(const std::filesystem::path& path) const;
};

// Records a timeline while alive; one recorder at a time in a process (a second one throws
// ValueError). The timeline starts with a point for what was alive at construction.
class TimelineRecorder {
 public:
  explicit TimelineRecorder(std::string label);
  ~TimelineRecorder();
  TimelineRecorder(const TimelineRecorder&) = delete;
  TimelineRecorder& operator=(const TimelineRecorder&) = delete;

  // Stops recording and returns the timeline (a final point holds allocations after the last op).
  Timeline finish();

 private:
  bool active_ = true;
};

struct SvgOptions {
  int width = 960;
  int height = 420;
  std::string title = "Live array memory over one training step";
  // Plot each run's bytes above what was live when its recording started (its first point): what
  // the recorded work itself holds, without the model, the data and whatever else the program keeps.
  bool above_start = false;
};

// The runs as one SVG plot: live bytes (the within-op peaks) over op index, one curve per run, each
// run's forward / recomputation / backward ops shaded in a strip under the plot, every run's peak
// marked with its size, module path and op, and a legend. A run that offloaded residuals gets a
// second, dashed curve in its colour: the bytes in the spill file. Runs of different lengths (remat adds
// recomputation ops) share the op-index axis.
std::string render_svg(const std::vector<Timeline>& runs, const SvgOptions& options = {});
// Atomically writes render_svg(runs, options) to `path`.
void save_svg(const std::filesystem::path& path, const std::vector<Timeline>& runs, const SvgOptions& options = {});


}  // namespace linum::memory
