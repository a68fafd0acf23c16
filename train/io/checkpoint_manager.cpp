#include <linum/train/io/checkpoint_manager.hpp>
#include <linum/train/io/serialization.hpp>
#include <linum/core/warnings.hpp>

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <exception>
#include <string>
#include <system_error>
#include <thread>

namespace linum {

namespace fs = std::filesystem;

namespace {

bool parse_step(const std::string& name, std::int64_t& step) {
  if (name.empty() || name.size() > 18) return false;
  for (char c : name)
    if (c < '0' || c > '9') return false;
  step = std::stoll(name);
  return true;
}

void fsync_path(const fs::path& p, bool directory) {
  const int fd = ::open(p.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) return;
  (void)::fsync(fd);
  ::close(fd);
}

// The temporary of a step being written: ".tmp-<step>-<pid>".
std::string temporary_name(std::int64_t step) { return ".tmp-" + std::to_string(step) + "-" + std::to_string(::getpid()); }

// Whether `name` is a temporary whose writer process is gone (so it will never be completed).
bool abandoned_temporary(const std::string& name) {
  if (name.rfind(".tmp-", 0) != 0) return false;
  const auto dash = name.rfind('-');
  if (dash == std::string::npos || dash + 1 >= name.size() || dash < 5) return true;
  long pid = 0;
  for (std::size_t i = dash + 1; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || pid > 1'000'000'000) return true;
    pid = pid * 10 + (name[i] - '0');
  }
  return pid <= 0 || (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH);
}

// What every query reads, without waiting for a save in flight (the background writer calls these).
std::vector<std::int64_t> steps_on_disk(const fs::path& root) {
  std::vector<std::int64_t> steps;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    std::int64_t step = 0;
    if (entry.is_directory() && parse_step(entry.path().filename().string(), step) &&
        fs::exists(entry.path() / "state.msgpack"))
      steps.push_back(step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::map<std::string, double> metrics_on_disk(const fs::path& root, std::int64_t step) {
  const fs::path file = root / std::to_string(step) / "metrics.json";
  if (!fs::exists(file)) return {};
  const auto bytes = serialization::read_file(file);
  std::map<std::string, double> out;
  try {
    const auto j = nlohmann::json::parse(bytes.begin(), bytes.end());
    for (const auto& [name, value] : j.items()) out[name] = value.get<double>();
  } catch (const nlohmann::json::exception& e) {
    throw IoError(detail::cat("CheckpointManager: '", file.string(), "' is not a metrics file: ", e.what()));
  }
  return out;
}

// Removes the steps beyond max_to_keep.
void keep_only(const fs::path& root, const CheckpointManagerOptions& options) {
  if (options.max_to_keep == 0) return;
  std::vector<std::int64_t> steps = steps_on_disk(root);
  if (static_cast<int>(steps.size()) <= options.max_to_keep) return;
  std::vector<std::int64_t> keep;
  if (options.best_metric.empty()) {
    keep.assign(steps.end() - options.max_to_keep, steps.end());
  } else {
    // Rank by the metric (steps without it last, newer first among equals), keep the best N and
    // the newest step.
    std::vector<std::pair<std::int64_t, std::optional<double>>> ranked;
    for (std::int64_t s : steps) {
      const auto m = metrics_on_disk(root, s);
      const auto it = m.find(options.best_metric);
      ranked.emplace_back(s, it == m.end() ? std::nullopt : std::optional<double>(it->second));
    }
    std::stable_sort(ranked.begin(), ranked.end(), [&](const auto& a, const auto& b) {
      if (a.second.has_value() != b.second.has_value()) return a.second.has_value();
      if (!a.second) return a.first > b.first;
      if (*a.second != *b.second)
        return options.best_mode == BestMode::max ? *a.second > *b.second : *a.second < *b.second;
      return a.first > b.first;
    });
    for (int i = 0; i < options.max_to_keep; ++i) keep.push_back(ranked[static_cast<std::size_t>(i)].first);
    keep.push_back(steps.back());
  }
  std::error_code ec;
  for (std::int64_t s : steps)
    if (std::find(keep.begin(), keep.end(), s) == keep.end()) fs::remove_all(root / std::to_string(s), ec);
}

// A step's encoded files, written into a temporary directory and renamed into place, then the
// steps beyond max_to_keep removed. Touches no Array: safe on a background thread.
void write_step(const fs::path& root, const CheckpointManagerOptions& options, std::int64_t step,
                const std::vector<std::uint8_t>& state, const std::string& metrics) {
  const fs::path tmp = root / temporary_name(step);
  std::error_code ec;
  fs::remove_all(tmp, ec);
  if (!fs::create_directory(tmp, ec))
    throw IoError(detail::cat("CheckpointManager::save: cannot create '", tmp.string(), "': ",
                              ec ? ec.message() : std::string("it exists")));
  try {
    serialization::write_file_atomic(tmp / "state.msgpack", state);
    serialization::write_file_atomic(
        tmp / "metrics.json", std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(metrics.data()), metrics.size()));
    fsync_path(tmp, true);
    fs::rename(tmp, root / std::to_string(step));  // atomic: the step appears whole
    fsync_path(root, true);
  } catch (const fs::filesystem_error& e) {
    fs::remove_all(tmp, ec);
    throw IoError(detail::cat("CheckpointManager::save: step ", step, " could not be put in place in '", root.string(),
                              "': ", e.code().message()));
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  keep_only(root, options);
}

}  // namespace

// A background save: its thread writes the step; `error` is written before `done` and read after
// the join.
struct CheckpointManager::InFlight {
  std::int64_t step = 0;
  std::thread thread;
  std::exception_ptr error;
  std::atomic<bool> done{false};
};

CheckpointManager::CheckpointManager(fs::path root, CheckpointManagerOptions options)
    : root_(std::move(root)), options_(std::move(options)) {
  if (options_.max_to_keep < 0)
    throw ValueError(detail::cat("CheckpointManager: max_to_keep must be >= 0 (0 keeps all), got ", options_.max_to_keep));
  if (options_.save_interval_steps < 1)
    throw ValueError(detail::cat("CheckpointManager: save_interval_steps must be >= 1, got ", options_.save_interval_steps));
  std::error_code ec;
  fs::create_directories(root_, ec);
  if (!fs::is_directory(root_))
    throw IoError(detail::cat("CheckpointManager: '", root_.string(), "' is not a directory I can create or use",
                              ec ? ": " + ec.message() : std::string()));
  // Temporaries of writers that were killed mid-step (not those of live processes: another
  // manager on this root may be writing one).
  for (const auto& entry : fs::directory_iterator(root_, ec))
    if (abandoned_temporary(entry.path().filename().string())) fs::remove_all(entry.path(), ec);
}

CheckpointManager::~CheckpointManager() {
  try {
    wait_until_finished();
  } catch (const std::exception& e) {
    warn(detail::cat("CheckpointManager on '", root_.string(), "': a background save failed and nobody waited for it: ", e.what()));
  }
}

CheckpointManager::CheckpointManager(CheckpointManager&&) noexcept = default;

CheckpointManager& CheckpointManager::operator=(CheckpointManager&& other) noexcept {
  if (this != &other) {
    try {
      wait_until_finished();
    } catch (const std::exception& e) {
      warn(detail::cat("CheckpointManager on '", root_.string(), "': a background save failed and nobody waited for it: ", e.what()));
    }
    root_ = std::move(other.root_);
    options_ = std::move(other.options_);
    in_flight_ = std::move(other.in_flight_);
  }
  return *this;
}

void CheckpointManager::wait_until_finished() const {
  if (!in_flight_) return;
  std::unique_ptr<InFlight> ended = std::move(in_flight_);
  ended->thread.join();
  if (ended->error) std::rethrow_exception(ended->error);
}

void CheckpointManager::check_for_errors() const {
  if (in_flight_ && in_flight_->done.load(std::memory_order_acquire)) wait_until_finished();
}

std::optional<std::int64_t> CheckpointManager::step_in_flight() const {
  if (!in_flight_) return std::nullopt;
  return in_flight_->step;
}

fs::path CheckpointManager::step_dir(std::int64_t step) const { return root_ / std::to_string(step); }

bool CheckpointManager::should_save(std::int64_t step) const {
  return step >= 0 && step % options_.save_interval_steps == 0 && !fs::exists(step_dir(step)) &&
         !(in_flight_ && in_flight_->step == step);
}

bool CheckpointManager::save(std::int64_t step, const Tree& state, const std::map<std::string, double>& metrics) {
  if (step < 0) throw ValueError(detail::cat("CheckpointManager::save: the step must be >= 0, got ", step));
  if (fs::exists(step_dir(step)) || (in_flight_ && in_flight_->step == step))
    throw ValueError(detail::cat("CheckpointManager::save: step ", step, " is already saved in '", root_.string(),
                                 "'; save each step once (or remove that directory first)"));
  if (!should_save(step)) return false;
  nlohmann::json m = nlohmann::json::object();
  for (const auto& [name, value] : metrics) {
    if (!std::isfinite(value))
      throw ValueError(detail::cat("CheckpointManager::save: metric '", name, "' is ", value, "; metrics must be finite"));
    m[name] = value;
  }
  // The encoded state is the copy the step is written from: the caller may update its arrays as
  // soon as this returns.
  std::vector<std::uint8_t> encoded = serialization::to_msgpack(state);
  std::string metrics_text = m.dump();
  wait_until_finished();  // one save in flight at a time; the previous one's error is thrown here
  if (!options_.async_save) {
    write_step(root_, options_, step, encoded, metrics_text);
    return true;
  }
  auto job = std::make_unique<InFlight>();
  job->step = step;
  InFlight* raw = job.get();
  job->thread = std::thread([raw, root = root_, options = options_, step, encoded = std::move(encoded),
                             metrics_text = std::move(metrics_text)] {
    try {
      write_step(root, options, step, encoded, metrics_text);
    } catch (...) {
      raw->error = std::current_exception();
    }
    raw->done.store(true, std::memory_order_release);
  });
  in_flight_ = std::move(job);
  return true;
}

std::vector<std::int64_t> CheckpointManager::all_steps() const {
  wait_until_finished();
  return steps_on_disk(root_);
}

std::optional<std::int64_t> CheckpointManager::latest_step() const {
  const auto steps = all_steps();
  if (steps.empty()) return std::nullopt;
  return steps.back();
}

std::map<std::string, double> CheckpointManager::metrics(std::int64_t step) const {
  wait_until_finished();
  return metrics_on_disk(root_, step);
}

std::optional<std::int64_t> CheckpointManager::best_step() const {
  if (options_.best_metric.empty()) return std::nullopt;
  std::optional<std::int64_t> best;
  double best_value = 0;
  for (std::int64_t step : all_steps()) {
    const auto m = metrics(step);
    const auto it = m.find(options_.best_metric);
    if (it == m.end()) continue;
    const bool better = options_.best_mode == BestMode::max ? it->second > best_value : it->second < best_value;
    if (!best || better) {
      best = step;
      best_value = it->second;
    }
  }
  return best;
}

Tree CheckpointManager::restore(std::int64_t step) const {
  wait_until_finished();
  const fs::path file = step_dir(step) / "state.msgpack";
  if (!fs::exists(file)) {
    const auto steps = all_steps();
    std::string available;
    for (std::int64_t s : steps) available += (available.empty() ? "" : ", ") + std::to_string(s);
    throw IoError(detail::cat("CheckpointManager::restore: no step ", step, " in '", root_.string(), "' (saved steps: ",
                              available.empty() ? "none" : available, ")"));
  }
  return serialization::load_msgpack(file);
}

Tree CheckpointManager::restore(std::int64_t step, const Tree& target) const {
  Tree restored = restore(step);
  if (auto diff = structure_difference(target, restored))
    throw ValueError(detail::cat("CheckpointManager::restore: step ", step, " of '", root_.string(),
                                 "' does not fit the target: ", *diff,
                                 " (target first); restore into the model and optimizer that saved it"));
  return restored;
}

}  // namespace linum
